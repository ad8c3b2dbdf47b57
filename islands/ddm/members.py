"""The members of a Decentralized Diffusion Model (experts, router, monolith), each trained in a process of its own.

Every member runs `islands train ENSEMBLE/config.yaml ROLE run_dir=ENSEMBLE`: the resolved config `islands ddm`
wrote before any member started, whatever mix of file and command-line overrides produced it, so a member can
never train on other settings than the ensemble was built from. Its output goes to ENSEMBLE/logs/<member>.log;
the parent shows one progress bar over the images of the members it waits for.
"""

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from islands.errors import MemberFailed
from islands.rundir import LogLine

CONFIG = "config.yaml"  # the ensemble's resolved config, in the ensemble folder


@dataclass(frozen=True)
class Member:
    name: str  # expert0, router, monolith
    role: str  # what `islands train` takes: expert=0, router, monolith
    run_dir: Path
    images: int  # its run length, for the progress bar
    overrides: tuple[str, ...] = ()


def train_command(root: Path, role: str, *overrides: str, python: str = sys.executable) -> list[str]:
    """`islands train` of one member from the ensemble's own config; run_dir names the folder wherever it is now."""
    return [python, "-m", "islands", "train", str(Path(root) / CONFIG), role, f"run_dir={root}", *overrides]


def images_done(run_dir: Path) -> int:
    """Training images a member has consumed, from the last line of its metrics log (0 before the first)."""
    try:
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        return LogLine.model_validate_json(lines[-1]).images if lines else 0
    except (OSError, ValueError):  # not started yet, or a line being written (a ValidationError is a ValueError)
        return 0


def last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def run_members(root: Path, members: list[Member], threads: int, progress: bool = True) -> None:
    """Train `members` at once, `threads` cores each; raise MemberFailed naming every one that failed."""
    logs = Path(root) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # spawned processes must not oversubscribe the cores
    running = []
    for m in members:
        log = open(logs / f"{m.name}.log", "a")
        cmd = train_command(root, m.role, *m.overrides, f"train.threads={threads}", "--quiet")
        running.append((m, log, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)))
    names = ", ".join(m.name for m in members)
    bar = tqdm(total=sum(m.images for m in members), unit="img", desc=f"training {names}", disable=not progress,
               dynamic_ncols=True)
    try:
        while any(proc.poll() is None for _, _, proc in running):
            bar.n = sum(min(images_done(m.run_dir), m.images) for m in members)
            bar.refresh()
            time.sleep(1.0)
        bar.n = sum(min(images_done(m.run_dir), m.images) for m in members)
        bar.refresh()
    finally:
        bar.close()
        for _, log, proc in running:
            if proc.poll() is None:  # interrupted: the members stop with the parent
                proc.terminate()
                proc.wait()
            log.close()
    failed = [(m, proc.returncode, logs / f"{m.name}.log") for m, _, proc in running if proc.returncode != 0]
    if failed:
        raise MemberFailed("; ".join(
            f"ddm: {m.name} failed with exit status {code} (log: {log}; last line: {last_line(log)!r})"
            for m, code, log in failed) + "; rerun the same command to continue")
