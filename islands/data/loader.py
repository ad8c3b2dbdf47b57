"""Batches in global-stream order: resumable at any image, sliced disjointly across ranks.

Position n of the stream is example perm_e[n mod N] of epoch e = n div N, with perm_e keyed on
(seed, e). Global batch b covers positions [b B, (b + 1) B); rank r of W takes the r-th contiguous
slice of it (replicas that differ in batch or update frequency read by islands.data.schedule, which is
this layout when they are alike). Each example keeps its position, from which its flip, noise, time and label dropout
are drawn here, so the trajectory does not depend on W, on the accumulation count, on the loader's workers or on
where a run was resumed.
"""

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from islands.data import streams
from islands.data.batch import Batch
from islands.data.schedule import WorkerSchedule


class StreamOrder:
    """An infinite batch sampler of (example index, stream position) pairs for one rank: its part of its
    replica's slice at every tick its replica steps (islands.data.schedule)."""

    def __init__(self, num_examples: int, schedule: WorkerSchedule, seed: int, start: int = 0, replica: int = 0,
                 part: int = 0, parts: int = 1, own_order: bool = False):
        if schedule.batches[replica] % parts:
            raise ValueError(f"a replica's batch of {schedule.batches[replica]} is not divisible by its {parts} ranks")
        self.n, self.schedule, self.seed, self.tick = num_examples, schedule, seed, schedule.tick_at(start)
        self.replica, self.part, self.parts = replica, part, parts
        # own_order: the replica reads its own data (a shard) in an order of its own, on its own image clock; the
        # positions, which key the noise, stay the global ones
        self.own_order = own_order
        self._epoch, self._perm = -1, None

    def index_of(self, position: int) -> int:
        epoch = position // self.n
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = torch.randperm(self.n, generator=streams.generator(self.seed, epoch, "order"))
        return int(self._perm[position % self.n])

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        s, r = self.schedule, self.replica
        per_rank = s.batches[r] // self.parts
        while True:
            if s.active(self.tick, r):
                lo = s.first_position(self.tick, r) + self.part * per_rank
                mine = s.replica_images(self.tick, r) + self.part * per_rank if self.own_order else lo
                yield [(self.index_of(mine + i), lo + i) for i in range(per_rank)]
            self.tick += 1


class StreamDataset(Dataset):
    """Fetches examples by (index, position), applies the position-keyed horizontal flip and, if it `draws`, draws
    each example's training randomness from its position (in the loader's workers, when it has any)."""

    def __init__(self, source, seed: int, flip: bool, draws: bool = True):
        self.source, self.seed, self.flip, self.draws = source, seed, flip, draws

    def __getitems__(self, items: list[tuple[int, int]]) -> Batch:
        indices = [i for i, _ in items]
        positions = [p for _, p in items]
        x, y = self.source.get(indices)
        if self.flip:
            flip = streams.uniform(self.seed, positions, "flip") < 0.5
            x = torch.where(flip.reshape(-1, *([1] * (x.dim() - 1))), x.flip(-1), x)
        conditioned = y is not None
        if not conditioned:
            y = torch.full((len(items),), -1, dtype=torch.long)
        batch = Batch(x, y, torch.tensor(positions, dtype=torch.long), cluster=self.source.clusters_of(indices))
        return batch.drawn(self.seed, conditioned) if self.draws else batch


def _already_batched(batch):
    return batch


def stream_loader(source, batch_size: int, seed: int, start: int = 0, rank: int = 0, world: int = 1,
                  workers: int = 0, flip: bool | None = None, schedule: WorkerSchedule | None = None, part: int = 0,
                  parts: int = 1, own_order: bool = False, pin_memory: bool = False, draws: bool = True) -> DataLoader:
    """Infinite loader of `Batch`es for this rank's slice of each global batch of `batch_size` images (`world`
    ranks), or, given a schedule, of replica `rank`'s batches (its `part` of `parts`); in page-locked memory with
    `pin_memory`, for a GPU to copy asynchronously. Without `draws`, the batches come without their noise and
    uniforms, for the objective to draw from the positions at the shape it trains on (a latent run's)."""
    schedule = schedule or WorkerSchedule.even(batch_size, world)
    order = StreamOrder(len(source), schedule, seed, start, rank, part, parts, own_order)
    dataset = StreamDataset(source, seed, source.flip if flip is None else flip, draws)
    # Its own generator: a DataLoader iterator otherwise draws its worker seed from the global RNG,
    # which would shift dropout masks after a resume.
    return DataLoader(dataset, batch_sampler=order, collate_fn=_already_batched, num_workers=workers,
                      prefetch_factor=4 if workers else None, generator=torch.Generator().manual_seed(seed),
                      pin_memory=pin_memory)
