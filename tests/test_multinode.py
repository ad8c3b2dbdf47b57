"""Two "nodes" on one machine: two torchrun agents (--nnodes=2 --nproc_per_node=1) that meet at a c10d rendezvous on
127.0.0.1, each with its own $ISLANDS_CACHE and scratch folder ($TMPDIR), as two machines have; the run directory is
shared, as a cluster's is. Every agent under a timeout."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from test_parallel import final_weights, launch_ranks, mlp_config, relative_difference

from islands.cli import main
from islands.config import validate
from islands.parallel.launch import free_port
from islands.rundir import latest_checkpoint
from islands.trainer import train

TIMEOUT_S = 240


def node_env(tmp_path, node: int) -> dict:
    """What differs between two machines: the cache, the scratch folder."""
    cache, scratch = tmp_path / f"node{node}" / "cache", tmp_path / f"node{node}" / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "OMP_NUM_THREADS": "1", "ISLANDS_CACHE": str(cache), "TMPDIR": str(scratch)}


def start_agents(argv: list[str], tmp_path, port: int, *options: str) -> list[subprocess.Popen]:
    """One torchrun agent per node (node 0 hosts the rendezvous store), each in a session of its own, so that a
    node's death is its whole process group's."""
    agents = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=islands-test",
               f"--rdzv-conf=is_host={node == 0},join_timeout=30,last_call_timeout=1", "--monitor-interval=0.2",
               *options, *argv]
        log = open(tmp_path / f"agent{node}-{time.monotonic_ns()}.log", "w")
        agent = subprocess.Popen(cmd, env=node_env(tmp_path, node), stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        agent.log = log
        agents.append(agent)
    return agents


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (torchrun starts its ranks in sessions of their own)."""
    try:
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except FileNotFoundError:
        return [pid]
    return [pid, *(d for child in children for d in descendants(int(child)))]


def kill_node(agent: subprocess.Popen) -> None:
    """The node is gone: its agent and its ranks."""
    for pid in descendants(agent.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def finish(agents: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for every agent; -> their outputs. Whatever is left at the timeout is killed, with its ranks."""
    deadline = time.monotonic() + timeout
    try:
        for agent in agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for agent in agents:
            kill_node(agent)
            agent.wait()
            agent.log.close()
    return [open(agent.log.name).read() for agent in agents]


def train_on_two_nodes(cfg: dict, tmp_path, *overrides: str, options=()) -> tuple[list[subprocess.Popen], list]:
    path = tmp_path / f"{os.path.basename(cfg['run_dir'])}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    agents = start_agents(["-m", "islands", "train", str(path), *overrides, "--quiet"], tmp_path, free_port(),
                          *options)
    return agents


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The single-process run the two nodes must follow."""
    cfg = mlp_config(tmp_path_factory.mktemp("single") / "run")
    torch.set_num_threads(1)
    train(validate(cfg), progress=False)
    return cfg, final_weights(cfg["run_dir"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_nodes_meeting_by_rendezvous_follow_the_one_process_trajectory(tmp_path, one_process, strategy):
    """Two agents, one rank each, meet at the c10d rendezvous and train as the single process does (to float
    rounding: the mean of two half-batch gradients); one process prints the end-of-run summary."""
    cfg, single = one_process
    cfg = {**cfg, "run_dir": str(tmp_path / strategy)}
    agents = train_on_two_nodes(cfg, tmp_path, f"parallel.strategy={strategy}")
    said = finish(agents, TIMEOUT_S)
    assert [a.returncode for a in agents] == [0, 0], [s[-3000:] for s in said]
    assert relative_difference(single, final_weights(cfg["run_dir"])) < 1e-5
    assert sum(s.count("run directory:") for s in said) == 1, said


def test_a_node_that_dies_stops_the_other_and_a_relaunch_resumes_exactly(tmp_path):
    """Node 1 dies (its agent and rank killed) after the first checkpoint: node 0's agent restarts its rank, whose
    rendezvous finds no peer, and exits non-zero within the timeout; both agents relaunched (--max-restarts=1) resume
    from the last complete checkpoint and end bit-identical to the same two ranks never interrupted."""
    cfg = mlp_config(tmp_path / "restarted")
    cfg["train"].update(images=8000, checkpoint_every=2000, log_every=2000)
    cfg["parallel"] = {"strategy": "ddp", "timeout_s": 10}
    agents = train_on_two_nodes(cfg, tmp_path, options=("--max-restarts=1",))
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while latest_checkpoint(cfg["run_dir"]) is None:
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), "no checkpoint"
            time.sleep(0.05)
        kill_node(agents[1])
        killed = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            agents[0].wait(timeout=150)
        stopped = time.monotonic() - killed
    finally:
        said = finish(agents, 1)
    assert stopped < 150 and agents[0].returncode != 0, said[0][-3000:]
    print(f"node 0 exited {stopped:.1f} s after node 1 died")
    stopped_at = latest_checkpoint(cfg["run_dir"]).name
    assert int(stopped_at) < 8000

    agents = train_on_two_nodes(cfg, tmp_path, options=("--max-restarts=1",))
    said = finish(agents, TIMEOUT_S)
    assert [a.returncode for a in agents] == [0, 0], [s[-3000:] for s in said]
    straight = {**cfg, "run_dir": str(tmp_path / "straight")}
    assert all(r.returncode == 0 for r in launch_ranks(2, straight, tmp_path))
    a, b = final_weights(cfg["run_dir"]), final_weights(straight["run_dir"])
    assert all(torch.equal(a[k], b[k]) for k in a)


def written_by_two_nodes(command: list[str], tmp_path) -> list[str]:
    agents = start_agents(["-m", "islands", *command], tmp_path, free_port())
    said = finish(agents, TIMEOUT_S)
    assert [a.returncode for a in agents] == [0, 0], [s[-3000:] for s in said]
    return said


def same_files(one, two) -> None:
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in two.iterdir()) and len(names) == 22  # 7 tars, indices, sha256s, manifest
    for name in names:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name


def test_islands_shard_on_two_nodes_writes_the_bytes_one_process_writes(tmp_path, image_npz):
    from conftest import write_config

    config = write_config(tmp_path / "c.yaml", {"run_dir": str(tmp_path / "run"),
                                                "data": {"source": "npz", "path": str(image_npz)}})
    args = ["--shard-size", "10", "--quiet"]
    assert main(["shard", config, str(tmp_path / "one"), *args]) == 0
    written_by_two_nodes(["shard", config, str(tmp_path / "two"), *args], tmp_path)
    same_files(tmp_path / "one", tmp_path / "two")
    assert not list(tmp_path.glob(".*partial"))


def test_islands_encode_on_two_nodes_writes_the_bytes_one_process_writes(tmp_path, image_npz):
    from conftest import run_ranks, write_config
    from test_latents import saved_vae

    vae = saved_vae(tmp_path / "vae")
    config = write_config(tmp_path / "c.yaml", {"run_dir": str(tmp_path / "run"),
                                                "data": {"source": "npz", "path": str(image_npz), "flip": True}})
    args = ["--autoencoder", str(vae), "--shard-size", "10", "--batch-size", "4", "--quiet"]
    # one process as each rank runs (one thread: a convolution's float sums follow the thread count)
    assert run_ranks(["encode", config, str(tmp_path / "one"), *args], nproc=1, timeout=TIMEOUT_S)[0].returncode == 0
    written_by_two_nodes(["encode", config, str(tmp_path / "two"), *args], tmp_path)
    same_files(tmp_path / "one", tmp_path / "two")


NODE_FIRST = """
import json, os, sys, time
rank = int(os.environ["RANK"])
os.environ["LOCAL_RANK"] = str(rank % 2)  # 4 ranks as 2 nodes of 2, as torchrun numbers them
from islands.parallel.launch import close_world, init_world
world = init_world()
with world.node_first():
    start = time.time()
    time.sleep(0.5)  # long enough for a rank that should wait to be seen overlapping
    end = time.time()
with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as f:
    json.dump({"local_rank": world.local_rank, "start": start, "end": end}, f)
close_world()
"""


def test_per_machine_work_is_done_first_by_each_nodes_first_rank_not_by_the_jobs(tmp_path):
    """Each node's first rank (LOCAL_RANK 0) fills the machine's caches before the node's other ranks start: on a
    second node that is global rank 2, so code that asked for global rank 0 (`is_main`) would let it overlap."""
    from islands.parallel.launch import run_local_ranks

    done = run_local_ranks([sys.executable, "-c", NODE_FIRST, str(tmp_path)], 4, TIMEOUT_S)
    assert all(p.returncode == 0 for p in done), [p.stderr[-500:] for p in done]
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    first = [r for r in ranks if r["local_rank"] == 0]
    others = [r for r in ranks if r["local_rank"] != 0]
    assert len(first) == 2 and max(r["end"] for r in first) <= min(r["start"] for r in others)
