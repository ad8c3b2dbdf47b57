"""Batches in global-stream order: resumable at any image, sliced disjointly across ranks.

Position n of the stream is example perm_e[n mod N] of epoch e = n div N, with perm_e keyed on
(seed, e). Global batch b covers positions [b B, (b + 1) B); rank r of W takes the r-th contiguous
slice of it (replicas that differ in batch or update frequency read by islands.data.schedule, which is
this layout when they are alike). Each example keeps its position, from which its flip, noise, time and label dropout
are drawn here, so the trajectory does not depend on W, on the accumulation count, on the loader's workers or on
where a run was resumed.

`training_batches` is the one path from a source to the objective, in this order: the source reads each example's
fields (`Source.read`), the loader draws from its position (in its workers), and on the run's device the data space
(`DataSpace.encode`: pixels, or an autoencoder's latents) flips and maps the examples. The trainer steps on what it
gets.
"""

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from islands.data import streams
from islands.data.batch import Batch
from islands.data.order import BlockOrder, GlobalOrder
from islands.data.schedule import WorkerSchedule
from islands.data.sources import CLUSTER, LABEL, X
from islands.data.space import DataSpace


class StreamOrder:
    """An infinite batch sampler of (example index, stream position) pairs for one rank: its part of its
    replica's slice at every tick its replica steps (islands.data.schedule)."""

    def __init__(self, order, schedule: WorkerSchedule, start: int = 0, replica: int = 0, part: int = 0,
                 parts: int = 1, own_order: bool = False):
        if schedule.batches[replica] % parts:
            raise ValueError(f"a replica's batch of {schedule.batches[replica]} is not divisible by its {parts} ranks")
        self.order, self.schedule, self.tick = order, schedule, schedule.tick_at(start)  # data/order.py
        self.replica, self.part, self.parts = replica, part, parts
        # own_order: the replica reads its own data (a shard) in an order of its own, on its own image clock; the
        # positions, which key the noise, stay the global ones
        self.own_order = own_order

    def index_of(self, position: int) -> int:
        return self.order.index_of(position)

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
    """Reads the fields of examples by (index, position), and draws from each position its horizontal flip (where
    the data flips) and its training randomness, the noise at `shape`, the shape the network sees (in the loader's
    workers, when it has any). `condition`: the field the network is conditioned on (a class; a caption's
    embedding)."""

    def __init__(self, source, seed: int, flip: bool, shape: tuple, condition: str = LABEL, order=None):
        self.source, self.seed, self.flip, self.shape, self.condition = source, seed, flip, shape, condition
        self.holding = read_in(source, order)

    def __getitems__(self, items: list[tuple[int, int]]) -> Batch:
        indices = [i for i, _ in items]
        positions = [p for _, p in items]
        if self.holding is not None:  # shards at a URL read in blocks: which blocks this batch ends the use of
            shards, order = self.holding
            shards.hold_until({i: order.window_end(p) for i, p in items}, min(positions))
        got = self.source.read(indices, (X, self.condition, CLUSTER))
        condition = got.get(self.condition)
        conditioned = condition is not None
        if not conditioned:
            condition = torch.full((len(items),), -1, dtype=torch.long)
        flip = streams.uniform(self.seed, positions, "flip") < 0.5 if self.flip else None
        batch = Batch(got[X], condition, torch.tensor(positions, dtype=torch.long), cluster=got.get(CLUSTER), flip=flip)
        return batch.drawn(self.seed, conditioned, self.shape)


def _already_batched(batch):
    return batch


def stream_loader(source, batch_size: int, seed: int, start: int = 0, rank: int = 0, world: int = 1,
                  workers: int = 0, flip: bool | None = None, schedule: WorkerSchedule | None = None, part: int = 0,
                  parts: int = 1, own_order: bool = False, pin_memory: bool = False, shape: tuple | None = None,
                  condition: str = LABEL, order=None) -> DataLoader:
    """Infinite loader of `Batch`es for this rank's slice of each global batch of `batch_size` images (`world`
    ranks), or, given a schedule, of replica `rank`'s batches (its `part` of `parts`); in page-locked memory with
    `pin_memory`, for a GPU to copy asynchronously. Their examples come as the source holds them, with the flips to
    apply (`flip`; None: the source's own default) and the noise drawn at `shape` (None: the source's), in `order`
    (data/order.py; None: a global permutation per epoch)."""
    schedule = schedule or WorkerSchedule.even(batch_size, world)
    order = order or GlobalOrder(len(source), seed)
    dataset = StreamDataset(source, seed, source.flip if flip is None else flip, tuple(shape or source.shape),
                            condition, order)
    order = StreamOrder(order, schedule, start, rank, part, parts, own_order)
    # Its own generator: a DataLoader iterator otherwise draws its worker seed from the global RNG,
    # which would shift dropout masks after a resume.
    return DataLoader(dataset, batch_sampler=order, collate_fn=_already_batched, num_workers=workers,
                      prefetch_factor=4 if workers else None, generator=torch.Generator().manual_seed(seed),
                      pin_memory=pin_memory)


def read_in(source, order):
    """Shards at a URL are read as the order asks for them: under data.order blocks, each block with one ranged
    request, held in the reading process (a loader worker) until the positions of its window are behind the batches
    that process reads (a process reads its batches in position order), so each block is requested once per process
    per epoch; under global, one request per example. -> (the shard reader, the order) where blocks are held, else
    None. Nothing changes for data read from a local disk."""
    from islands.data.shards import shard_source_of

    shards = shard_source_of(source)
    if shards is None or not shards.remote:
        return None
    if not isinstance(order, BlockOrder):
        shards.hold_blocks(None)
        return None
    shards.hold_blocks(order.block, None)
    return shards, order


def training_batches(source, space: DataSpace, batch_size: int, seed: int, device, flip: bool | None = None,
                     **placement) -> Iterator[Batch]:
    """A run's batches on `device`, in the space its network works in: the loader's (`stream_loader`, its keyword
    arguments in `placement`: where in the stream and which share), each mapped by `space` (its flip applied, its
    examples encoded) as it reaches the device."""
    loader = stream_loader(source, batch_size, seed, flip=space.flips(flip, source.flip),
                           shape=space.example_shape(tuple(source.shape)), **placement)
    for batch in loader:
        yield space.encode(batch.to(device, non_blocking=True))
