"""Process-group start-up: the only place that decides backend, device and timeouts.

Run under torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Without
them the run is a single process and nothing is initialised.
"""

import contextlib
import gc
import os
import socket
import subprocess
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from islands.errors import IslandsWarning


@dataclass(frozen=True)
class World:
    """The ranks a run trains on: every rank of the job, or one group of them (`split`). rank and size are within
    the group; `group` is its process group (None: the whole job's)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    group: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def all_finite(self, flag: bool) -> bool:
        """Whether every rank saw a finite step: all ranks must skip a step together."""
        if not self.distributed:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)  # on the device: NCCL carries it on GPUs
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def mean(self, values: list[float]) -> list[float]:
        """Logged scalars averaged over ranks."""
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return (t / self.size).tolist()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    @contextlib.contextmanager
    def node_first(self):
        """Work each machine does once (its caches: the emoji, the caption table, the data's checks): the first rank
        of every node does it while the node's other ranks wait, then they do it again from the caches it filled.
        Every rank must enter; an error on a first rank lets the others go on to meet it themselves."""
        if self.local_rank != 0:
            self.barrier()
        try:
            yield
        finally:
            if self.local_rank == 0:
                self.barrier()

    def split(self, groups: int) -> tuple[int, "World"]:
        """Cut the job's ranks into `groups` contiguous groups of equal size, which share nothing afterwards:
        (this rank's group, the World of that group). Every rank must call it (each group is created by all)."""
        if groups < 1 or self.size % groups:
            raise ValueError(f"parallel.strategy: {self.size} ranks do not split into {groups} equal groups")
        per = self.size // groups
        handles = [dist.new_group(list(range(g * per, (g + 1) * per))) if self.size > 1 else None
                   for g in range(groups)]
        index = self.rank // per
        return index, World(rank=self.rank % per, size=per, local_rank=self.local_rank, device=self.device,
                            group=handles[index])


def _store(rank: int, size: int, timeout: timedelta) -> dist.Store:
    """The rendezvous store, prefixed per restart attempt.

    After a torchrun restart the keys of the failed attempt are still in the store; gloo then tries to
    connect to dead peers. A prefix keyed on TORCHELASTIC_RESTART_COUNT gives each attempt a clean view.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(host, port, size, is_master=(rank == 0 and not agent_hosts_store), timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"islands/attempt_{attempt}", store)


def backend_for(device: torch.device) -> str:
    """The process group's backend for a run on `device`: on GPUs NCCL for CUDA tensors and gloo beside it, since
    an NCCL-only group refuses every CPU tensor ("No backend type associated with device type cpu") and a collective
    that meets one (a count kept on the host, `islands plan`'s probe) would fail on its first call; gloo on CPUs."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_world(timeout_s: float = 600.0) -> World:
    """Join the process group torchrun prepared (NCCL and gloo on GPUs, gloo on CPUs), or stay single."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if size == 1:
        return World(device=device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend_for(device), store=_store(rank, size, timeout), rank=rank, world_size=size,
                                timeout=timeout)
    return World(rank=rank, size=size, local_rank=local_rank, device=device)


def bf16_is_native(device: torch.device | str) -> bool:
    """Whether bf16 matmuls and convolutions run in hardware on `device`. Where a CPU has neither AVX512-BF16 nor
    AMX they are emulated, and bf16 autocast is about ten times slower than fp32 (a U-Net step of 16 images on an
    AVX2 EPYC: 4.5 s in bf16, 0.46 s in fp32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return True
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(probe() for probe in probes if probe is not None)


def warn_if_bf16_is_slow(key: str, precision: str, device: torch.device | str) -> None:
    if precision == "bf16" and not bf16_is_native(device):
        warnings.warn(IslandsWarning(f"{key}: bf16 is emulated on this CPU (no AVX512-BF16 or AMX), about 10x slower "
                                     f"than fp32; set {key}=fp32"), stacklevel=2)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a rendezvous this process starts (tests, probes, benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local_ranks(argv: list[str], ranks: int, timeout_s: float, env: dict | None = None,
                    ) -> list[subprocess.CompletedProcess]:
    """`argv` on `ranks` processes of this machine started as torchrun starts them (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR/PORT on 127.0.0.1, one thread each) but without its agent, whose own start is
    slow and which stops the other ranks as soon as one fails: each rank's exit status and output are seen. Every
    rank is killed once all have ended or `timeout_s` has passed (subprocess.TimeoutExpired)."""
    shared = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(ranks),
              "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen(argv, env={**shared, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    try:
        deadline = time.monotonic() + timeout_s
        outputs = [p.communicate(timeout=max(0.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:  # a rank whose peer failed would wait for it until its own timeout
            p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outputs, strict=True)]


def close_world() -> None:
    if dist.is_initialized():
        # DDP, FSDP's device mesh and pending work keep the process group alive through reference cycles;
        # freed later, during interpreter shutdown, gloo's threads abort the process
        # ("terminate called without an active exception"). Free them while Python is whole.
        gc.collect()
        dist.destroy_process_group()
