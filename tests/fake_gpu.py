"""A second device for a machine without a GPU: `fakegpu`, whose tensors hold real values on the CPU and which
refuses, as CUDA does, any operation that mixes its tensors with CPU tensors. Code that would fail on a GPU because
a tensor stayed on the CPU then fails here too, with the operation and the devices named.

Why not torch's FakeTensorMode on `cuda`: in the CPU wheel of torch 2.13 the first autograd graph on a fake CUDA
tensor aborts the process (autograd asks for CUDA's device guard, which that wheel does not have), and every
data-dependent operation (`.item()`, `bool`, `nonzero`) raises, so neither a training step nor a sampler's loop
nor a router's selection could run. `fakegpu` is torch's PrivateUse1 device made a Python backend (with a device
guard and hooks, so autograd, optimizers, autocast's entry and the loss scaler accept it), its tensors a wrapper
subclass whose operations run on the CPU tensor they wrap.

Importing this module registers the backend, which cannot be undone and changes `torch.accelerator` for the whole
process: import it only in a process of its own (tests/test_devices.py starts one).

What it cannot show: anything of CUDA itself (its kernels and their numerics, TF32, memory and its limits, the
CUDA generator that draws dropout on a GPU), autocast's casting rules (autocast passes fakegpu's operations through
unchanged), streams, `non_blocking` copies and pinned memory (fakegpu works synchronously; the loader pins only
for `cuda`), torch.compile, NCCL and everything that needs a process group of several ranks (DDP, FSDP, pipeline
stages; their collectives here are stand-ins on one rank), and the code that branches on `device.type == "cuda"`
(the backend's choice is tested apart). It is stricter than CUDA in one respect: CUDA accepts CPU index tensors
into a CUDA tensor, fakegpu refuses them.
"""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.backend_registration import _DummyBackendModule, _setup_privateuseone_for_python_backend

NAME = "fakegpu"
CPU = torch.device("cpu")

aten = torch.ops.aten
# Copies are the operations that cross devices; `_foreach_copy_` too (torch's FakeTensorMode allows it).
CROSSING = {aten._to_copy.default, aten.copy_.default, aten._foreach_copy_.default, aten._foreach_copy.default}


class DeviceMismatch(RuntimeError):
    """An operation met tensors on two devices (what CUDA raises as 'Expected all tensors to be on the same
    device')."""


class OnFakeGpu(torch.Tensor):
    """A tensor on `fakegpu`: its values live in `elem`, a CPU tensor of the same shape and strides."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                   storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                   layout=elem.layout, device=DEVICE, requires_grad=elem.requires_grad)

    def __init__(self, elem: torch.Tensor):
        self.elem = elem

    def __repr__(self):
        return f"OnFakeGpu({self.elem!r})"

    def tolist(self):  # as CUDA's does, by a copy to the host (torch refuses tolist on a subclass); numpy() is refused
        return self.elem.tolist()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return run(func, args, kwargs or {})


def _devices(func, flat: list) -> set[str]:
    """The devices of an operation's tensors, as CUDA counts them: a 0-dim CPU tensor is read as a number."""
    tensors = [a for a in flat if isinstance(a, torch.Tensor)]
    devices = {a.device.type for a in tensors if not (a.device.type == "cpu" and a.dim() == 0)}
    if func not in CROSSING and len(devices) > 1:
        raise DeviceMismatch(f"{func}: tensors on {' and '.join(sorted(devices))}")
    return devices or {a.device.type for a in tensors}


def run(func, args, kwargs):
    """`func` on the wrapped CPU tensors; its tensor results on `fakegpu` where the operation's device is."""
    flat, _ = tree_flatten((args, kwargs))
    devices = _devices(func, flat)
    if "device" in kwargs and kwargs["device"] is not None:  # a factory or a copy names its device
        on_gpu = torch.device(kwargs["device"]).type == NAME
        kwargs = {**kwargs, "device": CPU}
    elif func in CROSSING:  # a copy without a device keeps its source's (or, in place, its destination's)
        on_gpu = isinstance(args[0], OnFakeGpu)
    else:
        on_gpu = NAME in devices
    generators = [a for a in flat if isinstance(a, torch.Generator)]
    if on_gpu and generators:  # CUDA draws only from a CUDA generator
        raise DeviceMismatch(f"{func}: a {generators[0].device.type} generator for a tensor on {NAME}")
    wrappers = {id(a.elem): a for a in flat if isinstance(a, OnFakeGpu)}
    out = func(*tree_map(lambda a: a.elem if isinstance(a, OnFakeGpu) else a, args),
               **tree_map(lambda a: a.elem if isinstance(a, OnFakeGpu) else a, kwargs))

    def wrap(o):
        if not isinstance(o, torch.Tensor):
            return o
        if id(o) in wrappers:  # an argument written in place (or out=) is returned as itself
            return wrappers[id(o)]
        return OnFakeGpu(o) if on_gpu else o

    return tree_map(wrap, out)


class FakeGpuMode(TorchDispatchMode):
    """Routes the operations that create tensors on `fakegpu` (factories, copies from the CPU), which reach no
    `OnFakeGpu` argument, to `run`."""

    def __enter__(self):
        # torch.tensor(data, device=...) builds on its device below the Python dispatch key, where fakegpu has no
        # kernels; this flag (FakeTensorMode's too) makes it build on the CPU and copy, a copy that reaches the mode
        self._lift = torch._C._only_lift_cpu_tensors()
        torch._C._set_only_lift_cpu_tensors(True)
        return super().__enter__()

    def __exit__(self, *exc):
        torch._C._set_only_lift_cpu_tensors(self._lift)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if any(issubclass(t, OnFakeGpu) for t in types) or (device is not None and torch.device(device).type == NAME):
            return run(func, args, kwargs)
        return func(*args, **kwargs)


class _Stream:
    """fakegpu's one stream: its work is done, synchronously, by the time an operation returns."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


class _Backend(_DummyBackendModule):
    """`torch.fakegpu`: what autocast, lazy initialisation, fork_rng and DCP's copies to the host ask of a device
    module."""

    _stream = _Stream()

    def current_stream(self, device=None) -> _Stream:
        return self._stream

    def stream(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def synchronize(self, device=None) -> None:
        pass

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    def _lazy_init(self) -> None:
        pass

    # Its random numbers come from the CPU's generator, which torch.random.fork_rng saves and restores anyway.
    def get_rng_state(self, device=None) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor, device=None) -> None:
        pass


def _install() -> torch.library.Library:
    """Register `fakegpu`. Autocast passes its operations through unchanged: the checks are of devices, not of
    autocast's casting rules. -> the library object that must stay alive for the registration to last."""
    _setup_privateuseone_for_python_backend(NAME, backend_module=_Backend())
    library = torch.library.Library("_", "IMPL")
    library.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    return library


_LIBRARY = _install()
DEVICE = torch.device(NAME, 0)
