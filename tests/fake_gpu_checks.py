"""Every tensor that meets the model sits on the model's device: the library's code run on `fakegpu`
(tests/fake_gpu.py), a device that refuses, as CUDA does, an operation that mixes its tensors with CPU tensors.

Run by tests/test_devices.py in a process of its own (`pytest tests/fake_gpu_checks.py`), since the device's
registration lasts for the whole process.
"""

import pytest
import torch
import torch.distributed as dist
from fake_gpu import DEVICE, FakeGpuMode

from islands.parallel.launch import World


@pytest.fixture(autouse=True)
def on_fake_gpu():
    with FakeGpuMode():
        yield


@pytest.fixture
def collectives(monkeypatch):
    """The devices of the tensors each collective is handed, with the collective itself a no-op on one rank."""
    seen = []

    def recorded(name, copy=None):
        def collective(*tensors, **kwargs):
            seen.append((name, *(t.device.type for t in tensors if isinstance(t, torch.Tensor))))
            if copy is not None:
                copy(*tensors)
        return collective

    monkeypatch.setattr(dist, "all_reduce", recorded("all_reduce"))
    monkeypatch.setattr(dist, "all_to_all_single", recorded("all_to_all_single", lambda out, inp: out.copy_(inp)))
    return seen


def test_the_worlds_collectives_run_on_its_device(collectives):
    world = World(rank=0, size=2, device=DEVICE)
    assert world.all_finite(True) and world.mean([1.0, 3.0]) == [0.5, 1.5]  # the no-op all-reduce: one rank's own
    assert collectives == [("all_reduce", "fakegpu")] * 2


def test_ddp_consistency_check_on_the_device(collectives):
    from islands.parallel.strategies import DDPStrategy

    net = torch.nn.Linear(3, 2).to(DEVICE)
    DDPStrategy(World(rank=0, size=2, device=DEVICE)).check_consistency(net)
    assert collectives == [("all_reduce", "fakegpu")] * 2


def test_expert_parallel_exchange_sends_its_counts_where_its_rows_are(collectives):
    from islands.parallel.expert_parallel import exchange

    rows = torch.arange(6.0, device=DEVICE).reshape(3, 2)
    (received,) = exchange([[rows]], World(device=DEVICE))
    assert torch.equal(received[0].cpu(), rows.cpu())
    assert collectives == [("all_to_all_single", "fakegpu", "fakegpu")] * 2
