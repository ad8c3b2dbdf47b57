"""Preemption: the warning a cluster sends before it takes the machine away ends the run at a step every rank agrees
on, with a checkpoint there, so that no image since the last checkpoint is lost.

The signals are Slurm's (`sbatch --signal=USR1@SECONDS`, `scancel --signal=USR1`) and a spot instance's SIGTERM. The
handler only sets a flag; the loop asks `Preemption.agreed` at every step boundary, which is the flag's maximum over
the ranks (one all-reduce of one number), so every rank stops after the same step even when the signal reached them
at different times. The run then writes its checkpoint and stops with `Preempted`, whose exit status (75, EX_TEMPFAIL:
"try again later") says "resume me"; global rank 0 also writes the file $ISLANDS_PREEMPTED names, if set, since
torchrun's agent reports its own status, not its workers' (examples/slurm.sbatch requeues the job when it is there).
"""

import json
import os
import signal
import threading
import time
from pathlib import Path

from islands.errors import TrainingStopped
from islands.parallel.launch import World

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
EXIT_STATUS = 75  # sysexits.h EX_TEMPFAIL: the run is whole and wants to be run again
MARKER_ENV = "ISLANDS_PREEMPTED"


class Preempted(TrainingStopped):
    """The run stopped on a preemption signal after writing its checkpoint; rerunning the command resumes it."""

    exit_status = EXIT_STATUS


class Preemption:
    """The flag the preemption signals set, and the ranks' agreement on it. Installed in the main thread for the run
    and restored afterwards (`close`). A signal that came while the process started up is taken over from the
    handler the command line installed first thing (islands/cli.py, `EarlySignals`: anything with `received`, a
    (signal, time) or None), since the default action would kill a process that has not written its checkpoint."""

    def __init__(self, world: World):
        self.world = world
        self.signal: int | None = None
        self.received_at: float | None = None
        # signals reach Python's main thread only: a run trained from another thread keeps their default actions
        main = threading.current_thread() is threading.main_thread()
        self.previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS} if main else {}
        early = next((h.received for h in self.previous.values() if getattr(h, "received", None)), None)
        if early is not None:
            self.signal, self.received_at = early

    def _handle(self, signum, frame) -> None:  # only a flag: the loop acts on it at a step boundary
        if self.signal is None:
            self.signal, self.received_at = signum, time.monotonic()

    def agreed(self) -> bool:
        """Whether any rank has received a preemption signal: the same answer on every rank (a collective)."""
        return not self.world.all_finite(self.signal is None)  # the ranks' AND of "no signal here": one all-reduce

    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else "another rank's signal"

    def stop(self, images: int, checkpoint: Path | None) -> Preempted:
        """The error that ends the run, after its checkpoint is written; the job's rank 0 leaves the marker file."""
        waited = f", {time.monotonic() - self.received_at:.1f} s after it" if self.received_at is not None else ""
        marker = os.environ.get(MARKER_ENV)
        if marker and os.environ.get("RANK", "0") == "0":
            Path(marker).write_text(json.dumps({"images": images, "checkpoint": str(checkpoint),
                                                "signal": self.name()}) + "\n")
        return Preempted(f"preempted by {self.name()}: stopped at image {images} with its checkpoint {checkpoint}"
                         f"{waited}; rerun the same command to resume")

    def close(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
