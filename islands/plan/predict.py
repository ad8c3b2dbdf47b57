"""How long a config's training takes on a described cluster, for every strategy: compute from the run's counted
FLOPs, traffic and state from each strategy's own formulas (its `costs`, the ones the ledger is tested against),
time on the wire from a ring model. No strategy is named here but in the list of rows.

The model, stated once:
- compute per optimizer step = the images one accelerator processes x FLOPs per image (torch's flop counter on
  one training step) / (peak x MFU);
- a collective over W ranks is a ring of W - 1 steps (2 (W - 1) for an all-reduce), each paying the slowest link's
  latency, and the bytes the ledger books for it cross that link at its bandwidth, shared by the rings crossing it
  at once; an all-reduce takes a tree instead (2 log2 W latencies) when that is faster, as NCCL chooses; a
  collective is issued once per DDP bucket (25 MiB) or FSDP unit (each gather and each reduce-scatter of a unit
  is one call, all its parameters in one flat buffer), and a latency-only call (FSDP's gradient norm) costs its
  latencies; where the network measured a collective between the node's ranks (this-machine), its measured cost
  replaces the ring's; every step the ranks of a data-parallel group agree whether it was finite and whether
  one of them was told to stop (two more all-reduces of one value);
- a strategy's host work per step (`Network.host_s`, and its copies around the collectives at
  `Network.copy_gbit_s`; this-machine only) adds to the step, hidden behind nothing, and so does the wait of ranks
  that synchronise every step for the slowest of them (`Network.wait_s`, measured);
- gradient traffic (ddp, zero, fsdp, pipeline) hides behind `overlap` of the backward pass (2/3 of compute); the
  local updates' exchange and ZeRO-1's parameter broadcast do not overlap (Islands issues them after the step);
- activation memory and the data loader are not modelled; state memory is weights, gradients and AdamW's moments.
"""

import math
from dataclasses import asdict, dataclass, field

import torch

from islands.conditions import network_spec
from islands.nets import build_network
from islands.parallel.build import strategy_class
from islands.parallel.costs import LOCAL, carry_bytes, ddp_buckets, dense_bytes
from islands.parallel.ledger import bytes_sent
from islands.parallel.pipeline import balanced_cut, block_costs, example_input
from islands.plan.network import Link, Measured, Network
from islands.train.flops import flops_per_image
from islands.train.objectives import build_objective

SYNC_EVERY = (10, 50, 100, 200)
DENSE = ("ddp", "zero1", "zero2", "fsdp")  # every rank a data-parallel copy (sharded or not) of the network
AGREEMENTS = 2  # one-value all-reduces the trainer makes every step: a finite step? a preemption? (trainer/loop.py)
ALL_REDUCES = ("all_reduce", "outer_all_reduce")  # 2 (W - 1) ring steps; the other collectives W - 1
BLOCKING = ("outer_all_reduce", "broadcast")  # issued after the step, nothing to hide behind


@dataclass
class Row:
    strategy: str
    layout: str  # how the accelerators are used
    bytes_per_step: dict = field(default_factory=dict)  # per accelerator, by ledger collective
    compute_s: float = 0.0  # per optimizer step
    comm_s: float = 0.0  # communication per step, all of it
    exposed_s: float = 0.0  # the part not hidden behind compute
    host_s: float = 0.0  # the layout's own host work per step (hooks, copies), measured on this machine
    wait_s: float = 0.0  # the ranks' first synchronisation in a step waiting for the slowest (this machine)
    step_s: float = 0.0
    steps: int = 0
    hours: float = 0.0
    state_gib: float = 0.0  # weights, gradients, AdamW moments per accelerator
    slowest: str = ""  # the slowest link the traffic crosses

    def as_dict(self) -> dict:
        return asdict(self)


def collective_seconds(kind: str, sent: float, ranks: int, link: Link, sharing: int = 1, calls: int = 1,
                       measured: Measured | None = None) -> float:
    """Seconds for a collective of which each of `ranks` ranks sends `sent` bytes (the ledger's count), over
    `link` shared by `sharing` rings, issued as `calls` messages of equal size (with no bytes: latency only);
    as `measured` between these ranks, when it was."""
    if ranks <= 1 or (sent <= 0 and calls <= 0):
        return 0.0
    if measured is not None and measured.ranks == ranks:
        return measured.seconds(sent * sharing, calls)
    steps = 2 * (ranks - 1) if kind in ALL_REDUCES else ranks - 1
    ring = calls * steps * link.latency_s + sent * sharing / link.bytes_s
    if kind not in ALL_REDUCES:
        return ring
    payload = sent / bytes_sent(kind, 1, ranks)  # a tree moves the payload up and down once
    return min(ring, calls * 2 * math.ceil(math.log2(ranks)) * link.latency_s + 2 * payload * sharing / link.bytes_s)


class Planner:
    """The prediction for one config (train.images at the global train.batch_size) on one network, for data of
    `shape` with `num_classes` classes; the network is built on the meta device, so any size costs nothing. A latent
    run that encodes its images as it trains pays `encoder_flops` more per image."""

    def __init__(self, cfg, network: Network, shape: tuple, num_classes: int, encoder_flops: float = 0.0):
        self.cfg, self.net_desc, self.shape, self.num_classes = cfg, network, tuple(shape), num_classes
        self.W = network.world
        self.batch, self.images = cfg.train.batch_size, cfg.train.images
        self.steps = math.ceil(self.images / self.batch)
        with torch.device("meta"):
            self.net = build_network(network_spec(cfg.model, self.shape, num_classes))
        self.params = sum(p.numel() for p in self.net.parameters())
        self.buckets = ddp_buckets(self.net)  # DDP's all-reduces a step
        micro = max(1, self.batch // self.W // cfg.train.accumulate)
        self.flops = flops_per_image(cfg.model, self.shape, num_classes, build_objective(cfg), micro,
                                     checkpointing=cfg.train.activation_checkpointing) + encoder_flops
        self.encoder_flops = encoder_flops
        self.rate = network.gpu_tflops * 1e12 * network.mfu

    # --- pieces ---
    def compute_s(self, images_per_gpu: float) -> float:
        return images_per_gpu * self.flops / self.rate

    def traffic_s(self, sent: dict, ranks: int, sharing: int = 1, calls: dict | None = None,
                  span: int | None = None) -> tuple:
        """(hideable seconds, blocking seconds, slowest link) of one step's `sent` bytes over a group of `ranks`
        whose members lie within `span` consecutive ranks (default: `ranks`, a contiguous group)."""
        where, link = self.net_desc.slowest(span or ranks)
        measured = self.net_desc.collectives if where == "node" else {}
        calls = calls or {}
        hide = block = 0.0
        for kind in {**sent, **calls}:  # a call may carry no booked bytes (a norm's one value)
            seconds = collective_seconds(kind, sent.get(kind, 0.0), ranks, link, sharing,
                                         calls.get(kind, 1 if sent.get(kind, 0.0) > 0 else 0), measured.get(kind))
            if kind in BLOCKING:
                block += seconds
            else:
                hide += seconds
        return hide, block, where if ranks > 1 else "-"

    def finish(self, row: Row, compute: float, hide: float, block: float, extra: float = 1.0,
               host: float = 0.0, synced: bool = False) -> Row:
        """Fill in the row's times: `extra` scales the whole run (the router's share for the experts), `host` is
        the layout's own work per step; `synced`: the ranks synchronise every step, and wait for the slowest."""
        row.compute_s, row.host_s = compute, host
        row.wait_s = self.net_desc.wait_s if synced else 0.0
        row.comm_s = hide + block
        row.exposed_s = max(0.0, hide - self.net_desc.overlap * compute * 2 / 3) + block
        row.step_s = compute + row.exposed_s + host + row.wait_s
        row.steps = self.steps
        row.hours = row.steps * row.step_s * extra / 3600
        return row

    def state_gib(self, per_param_bytes: float) -> float:
        return self.params * per_param_bytes / 2**30

    # --- strategies ---
    def dense(self, strategy: str) -> Row:
        cfg, W, costs = self.cfg, self.W, strategy_class(strategy).costs
        sent = costs.bytes_per_step(self.net, W, cfg.train.accumulate, cfg.parallel.compression, cfg.train.precision)
        calls = costs.messages(self.net, cfg.train.accumulate)
        # and every step the ranks agree whether it was finite (to skip it together) and whether any of them was
        # told to stop (preemption): two all-reduces of one value
        calls = {**calls, "all_reduce": calls.get("all_reduce", 1 if sent.get("all_reduce") else 0) + AGREEMENTS}
        hide, block, where = self.traffic_s(sent, W, calls=calls)
        row = Row(strategy, f"{W} ranks", sent, state_gib=self.state_gib(costs.state_bytes(W)), slowest=where)
        host = self.net_desc.host_s.get(strategy, 0.0)
        if self.net_desc.copy_gbit_s:  # the copies around its collectives, on the host where it measured them
            copied = costs.copied_bytes(self.net, W, cfg.train.accumulate, cfg.train.precision)
            host += copied * 8 / (self.net_desc.copy_gbit_s * 1e9)
        return self.finish(row, self.compute_s(self.batch / W), hide, block, host=host if W > 1 else 0.0,
                           synced=W > 1)

    def local(self, strategy: str, every: int) -> Row:
        """Each island one replica (DDP inside it), or each accelerator one when there is one island."""
        n = self.net_desc
        replicas = n.islands if n.islands > 1 else self.W
        per = self.W // replicas
        costs = strategy_class(strategy).costs
        compression = costs.plan_compression
        sent = costs.bytes_per_step(self.net, self.W, 1, compression, self.cfg.train.precision, every, replicas)
        inner = {k: v for k, v in sent.items() if k == "all_reduce"}
        # one exchange every H steps: each rank all-reduces its piece with its counterparts in the other replicas
        # (`per` rings cross the slowest link at once), then the group gathers the pieces on its own network
        _, block, where = self.traffic_s({"outer_all_reduce": sent["outer_all_reduce"] * every}, replicas,
                                         sharing=per, span=self.W)
        if per > 1:
            block += collective_seconds("all_gather", sent["all_gather"] * every, per, n.slowest(per)[1])
        block /= every
        hide, _, _ = self.traffic_s(inner, per, calls={"all_reduce": self.buckets})
        name = f"{strategy} H={every}" + (f" {compression}" if compression != "none" else "")
        row = Row(name, f"{replicas} replicas x {per}", sent, state_gib=self.state_gib(costs.state_bytes(self.W)),
                  slowest=where)
        # every step the replicas agree whether it was finite (the world's all-reduce of one value)
        return self.finish(row, self.compute_s(self.batch / self.W), hide, block, synced=self.W > 1)

    def pipeline(self) -> Row | None:
        """The stages on the accelerators of a node (1F1B), data parallel across nodes and islands."""
        n, cfg = self.net_desc, self.cfg
        if not hasattr(self.net, "blocks") or cfg.train.objective != "diffusion":  # as build_parts refuses
            return None
        stages = min(n.gpus_per_node, len(self.net.blocks))
        if stages < 2:
            return None
        data = self.W // stages
        micro = strategy_class("pipeline").costs.micro_batches(cfg, stages)
        costs = block_costs(self.net, example_input(self.net))
        cuts = balanced_cut(costs, stages)
        share = max(sum(costs[i] for i in r) for r in cuts) / sum(costs)
        per_copy = self.batch / data
        carries = [carry_bytes(self.net, 1, r.stop) * per_copy for r in cuts[:-1]]
        sent = {"pipeline_activations": sum(carries) / stages, "pipeline_gradients": sum(carries) / stages}
        biggest = max(dense_bytes([p for i in r for p in self.net.blocks[i].parameters()]) for r in cuts)
        if data > 1:
            sent["all_reduce"] = bytes_sent("all_reduce", biggest, data)
        bubble = (stages - 1) / (micro + stages - 1)
        compute = self.compute_s(per_copy) * share / (1 - bubble)
        # the busiest stage sends its activations forward and the previous cut's gradients back, a message per
        # micro-batch each way, beside the other micro-batches' compute (1F1B)
        busiest = max(a + b for a, b in zip([0.0, *carries], [*carries, 0.0], strict=True))
        p2p = 2 * micro * n.node.latency_s + busiest / n.node.bytes_s
        hide, block, where = self.traffic_s({k: v for k, v in sent.items() if k == "all_reduce"}, data,
                                            sharing=stages, span=self.W) if data > 1 else (0.0, 0.0, "node")
        row = Row("pipeline", f"{stages} stages x {data}, {micro} micro-batches", sent,
                  state_gib=biggest / 4 * 16 / 2**30, slowest=where)
        return self.finish(row, compute, hide + p2p, block)

    def experts(self) -> Row:
        """Decentralized experts: one per island (or per node, or per accelerator), no traffic between them;
        each trains at batch / K for the run's steps with DDP inside its island, then the router's share."""
        n = self.net_desc
        k = n.islands if n.islands > 1 else n.nodes_per_island if n.nodes_per_island > 1 else self.W
        per = self.W // k
        sent = strategy_class("ddp").costs.bytes_per_step(self.net, per) if per > 1 else {}
        hide, block, where = self.traffic_s(sent, per, calls={"all_reduce": self.buckets})
        row = Row("ddm experts", f"{k} experts x {per}", sent, state_gib=self.state_gib(16), slowest=where)
        return self.finish(row, self.compute_s(self.batch / self.W), hide, block,
                           extra=1 + self.cfg.ddm.router.flops_fraction)

    def rows(self, sync_every=SYNC_EVERY) -> list[Row]:
        rows = [self.dense(s) for s in DENSE]
        if (pipe := self.pipeline()) is not None:
            rows.append(pipe)
        for strategy in LOCAL:
            rows += [self.local(strategy, h) for h in sync_every]
        return [*rows, self.experts()]
