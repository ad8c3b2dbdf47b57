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
"""

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


class _Backend(_DummyBackendModule):
    """`torch.fakegpu`: what autocast and lazy initialisation ask of a device module."""

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    def _lazy_init(self) -> None:
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
