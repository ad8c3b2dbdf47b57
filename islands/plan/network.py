"""The cluster a plan prices: islands of nodes of accelerators, and the three links between them.

Ranks are numbered island by island, node by node, as torchrun numbers them. A link is described by the bandwidth
one ring crossing it gets and its latency per message: between two accelerators of a node (NVLink, or loopback
for processes on one machine), between two nodes of an island, between two islands. Rings that cross the same link
at once share its bandwidth.

A measured machine (`this-machine`) adds what a ring model cannot know: each collective's own cost between the
node's ranks as this backend implements it beside the compute (`collectives`; gloo's reduce-scatter is an
all-reduce of the whole buffer, for one), the seconds a strategy's layout spends on the host each step whatever the
peers do (`host_s`: FSDP2's hooks and DTensor bookkeeping, measured on one rank), the rate a process copies
memory (`copy_gbit_s`: FSDP2 copies every unit into and out of flat buffers) and what a step's first
synchronisation waits for the slowest rank (`wait_s`). A cluster described by hand leaves them out: NCCL's
collectives are the rings the model prices, a GPU's host work runs ahead of its kernels, and its ranks do not share
cores.
"""

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from islands.config import ConfigError


class Link(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gbit_s: float = Field(gt=0)  # bandwidth of one direction, Gbit/s
    latency_us: float = Field(ge=0)  # per message

    @property
    def bytes_s(self) -> float:
        return self.gbit_s * 1e9 / 8

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


class Measured(BaseModel):
    """One collective as measured between `ranks` processes: a call takes `call_us` (what a call of one value
    takes) plus the bytes the ledger books for it at `gbit_s`, beside the compute of a training step."""

    model_config = ConfigDict(extra="forbid")
    ranks: int = Field(ge=2)
    call_us: float = Field(ge=0)
    gbit_s: float = Field(gt=0)

    def seconds(self, sent: float, calls: int = 1) -> float:
        return calls * self.call_us * 1e-6 + sent * 8 / (self.gbit_s * 1e9)


class Network(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    islands: int = Field(1, ge=1)
    nodes_per_island: int = Field(1, ge=1)
    gpus_per_node: int = Field(1, ge=1)
    gpu_tflops: float = Field(gt=0)  # peak dense FLOP/s of one accelerator in the run's precision, x 1e12
    mfu: float = Field(0.4, gt=0, le=1)  # the share of the peak a training step sustains
    # the share of the backward pass (2/3 of a step's compute) that gradient traffic hides behind: DDP's bucketed
    # all-reduce and FSDP's prefetched gathers run beside the compute; the local updates' exchange does not
    overlap: float = Field(0.8, ge=0, le=1)
    node: Link  # between two accelerators of a node
    cluster: Link | None = None  # between two nodes of an island (needed when nodes_per_island > 1)
    island: Link | None = None  # between two islands (needed when islands > 1)
    # measured on this machine only (see above): by ledger collective, and by strategy
    collectives: dict[str, Measured] = Field(default_factory=dict)
    host_s: dict[str, float] = Field(default_factory=dict)
    # what the ranks' first synchronisation in a step waits for the slowest of them beyond the call itself, where
    # they share cores with other work (stragglers, measured); 0 on a cluster described by hand
    wait_s: float = Field(0.0, ge=0)
    # the rate one process copies memory (this machine); None: copies are not priced (HBM copies in microseconds)
    copy_gbit_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _links(self):
        for key, needed in (("cluster", self.nodes_per_island > 1), ("island", self.islands > 1)):
            if needed and getattr(self, key) is None:
                raise ValueError(f"{key}: a link is needed with {self.islands} islands of {self.nodes_per_island} "
                                 "nodes")
        return self

    @property
    def world(self) -> int:
        return self.islands * self.nodes_per_island * self.gpus_per_node

    def slowest(self, ranks: int) -> tuple[str, Link]:
        """The slowest link inside a group of `ranks` consecutive ranks (island by island, node by node)."""
        if ranks > self.nodes_per_island * self.gpus_per_node:
            return "island", self.island
        if ranks > self.gpus_per_node:
            return "cluster", self.cluster
        return "node", self.node


NVLINK = {"gbit_s": 3600.0, "latency_us": 3.0}  # H100 NVLink 4: 450 GB/s each way
H100 = {"gpu_tflops": 989.0, "mfu": 0.4}  # dense bf16 peak
PRESETS = {
    "nvlink": {"name": "nvlink", "gpus_per_node": 8, **H100, "node": NVLINK},
    "infiniband": {"name": "infiniband", "nodes_per_island": 16, "gpus_per_node": 8, **H100, "node": NVLINK,
                   "cluster": {"gbit_s": 400.0, "latency_us": 5.0}},  # NDR, one 400 Gbit/s NIC per GPU
    "10gbe": {"name": "10gbe", "nodes_per_island": 8, "gpus_per_node": 8, **H100, "node": NVLINK,
              "cluster": {"gbit_s": 10.0, "latency_us": 50.0}},  # one 10 GbE port per node
    "datacenters": {"name": "datacenters", "islands": 8, "gpus_per_node": 8, **H100, "node": NVLINK,
                    "island": {"gbit_s": 1.0, "latency_us": 20_000.0}},  # 1 Gbit/s, 20 ms between data centres
}


def load_network(name_or_path: str) -> Network:
    """A preset by name, or a YAML file with Network's keys."""
    if name_or_path in PRESETS:
        return Network(**PRESETS[name_or_path])
    path = Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"--network: {name_or_path!r} is neither this-machine, a preset ({', '.join(PRESETS)}) "
                          "nor a file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"--network: {path} is not YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--network: {path} must hold a mapping of Network keys")
    try:
        return Network(**{"name": path.stem, **raw})
    except ValidationError as err:
        first = err.errors()[0]
        where = "".join(f"{key}: " for key in (".".join(map(str, first["loc"])),) if key)
        raise ConfigError(f"--network: {path}: {where}{first['msg'].removeprefix('Value error, ')}") from None
