"""Which example each position of the stream reads: a pure function of (seed, epoch, position), so that a run resumes
at any image on any number of ranks and loader workers.

`global` (the default): epoch e reads a permutation of all examples keyed on (seed, e), one random example after
another. `blocks`: for storage that serves long ranges well and single examples badly (object stores, network
filesystems), the examples are cut into contiguous blocks of `block` examples of one shard, the blocks are shuffled
per epoch, and they are read a window of `window` blocks at a time, the window's examples in a shuffled order of
their own: every example once per epoch, each block within `window * block` positions of its first read (so a
reader holds about `window` blocks at once), and a global batch of B drawn from up to `window` blocks of as many
shards. This is MosaicML streaming's shuffle-by-block-then-buffer idea, defined on positions rather than on nodes.
"""

import numpy as np
import torch

from islands.data import streams


class GlobalOrder:
    """Position n of epoch e reads example perm_e[n mod N], perm_e a permutation of all N keyed on (seed, e)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._epoch, self._perm = -1, None

    def index_of(self, position: int) -> int:
        epoch = position // self.n
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = torch.randperm(self.n, generator=streams.generator(self.seed, epoch, "order"))
        return int(self._perm[position % self.n])


class BlockOrder:
    """Blocks of `block` contiguous examples of one shard (`shard_starts`: each shard's first example and, last, the
    number of examples), shuffled per epoch and read `window` at a time, each window's examples shuffled."""

    def __init__(self, shard_starts, block: int, window: int, seed: int):
        if block < 1 or window < 1:
            raise ValueError(f"data.block and data.window must be at least 1, got {block} and {window}")
        starts = np.asarray(shard_starts, dtype=np.int64)
        firsts = [np.arange(lo, hi, block, dtype=np.int64) for lo, hi in zip(starts[:-1], starts[1:], strict=True)]
        self.first = np.concatenate(firsts) if firsts else np.zeros(0, np.int64)  # each block's first example
        ends = np.minimum(self.first + block, np.repeat(starts[1:], [len(f) for f in firsts]))
        self.size = ends - self.first
        self.n, self.block, self.window, self.seed = int(starts[-1]), block, window, seed
        self._epoch, self._group = -1, (-1, None)

    def _of_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            self._epoch, self._group = epoch, (-1, None)
            self._blocks = torch.randperm(len(self.first), generator=streams.generator(self.seed, epoch, "order"))
            sizes = self.size[self._blocks.numpy()]
            per_group = np.add.reduceat(sizes, np.arange(0, len(sizes), self.window))
            self._group_starts = np.concatenate([[0], np.cumsum(per_group)])

    def window_end(self, position: int) -> int:
        """The first position after the window `position` reads in: past it, none of that window's blocks is read
        again this epoch (what a reader holding them may drop, data/loader.py)."""
        epoch, at = divmod(position, self.n)
        self._of_epoch(epoch)
        group = int(np.searchsorted(self._group_starts, at, side="right")) - 1
        return epoch * self.n + int(self._group_starts[group + 1])

    def index_of(self, position: int) -> int:
        epoch, at = divmod(position, self.n)
        self._of_epoch(epoch)
        group = int(np.searchsorted(self._group_starts, at, side="right")) - 1
        if self._group[0] != group:
            self._group = (group, self._examples_of(epoch, group))
        return int(self._group[1][at - self._group_starts[group]])

    def _examples_of(self, epoch: int, group: int) -> np.ndarray:
        """The examples of a window's blocks, in an order keyed on (seed, epoch, window)."""
        blocks = self._blocks[group * self.window:(group + 1) * self.window].numpy()
        examples = np.concatenate([np.arange(self.first[b], self.first[b] + self.size[b]) for b in blocks])
        key = epoch * (len(self.first) + 1) + group  # one key per (epoch, window), never another epoch's
        return examples[torch.randperm(len(examples), generator=streams.generator(self.seed, key, "block")).numpy()]


def build_order(source, seed: int, kind: str = "global", block: int = 256, window: int = 8):
    """The order a run reads `source` in (data.order, data.block, data.window); a source read from shards cuts its
    blocks at their boundaries (`shard_starts`), any other is one shard."""
    if kind == "global":
        return GlobalOrder(len(source), seed)
    return BlockOrder(getattr(source, "shard_starts", (0, len(source))), block, window, seed)
