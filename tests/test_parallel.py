"""torch.distributed on CPU: gloo on 127.0.0.1, 2 processes under torchrun, each run under a timeout.

Every check compares what the ranks wrote against a single-process reference run of the same config.
"""

import contextlib
import datetime
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import poisoned_npz

from islands.conditions import network_spec
from islands.config import validate
from islands.data.loader import stream_loader
from islands.data.registry import build_source
from islands.errors import TrainingStopped
from islands.nets import build_network
from islands.parallel.build import strategy_class
from islands.parallel.launch import World, free_port, run_local_ranks
from islands.parallel.ledger import bytes_sent
from islands.rundir import checkpoint_dir, latest_checkpoint, list_checkpoints, load_weights, read_state
from islands.train.checkpoint import adam_state, read_sharded
from islands.train.ema import EMA
from islands.train.logbook import read_metrics
from islands.train.objectives import build_objective
from islands.trainer import train
from islands.trainer.ranges import tstage_config

TIMEOUT_S = 240
NODE_OF_TWO = {"gpus_per_node": 2, "gpu_tflops": 1.0, "node": {"gbit_s": 10.0, "latency_us": 10.0}}  # islands plan


def on_ranks(nproc: int, config: dict, tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    """`islands train` on `nproc` ranks started as torchrun starts them (launch_ranks), as one result: the first
    failing rank's status, every rank's output. Without torchrun's agent, whose own start (a torch import) cost
    about 5 s a launch here; the tests of restarts and killed ranks use the real torchrun."""
    ranks = launch_ranks(nproc, config, tmp_path, *overrides)
    status = next((r.returncode for r in ranks if r.returncode != 0), 0)
    return subprocess.CompletedProcess([r.args for r in ranks], status, "".join(r.stdout for r in ranks),
                                       "".join(r.stderr for r in ranks))


def relative_difference(a: dict, b: dict) -> float:
    diff = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a).sqrt()
    return (diff / sum((a[k].double() ** 2).sum() for k in a).sqrt()).item()


def final_weights(run_dir):
    return load_weights(latest_checkpoint(run_dir) / "model.safetensors")


def mlp_config(run_dir) -> dict:
    """A small MLP on a 3-mode mixture, 20 optimizer steps of 32 examples. (The tiny U-Nets have one
    channel per GroupNorm group, which makes their conv biases' gradients pure rounding noise that Adam
    then amplifies: no layout could match them to 1e-5.)"""
    return {"run_dir": str(run_dir), "seed": 5,
            "data": {"source": "gmm", "means": [[1.0, 0.0], [-1.0, 1.0], [0.0, -1.5]], "std": 0.2, "size": 4096},
            "model": {"arch": "mlp", "hidden": 64, "depth": 3, "num_classes": 3},
            "train": {"images": 640, "batch_size": 32, "lr": 1e-3, "warmup_images": 64, "ema_halflife_images": 100,
                      "checkpoint_every": 320, "log_every": 160},
            "sample": {"num": 16, "steps": 4}}


@pytest.fixture
def reference(tmp_path):
    """The single-process run every parallel layout must reproduce."""
    cfg = mlp_config(tmp_path / "single")
    torch.set_num_threads(1)
    run_dir = train(validate(cfg), progress=False)
    return cfg, final_weights(run_dir)


def predicted_bytes(strategy: str, accumulate: int, cfg: dict, world: int = 2) -> dict:
    """Bytes per optimizer step per rank, by collective, from the strategy's own formulas (its `costs`): those
    `islands plan` prices, checked here against what the ledger counted."""
    parallel = validate(cfg).parallel
    net = build_network(network_spec(validate(cfg).model, (2,), 3))
    return strategy_class(strategy).costs.bytes_per_step(net, world, accumulate, parallel.compression,
                                                         validate(cfg).train.precision)


@pytest.mark.parametrize("strategy,accumulate,checkpointing", [
    ("ddp", 1, False), ("ddp", 2, True), ("zero1", 2, True), ("zero2", 1, False), ("zero2", 2, True),
    ("fsdp", 1, False), ("fsdp", 2, True)])
def test_every_strategy_on_two_ranks_follows_the_single_process_trajectory(
        tmp_path, reference, strategy, accumulate, checkpointing):
    cfg, single = reference
    cfg = {**cfg, "run_dir": str(tmp_path / strategy)}
    result = on_ranks(2, cfg, tmp_path, f"parallel.strategy={strategy}", f"train.accumulate={accumulate}",
                      f"train.activation_checkpointing={str(checkpointing).lower()}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert relative_difference(single, final_weights(cfg["run_dir"])) < 1e-5
    # The ledger: what each rank sent per optimizer step equals the prediction, collective by collective.
    summary = json.loads((tmp_path / strategy / "communication.json").read_text())
    predicted = predicted_bytes(strategy, accumulate, cfg)
    assert summary["steps"] == 20
    assert summary["bytes_per_step"] == pytest.approx(predicted)
    for record in read_metrics(cfg["run_dir"]):
        assert record["comm_bytes_per_step_per_rank"] == pytest.approx(sum(predicted.values()))


def test_fsdp_in_bf16_gathers_bf16_weights_reduces_fp32_gradients_and_keeps_fp32_masters(tmp_path, reference):
    cfg, single = reference
    cfg = {**cfg, "run_dir": str(tmp_path / "bf16")}
    result = on_ranks(2, cfg, tmp_path, "parallel.strategy=fsdp", "train.precision=bf16")
    assert result.returncode == 0, result.stderr[-3000:]
    fp32 = predicted_bytes("fsdp", 1, cfg)
    summary = json.loads((tmp_path / "bf16" / "communication.json").read_text())
    assert summary["bytes_per_step"] == pytest.approx({"all_gather": fp32["all_gather"] / 2,
                                                       "reduce_scatter": fp32["reduce_scatter"]})
    weights = final_weights(cfg["run_dir"])
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert 1e-6 < relative_difference(single, weights) < 5e-2  # bf16 arithmetic: near, not equal


def exact_config(run_dir, **train_keys) -> dict:
    """mlp_config without gradient clipping, whose norm a sharded run sums in another order.

    Then 2 ranks with 16 examples each compute bit for bit what 1 process computes with 2 micro-batches
    of 16: the same per-micro-batch gradients, halved (exact in floating point) and added (commutative)."""
    cfg = mlp_config(run_dir)
    cfg["train"].update(grad_clip=0.0, **train_keys)
    return cfg


@pytest.fixture(scope="module")
def exact_reference(tmp_path_factory):
    """One process, never stopped, two micro-batches per step."""
    run_dir = tmp_path_factory.mktemp("exact") / "single"
    torch.set_num_threads(1)
    train(validate(exact_config(run_dir, accumulate=2)), progress=False)
    return run_dir


def exported(run_dir) -> dict:
    ckpt = latest_checkpoint(run_dir)
    return {name: (ckpt / name).read_bytes() for name in ("model.safetensors", "ema.safetensors")}


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """2-rank runs of exact_config by (strategy, compression), each launched once for the whole module.

    With checkpoint_every=320 each also holds the checkpoint half way, which `cut_back` turns into an
    interrupted run for other layouts to resume."""
    runs = {}

    def run(strategy: str, compression: str = "none") -> Path:
        if (strategy, compression) not in runs:
            root = tmp_path_factory.mktemp(f"{strategy}-{compression}")
            cfg = exact_config(root / "run")
            result = on_ranks(2, cfg, root, *layout(strategy), f"parallel.compression={compression}")
            assert result.returncode == 0, result.stderr[-3000:]
            runs[strategy, compression] = Path(cfg["run_dir"])
        return runs[strategy, compression]

    return run


def layout(strategy: str) -> list[str]:
    """The overrides that run exact_config under `strategy` on 2 ranks. A 2-stage pipeline cuts each batch of 32
    into 2 micro-batches of 16, those of the 1-process reference with accumulate=2: the same gradients, bit for
    bit (each stage's halves of them added in the same order)."""
    return [f"parallel.strategy={strategy}", *(["parallel.microbatches=2"] if strategy == "pipeline" else [])]


def cut_back(run_dir: Path, to: Path, images: int) -> Path:
    """A copy of a run without its checkpoints after `images`: the run as it was when stopped there."""
    shutil.copytree(run_dir, to)
    for ckpt in list_checkpoints(to):
        if int(ckpt.name) > images:
            shutil.rmtree(ckpt)
    assert int(latest_checkpoint(to).name) == images
    return to


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp", "pipeline"])
def test_every_strategy_exports_the_same_weights_file_bit_for_bit(two_rank_run, exact_reference, strategy):
    assert exported(two_rank_run(strategy)) == exported(exact_reference)


def test_each_pipeline_stage_writes_the_shards_of_its_own_parameters_only(two_rank_run):
    from islands.parallel.distributed_checkpoint import _SafeReader

    metadata = _SafeReader(str(latest_checkpoint(two_rank_run("pipeline")) / "sharded")).read_metadata()
    writer = {}  # parameter -> the files its weights, moments and average were written to
    for index, info in metadata.storage_data.items():
        writer.setdefault(index.fqn.split(".", 1)[1], set()).add(info.relative_path.split("_")[2])
    assert writer["embed.time.mlp.0.weight"] == {"0"} and writer["proj_out.weight"] == {"1"}
    assert all(len(ranks) == 1 for ranks in writer.values())  # nothing written twice
    assert {"0", "1"} == set().union(*writer.values())


def test_a_two_rank_fsdp_run_resumes_on_one_process_bit_identically(tmp_path, exact_reference):
    """Saved as shards by 2 ranks half way, resumed by 1 process with 2 micro-batches: it must end exactly
    where the 1-process run that never stopped ended (weights, EMA, optimizer state and data position)."""
    cfg = exact_config(tmp_path / "moved", images=320)
    result = on_ranks(2, cfg, tmp_path, "parallel.strategy=fsdp")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [int(p.name) for p in list_checkpoints(cfg["run_dir"])] == [320]
    cfg["train"].update(images=640, accumulate=2)
    torch.set_num_threads(1)
    train(validate(cfg), progress=False)
    assert exported(cfg["run_dir"]) == exported(exact_reference)
    assert read_state(latest_checkpoint(cfg["run_dir"])).progress["step"] == 20


@pytest.mark.parametrize("strategy", ["zero1", "fsdp", "pipeline"])
def test_a_one_process_run_resumes_on_two_ranks_bit_identically(tmp_path, two_rank_run, strategy):
    straight = two_rank_run(strategy)  # 2 ranks, never stopped
    moved = exact_config(tmp_path / "moved", images=320, accumulate=2)
    torch.set_num_threads(1)
    train(validate(moved), progress=False)
    moved["train"].update(images=640, accumulate=1)
    result = on_ranks(2, moved, tmp_path, *layout(strategy))
    assert result.returncode == 0, result.stderr[-3000:]
    assert exported(moved["run_dir"]) == exported(straight)


@pytest.mark.parametrize("saved_by", ["ddp", "zero1", "zero2", "fsdp", "pipeline"])
def test_a_two_rank_checkpoint_of_every_strategy_resumes_on_one_process_bit_identically(
        tmp_path, two_rank_run, exact_reference, saved_by):
    moved = cut_back(two_rank_run(saved_by), tmp_path / "moved", 320)
    cfg = exact_config(moved, accumulate=2)
    torch.set_num_threads(1)
    train(validate(cfg), progress=False)
    assert exported(moved) == exported(exact_reference)
    assert read_state(latest_checkpoint(moved)).progress["step"] == 20


def test_an_fsdp_checkpoint_resumes_under_ddp_bit_identically(tmp_path, two_rank_run, exact_reference):
    """Sharded parameters and moments saved, replicated ones loaded: the same 2 ranks, another strategy."""
    moved = cut_back(two_rank_run("fsdp"), tmp_path / "moved", 320)
    result = on_ranks(2, exact_config(moved), tmp_path, "parallel.strategy=ddp")
    assert result.returncode == 0, result.stderr[-3000:]
    assert exported(moved) == exported(exact_reference)


def test_a_damaged_shard_sends_every_rank_back_to_the_checkpoint_before(tmp_path, two_rank_run, exact_reference):
    """Each rank reads its own slices, from any rank's file: a failure of any rank must be every rank's, or they
    would resume from different checkpoints (and hang at their first collective)."""
    moved = tmp_path / "moved"
    shutil.copytree(two_rank_run("fsdp"), moved)
    earlier, latest = list_checkpoints(moved)
    shard = latest / "sharded" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    result = on_ranks(2, exact_config(moved), tmp_path, "parallel.strategy=fsdp")
    assert result.returncode == 0, result.stderr[-3000:]
    warned = [line for line in result.stderr.splitlines() if line.startswith("islands: warning: checkpoint")]
    assert len(warned) == 1 and warned[0].endswith(f"resumed from {earlier}, the latest that can be"), warned
    assert exported(moved) == exported(exact_reference)


def test_a_checkpoint_another_rank_cannot_read_is_passed_over_by_this_one_too():
    from islands.trainer.parts import agreed

    class AnotherRankFailed(World):
        def all_finite(self, flag: bool) -> bool:
            return False

    assert agreed(World(), lambda: None) is None
    assert agreed(AnotherRankFailed(), lambda: None) == "another rank cannot read it"
    said = agreed(World(), lambda: read_state(Path("/nonexistent")))
    assert said.startswith("CheckpointError: cannot read /nonexistent/state.json")


def sharded_state_of_one_process(cfg) -> dict:
    """What one process holds, as the loop lays it out, ready for read_sharded to fill."""
    net = build_network(network_spec(cfg.model, (2,), 3))
    opt = torch.optim.AdamW(net.parameters())
    return {"model": net.state_dict(), "optim": adam_state(opt, net),
            "ema": EMA(net, cfg.train.ema_halflife_images, cfg.train.ema_rampup).state_dict()}


def test_three_ranks_with_uneven_padded_shards_resume_onto_and_from_one_process(tmp_path):
    """FSDP on 3 ranks splits the 64 rows of each hidden layer as 22, 22, 20 (dim 0 padded to 66).

    1 process (3 micro-batches of 16) trains to 240 images; 3 ranks resume to 960, saving at 480 and 720;
    1 process resumes from their 720. A global batch of 48 keeps every rank's slice whole, but 3 ranks
    cannot match 1 process bit for bit: a sum of three gradients (and the division by 3) is rounded in
    another order. Both moves end 3e-8 from the 1-process run (weights and EMA); the smallest change of the
    resumed state tried (Adam's step count off by one) leaves 2e-4, an EMA replaced by the weights 8e-5,
    moments zeroed or shifted by a row 1e-2 and more: the bound 1e-6 tells them apart. The weights and EMA
    read back from the uneven shards must be exactly those the ranks exported."""
    def config(run_dir, **keys):
        return exact_config(run_dir, batch_size=48, images=960, checkpoint_every=240, keep_checkpoints=10, **keys)

    torch.set_num_threads(1)
    single = train(validate(config(tmp_path / "single", accumulate=3)), progress=False)
    onto = cut_back(single, tmp_path / "onto", 240)
    result = on_ranks(3, config(onto), tmp_path, "parallel.strategy=fsdp")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [int(p.name) for p in list_checkpoints(onto)] == [240, 480, 720, 960]
    back = cut_back(onto, tmp_path / "back", 720)
    train(validate(config(back, accumulate=3)), progress=False)

    held = sharded_state_of_one_process(validate(config(back)))
    written_by_three = checkpoint_dir(onto, 720)
    read_sharded(written_by_three, held)
    for part, file in (("model", "model.safetensors"), ("ema", "ema.safetensors")):
        whole = load_weights(written_by_three / file)
        assert all(torch.equal(held[part][k], whole[k]) for k in whole), part
    for file in ("model.safetensors", "ema.safetensors"):
        truth = load_weights(latest_checkpoint(single) / file)
        for moved in (onto, back):
            distance = relative_difference(truth, load_weights(latest_checkpoint(moved) / file))
            print(f"{moved.name} {file}: {distance:.2e} from the 1-process run")
            assert distance < 1e-6


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
def test_gradient_compression_under_sharding_halves_the_gradient_traffic_and_stays_on_course(
        two_rank_run, exact_reference, strategy):
    """parallel.compression=bf16 lowers the gradient reduction (ZeRO-1's all-reduce, FSDP's reduce-scatter)
    to 16 bits; parameters still travel in fp32. The sum of two bf16 numbers is commutative, so every
    layout rounds the same numbers and the compressed runs agree with each other bit for bit."""
    run_dir = two_rank_run(strategy, "bf16")
    fp32 = predicted_bytes(strategy, 1, exact_config(run_dir))
    gradients = "all_reduce" if strategy == "zero1" else "reduce_scatter"
    summary = json.loads((run_dir / "communication.json").read_text())
    assert summary["bytes_per_step"] == pytest.approx({**fp32, gradients: fp32[gradients] / 2})
    distance = relative_difference(final_weights(exact_reference), final_weights(run_dir))
    print(f"{strategy} with bf16 gradients ends {distance:.2e} from fp32")
    assert 3e-5 < distance < 5e-4
    if strategy != "zero1":
        assert exported(run_dir) == exported(two_rank_run("zero1", "bf16"))


def test_islands_plan_prices_the_bytes_each_strategy_booked(two_rank_run, tmp_path):
    runs = {s: two_rank_run(s) for s in ("ddp", "zero1", "zero2", "fsdp")}
    config, network = tmp_path / "config.yaml", tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump(exact_config(tmp_path / "run")))
    network.write_text(yaml.safe_dump(NODE_OF_TWO))
    from islands.cli import main

    assert main(["plan", str(config), "--network", str(network), "--out", str(tmp_path / "plan")]) == 0
    planned = {r["strategy"]: r for r in json.loads((tmp_path / "plan.json").read_text())["rows"]}
    assert (tmp_path / "plan.png").stat().st_size > 0
    for strategy, run_dir in runs.items():
        booked = json.loads((run_dir / "communication.json").read_text())["bytes_per_step"]
        assert planned[strategy]["bytes_per_step"] == pytest.approx(booked), strategy


def test_a_compressed_zero1_checkpoint_resumes_under_compressed_fsdp_bit_identically(tmp_path, two_rank_run):
    moved = cut_back(two_rank_run("zero1", "bf16"), tmp_path / "moved", 320)
    result = on_ranks(2, exact_config(moved), tmp_path, "parallel.strategy=fsdp", "parallel.compression=bf16")
    assert result.returncode == 0, result.stderr[-3000:]
    assert exported(moved) == exported(two_rank_run("fsdp", "bf16"))


@pytest.mark.parametrize("wire,ratio", [("bf16", 0.5), ("fp16", 0.5)])
def test_ddp_gradient_compression_halves_the_traffic_and_stays_on_course(tmp_path, reference, wire, ratio):
    cfg, single = reference
    cfg = {**cfg, "run_dir": str(tmp_path / wire)}
    result = on_ranks(2, cfg, tmp_path, "parallel.strategy=ddp", f"parallel.compression={wire}")
    assert result.returncode == 0, result.stderr[-3000:]
    grad_bytes = 4 * sum(t.numel() for t in single.values())
    for record in read_metrics(cfg["run_dir"]):
        assert record["comm_bytes_per_step_per_rank"] == pytest.approx(ratio * bytes_sent("all_reduce", grad_bytes, 2))
    # 16-bit gradients change the trajectory a little, not a lot
    assert 1e-7 < relative_difference(single, final_weights(cfg["run_dir"])) < 2e-2


def _workers(agent_pid: int) -> dict[int, int]:
    """RANK -> pid of the worker processes torchrun started."""
    ranks = {}
    for child in open(f"/proc/{agent_pid}/task/{agent_pid}/children").read().split():
        env = open(f"/proc/{child}/environ", "rb").read().split(b"\0")
        rank = [e for e in env if e.startswith(b"RANK=")]
        if rank:
            ranks[int(rank[0][5:])] = int(child)
    return ranks


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_a_hung_rank_makes_the_other_fail_within_the_timeout(tmp_path):
    cfg = mlp_config(tmp_path / "hang")
    cfg["train"].update(images=10**7, log_every=64, checkpoint_every=10**6)
    cfg["parallel"] = {"strategy": "ddp", "timeout_s": 8}
    path = tmp_path / "hang.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "islands", "train", str(path), "--quiet"]
    agent = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = {}
    try:
        metrics = tmp_path / "hang" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().strip()):
            assert time.monotonic() < deadline and agent.poll() is None, "training never started"
            time.sleep(0.2)
        workers = _workers(agent.pid)
        os.kill(workers[1], signal.SIGSTOP)  # rank 1 hangs: alive, silent
        stopped = time.monotonic()
        while _alive(workers[0]):
            assert time.monotonic() - stopped < 8 + 20, "rank 0 still waiting long after the timeout"
            time.sleep(0.2)
        print(f"rank 0 exited {time.monotonic() - stopped:.1f} s after rank 1 hung (timeout 8 s)")
        os.kill(workers[1], signal.SIGKILL)  # spare torchrun its 30 s grace period for a stopped process
        assert agent.wait(timeout=90) != 0
    finally:
        for pid in workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if agent.poll() is None:
            agent.kill()


def test_torchrun_restart_after_a_killed_rank_resumes_from_the_last_checkpoint(tmp_path):
    """--max-restarts=1: a rank is killed after the first checkpoint; the second attempt (its own store
    prefix) resumes there and ends bit-identical to a 2-rank run that was never interrupted."""
    def config(name):
        cfg = mlp_config(tmp_path / name)
        cfg["train"].update(images=8000, checkpoint_every=2000, log_every=2000)
        cfg["parallel"] = {"strategy": "ddp", "timeout_s": 20}
        return cfg

    straight = config("straight")
    assert on_ranks(2, straight, tmp_path).returncode == 0
    restarted = config("restarted")
    path = tmp_path / "restarted.yaml"
    path.write_text(yaml.safe_dump(restarted))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "islands", "train", str(path), "--quiet"]
    agent = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while latest_checkpoint(restarted["run_dir"]) is None:
            assert time.monotonic() < deadline and agent.poll() is None, "no checkpoint before the kill"
            time.sleep(0.05)
        killed_at = int(latest_checkpoint(restarted["run_dir"]).name)
        os.kill(_workers(agent.pid)[1], signal.SIGKILL)
        _, err = agent.communicate(timeout=TIMEOUT_S)
        assert agent.returncode == 0, err[-3000:]
        assert "exitcode: -9" in err  # the first attempt did lose a rank; the second finished
    finally:
        if agent.poll() is None:
            agent.kill()
    assert killed_at < 8000
    a, b = final_weights(straight["run_dir"]), final_weights(restarted["run_dir"])
    assert all(torch.equal(a[k], b[k]) for k in a)


def _check_two_ranks(rank: int, port: int, perturb: bool, out: str) -> None:
    import torch.distributed as dist

    from islands.parallel.launch import World
    from islands.parallel.strategies import DDPStrategy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    if perturb and rank == 1:
        with torch.no_grad():
            net[1].bias[0] += 1e-6
    try:
        DDPStrategy(World(rank=rank, size=2)).layout.check_consistency(net)
        message = "consistent"
    except RuntimeError as err:
        message = str(err)
    open(f"{out}.{rank}", "w").write(message)
    dist.destroy_process_group()


@pytest.mark.parametrize("perturb", [False, True])
def test_consistency_check_names_the_parameter_that_differs(tmp_path, perturb):
    import torch.multiprocessing as mp

    out = str(tmp_path / "verdict")
    ctx = mp.spawn(_check_two_ranks, args=(free_port(), perturb, out), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline, "ranks hung"
    verdicts = [open(f"{out}.{r}").read() for r in range(2)]
    if perturb:
        assert all("ranks hold different weights" in v and "1.bias" in v and "0.weight" not in v for v in verdicts)
    else:
        assert verdicts == ["consistent", "consistent"]


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor this rank holds: its shard of a DTensor."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _probe_two_ranks(rank: int, port: int, out: str) -> None:
    """Rank `rank` of 2: the strategies' own objects, one real step each, and what they hold and send."""
    import torch.distributed as dist

    from islands.parallel.launch import World

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    world = World(rank=rank, size=2)
    cfg = validate(mlp_config("unused"))
    report = {"all_finite": {}, "moments": {}}
    for flags in itertools.product([True, False], repeat=2):  # (rank 0's verdict, rank 1's)
        report["all_finite"][str(flags)] = world.all_finite(flags[rank])

    issued = []  # every broadcast ZeroRedundancyOptimizer makes, seen below the strategy's own counting
    real_broadcast = dist.broadcast

    def observed(tensor, src, *args, **kwargs):
        issued.append((tensor.numel() * tensor.element_size(), src))
        return real_broadcast(tensor, src, *args, **kwargs)

    dist.broadcast = observed
    for name in ("ddp", "zero1", "zero2", "fsdp"):
        torch.manual_seed(0)
        strategy = strategy_class(name)(world)
        net = build_network(network_spec(cfg.model, (2,), 3))
        model = strategy.parallelize(net)
        opt = strategy.layout.optimizer(net, lr=1e-3)
        generator = torch.Generator().manual_seed(rank)
        x, t = torch.randn(8, 2, generator=generator), torch.rand(8, generator=generator)
        model(x, t, torch.randint(0, 3, (8,), generator=generator)).square().mean().backward()
        issued.clear()
        opt.step()
        local = strategy.checkpoint.local_optimizer(opt)
        held = sum(_local_bytes(state[k]) for state in local.state.values() for k in ("exp_avg", "exp_avg_sq"))
        if name == "zero1":  # ZeroRedundancyOptimizer's own partition: the parameters its local AdamW steps
            owned = [p for group in local.param_groups for p in group["params"]]
        else:  # FSDP: this rank's shard of every parameter; DDP: every parameter whole
            owned = list(net.parameters())
        report["moments"][name] = {"held": held, "partition": 2 * sum(_local_bytes(p) for p in owned),
                                   "whole": 2 * sum(p.numel() * p.element_size() for p in net.parameters())}
        if name == "zero1":
            steps = [{"ledger": strategy.ledger.close_step().get("comm_broadcast_bytes", 0.0),
                      "issued": [b for b, _ in issued], "sent_as_owner": sum(b for b, src in issued if src == rank),
                      "owned": sum(p.numel() * p.element_size() for p in owned)}]
            # A layer unfrozen later joins the optimizer: its broadcasts must be counted too.
            head = torch.nn.Linear(64, 64)
            head.weight.grad, head.bias.grad = torch.ones_like(head.weight), torch.ones_like(head.bias)
            opt.add_param_group({"params": list(head.parameters())})
            issued.clear()
            opt.step()
            steps.append({"ledger": strategy.ledger.close_step().get("comm_broadcast_bytes", 0.0),
                          "issued": [b for b, _ in issued],
                          "whole": sum(p.numel() * p.element_size() for p in [*net.parameters(), *head.parameters()])})
            report["zero1"] = steps
        del model, opt, net
    dist.broadcast = real_broadcast
    open(f"{out}.{rank}", "w").write(json.dumps(report))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_probe(tmp_path_factory):
    """What each of 2 ranks reported from _probe_two_ranks (one spawn for all the tests that read it)."""
    import torch.multiprocessing as mp

    out = str(tmp_path_factory.mktemp("probe") / "report")
    ctx = mp.spawn(_probe_two_ranks, args=(free_port(), out), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline, "ranks hung"
    return [json.loads(open(f"{out}.{r}").read()) for r in range(2)]


def test_all_finite_is_true_on_every_rank_only_when_every_rank_saw_a_finite_step(two_rank_probe):
    for flags in itertools.product([True, False], repeat=2):
        assert [report["all_finite"][str(flags)] for report in two_rank_probe] == [all(flags)] * 2, flags


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_each_rank_holds_the_moments_its_partition_says(two_rank_probe, strategy):
    """Adam's exp_avg and exp_avg_sq: the whole on each rank under DDP, about half under ZeRO-1 (whole
    parameters, balanced greedily by size) and FSDP (a dim-0 shard of every parameter), never twice."""
    moments = [report["moments"][strategy] for report in two_rank_probe]
    whole = moments[0]["whole"]
    for m in moments:
        assert m["held"] == m["partition"]
    if strategy == "ddp":
        assert [m["held"] for m in moments] == [whole, whole]
    else:
        assert sum(m["held"] for m in moments) == whole
        assert all(0.4 < m["held"] / whole < 0.6 for m in moments)


def test_zero1_books_the_broadcasts_its_step_really_issues(two_rank_probe):
    """One broadcast per parameter, from its owner; the ledger books each at (W - 1) / W of its payload
    on every rank. After a layer joins the optimizer, its broadcasts are booked too."""
    for report in two_rank_probe:
        first, joined = report["zero1"]
        assert first["issued"] and first["sent_as_owner"] == first["owned"]  # this rank broadcast its partition
        assert sum(first["issued"]) == two_rank_probe[0]["moments"]["zero1"]["whole"] // 2  # every parameter once
        assert first["ledger"] == pytest.approx(bytes_sent("broadcast", sum(first["issued"]), 2))
        assert sum(joined["issued"]) == joined["whole"] > sum(first["issued"])
        assert joined["ledger"] == pytest.approx(bytes_sent("broadcast", joined["whole"], 2))


def mixture_npz_poisoned(path: Path, steps: set[int], batch: int, seed: int, rank: int = 0, world: int = 1) -> Path:
    """1024 vectors of the 3-mode mixture (labels: the mode) as an npz, poisoned as `poisoned_npz` says."""
    rng = np.random.default_rng(0)
    means = np.array(mlp_config("unused")["data"]["means"])
    y = np.arange(1024) % 3
    x = (means[y] + 0.2 * rng.standard_normal((1024, 2))).astype(np.float32)
    return poisoned_npz(path, x, y, steps, batch, seed, rank, world)


def launch_ranks(nproc: int, config: dict, tmp_path, *overrides: str) -> list[subprocess.CompletedProcess]:
    """`islands train` on `nproc` ranks started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT),
    but without its agent, which stops the other ranks as soon as one has failed: each rank's own exit
    status and stderr are seen."""
    path = tmp_path / "ranks.yaml"
    path.write_text(yaml.safe_dump(config))
    return run_local_ranks([sys.executable, "-m", "islands", "train", str(path), *overrides, "--quiet"], nproc,
                           TIMEOUT_S)


def test_a_loss_non_finite_on_one_rank_only_skips_the_step_on_both_and_max_nonfinite_stops_both(tmp_path):
    """Rank 1 alone gets an overflowing example in steps 3 and 6-8, rank 0 a finite loss and gradients:
    only the ranks' agreement (all_finite) makes rank 0 skip. Both must skip steps 3, 6 and 7 as one
    process with the same global batches skips them (2 micro-batches, bit for bit up to the checkpoint
    at 160 images, whose consistency check has both ranks' weights equal), and both stop after step 8, the
    third non-finite step in a row, with exit status 1 and the message naming that checkpoint."""
    seed = mlp_config("unused")["seed"]
    data = mixture_npz_poisoned(tmp_path / "poisoned.npz", {3, 6, 7, 8}, batch=32, seed=seed, rank=1, world=2)

    def config(name, **train_keys):
        cfg = exact_config(tmp_path / name, checkpoint_every=160, log_every=32, max_nonfinite=3, **train_keys)
        cfg["data"] = {"source": "npz", "path": str(data)}
        cfg["parallel"] = {"timeout_s": 30}
        return cfg

    # The premise, at the initial weights: rank 1's third micro-batch overflows, its gradients and their norm
    # do not, so neither does the average rank 0 gets.
    cfg = validate(config("premise"))
    source = build_source("npz", path=data)
    batch = next(itertools.islice(stream_loader(source, 32, seed, rank=1, world=2), 2, None))
    torch.manual_seed(seed)
    net = build_network(network_spec(cfg.model, (2,), 3))
    objective = build_objective(cfg)
    objective.prepare(net)
    loss = objective(net, batch).mean()
    loss.backward()
    assert not torch.isfinite(loss) and torch.isfinite(torch.nn.utils.clip_grad_norm_(net.parameters(), math.inf))

    one = config("one", accumulate=2)
    torch.set_num_threads(1)
    with pytest.raises(TrainingStopped) as stopped:
        train(validate(one), progress=False)
    assert "3 steps in a row" in str(stopped.value) and "(image 256)" in str(stopped.value)

    two = config("two")
    ranks = launch_ranks(2, two, tmp_path, "parallel.strategy=ddp")
    last_good = Path(two["run_dir"]) / "checkpoints" / "000000000160"
    for rank in ranks:
        assert rank.returncode == 1, rank.stderr[-3000:]
        message = rank.stderr.strip().splitlines()[-1]
        assert message == f"islands: {str(stopped.value).replace(str(one['run_dir']), two['run_dir'])}"
        assert message.endswith(f"last good checkpoint: {last_good}")
    skipped = [r["skipped"] for r in read_metrics(two["run_dir"])]
    assert skipped == [r["skipped"] for r in read_metrics(one["run_dir"])] == [0, 0, 1, 1, 1, 2, 3]
    assert latest_checkpoint(two["run_dir"]) == last_good
    assert exported(two["run_dir"]) == exported(one["run_dir"])


def test_an_expert_of_a_decentralized_model_trains_under_torchrun_with_sharding(tmp_path):
    """Each island may use any strategy: an FSDP expert on 2 ranks follows the 1-process expert."""
    from islands.cli import main

    cfg = mlp_config(tmp_path / "ensemble")
    cfg["ddm"] = {"k": 2, "partition": {"fine": 32}}
    path = tmp_path / "ddm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["partition", str(path), "--quiet"]) == 0
    single = _write(tmp_path / "single.yaml", {**cfg, "run_dir": str(tmp_path / "single")})
    assert main(["partition", single, "--quiet"]) == 0  # the same partition: it is deterministic
    torch.set_num_threads(1)
    assert main(["train", single, "expert=0", "--quiet"]) == 0
    result = on_ranks(2, cfg, tmp_path, "expert=0", "parallel.strategy=fsdp")
    assert result.returncode == 0, result.stderr[-3000:]
    sharded = final_weights(tmp_path / "ensemble" / "experts" / "0")
    assert relative_difference(final_weights(tmp_path / "single" / "experts" / "0"), sharded) < 1e-5


def _write(path, cfg) -> str:
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize("nproc", [2, 4])
def test_tstages_gives_each_range_a_group_of_ranks_that_trains_it_as_one_process_would(tmp_path, nproc):
    """2 ranges on 2 ranks (a group of one each) and on 4 (ddp inside each group of two): each range's weights are
    those of its range trained alone in one process, and each group's traffic is its own ddp's, nothing more."""
    cfg = {**mlp_config(tmp_path / "grouped"), "flow": {"t_ranges": [0.0, 0.4, 1.0]}}
    ranks = launch_ranks(nproc, cfg, tmp_path, "parallel.strategy=tstages")
    assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
    torch.set_num_threads(1)
    for i in range(2):
        alone = train(tstage_config(validate({**cfg, "run_dir": str(tmp_path / "alone")}), i), progress=False)
        grouped = tmp_path / "grouped" / "tstages" / str(i)
        assert yaml.safe_load((grouped / "config.yaml").read_text())["flow"]["t_range"] == [[0.0, 0.4], [0.4, 1.0]][i]
        if nproc == 2:
            assert not (grouped / "communication.json").exists()  # a group of one rank sends nothing
            assert all(torch.equal(a, b) for a, b in zip(final_weights(grouped).values(),
                                                         final_weights(alone).values(), strict=True))
        else:
            assert relative_difference(final_weights(grouped), final_weights(alone)) < 1e-5
            sent = json.loads((grouped / "communication.json").read_text())
            assert sent["bytes_per_step"] == pytest.approx(predicted_bytes("ddp", 1, cfg)), sent  # 2 ranks' ring
