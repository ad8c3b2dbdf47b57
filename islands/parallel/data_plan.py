"""The data plan: which stream positions a rank reads (torchtitan's data-parallel dims, with Islands' image clock).

A plain data-parallel rank reads share `share` of `shares` of every global batch, and every share is a replica that
steps at every tick. Replicas that synchronise every few steps (local_updates.py) bring their own schedule: replica
`replica` reads part `part` of `parts` of its own batch, at the ticks the schedule gives it.
"""

from dataclasses import dataclass

from islands.data.schedule import WorkerSchedule


@dataclass(frozen=True)
class DataPlan:
    share: int = 0  # which share of each global batch this rank reads (the ranks of a pipeline's row read the same)
    shares: int = 1  # into how many shares it is cut
    schedule: WorkerSchedule | None = None  # the replicas' own clock; None: every share steps at every tick
    replica: int = 0  # with a schedule: this rank's replica, its part of the replica's batch, the parts
    part: int = 0
    parts: int = 1

    def clock(self, batch: int) -> tuple[WorkerSchedule, int, int, int]:
        """What this rank reads at each tick: (the replicas' schedule, this rank's replica, its part of the replica's
        batch, the parts)."""
        if self.schedule is None:
            return WorkerSchedule.even(batch, self.shares), self.share, 0, 1
        return self.schedule, self.replica, self.part, self.parts
