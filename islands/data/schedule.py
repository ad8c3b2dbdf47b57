"""The clock of a run's replicas: which stream positions each reads at each tick, and what each brings to a
synchronisation.

Replica r takes H_r optimizer steps of B_r images in every round (one round per synchronisation), at the first
H_r of the round's L = max_r H_r ticks: a replica with a smaller H is a slower worker, idle for the rest of the
round. Tick n = k L + t consumes the stream positions after `images_after(n)`, the batches of the replicas that
step at t one after another in replica order, so every position is read exactly once. When the replicas are alike
(data parallelism is W replicas with H = 1), tick n is global batch n, cut into W contiguous slices.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerSchedule:
    batches: tuple[int, ...]  # B_r: images per optimizer step of each replica
    steps: tuple[int, ...]  # H_r: its optimizer steps per round

    def __post_init__(self):
        if len(self.batches) != len(self.steps) or min(self.batches + self.steps) < 1:
            raise ValueError(f"a schedule needs one positive batch and step count per replica, got batches "
                             f"{list(self.batches)} and steps {list(self.steps)}")

    @classmethod
    def even(cls, batch: int, replicas: int, steps: int = 1) -> "WorkerSchedule":
        """`replicas` alike, sharing each global batch of `batch` images, synchronised every `steps`."""
        if batch % replicas:
            raise ValueError(f"global batch {batch} is not divisible by {replicas} ranks")
        return cls((batch // replicas,) * replicas, (steps,) * replicas)

    @property
    def ticks(self) -> int:
        """Ticks per round, L."""
        return max(self.steps)

    @property
    def round_images(self) -> int:
        return sum(b * h for b, h in zip(self.batches, self.steps, strict=True))

    @property
    def alike(self) -> bool:
        return len(set(self.batches)) == 1 and len(set(self.steps)) == 1

    def active(self, tick: int, replica: int) -> bool:
        return tick % self.ticks < self.steps[replica]

    def tick_images(self, tick: int) -> int:
        return sum(b for r, b in enumerate(self.batches) if self.active(tick, r))

    def images_after(self, ticks: int) -> int:
        """Images consumed by ticks 0 .. ticks - 1, summed over replicas: the run's clock."""
        k, t = divmod(ticks, self.ticks)
        return k * self.round_images + sum(b * min(t, h) for b, h in zip(self.batches, self.steps, strict=True))

    def tick_at(self, images: int) -> int:
        """The number of ticks that consume exactly `images` images (the inverse of images_after)."""
        k, t = images // self.round_images * self.ticks, 0
        while self.images_after(k + t) < images:
            t += 1
        if self.images_after(k + t) != images:
            raise ValueError(f"{images} images do not end a tick of replicas with batches {list(self.batches)} "
                             f"and steps {list(self.steps)}")
        return k + t

    def run_length(self, images: int) -> int:
        """The images a run of `images` consumes: it ends with the first tick that reaches them."""
        k = max(images // self.round_images - 1, 0) * self.ticks
        while self.images_after(k) < images:
            k += 1
        return self.images_after(k)

    def first_position(self, tick: int, replica: int) -> int:
        """The stream position of the first image replica r reads at `tick` (if it steps then)."""
        return self.images_after(tick) + sum(self.batches[j] for j in range(replica) if self.active(tick, j))

    def replica_images(self, tick: int, replica: int) -> int:
        """Images replica r consumed before `tick`: its own clock, which orders its own shard."""
        k, t = divmod(tick, self.ticks)
        b, h = self.batches[replica], self.steps[replica]
        return (k * h + min(t, h)) * b

    def weights(self, tick: int) -> list[float]:
        """Each replica's share of a synchronisation after `tick`: the images it consumed in the round so far
        over all of theirs."""
        t = tick % self.ticks
        consumed = [b * min(t + 1, h) for b, h in zip(self.batches, self.steps, strict=True)]
        return [c / sum(consumed) for c in consumed]
