"""Preemption, outside Slurm and under a real one-host Slurm: the warning a cluster sends before it takes a node
(SIGTERM on a spot instance; Slurm's `--signal=USR1@N`, `scancel --signal=USR1`) makes every rank stop after one
agreed step with a checkpoint there, exit 75, and the rerun (or the requeued job) ends bit-identical to a run never
interrupted. Everything under timeouts, on 127.0.0.1."""

import os
import signal
import subprocess
import sys
import time

import torch
import yaml
from test_parallel import final_weights, launch_ranks, mlp_config

from islands.parallel.launch import free_port
from islands.rundir import latest_checkpoint, list_checkpoints
from islands.train.logbook import read_metrics
from islands.trainer.preemption import EXIT_STATUS

TIMEOUT_S = 240


def long_config(tmp_path, name: str, images: int = 64000) -> dict:
    """mlp_config, long enough to be interrupted (2000 steps of 32), checkpoints rare: what a preemption would lose."""
    cfg = mlp_config(tmp_path / name)
    cfg["train"].update(images=images, checkpoint_every=32000, log_every=320)
    cfg["parallel"] = {"strategy": "ddp", "timeout_s": 30}
    return cfg


def start_ranks(cfg: dict, tmp_path, env: dict | None = None) -> list[subprocess.Popen]:
    """`islands train` on 2 ranks started as torchrun starts them (no agent: each rank's status is its own)."""
    path = tmp_path / f"{os.path.basename(cfg['run_dir'])}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    shared = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return [subprocess.Popen([sys.executable, "-m", "islands", "train", str(path), "--quiet"],
                             env={**shared, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for r in range(2)]


def wait_for_steps(run_dir, procs, deadline: float) -> None:
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "training never started"
        time.sleep(0.05)


def test_sigterm_on_one_rank_stops_both_at_one_step_with_a_checkpoint_and_the_rerun_is_exact(tmp_path):
    """A spot instance's SIGTERM reaches rank 1 only: both ranks agree on the step to stop after, write the
    checkpoint there (none was due: 32000 images between them), exit 75, and the rerun ends bit-identical to a run
    never interrupted; no image since the last checkpoint is lost."""
    cfg = long_config(tmp_path, "preempted", images=9600)
    marker = tmp_path / "preempted.json"
    procs = start_ranks(cfg, tmp_path, {"ISLANDS_PREEMPTED": str(marker)})
    deadline = time.monotonic() + TIMEOUT_S
    try:
        wait_for_steps(tmp_path / "preempted", procs, deadline)
        procs[1].send_signal(signal.SIGTERM)
        sent = time.monotonic()
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
        exited = time.monotonic() - sent
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [EXIT_STATUS, EXIT_STATUS], [err[-2000:] for _, err in outs]
    stopped = latest_checkpoint(cfg["run_dir"])
    assert stopped is not None and len(list_checkpoints(cfg["run_dir"])) == 1
    images = int(stopped.name)
    assert 0 < images < 9600
    # what the ranks had trained when they stopped is what the checkpoint holds: nothing lost
    assert f"stopped at image {images} " in outs[0][1] and f"stopped at image {images} " in outs[1][1]
    assert "preempted by SIGTERM" in outs[1][1] and "another rank's signal" in outs[0][1]
    assert all(err.count("\n") == 1 for _, err in outs), [err[-2000:] for _, err in outs]
    assert max(r["images"] for r in read_metrics(cfg["run_dir"])) <= images
    assert f'"images": {images}' in marker.read_text()
    print(f"preempted at image {images}: both ranks exited {exited:.2f} s after SIGTERM, 0 images lost")

    resumed = launch_ranks(2, cfg, tmp_path)
    assert all(r.returncode == 0 for r in resumed), [r.stderr[-2000:] for r in resumed]
    assert sum(r.stdout.count("run directory:") for r in resumed) == 1  # one process per run prints the summary
    straight = {**cfg, "run_dir": str(tmp_path / "straight")}
    assert all(r.returncode == 0 for r in launch_ranks(2, straight, tmp_path))
    a, b = final_weights(cfg["run_dir"]), final_weights(straight["run_dir"])
    assert all(torch.equal(a[k], b[k]) for k in a)
