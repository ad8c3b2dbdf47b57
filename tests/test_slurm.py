"""Preemption, outside Slurm and under a real one-host Slurm: the warning a cluster sends before it takes a node
(SIGTERM on a spot instance; Slurm's `--signal=USR1@N`, `scancel --signal=USR1`) makes every rank stop after one
agreed step with a checkpoint there, exit 75, and the rerun (or the requeued job) ends bit-identical to a run never
interrupted. Everything under timeouts, on 127.0.0.1."""

import contextlib
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml
from test_parallel import final_weights, launch_ranks, mlp_config

from islands.parallel.launch import free_port
from islands.rundir import latest_checkpoint, list_checkpoints
from islands.train.logbook import read_metrics
from islands.trainer.preemption import EXIT_STATUS

TIMEOUT_S = 240
SIGNAL_BEFORE_S = 150  # the preempted job's --signal=USR1@: more than the 90-150 s the test leaves it


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


# --- a real Slurm on this host --------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
SBATCH = REPO / "examples" / "slurm.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")


@dataclass
class Cluster:
    """A one-host Slurm cluster in a folder of its own: its config, spool, logs and munge key; `env` reaches it."""

    folder: Path
    env: dict
    daemons: list = field(default_factory=list)

    def run(self, *argv: str, cwd=None) -> str:
        """A Slurm command's output; a busy controller's timeouts are tried again, for up to a minute."""
        for attempt in range(12):
            done = subprocess.run(argv, env=self.env, cwd=cwd, capture_output=True, text=True, timeout=60)
            if done.returncode == 0:
                return done.stdout
            if "timed out" not in done.stderr.lower() and "try again" not in done.stderr.lower() or attempt == 11:
                raise AssertionError(f"{' '.join(argv)}: {done.stderr.strip()}\n{self.logs()}")
            time.sleep(5)

    def submit(self, *argv: str, cwd) -> int:
        return int(self.run("sbatch", "--parsable", *argv, cwd=cwd).split(";")[0])

    def job(self, job: int) -> dict:
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "-o", "show", "job", str(job))
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait(self, job: int, until, deadline: float, why: str) -> dict:
        while True:
            fields = self.job(job)
            if until(fields):
                return fields
            assert time.monotonic() < deadline, f"{why}: job {job} is {fields.get('JobState')} ({fields})\n" + \
                self.logs()
            time.sleep(0.5)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                         for p in sorted((self.folder / "log").glob("*")))


def _slurm_conf(folder: Path, host: str) -> str:
    """One node (this host, its CPUs), processes tracked by their parents (no cgroups in a container), no task
    binding, no accounting; every port free now, every file in `folder`."""
    return "\n".join([
        "ClusterName=islands", f"SlurmctldHost={host}", f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={folder}/munge/socket",
        "SlurmUser=root", "SlurmdUser=root", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/builtin",
        "MpiDefault=none", "ReturnToService=2", "JobRequeue=1", "KillWait=30", "MinJobAge=3600",
        f"StateSaveLocation={folder}/ctld", f"SlurmdSpoolDir={folder}/d",
        f"SlurmctldPidFile={folder}/run/slurmctld.pid", f"SlurmdPidFile={folder}/run/slurmd.pid",
        f"SlurmctldLogFile={folder}/log/slurmctld.log", f"SlurmdLogFile={folder}/log/slurmd.log",
        f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
        f"PartitionName=local Nodes={host} Default=YES MaxTime=INFINITE State=UP", ""])


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """munged, slurmctld and slurmd started for this module's tests (root only: slurmd runs jobs as their users)."""
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing; `make test` installs slurm-wlm and munge "
                    "where it runs as root)")
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root: slurmd starts each job as its user")
    folder = tmp_path_factory.mktemp("slurm")
    for sub in ("ctld", "d", "log", "run", "munge"):
        (folder / sub).mkdir()
    key = folder / "munge" / "key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    (folder / "munge").chmod(0o700)
    (folder / "slurm.conf").write_text(_slurm_conf(folder, socket.gethostname()))
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    cluster = Cluster(folder, env)
    logs = folder / "log"
    starts = [["munged", "-F", "-f", f"--socket={folder}/munge/socket", f"--key-file={key}",
               f"--log-file={logs}/munged.log", f"--pid-file={folder}/run/munged.pid",
               f"--seed-file={folder}/munge/seed"],
              ["slurmctld", "-D", "-i"], ["slurmd", "-D"]]
    try:
        for argv in starts:
            cluster.daemons.append(subprocess.Popen(argv, env=env, stdout=open(logs / f"{argv[0]}.out", "w"),
                                                    stderr=subprocess.STDOUT))
            time.sleep(0.5 if argv[0] == "munged" else 0)
        deadline = time.monotonic() + 60
        while True:
            try:
                state = cluster.run("sinfo", "-h", "-o", "%T").strip()
            except subprocess.CalledProcessError:
                state = ""
            if state == "idle":
                break
            dead = [d.args[0] for d in cluster.daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                pytest.skip(f"a local Slurm did not start ({', '.join(dead) or 'node ' + (state or 'unknown')}): "
                            + " | ".join(cluster.logs().splitlines()[-12:]))
            time.sleep(0.5)
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            cluster.run("scancel", "--user=root")
        for daemon in reversed(cluster.daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()


def submit(slurm: Cluster, cfg: dict, folder: Path, *options: str) -> int:
    """examples/slurm.sbatch with `cfg`, on this host's one node: 2 CPU ranks of DDP (RANKS_PER_NODE), no GPUs."""
    config = folder / f"{Path(cfg['run_dir']).name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"  # this venv's torchrun
    env = f"ALL,RANKS_PER_NODE=2,RDZV_PORT={free_port()},OMP_NUM_THREADS=1,PYTHONPATH={REPO},PATH={path}"
    return slurm.submit("--nodes=1", "--gpus-per-node=0", f"--cpus-per-task={min(2, os.cpu_count())}",
                        f"--export={env}", f"--output={folder}/job-%j.out", *options, str(SBATCH), str(config),
                        "--quiet", cwd=folder)


def done(fields: dict) -> bool:
    """Whether the job ended (a requeue passes through CANCELLED: not an end)."""
    return fields["JobState"] in ("COMPLETED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def slurm_config(tmp_path, name: str) -> dict:
    """1000 steps of 32 images on 2 ranks, a checkpoint at the middle and the end."""
    cfg = long_config(tmp_path, name, images=32000)
    cfg["train"].update(checkpoint_every=16000, log_every=640, keep_checkpoints=10)
    cfg["parallel"]["timeout_s"] = 60
    return cfg


def job_processes(job: int, ranks_only: bool = False) -> list[int]:
    """The processes of a job (with `ranks_only`, torchrun's workers: they have a RANK), by their SLURM_JOB_ID."""
    pids = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            env = (proc / "environ").read_bytes().split(b"\0") if proc.name.isdigit() else []
            if f"SLURM_JOB_ID={job}".encode() in env and (not ranks_only or any(e.startswith(b"RANK=") for e in env)):
                pids.append(int(proc.name))
    return pids


def start_now(slurm: Cluster, job: int, restarts: int, deadline: float, *changes: str) -> float:
    """The requeued job's `changes` made while it waits, then the job started without Slurm's 2-minute requeue delay
    once its last run's processes are gone (its torchrun held the rendezvous port) and its node is idle: a job started
    again while its node still ends the last run is killed ("Job credential revoked"), which Slurm's own delay avoids.
    Where Slurm's delay ends first (a slow node's last run), the job has started itself: nothing left to hurry. Returns
    the seconds the hurry waited."""
    waited = time.monotonic()
    slurm.wait(job, lambda fields: requeued_for(fields, restarts), deadline, "requeued")
    if changes:
        slurm.run("scontrol", "update", f"JobId={job}", *changes)
    while True:
        fields = slurm.job(job)
        if not requeued_for(fields, restarts):
            return time.monotonic() - waited
        if not job_processes(job) and "State=IDLE " in slurm.run("scontrol", "-o", "show", "node"):
            break
        assert time.monotonic() < deadline, (f"job {job}'s last run does not end: processes {job_processes(job)}, "
                                             f"node {slurm.run('scontrol', '-o', 'show', 'node')}")
        time.sleep(0.2)
    time.sleep(1.0)
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    return time.monotonic() - waited


def throttled(job: int, until, deadline: float) -> None:
    """Run the job's ranks at a tenth of their speed (stopped 0.45 s of every 0.5: the same computation, later) until
    `until()`, so that Slurm's timer, which it checks about every 30 s, comes while they train; a signal that comes
    while a rank is stopped is delivered when it continues."""
    while not until():
        assert time.monotonic() < deadline, "the timer's signal never came"
        pids = job_processes(job, ranks_only=True)
        for sig, pause in ((signal.SIGSTOP, 0.45), (signal.SIGCONT, 0.05)):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            time.sleep(pause)


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory):
    """examples/slurm.sbatch run to its end under Slurm: (config, job log, seconds from sbatch to COMPLETED)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    cfg = slurm_config(folder, "uninterrupted")
    started = time.monotonic()
    job = submit(slurm, cfg, folder)
    fields = slurm.wait(job, done, started + 2 * TIMEOUT_S, "the job did not finish")
    return cfg, fields, (folder / f"job-{job}.out").read_text(), time.monotonic() - started


# Slurm's timer and the time limit it signals against are wall-clock: run alone, where a loaded machine cannot stretch
# a preemption's stop past the limit (both tests, so that the uninterrupted job they share runs once)
@pytest.mark.serial
def test_the_example_sbatch_trains_to_completion_under_slurm(uninterrupted):
    """examples/slurm.sbatch under a real Slurm: 2 ranks from RANKS_PER_NODE (not a hard-coded 8), the run trains to
    its end and writes its checkpoints; one process prints the end-of-run summary."""
    cfg, fields, log, took = uninterrupted
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", log[-3000:]
    print(f"the Slurm job took {took:.1f} s from sbatch to COMPLETED")
    assert [p.name for p in list_checkpoints(cfg["run_dir"])] == ["000000016000", "000000032000"]
    assert log.count("run directory:") == 1, log[-3000:]
    assert log.count("islands: warning") == 0 and "Traceback" not in log, log[-3000:]


def trains_past(slurm: Cluster, job: int, cfg: dict, images: int, deadline: float) -> None:
    metrics = Path(cfg["run_dir"]) / "metrics.jsonl"
    while not metrics.exists() or max((r["images"] for r in read_metrics(cfg["run_dir"])), default=0) <= images:
        assert time.monotonic() < deadline and not done(slurm.job(job)), "the job stopped before image {images}"
        time.sleep(0.1)


def run_seconds(run_time: str) -> int:
    """Slurm's RunTime, [[D-]HH:]MM:SS, in seconds."""
    days, _, clock = run_time.rpartition("-")
    seconds = 0
    for part in clock.split(":"):
        seconds = 60 * seconds + int(part)
    return seconds + 86400 * int(days or 0)


def requeued_for(fields: dict, times: int) -> bool:
    """The job is back in the queue for the `times`th time (its BeginTime set, which the test may then move)."""
    return fields["Restarts"] == str(times) and fields["JobState"] == "PENDING"


def stops(log: str) -> list[int]:
    """The image counts at which the job's ranks said they stopped, one per rank per preemption."""
    return [int(m) for m in re.findall(r"stopped at image (\d+) ", log)]


@pytest.mark.serial
def test_slurm_preemption_by_the_time_signal_and_by_scancel_requeues_and_resumes_exactly(slurm, uninterrupted,
                                                                                         tmp_path):
    """A job with --signal=USR1@150 whose time limit is cut to 90-150 s away once it trains (the ranks' first seconds
    are torchrun's start: see examples/slurm.sbatch), and which runs slowed down (`throttled`) until Slurm's signal
    comes: it makes both ranks stop after one agreed step with a checkpoint there; the script requeues the job (whose
    time limit the test then raises again, and whose 2-minute requeue delay it skips); in the second run `scancel
    --signal=USR1` does the same; the third run finishes. No stop loses an image (its checkpoint is at the stop), and
    the end is bit-identical to the job never interrupted."""
    cfg = slurm_config(tmp_path, "preempted")
    started = time.monotonic()
    deadline = started + 3 * TIMEOUT_S
    job = submit(slurm, cfg, tmp_path, "--time=10", f"--signal=USR1@{SIGNAL_BEFORE_S}")
    log = tmp_path / f"job-{job}.out"
    trains_past(slurm, job, cfg, 640, deadline)
    # [[D-]HH:]MM:SS, under ten minutes: compared as text
    throttled(job, lambda: slurm.job(job)["RunTime"] >= "00:00:12", deadline)
    # Slurm keeps time limits in minutes and checks its timer about every 30 s: a limit 90-150 s away has the signal
    # due at once and leaves the stop at least a minute before the limit, even on a loaded machine (a cut to one minute
    # could leave it 18 s, and a slow stop was killed at the limit instead of requeued)
    limit_min = math.ceil((run_seconds(slurm.job(job)["RunTime"]) + 90) / 60)
    slurm.run("scontrol", "update", f"JobId={job}", f"TimeLimit={limit_min}")
    throttled(job, lambda: "stopped at image" in log.read_text() or done(slurm.job(job)), deadline)
    requeued = slurm.wait(job, lambda f: requeued_for(f, 1) or done(f), deadline, "no preemption by the timer")
    assert requeued["Restarts"] == "1", log.read_text()[-3000:]
    first = stops(log.read_text())
    assert len(first) == 2 and first[0] == first[1] < 32000, log.read_text()[-3000:]
    assert (Path(cfg["run_dir"]) / "checkpoints" / f"{first[0]:012d}" / "complete").exists()
    hurried = [start_now(slurm, job, 1, deadline, "TimeLimit=10")]

    slurm.wait(job, lambda f: f["JobState"] != "PENDING" and f["Restarts"] == "1", deadline, "not restarted")
    trains_past(slurm, job, cfg, first[0] + 640, deadline)
    signalled = time.monotonic()
    slurm.run("scancel", "--signal=USR1", str(job))
    slurm.wait(job, lambda f: requeued_for(f, 2) or done(f), deadline, "no preemption by scancel")
    left = time.monotonic() - signalled
    second = stops(log.read_text())[2:]
    assert len(second) == 2 and first[0] < second[0] == second[1] < 32000, log.read_text()[-3000:]
    assert (Path(cfg["run_dir"]) / "checkpoints" / f"{second[0]:012d}" / "complete").exists()
    hurried.append(start_now(slurm, job, 2, deadline))
    fields = slurm.wait(job, done, deadline, "the requeued job did not finish")
    text = log.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "2", f"{fields}\n{text[-3000:]}"
    assert text.count("run directory:") == 1 and text.count("requeueing job") == 2, text[-3000:]
    print(f"Slurm preemption: stopped at images {first[0]} (--signal=USR1@{SIGNAL_BEFORE_S}) and {second[0]} (scancel "
          f"--signal=USR1, after which the job left RUNNING in {left:.1f} s); whole test "
          f"{time.monotonic() - started:.0f} s; requeued runs started after {hurried[0]:.1f} and {hurried[1]:.1f} s; "
          + "; ".join(re.findall(r"[0-9.]+ s after it", text)))

    # the ranks stopped at the checkpoint's image count: what they had trained is all in it
    checkpoints = {int(p.name) for p in list_checkpoints(cfg["run_dir"])}
    assert {first[0], second[0], 32000} <= checkpoints
    a, b = final_weights(cfg["run_dir"]), final_weights(uninterrupted[0]["run_dir"])
    assert all(torch.equal(a[k], b[k]) for k in a)
