"""The communication ledger: bytes each rank sends, per collective, per optimizer step.

Bytes are counted where the collective is issued, from the payload size and the algorithm's
per-rank traffic: a ring all-reduce of n bytes over W ranks sends 2 (W - 1) / W * n bytes from each
rank (reduce-scatter then all-gather); a reduce-scatter or an all-gather of a full tensor of n bytes
sends (W - 1) / W * n, and so does a pipelined broadcast of n bytes, averaged over the ranks: the owner
and every peer but the last forward the n bytes once, so W - 1 of the W ranks send n. Every rank books
each broadcast it takes part in at that average, sender or receiver; ZeRO-1's broadcasts of each
parameter from its owner then add up to an all-gather of the whole parameters.
"""

from collections import defaultdict

RING_FACTOR = {"all_reduce": lambda w: 2 * (w - 1) / w, "reduce_scatter": lambda w: (w - 1) / w,
               "outer_all_reduce": lambda w: 2 * (w - 1) / w,  # the local updates' synchronisation of replicas
               "all_gather": lambda w: (w - 1) / w, "broadcast": lambda w: (w - 1) / w,
               # booked at the bytes that leave the rank, counted by the caller:
               "all_to_all": lambda w: 1.0, "pipeline_activations": lambda w: 1.0, "pipeline_gradients": lambda w: 1.0}


def bytes_sent(collective: str, payload_bytes: int, world: int) -> float:
    """Bytes one rank sends for one ring collective over a payload of `payload_bytes`."""
    return RING_FACTOR[collective](world) * payload_bytes


class Ledger:
    def __init__(self, world: int):
        self.world = world
        self.step = defaultdict(float)  # this optimizer step, by collective
        self.total = defaultdict(float)  # the whole run (this process)
        self.steps = 0

    def record(self, collective: str, payload_bytes: int, ranks: int | None = None) -> None:
        """Book one collective over `ranks` ranks (None: the whole world of the ledger)."""
        self.step[collective] += bytes_sent(collective, payload_bytes, ranks or self.world)

    def close_step(self) -> dict:
        """Bytes sent during the step that just ended, by collective; starts the next step."""
        done = {f"comm_{k}_bytes": v for k, v in self.step.items()}
        for k, v in self.step.items():
            self.total[k] += v
        self.steps += 1
        self.step = defaultdict(float)
        return done

    def state_dict(self) -> dict:
        """The run's totals so far, kept in a checkpoint: a resumed run's communication.json counts the whole run,
        not only the steps since its last start."""
        return {"steps": self.steps, "total": dict(self.total)}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.total = defaultdict(float, {str(k): float(v) for k, v in state["total"].items()})

    def summary(self) -> dict:
        per_step = {k: v / max(self.steps, 1) for k, v in self.total.items()}
        return {"steps": self.steps, "bytes_per_step": per_step, "total_bytes": dict(self.total)}
