"""Activation checkpointing applied from outside the network, block by block.

Each block's forward is replaced by a checkpointed call of the original one, so the module tree and
its state-dict keys stay unchanged: checkpoints load the same with or without it.
"""

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(net: nn.Module) -> int:
    """Recompute each block of `net.blocks` during backward instead of storing its activations."""
    for block in net.blocks:
        block.forward = functools.partial(_checkpointed, block.forward)
    return len(net.blocks)
