"""The order examples are read in (islands/data/order.py): `blocks` reads contiguous blocks of one shard a window at a
time, every example once per epoch, and stays a pure function of (seed, position), so that ranks, loader workers and
resumes read exactly what one process reading straight through reads (issue 38, section 2)."""

import itertools

import numpy as np
import pytest
import torch
from conftest import tiny_unet

from islands.data.loader import stream_loader
from islands.data.order import BlockOrder, GlobalOrder
from islands.data.sources import _ArraySource
from islands.rundir import latest_checkpoint, load_weights
from islands.trainer import train

SHARDS = (0, 37, 37 + 64, 37 + 64 + 5, 37 + 64 + 5 + 50)  # uneven shards, one shorter than a block


def epoch_of(order, n: int, epoch: int) -> np.ndarray:
    return np.array([order.index_of(epoch * n + p) for p in range(n)])


@pytest.mark.parametrize("order", [GlobalOrder(SHARDS[-1], 3), BlockOrder(SHARDS, 8, 3, 3)])
def test_every_example_is_read_once_per_epoch_in_a_new_order_each_epoch(order):
    n = SHARDS[-1]
    first, second = epoch_of(order, n, 0), epoch_of(order, n, 1)
    assert sorted(first) == list(range(n)) and sorted(second) == list(range(n))
    assert not np.array_equal(first, second)


def test_blocks_are_contiguous_within_a_shard_and_read_within_their_window():
    block, window, n = 8, 3, SHARDS[-1]
    order = BlockOrder(SHARDS, block, window, seed=3)
    read = epoch_of(order, n, 0)
    shard_of = np.searchsorted(SHARDS, np.arange(n), side="right") - 1
    first_of_block = {}
    for b, (lo, size) in enumerate(zip(order.first, order.size, strict=True)):
        assert size <= block and shard_of[lo] == shard_of[lo + size - 1]  # a block never crosses a shard's end
        first_of_block.update({e: b for e in range(lo, lo + size)})
    for b in range(len(order.first)):
        at = np.flatnonzero([first_of_block[e] == b for e in read])
        assert at.max() - at.min() < window * block  # read whole within one window's span
    starts = order._group_starts  # a window's positions read at most `window` blocks, whole
    for lo, hi in zip(starts[:-1], starts[1:], strict=True):
        blocks = {first_of_block[e] for e in read[lo:hi]}
        assert len(blocks) <= window and hi - lo == sum(order.size[b] for b in blocks)


def pairs(source, order, batch, start=0, world=1, workers=0, batches=12) -> set:
    """(position, example) of what every rank's loader reads from `start` on, `batches` global batches."""
    seen = set()
    for rank in range(world):
        loader = stream_loader(source, batch, seed=3, start=start, rank=rank, world=world, workers=workers,
                               order=order)
        for b in itertools.islice(loader, batches):
            x = b.x.flatten(1)[:, 0].round().long().tolist()  # each example holds its own index
            seen |= set(zip(b.positions.tolist(), x, strict=True))
    return seen


def test_ranks_workers_and_a_resume_mid_block_read_what_one_process_reads():
    n = SHARDS[-1]
    source = _ArraySource(torch.arange(n, dtype=torch.float32)[:, None].expand(n, 4).contiguous(), None, 0)
    straight = pairs(source, BlockOrder(SHARDS, 8, 3, 3), 12, batches=24)
    assert len({p for p, _ in straight}) == 24 * 12
    split = pairs(source, BlockOrder(SHARDS, 8, 3, 3), 12, world=2, workers=2, batches=24)
    resumed = pairs(source, BlockOrder(SHARDS, 8, 3, 3), 12, batches=11) | \
        pairs(source, BlockOrder(SHARDS, 8, 3, 3), 12, start=11 * 12, world=3, batches=13)  # 132: mid-block
    assert split == straight and resumed == straight


def test_a_run_in_block_order_resumes_bit_identically(tmp_path, image_npz):
    blocks = {"order": "blocks", "block": 8, "window": 2}
    short = {"images": 48, "checkpoint_every": 24, "sample_every": 0}
    straight = train(tiny_unet(tmp_path / "straight", image_npz, data=blocks, train=short), progress=False)
    train(tiny_unet(tmp_path / "resumed", image_npz, data=blocks, train={**short, "images": 24}), progress=False)
    resumed = train(tiny_unet(tmp_path / "resumed", image_npz, data={**blocks, "workers": 2}, train=short),
                    progress=False)
    other = train(tiny_unet(tmp_path / "global", image_npz, train=short), progress=False)
    a, b, c = (load_weights(latest_checkpoint(run) / "model.safetensors") for run in (straight, resumed, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)  # the order is not the global one


def test_ranks_read_disjoint_shares_that_make_up_every_position_once():
    """Each position of an epoch in blocks order is read by exactly one rank (and the whole epoch by the ranks
    together): what rank r of 3 reads is its slice of every global batch, never another's."""
    n = SHARDS[-1]
    source = _ArraySource(torch.arange(n, dtype=torch.float32)[:, None].expand(n, 4).contiguous(), None, 0)
    per_rank = [_rank_pairs(source, rank) for rank in range(3)]
    positions = [{p for p, _ in share} for share in per_rank]
    assert all(not (a & b) for i, a in enumerate(positions) for b in positions[i + 1:])
    union = set().union(*per_rank)
    assert {p for p, _ in union} == set(range(13 * 12))  # 156: past the epoch's 156 examples exactly
    assert sorted(e for p, e in union if p < n) == list(range(n))  # every example once in the epoch


def _rank_pairs(source, rank: int) -> set:
    loader = stream_loader(source, 12, seed=3, rank=rank, world=3, order=BlockOrder(SHARDS, 8, 3, 3))
    seen = set()
    for b in itertools.islice(loader, 13):
        seen |= set(zip(b.positions.tolist(), b.x.flatten(1)[:, 0].round().long().tolist(), strict=True))
    return seen
