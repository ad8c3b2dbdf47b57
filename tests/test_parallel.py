"""torch.distributed on CPU: gloo on 127.0.0.1, 2 processes under torchrun, each run under a timeout.

Every check compares what the ranks wrote against a single-process reference run of the same config.
"""

import contextlib
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import yaml

from islands.config import validate
from islands.nets import build_network
from islands.parallel.ledger import bytes_sent
from islands.train.checkpoint import latest_checkpoint, list_checkpoints, load_weights, read_state
from islands.train.logbook import read_metrics
from islands.train.loop import train

TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, config: dict, tmp_path, *overrides: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    path = tmp_path / f"config-{nproc}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", *extra,
           "-m", "islands", "train", str(path), *overrides, "--quiet"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


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
    """Bytes per optimizer step per rank, by collective, from the parameter sizes and the ring algorithm.

    FSDP shards every parameter along dim 0, padded to a multiple of the world size; a block is gathered
    in forward and again in backward (fsdp) or once per micro-batch (zero2), the root once, and every
    unit's gradients are reduce-scattered once per step."""
    net = build_network(validate(cfg).model, (2,), 3)
    plain = 4 * sum(p.numel() for p in net.parameters())
    if strategy in ("ddp", "zero1"):
        sent = {"all_reduce": bytes_sent("all_reduce", plain, world)}
        if strategy == "zero1":
            sent["broadcast"] = bytes_sent("broadcast", plain, world)
        return sent

    def padded(params):
        return 4 * sum(-(-p.shape[0] // world) * world * p[0].numel() for p in params)

    blocks = padded([p for b in net.blocks for p in b.parameters()])
    everything = padded([p for n, p in net.named_parameters() if not n.startswith("blocks.")]) + blocks
    gathered = everything + (blocks if strategy == "fsdp" else 0)
    return {"all_gather": bytes_sent("all_gather", accumulate * gathered, world),
            "reduce_scatter": bytes_sent("reduce_scatter", everything, world)}


@pytest.mark.parametrize("strategy,accumulate,checkpointing", [
    ("ddp", 1, False), ("ddp", 2, True), ("zero1", 2, True), ("zero2", 1, False), ("zero2", 2, True),
    ("fsdp", 1, False), ("fsdp", 2, True)])
def test_every_strategy_on_two_ranks_follows_the_single_process_trajectory(
        tmp_path, reference, strategy, accumulate, checkpointing):
    cfg, single = reference
    cfg = {**cfg, "run_dir": str(tmp_path / strategy)}
    result = torchrun(2, cfg, tmp_path, f"parallel.strategy={strategy}", f"train.accumulate={accumulate}",
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
    result = torchrun(2, cfg, tmp_path, "parallel.strategy=fsdp", "train.precision=bf16")
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


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_every_strategy_exports_the_same_weights_file_bit_for_bit(tmp_path, exact_reference, strategy):
    cfg = exact_config(tmp_path / strategy)
    result = torchrun(2, cfg, tmp_path, f"parallel.strategy={strategy}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert exported(cfg["run_dir"]) == exported(exact_reference)


def test_a_two_rank_fsdp_run_resumes_on_one_process_bit_identically(tmp_path, exact_reference):
    """Saved as shards by 2 ranks half way, resumed by 1 process with 2 micro-batches: it must end exactly
    where the 1-process run that never stopped ended (weights, EMA, optimizer state and data position)."""
    cfg = exact_config(tmp_path / "moved", images=320)
    result = torchrun(2, cfg, tmp_path, "parallel.strategy=fsdp")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [int(p.name) for p in list_checkpoints(cfg["run_dir"])] == [320]
    cfg["train"].update(images=640, accumulate=2)
    torch.set_num_threads(1)
    train(validate(cfg), progress=False)
    assert exported(cfg["run_dir"]) == exported(exact_reference)
    assert read_state(latest_checkpoint(cfg["run_dir"]))["progress"]["step"] == 20


@pytest.mark.parametrize("strategy", ["zero1", "fsdp"])
def test_a_one_process_run_resumes_on_two_ranks_bit_identically(tmp_path, strategy):
    straight = exact_config(tmp_path / "straight")  # 2 ranks, never stopped
    assert torchrun(2, straight, tmp_path, f"parallel.strategy={strategy}").returncode == 0
    moved = exact_config(tmp_path / "moved", images=320, accumulate=2)
    torch.set_num_threads(1)
    train(validate(moved), progress=False)
    moved["train"].update(images=640, accumulate=1)
    result = torchrun(2, moved, tmp_path, f"parallel.strategy={strategy}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert exported(moved["run_dir"]) == exported(straight["run_dir"])


@pytest.mark.parametrize("wire,ratio", [("bf16", 0.5), ("fp16", 0.5)])
def test_ddp_gradient_compression_halves_the_traffic_and_stays_on_course(tmp_path, reference, wire, ratio):
    cfg, single = reference
    cfg = {**cfg, "run_dir": str(tmp_path / wire)}
    result = torchrun(2, cfg, tmp_path, "parallel.strategy=ddp", f"parallel.compression={wire}")
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
        cfg["train"].update(images=16000, checkpoint_every=4000, log_every=2000)
        cfg["parallel"] = {"strategy": "ddp", "timeout_s": 20}
        return cfg

    straight = config("straight")
    assert torchrun(2, straight, tmp_path).returncode == 0
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
    assert killed_at < 16000
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
        DDPStrategy(World(rank=rank, size=2)).check_consistency(net)
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
    result = torchrun(2, cfg, tmp_path, "expert=0", "parallel.strategy=fsdp")
    assert result.returncode == 0, result.stderr[-3000:]
    sharded = final_weights(tmp_path / "ensemble" / "experts" / "0")
    assert relative_difference(final_weights(tmp_path / "single" / "experts" / "0"), sharded) < 1e-5


def _write(path, cfg) -> str:
    path.write_text(yaml.safe_dump(cfg))
    return str(path)
