"""Per-example randomness keyed on (seed, position in the global stream, purpose).

The n-th training example always gets the same noise, time and flip, whichever rank, micro-batch or
resumed process handles it (DESIGN.md section 3). Samples are seeded the same way, so sample i does not
depend on the batch it was generated in.
"""

import torch
from torch import Tensor

_MASK = (1 << 64) - 1
PURPOSES = {"noise": 1, "time": 2, "label_drop": 3, "flip": 4, "sample": 5, "order": 6, "validation": 7,
            "oracle": 8, "latent": 9, "block": 10}


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def stream_seed(seed: int, position: int, purpose: str) -> int:
    """A well-mixed 63-bit seed for one (seed, position, purpose) triple."""
    z = _splitmix64(_splitmix64(_splitmix64(seed & _MASK) ^ position) ^ PURPOSES[purpose])
    return z >> 1


def generator(seed: int, position: int, purpose: str) -> torch.Generator:
    return torch.Generator().manual_seed(stream_seed(seed, position, purpose))


def normal(seed: int, positions: list[int], shape: tuple[int, ...], purpose: str = "noise") -> Tensor:
    """One standard normal tensor of `shape` per position, stacked: (len(positions), *shape)."""
    out = torch.empty((len(positions), *shape))
    for row, n in enumerate(positions):
        out[row] = torch.randn(shape, generator=generator(seed, n, purpose))
    return out


def uniform(seed: int, positions: list[int], purpose: str) -> Tensor:
    """One uniform number in [0, 1) per position: (len(positions),)."""
    return torch.tensor([torch.rand((), generator=generator(seed, n, purpose)).item() for n in positions])
