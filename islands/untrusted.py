"""The rules for reading what came from elsewhere (another island's ensemble, a shared shard folder, a downloaded
autoencoder or text encoder, a checkpoint copied between machines), in one place so every reader applies the same:

- `inside`: the real path of every file read from a folder lies inside that folder (no link out, no `../`, no
  absolute name);
- `file_sha256`: what a record hashes is the bytes on disk, streamed;
- `safetensors_tensors` and `parameter_budget`: a network built from a config that came with weights is built only as
  large as those weights; the budget stops its construction the moment it registers more parameters than the
  file holds, so a config that names `channels: 20000` or a billion layers fails in one line before it allocates.
"""

import contextlib
import hashlib
import json
import math
import struct
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from islands.errors import DataError

HASH_BLOCK = 1 << 20
SAFETENSORS_HEADER_LIMIT = 100 << 20  # safetensors' own reader refuses larger headers


def inside(folder: Path, name: str | Path, what: str) -> Path:
    """folder/name, refused in one line unless its real path lies inside the real path of `folder`: an absolute
    name, a `..` that climbs out, or a link that leads out are all refused. Whether the file exists is the caller's
    question."""
    folder = Path(folder)
    relative = Path(name)
    path = folder / relative
    if relative.is_absolute() or not path.resolve().is_relative_to(folder.resolve()):
        raise DataError(f"{what} {folder}: {name} leads out of the folder (to {path.resolve()})")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def safetensors_tensors(path: Path, what: str = "weights file") -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor in a safetensors file, read from its header alone (nothing else of the
    file is read); a file that is not safetensors is refused in one line."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("shorter than a safetensors header")
            (size,) = struct.unpack("<Q", head)
            if size > SAFETENSORS_HEADER_LIMIT:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
        tensors = {name: (entry["dtype"], tuple(int(n) for n in entry["shape"]))
                   for name, entry in header.items() if name != "__metadata__"}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise DataError(f"{what} {path}: not a safetensors file ({type(err).__name__}: {err})") from None
    return tensors


def parameters_in(paths) -> int:
    """How many numbers the safetensors files at `paths` hold, from their headers."""
    return sum(math.prod(shape) for path in paths for _, shape in safetensors_tensors(path).values())


class WithoutInitialisation(TorchFunctionMode):
    """Inside, initialisers leave their tensor as it is: weights about to be loaded need no values, and no global
    random numbers are drawn (nor, on the meta device, torch._dynamo imported for the meta kernels of the random
    fills). Some of torch.nn.init's functions come here themselves, the others as their random fills."""

    FILLS = (torch.Tensor.uniform_, torch.Tensor.normal_)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FILLS or getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]  # nn.init hands it over by name
        return func(*args, **kwargs)


class TooLarge(DataError):
    """A network's construction registered more parameters than its weights file holds."""


@contextlib.contextmanager
def parameter_budget(limit: int, what: str):
    """Every module built inside may register at most `limit` parameters in all (the numbers its weights file
    holds): the construction of a network larger than that stops at the first parameter past the limit, before the
    rest is built or allocated. `what` names the config that implied it, for the one-line error."""
    total = 0

    def count(module, name, param):
        nonlocal total
        if param is not None:
            total += param.numel()
            if total > limit:
                raise TooLarge(f"{what} implies more than the {limit:,} parameters its weights hold: refused before "
                               "it is built (a config the weights do not fit)")
        return None

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(count)
    try:
        yield
    finally:
        handle.remove()


# Parameters registered while a network is built may exceed those it ends with (a layer made, then replaced; T5's
# shared embedding registered by each tower): the budget stops a runaway at this many times the weights' count, and
# the network built is then held to the count exactly.
REGISTRATIONS = 4


def check_fits(build, weights: list[Path] | int, what: str, exact: bool = True) -> None:
    """Build the network `build()` makes on the meta device (nothing allocated, nothing initialised) under the budget
    of the parameters in `weights` (safetensors files, or their count); a config that implies more, or that its class
    cannot build at all, is refused in one line. Without `exact`, only a runaway is (the loader then names the
    tensors that do not fit)."""
    limit = weights if isinstance(weights, int) else parameters_in(weights)
    with torch.device("meta"), WithoutInitialisation(), parameter_budget(REGISTRATIONS * limit, what):
        try:
            net = build()
        except TooLarge:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, OverflowError, MemoryError,
                SystemError) as err:
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise DataError(f"{what} cannot be built: {reason}") from None
    built = sum(p.numel() for p in net.parameters()) if isinstance(net, torch.nn.Module) else 0
    if exact and built > limit:
        raise TooLarge(f"{what} implies {built:,} parameters, more than the {limit:,} its weights hold: refused "
                       "before it is built (a config the weights do not fit)")
