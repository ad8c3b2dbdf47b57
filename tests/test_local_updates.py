"""Training that synchronises every H steps (local SGD, DiLoCo), against DDP, against each other and against a hand
computation (gloo on 127.0.0.1, every run under a timeout)."""

import datetime
import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml
from test_parallel import (
    cut_back,
    exported,
    final_weights,
    free_port,
    launch_ranks,
    mlp_config,
    predicted_bytes,
    relative_difference,
)

from islands.conditions import network_spec
from islands.config import Config, validate
from islands.data import ClusterSubset, GMMSource
from islands.data.loader import StreamOrder
from islands.data.order import GlobalOrder
from islands.data.schedule import WorkerSchedule
from islands.nets import build_network
from islands.parallel.launch import World
from islands.parallel.local_updates import DiLoCoStrategy, LocalSGDStrategy, fragments_of
from islands.trainer import train


def plain(cfg: dict, **train) -> dict:
    """mlp_config (20 steps of 32) without gradient clipping, which each replica would apply to its own norm."""
    return {**cfg, "train": {**cfg["train"], "grad_clip": 0.0, **train}}


def two_ranks(tmp_path, name: str, cfg: dict, *overrides: str):
    cfg = {**cfg, "run_dir": str(tmp_path / name)}
    ranks = launch_ranks(2, cfg, tmp_path, *overrides)
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    return tmp_path / name


def test_local_sgd_every_step_with_plain_sgd_is_ddp(tmp_path):
    """Averaging the weights after one SGD step each is stepping once with the averaged gradient."""
    cfg = plain(mlp_config(tmp_path), optimizer="sgd", lr=0.05)
    ddp = two_ranks(tmp_path, "ddp", cfg, "parallel.strategy=ddp")
    local = two_ranks(tmp_path, "local", cfg, "parallel.strategy=local_sgd", "parallel.sync_every=1")
    assert relative_difference(final_weights(ddp), final_weights(local)) < 1e-5


def test_diloco_with_outer_lr_1_and_no_momentum_is_local_sgd_whole_or_streamed_and_sends_ddps_bytes_over_h(tmp_path):
    cfg = plain(mlp_config(tmp_path))
    local = two_ranks(tmp_path, "local", cfg, "parallel.strategy=local_sgd", "parallel.sync_every=4")
    diloco = two_ranks(tmp_path, "diloco", cfg, "parallel.strategy=diloco", "parallel.sync_every=4",
                       "parallel.outer_lr=1", "parallel.outer_momentum=0")
    assert relative_difference(final_weights(local), final_weights(diloco)) < 1e-5
    # 20 steps, a synchronisation every 4: one all-reduce of the weights per 4 steps, where DDP sends its gradients
    # (the same bytes) every step. bf16 pseudo-gradients halve it.
    sent = json.loads((local / "communication.json").read_text())["bytes_per_step"]
    net = build_network(network_spec(validate(cfg).model, (2,), 3))
    assert sent == pytest.approx({"outer_all_reduce": predicted_bytes("ddp", 1, cfg)["all_reduce"] / 4})
    # what `islands plan` prices
    assert sent == pytest.approx(LocalSGDStrategy.costs.bytes_per_step(net, 2, sync_every=4))
    halved = two_ranks(tmp_path, "bf16", cfg, "parallel.strategy=diloco", "parallel.sync_every=4",
                       "parallel.compression=bf16")
    sent16 = json.loads((halved / "communication.json").read_text())["bytes_per_step"]
    assert sent16 == pytest.approx({"outer_all_reduce": predicted_bytes("ddp", 1, cfg)["all_reduce"] / 8})
    assert sent16 == pytest.approx(DiLoCoStrategy.costs.bytes_per_step(net, 2, compression="bf16", sync_every=4))

    # Streamed: two fragments taking turns every 2 of the 4 steps of a cycle, each synchronisation moving its
    # fragment only, on a trajectory of its own.
    streamed = two_ranks(tmp_path, "streamed", cfg, "parallel.strategy=local_sgd", "parallel.sync_every=4",
                         "parallel.fragments=2")
    streamed_diloco = two_ranks(tmp_path, "streamed_diloco", cfg, "parallel.strategy=diloco", "parallel.sync_every=4",
                                "parallel.fragments=2", "parallel.outer_lr=1", "parallel.outer_momentum=0")
    assert relative_difference(final_weights(streamed), final_weights(streamed_diloco)) < 1e-5
    assert relative_difference(final_weights(streamed), final_weights(local)) > 1e-3
    total = {name: json.loads((run / "communication.json").read_text())["total_bytes"]["outer_all_reduce"]
             for name, run in (("whole", local), ("streamed", streamed))}
    # 20 steps: the whole model at steps 4, 8, .., 20; fragment 1 at the same steps, fragment 0 at 2, 6, .., 18
    # and once more at the last step, which synchronises every fragment.
    net = build_network(network_spec(Config(**cfg).model, (2,), 3))  # in parameter order, which the fragments follow
    sizes = [p.numel() for p in net.parameters()]
    first = sum(sizes[i] for i in fragments_of(sizes, 2)[0])
    assert total["streamed"] == pytest.approx(total["whole"] * (1 + first / (5 * sum(sizes))))
    assert 0.25 < first / sum(sizes) < 0.75


def test_a_killed_streaming_diloco_run_resumes_inside_its_cycle_bit_identically(tmp_path):
    """Saved at step 10 of cycles of 4 (the replicas apart, the outer momentum under way, one fragment just
    synchronised and the other not), resumed on 2 ranks: it ends where the run that never stopped ended."""
    cfg = plain(mlp_config(tmp_path))
    args = ("parallel.strategy=diloco", "parallel.sync_every=4", "parallel.fragments=2")
    straight = two_ranks(tmp_path, "straight", cfg, *args)
    moved = cut_back(straight, tmp_path / "moved", 320)
    two_ranks(tmp_path, "moved", {**cfg, "run_dir": str(moved)}, *args)
    assert exported(moved) == exported(straight)
    # and its ledger counts the whole run, the steps before the checkpoint too
    sent = [json.loads((run / "communication.json").read_text()) for run in (moved, straight)]
    assert sent[0]["steps"] == sent[1]["steps"] and sent[0]["total_bytes"] == pytest.approx(sent[1]["total_bytes"])


def test_two_islands_of_two_ranks_synchronising_every_step_with_plain_sgd_are_one_process(tmp_path):
    """4 ranks as 2 replicas of 2 (DDP inside each): averaging the replicas after each SGD step on their averaged
    gradients is one step on the whole batch's gradient. Each rank sends ddp's bytes over 2 ranks inside its replica
    every step and the same again, every 4 steps, to its counterpart in the other replica."""
    cfg = plain(mlp_config(tmp_path / "single"), optimizer="sgd", lr=0.05)
    torch.set_num_threads(1)
    single = final_weights(train(validate(cfg), progress=False))
    cfg = {**cfg, "run_dir": str(tmp_path / "islands")}
    for every, run in ((1, "every_step"), (4, "every_4")):
        ranks = launch_ranks(4, {**cfg, "run_dir": str(tmp_path / run)}, tmp_path, "parallel.strategy=local_sgd",
                             "parallel.replicas=2", f"parallel.sync_every={every}")
        assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    assert relative_difference(single, final_weights(tmp_path / "every_step")) < 1e-5
    ddp = predicted_bytes("ddp", 1, cfg)["all_reduce"]  # over 2 ranks
    sent = json.loads((tmp_path / "every_4" / "communication.json").read_text())["bytes_per_step"]
    net = build_network(network_spec(validate(cfg).model, (2,), 3))
    half = 4 * -(-sum(p.numel() for p in net.parameters()) // 2)  # bytes of half the flat parameters, padded
    assert sent == pytest.approx({"all_reduce": ddp, "outer_all_reduce": half / 4, "all_gather": half / 4})
    assert sent == pytest.approx(LocalSGDStrategy.costs.bytes_per_step(net, 4, sync_every=4, replicas=2))
    assert relative_difference(single, final_weights(tmp_path / "every_4")) > 1e-4


def test_fragments_are_contiguous_non_empty_and_balanced():
    assert fragments_of([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert fragments_of([10, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert fragments_of([100, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 3)]  # one tensor each at least
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        sizes = torch.randint(1, 50, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        count = int(torch.randint(1, len(sizes) + 1, (1,), generator=g))
        runs = fragments_of(sizes, count)
        assert len(runs) == count and all(len(r) for r in runs)
        assert [i for r in runs for i in r] == list(range(len(sizes)))
        share = sum(sizes) / count  # each fragment ends at the first tensor past its share, if it may
        for f, r in enumerate(runs[:-1]):
            assert sum(sizes[: r.stop]) <= (f + 1) * share + max(sizes)
    with pytest.raises(ValueError, match="parallel.fragments"):
        fragments_of([3, 4], 3)
    with pytest.raises(ValueError, match="parallel.fragments: 3 fragments cannot take turns within sync_every=2"):
        LocalSGDStrategy(World(rank=0, size=1), sync_every=2, fragments=3)


def test_one_diloco_outer_step_is_nesterov_on_the_averaged_change(tmp_path):
    """Two synchronisations of a one-rank DiLoCo against torch-free arithmetic: m <- mu m + g, anchor <- anchor -
    lr (g + mu m), with g the anchor minus the weights."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        strategy = DiLoCoStrategy(World(rank=0, size=1), sync_every=1, batch_size=1, outer_lr=0.7,
                                  outer_momentum=0.9)
        net = torch.nn.Linear(3, 2)
        strategy.parallelize(net)
        anchor = {n: p.detach().clone() for n, p in net.named_parameters()}
        momentum = {n: torch.zeros_like(p) for n, p in anchor.items()}
        for step in range(2):
            with torch.no_grad():
                for p in net.parameters():  # what H inner steps would have done
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)))
            expected = {}
            for n, p in net.named_parameters():
                g = anchor[n] - p.detach()
                momentum[n] = 0.9 * momentum[n] + g
                expected[n] = anchor[n] - 0.7 * (g + 0.9 * momentum[n])
            assert strategy.replicas.after_step(step + 1) == 1
            for n, p in net.named_parameters():
                torch.testing.assert_close(p.detach(), expected[n], rtol=1e-6, atol=1e-6)
                anchor[n] = expected[n]
    finally:
        dist.destroy_process_group()


def test_streamed_diloco_steps_each_fragment_at_its_own_time_with_its_own_nesterov(tmp_path):
    """One rank, H = 2, two fragments of a Linear (its weight, then its bias): at odd steps the weight takes an
    outer step and the bias keeps its local value, at even steps the bias takes its first outer step on the change
    of both steps; the EMA's weights are the anchors."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        strategy = DiLoCoStrategy(World(rank=0, size=1), sync_every=2, batch_size=1, outer_lr=0.7,
                                  outer_momentum=0.9, fragments=2)
        net = torch.nn.Linear(3, 2)
        strategy.parallelize(net)
        assert strategy.replicas.fragments == [["weight"], ["bias"]]
        anchor = {n: p.detach().clone() for n, p in net.named_parameters()}
        momentum = {n: torch.zeros_like(p) for n, p in anchor.items()}
        for step in range(1, 5):
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)))
            due = "weight" if step % 2 else "bias"
            local = {n: p.detach().clone() for n, p in net.named_parameters()}
            g = anchor[due] - local[due]
            momentum[due] = 0.9 * momentum[due] + g
            anchor[due] = anchor[due] - 0.7 * (g + 0.9 * momentum[due])
            assert strategy.replicas.after_step(step) == 1
            torch.testing.assert_close(dict(net.named_parameters())[due].detach(), anchor[due], rtol=1e-6, atol=1e-6)
            other = "bias" if due == "weight" else "weight"
            assert torch.equal(dict(net.named_parameters())[other].detach(), local[other])
            for n in anchor:
                torch.testing.assert_close(strategy.replicas.ema_weights()[n], anchor[n], rtol=1e-6, atol=1e-6)
    finally:
        dist.destroy_process_group()


def test_local_sgd_refuses_16_bit_weights(tmp_path, capsys):
    """A check of the config alone: it fails in one process as it would on every rank, before any process group."""
    from islands.cli import main

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(mlp_config(tmp_path / "bad")))
    assert main(["train", str(path), "parallel.strategy=local_sgd", "parallel.compression=bf16", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "parallel.compression: local_sgd averages the weights themselves" in err


def test_a_schedule_of_unequal_replicas_reads_every_position_once_and_weighs_them_by_their_images():
    """Replica 0 steps 3 times with 2 images per round, replica 1 once with 6: ticks of 8, 2 and 2 images."""
    s = WorkerSchedule((2, 6), (3, 1))
    assert (s.ticks, s.round_images, [s.tick_images(n) for n in range(4)]) == (3, 12, [8, 2, 2, 8])
    assert [s.first_position(n, 0) for n in range(4)] == [0, 8, 10, 12] and s.first_position(0, 1) == 2
    assert [s.active(n, 1) for n in range(4)] == [True, False, False, True]
    # after the whole round each brought 6 images; after its first tick, replica 1 had brought 6 of 8
    assert s.weights(2) == [0.5, 0.5] and s.weights(0) == [0.25, 0.75] and s.weights(4) == [4 / 10, 6 / 10]
    assert [s.tick_at(s.images_after(n)) for n in range(10)] == list(range(10))
    assert (s.run_length(12), s.run_length(13), s.run_length(21)) == (12, 20, 22)
    with pytest.raises(ValueError, match="do not end a tick"):
        s.tick_at(9)
    # every position is read exactly once, by one replica at one tick
    read = [p for n in range(9) for r in (0, 1) if s.active(n, r) for p in
            range(s.first_position(n, r), s.first_position(n, r) + s.batches[r])]
    assert sorted(read) == list(range(s.images_after(9)))
    # alike replicas read the global batches of data parallelism, cut in contiguous slices
    even = WorkerSchedule.even(32, 2, steps=4)
    assert [even.first_position(n, r) for n in range(3) for r in (0, 1)] == [0, 16, 32, 48, 64, 80]


def test_a_sharded_replica_reads_its_own_cluster_in_its_own_order_under_global_positions():
    source = GMMSource([[1.0, 0.0], [-1.0, 0.0]], 0.1, size=40, seed=0)
    cluster = np.arange(40) % 2
    s = WorkerSchedule((2, 6), (3, 1))
    seen = {}
    for r in (0, 1):
        shard = ClusterSubset(source, cluster, r)
        order = iter(StreamOrder(GlobalOrder(len(shard), 1), s, replica=r, own_order=True))
        seen[r] = [next(order) for _ in range(4)]
        indices = [i for batch in seen[r] for i, _ in batch]
        # its own clock: each epoch of its 20 examples is a permutation of them
        assert sorted(indices[:20]) == list(range(20)) if r == 1 else sorted(set(indices)) == sorted(indices)
    positions = [p for r in (0, 1) for batch in seen[r] for _, p in batch]
    assert len(set(positions)) == len(positions)  # the noise keys stay the global, distinct positions


def test_replicas_with_unequal_batches_averaged_by_their_images_are_one_process_at_their_summed_batch(tmp_path):
    """H = 1, plain SGD, batches of 8 and 24: the images-weighted mean of the two replicas' steps is the step on the
    mean gradient of all 32 images, which one process takes (an unweighted mean would be off by a quarter)."""
    cfg = plain(mlp_config(tmp_path / "one"), optimizer="sgd", lr=0.05)
    one = train(validate(cfg), progress=False)
    local = two_ranks(tmp_path, "local", {**cfg, "parallel": {"worker_batch": [8, 24]}},
                      "parallel.strategy=local_sgd", "parallel.sync_every=1")
    assert relative_difference(final_weights(one), final_weights(local)) < 1e-5
    # Unequal update frequencies, learning rates and non-IID shards: replica 0 steps 4 times a round, replica 1
    # twice, each on its own cluster; the run still ends at the images summed over replicas.
    partition = tmp_path / "partition"
    partition.mkdir()
    np.savez(partition / "assignments.npz", cluster=np.arange(4096) % 2)
    hetero = {**cfg, "data": {**cfg["data"], "shards": str(partition)},
              "parallel": {"worker_batch": [8, 24], "worker_lr": [0.05, 0.02], "worker_sync_every": [4, 2]}}
    run = two_ranks(tmp_path, "hetero", hetero, "parallel.strategy=diloco", "train.log_every=8")
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["images"] == WorkerSchedule((8, 24), (4, 2)).run_length(640) == 640
    # A line per tick. In ticks 2 and 3 of each round (80 images: 32, 32, 8, 8) replica 1 is idle: the line is
    # replica 0's loss alone, not its mean with a 0 (which would halve it).
    idle = [r["loss"] for r in lines if r["images"] % 80 in (72, 0)]
    busy = [r["loss"] for r in lines if r["images"] % 80 in (32, 64)]
    assert len(idle) == len(busy) == 16
    assert 0.75 < np.mean(idle) / np.mean(busy) < 1.33
    sent = json.loads((run / "communication.json").read_text())["total_bytes"]["outer_all_reduce"]
    assert sent == pytest.approx(8 * predicted_bytes("ddp", 1, cfg)["all_reduce"])  # 8 rounds of 4 x 8 + 2 x 24
