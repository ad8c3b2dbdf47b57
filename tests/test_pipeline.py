"""Pipeline parallelism: networks cut into stages, and pipelined training against one process (gloo on 127.0.0.1,
every run under a timeout; the checkpoint tests of the pipeline are in test_parallel.py, beside the other
strategies')."""

import itertools
import json

import pytest
import torch
from conftest import random_images
from test_parallel import final_weights, launch_ranks, mlp_config, relative_difference
from torch.utils.flop_counter import FlopCounterMode

from islands.conditions import network_spec
from islands.config import validate
from islands.nets import build_network
from islands.parallel.costs import carry_bytes
from islands.parallel.ledger import bytes_sent
from islands.parallel.pipeline import Stage, balanced_cut, block_costs
from islands.trainer import train

TINY = {
    "dit": ({"arch": "dit", "num_classes": 4, "patch_size": 2, "hidden_size": 32, "depth": 4, "num_heads": 2},
            (1, 8, 8)),
    # 64 channels: two per GroupNorm group, else the conv biases' gradients are pure rounding noise (test_parallel)
    "unet": ({"arch": "unet", "num_classes": 4, "channels": 64, "channel_mult": [1, 2], "num_res_blocks": 1,
              "attention_resolutions": [4]}, (1, 8, 8)),
    "mlp": ({"arch": "mlp", "hidden": 32, "depth": 3, "num_classes": 4}, (2,)),
}


def tiny_network(arch: str):
    model, shape = TINY[arch]
    torch.manual_seed(0)
    net = build_network(network_spec(validate({"run_dir": "unused", "model": model}).model, shape, 4))
    for p in net.parameters():  # away from the zero initialisations, so that every block computes something
        p.data.add_(0.05 * torch.randn_like(p))
    return net, shape


def example(shape, batch=3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, *shape, generator=g), torch.rand(batch, generator=g), torch.tensor([0, 3, 4])[:batch]


@pytest.mark.parametrize("arch", ["dit", "unet", "mlp"])
def test_a_network_cut_anywhere_into_stages_computes_its_forward_and_its_stages_own_each_parameter_once(arch):
    net, shape = tiny_network(arch)
    x, t, cond = example(shape)
    whole = net(x, t, cond)
    n = len(net.blocks)
    for parts in (2, 3):
        for bounds in itertools.combinations(range(1, n), parts - 1):
            edges = [0, *bounds, n]
            stages = [Stage(net, range(a, b), i == 0, i == parts - 1)
                      for i, (a, b) in enumerate(itertools.pairwise(edges))]
            carry = (x, t, cond)
            for stage in stages:
                carry = stage(*carry) if isinstance(carry, tuple) else carry
            assert torch.equal(carry, whole), (arch, edges)
            owned = [id(p) for stage in stages for p in stage.parameters()]
            assert sorted(owned) == sorted(id(p) for p in net.parameters())  # each once, none missing


def test_the_balanced_cut_minimises_the_largest_stage_over_every_contiguous_cut():
    g = torch.Generator().manual_seed(0)
    for n, parts in [(5, 2), (7, 3), (8, 4), (4, 4)]:
        costs = (torch.rand(n, generator=g) * 10).tolist()
        cut = balanced_cut(costs, parts)
        assert [r.start for r in cut] == sorted(r.start for r in cut) and cut[0].start == 0 and cut[-1].stop == n
        assert all(len(r) > 0 for r in cut) and sum(len(r) for r in cut) == n
        best = min(max(sum(costs[a:b]) for a, b in itertools.pairwise([0, *bounds, n]))
                   for bounds in itertools.combinations(range(1, n), parts - 1))
        assert max(sum(costs[i] for i in r) for r in cut) == pytest.approx(best)
    with pytest.raises(ValueError, match="too few for 5 stages"):
        balanced_cut([1.0] * 4, 5)


@pytest.mark.parametrize("arch", ["dit", "unet"])
def test_the_block_costs_add_up_to_the_forward_flops_of_the_whole_network(arch):
    net, shape = tiny_network(arch)
    x, t, cond = example(shape, batch=1)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        net(x, t, cond)
    costs = block_costs(net, (x, t, cond))
    assert len(costs) == len(net.blocks)
    assert sum(costs) - len(costs) == counter.get_total_flops()  # one FLOP added per block


def image_config(run_dir, data_path, arch: str) -> dict:
    """10 optimizer steps of 16 images, checkpointed at the end only."""
    return {"run_dir": str(run_dir), "seed": 3, "data": {"source": "npz", "path": str(data_path)},
            "model": TINY[arch][0],
            "train": {"images": 160, "batch_size": 16, "lr": 1e-3, "warmup_images": 32, "ema_halflife_images": 40,
                      "checkpoint_every": 160, "log_every": 80, "sample_every": 0},
            "sample": {"num": 8, "steps": 4, "solver": "euler"}}


@pytest.fixture(scope="module")
def single_image_runs(tmp_path_factory):
    """One process, for each network: the trajectory every pipelined run must follow."""
    root = tmp_path_factory.mktemp("single")
    data = random_images(root)
    runs = {}

    def run(arch: str):
        if arch not in runs:
            cfg = image_config(root / arch, data, arch)
            torch.set_num_threads(1)
            runs[arch] = (cfg, final_weights(train(validate(cfg), progress=False)))
        return runs[arch]

    return run


@pytest.mark.parametrize("arch,schedule", list(itertools.product(["dit", "unet"], ["gpipe", "1f1b", "interleaved"])))
def test_ten_pipelined_steps_follow_the_single_process_trajectory(tmp_path, single_image_runs, arch, schedule):
    cfg, single = single_image_runs(arch)
    cfg = {**cfg, "run_dir": str(tmp_path / "pipe")}
    virtual = 2 if schedule == "interleaved" else 1
    ranks = launch_ranks(2, cfg, tmp_path, "parallel.strategy=pipeline", f"parallel.schedule={schedule}",
                         f"parallel.virtual_stages={virtual}", "parallel.microbatches=4")
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    assert relative_difference(single, final_weights(cfg["run_dir"])) < 1e-5
    if virtual == 1:  # rank 0, stage 0, sends the carry at the cut forward and receives its gradient back
        net, shape = tiny_network(arch)
        cut = balanced_cut(block_costs(net, example(shape, 1)), 2)
        sent = json.loads((tmp_path / "pipe" / "communication.json").read_text())["bytes_per_step"]
        carry = carry_bytes(net, cfg["train"]["batch_size"], cut[0].stop)
        assert sent == {"pipeline_activations": carry, "pipeline_gradients": 0.0}


def test_bf16_and_activation_checkpointing_compose_with_the_pipeline_bit_for_bit(tmp_path, image_npz):
    """The same micro-batches in the same precision: 4 pipelined micro-batches compute what one process computes
    with 4 accumulated ones, to the bit."""
    cfg = image_config(tmp_path / "pipe", image_npz, "dit")
    cfg["train"].update(precision="bf16", activation_checkpointing=True, images=64)
    ranks = launch_ranks(2, cfg, tmp_path, "parallel.strategy=pipeline", "parallel.microbatches=4")
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    torch.set_num_threads(1)
    single = train(validate({**cfg, "run_dir": str(tmp_path / "single"), "train": {**cfg["train"], "accumulate": 4}}),
                   progress=False)
    pipelined, alone = final_weights(tmp_path / "pipe"), final_weights(single)
    assert all(torch.equal(pipelined[k], alone[k]) for k in alone)


def test_two_data_parallel_copies_of_a_two_stage_pipeline_follow_one_process_and_book_both_kinds_of_traffic(
        tmp_path):
    cfg = mlp_config(tmp_path / "mesh")
    ranks = launch_ranks(4, cfg, tmp_path, "parallel.strategy=pipeline", "parallel.data=2",
                         "parallel.microbatches=2")
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    torch.set_num_threads(1)
    single = final_weights(train(validate({**cfg, "run_dir": str(tmp_path / "single")}), progress=False))
    assert relative_difference(single, final_weights(tmp_path / "mesh")) < 1e-5
    # Rank 0 is stage 0 of data row 0: it sends its 16 examples' carry (h, emb: 2 x 64 floats each) forward and
    # all-reduces its stage's gradients with rank 2, its copy in the other row.
    net = build_network(network_spec(validate(cfg).model, (2,), 3))
    cut = balanced_cut(block_costs(net, (torch.zeros(1, 2), torch.zeros(1), torch.zeros(1, dtype=torch.long))), 2)
    stage0 = Stage(net, cut[0], True, False)
    sent = json.loads((tmp_path / "mesh" / "communication.json").read_text())["bytes_per_step"]
    assert sent == pytest.approx({"pipeline_activations": 16 * 2 * 64 * 4, "pipeline_gradients": 0.0,
                                  "all_reduce": bytes_sent("all_reduce", 4 * sum(p.numel() for p in
                                                                                stage0.parameters()), 2)})


@pytest.mark.parametrize("overrides,message", [
    (["parallel.stages=3"], "parallel.stages: 3 stages do not divide the 2 ranks"),
    (["parallel.data=2"], "parallel.data: 2 data-parallel copies of 2 stages need 4 ranks, not 2"),
    (["train.accumulate=2"], "train.accumulate: a pipeline cuts each rank's 32 images into "
                             "parallel.microbatches=4 equal pieces itself"),
    (["parallel.stages=2", "model.depth=1"], "parallel.stages: the network has 1 blocks, too few for 2 stages"),
    (["train.objective=router"], "parallel.strategy: a pipeline trains denoisers"),
    (["parallel.microbatches=1", "train.batch_size=32"], "parallel.microbatches: the 1f1b schedule needs at least "
                                                         "one per stage (2), not 1"),
])
def test_a_pipeline_that_cannot_be_built_fails_every_rank_with_one_line_naming_the_key(tmp_path, overrides, message):
    cfg = mlp_config(tmp_path / "bad")
    ranks = launch_ranks(2, cfg, tmp_path, "parallel.strategy=pipeline", *overrides)
    for r in ranks:
        assert r.returncode == 2, r.stderr[-2000:]
        assert message in r.stderr and "Traceback" not in r.stderr
