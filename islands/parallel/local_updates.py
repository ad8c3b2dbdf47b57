"""Training that synchronises every H optimizer steps: local SGD and DiLoCo, whole or streamed in fragments.

Every rank is a replica that steps its own copy of the network on its share of each global batch, with no
communication, and every `parallel.sync_every` = H optimizer steps (counted on the run's image clock, so a resumed
run keeps its place in the cycle) the replicas are brought back together:

local_sgd  the parameters are averaged (Lin et al. 2020, "Don't use large mini-batches, use local SGD").
diloco     the averaged change since the last synchronisation, the pseudo-gradient anchor - theta, is applied to
           the anchor by an outer SGD step with Nesterov momentum (Douillard et al. 2023, Algorithm 1: outer lr
           0.7, momentum 0.9), optionally sent in fp16 or bf16; every replica continues from the new anchor.

Streaming (`parallel.fragments` = F > 1, Liu et al. 2025, arXiv 2501.18512): the parameters are cut into F
contiguous fragments of about equal size, and fragment f synchronises at the steps s = (f + 1) H / F (mod H), so
each synchronisation moves 1/F of the model and the peak bandwidth drops F-fold while every fragment still
synchronises once per H steps. Islands replaces a fragment's local weights with the synchronised ones (the
paper's mixing factor alpha = 0) and does not overlap the exchange with the next steps: on the ledger the bytes
are the paper's, the wall time is not.

Islands of islands (`parallel.replicas` = R < the world size): the ranks form R contiguous groups, each one
replica trained by DDP inside it every step (the fast local network); the synchronisation runs between the ranks of
the same place in every group (R ranks each, the slow link), so the ledger books the groups' gradient all-reduce
(`all_reduce`) apart from the replicas' synchronisation (`outer_all_reduce`). The ranks of a group hold the same
replica, so the exchange is hierarchical: the rank at place p of its group (of G) averages only the p-th of G equal
pieces of the flat parameters with its counterparts, and the group then all-gathers the pieces (in fp32) on its fast
network (`all_gather`). The slow link carries the model once per group, not G times.

Replicas that differ (`parallel.worker_batch`, `worker_lr`, `worker_sync_every`, `data.shards`): replica r takes
H_r steps of B_r images in every round, on its own shard if given (islands.data.schedule lays out the stream), and
the synchronisation weighs each replica by the images it consumed since the last one (B_r H_r / sum_j B_j H_j
after a whole round), in place of the plain mean.

Between synchronisations the replicas differ, so each rank's own state (weights, inner optimizer, EMA) is saved
under its own name (`replica_<rank>`) and the synchronised state, the same on every rank, under `outer`. The EMA
takes in only synchronised weights (the anchor, fragment by fragment when streaming), credited with the images
since the last synchronisation, so it is the same on every rank. The last step of a run synchronises every
fragment, so the exported weights are the replicas' common ones.

Replicas that are separate jobs (`parallel.lighthouse`): each job is replica `parallel.replica_id` of
`parallel.replicas`, its ranks one replica (DDP inside it when there are several), and the synchronisation goes
through torchft (islands.parallel.fault_tolerance), so replicas may drop out and rejoin.
"""

import torch
import torch.distributed as dist
from torch import nn

from islands.config import Config
from islands.data.schedule import WorkerSchedule
from islands.parallel.launch import World
from islands.parallel.strategies import WIRE_DTYPES, DDPStrategy, Strategy, averaged


def fragments_of(sizes: list[int], count: int) -> list[range]:
    """Cut parameters of these sizes, in order, into `count` contiguous non-empty runs of about equal total size
    (a parameter is never split: fragment f ends at the first parameter past (f + 1) / count of the total)."""
    if not 1 <= count <= len(sizes):
        raise ValueError(f"parallel.fragments: {count} fragments of a network with {len(sizes)} parameter tensors")
    total, cuts, running = sum(sizes), [0], 0
    for i, size in enumerate(sizes[:-1]):
        running += size
        f, left = len(cuts), len(sizes) - (i + 1)  # fragment f - 1 would end here; tensors after this one
        # close it once past its share, or when each fragment still to come needs one of the tensors left
        if f < count and left >= count - f and (running * count >= f * total or left == count - f):
            cuts.append(i + 1)
    cuts.append(len(sizes))
    return [range(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]


class LocalSGDStrategy(Strategy):
    name = "local_sgd"
    several_ranks = True  # or a job of its own, one replica of several joined through torchft's lighthouse
    in_a_group = False  # its replicas are groups of the whole job

    @classmethod
    def options(cls, cfg: Config) -> dict:
        par = cfg.parallel
        keys = ("sync_every", "fragments", "replicas", "worker_batch", "worker_sync_every", "lighthouse", "replica_id",
                "host", "min_replicas", "timeout_s", "quorum_timeout_s")
        return {**super().options(cfg), **{k: getattr(par, k) for k in keys}, "batch_size": cfg.train.batch_size}

    @classmethod
    def check(cls, cfg: Config) -> None:
        if cfg.parallel.compression != "none":
            raise ValueError("parallel.compression: local_sgd averages the weights themselves, which 16 bits would "
                             "round; diloco sends its pseudo-gradients in 16 bits")

    def __init__(self, world: World, compression: str = "none", precision: str = "fp32", compile: bool = False,
                 activation_checkpointing: bool = False, sync_every: int = 100, batch_size: int = 1,
                 fragments: int = 1, replicas: int | None = None,
                 worker_batch: list[int] | None = None, worker_sync_every: list[int] | None = None,
                 lighthouse: str | None = None, replica_id: int | None = None, host: str | None = None,
                 min_replicas: int = 1, timeout_s: float = 600.0, quorum_timeout_s: float = 3600.0):
        super().__init__(world, compression, precision, compile, activation_checkpointing)
        if fragments > sync_every:
            raise ValueError(f"parallel.fragments: {fragments} fragments cannot take turns within "
                             f"sync_every={sync_every} steps")
        self.replicas, self.outer_group, self.inner, per = world.size, world.group, None, 1
        # separate jobs: torchft's exchange, the state a rejoining replica is sent, and the clock it then takes
        self.link, self.shared, self.images, self.joined = None, {}, 0, None
        self.synchronisations = torch.zeros(2, dtype=torch.int64)  # torchft's step and batches committed
        if lighthouse is not None:  # this job is one replica of `replicas`, its ranks in DDP
            try:  # torchft, imported only by the runs that use it
                from islands.parallel.fault_tolerance import ReplicaLink
            except ImportError as err:
                raise ValueError(f"parallel.lighthouse: needs torchft ({err}); pip install 'islands[ft]'") from None
            if fragments > 1:  # a rejoining replica would have to find its peers' fragment in their cycle
                raise ValueError("parallel.fragments: streamed fragments are not offered with parallel.lighthouse; "
                                 "replicas that are separate jobs synchronise whole (fragments=1)")
            self.replicas, per = replicas, world.size
            if world.distributed:
                self.inner = DDPStrategy(world, "none", precision, compile, activation_checkpointing)
                self.inner.ledger = self.ledger
            self.link = ReplicaLink(lighthouse, replica_id, world, host, min_replicas, timeout_s, quorum_timeout_s,
                                    self.shared_state, self.heal)
        elif replicas is not None and replicas != world.size:
            if world.size % replicas:
                raise ValueError(f"parallel.replicas: {world.size} ranks do not split into {replicas} equal replicas")
            self.replicas, (_, group) = replicas, world.split(replicas)
            self.inner = DDPStrategy(group, "none", precision, compile, activation_checkpointing)
            self.inner.ledger = self.ledger
            per = group.size  # every rank creates every group, in the same order
            across = [dist.new_group([place + r * per for r in range(replicas)]) for place in range(per)]
            self.outer_group = across[group.rank]
        self.replica, self.part, self.parts = world.rank // per, world.rank % per, per
        if self.link is not None:
            self.replica = replica_id
        for key, given in (("worker_batch", worker_batch), ("worker_sync_every", worker_sync_every)):
            if given is not None and len(given) != self.replicas:
                raise ValueError(f"parallel.{key}: {len(given)} entries for {self.replicas} replicas")
        even = WorkerSchedule.even(batch_size, self.replicas, sync_every)
        self.schedule = WorkerSchedule(tuple(worker_batch or even.batches), tuple(worker_sync_every or even.steps))
        # a round of the schedule is a cycle of H = the longest replica's steps (the common sync_every if alike)
        self.every, self.count = self.schedule.ticks, fragments
        # fragment f synchronises at the steps s with s = offsets[f] (mod H); the last fragment at multiples of H
        self.offsets = [(f + 1) * self.every // fragments % self.every for f in range(fragments)]
        self.net: nn.Module | None = None
        self.anchor: dict[str, torch.Tensor] = {}  # the last synchronised weights, where the net does not hold them

    @property
    def communicates(self) -> bool:
        return self.world.distributed or self.link is not None

    def wrap(self, net: nn.Module) -> nn.Module:
        model = self.inner.wrap(net) if self.inner else super().wrap(net)
        self.net = net
        named = list(net.named_parameters())
        self.fragments = [[named[i][0] for i in r] for r in fragments_of([p.numel() for _, p in named], self.count)]
        # whole synchronisations leave the synchronised weights in the net itself; a rejoining replica is sent them
        if self.count > 1 or self.link is not None:
            self.anchor = {name: p.detach().clone() for name, p in named}
        return model

    def no_sync(self, model: nn.Module):
        return self.inner.no_sync(model) if self.inner else super().no_sync(model)

    def check_consistency(self, net: nn.Module) -> None:
        if self.inner:  # the ranks of one replica hold the same weights
            self.inner.check_consistency(net)

    def clock(self, batch: int) -> tuple[WorkerSchedule, int, int, int]:
        return self.schedule, self.replica, self.part, self.parts

    def due(self, step: int) -> list[int]:
        return [f for f, offset in enumerate(self.offsets) if step % self.every == offset]

    def after_step(self, images: int, last: bool = False) -> int:
        """Synchronise the fragments due at this step, and all of them at the end of the run; -> the images since
        the previous synchronisation if one happened now (what the EMA takes in), else 0."""
        self.joined = None
        step = self.schedule.tick_at(images)
        due = range(self.count) if last else self.due(step)
        if not due:
            return 0
        # replicas that differ bring what they consumed since the round began (islands.data.schedule)
        weight = None if self.schedule.alike else self.schedule.weights(step - 1)[self.replica]
        if self.link is not None:
            self.images = images
            self.link.begin(1.0 if weight is None else weight)  # may heal this replica (self.heal)
            if self.joined is not None:  # it rejoined: it brings nothing and continues on its peers' clock
                images, step, weight = self.joined, self.schedule.tick_at(self.joined), 0.0
            weight = 1.0 if weight is None else weight
        params = dict(self.net.named_parameters())
        pieces = [([params[n] for n in self.fragments[f]], [self.anchor.get(n) for n in self.fragments[f]])
                  for f in due]
        means = [self.average(self.payload(p, a), self.wire, weight) for p, a in pieces]
        if self.link is not None and not self.link.commit():
            return 0  # a replica failed inside the exchange: nobody applies it, each keeps its own weights
        for (p, a), mean in zip(pieces, means, strict=True):
            self.apply(p, a, mean)
        previous = max(s for s in range(max(step - self.every, 0), step) if s == 0 or self.due(s))
        return images - self.schedule.images_after(previous)

    def shared_state(self) -> dict:
        """What a rejoining replica is sent: the last synchronised weights and outer state, the EMA's weights if
        given (`share`), and the image count of this synchronisation."""
        return {"anchor": self.anchor, **self.outer_state(), "images": self.images,
                **{name: get() for name, (get, _) in self.shared.items()}}

    @torch.no_grad()
    def heal(self, state: dict) -> None:
        """Take in a peer's `shared_state` (called by torchft at the quorum of a replica that is behind)."""
        params = dict(self.net.named_parameters())
        for name, value in state["anchor"].items():
            self.anchor[name].copy_(value)
            params[name].copy_(value)
        self.load_outer_state(state)
        for name, (_, load) in self.shared.items():
            load(state[name])
        self.joined = int(state["images"])

    def share(self, name: str, get, load) -> None:
        if self.link is not None:
            self.shared[name] = (get, load)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()

    def ema_weights(self) -> dict[str, torch.Tensor] | None:
        return self.anchor if self.count > 1 else None  # whole: the net holds the anchor after each synchronisation

    def outer_average(self, tensors: list[torch.Tensor], wire: torch.dtype | None, weight: float | None) -> list:
        """The (weighted) mean over the replicas of this rank's `tensors`, through torchft between separate jobs."""
        if self.link is not None:
            return self.link.average(tensors, self.ledger, wire, weight)
        return averaged(tensors, self.ledger, self.outer_group, self.replicas, wire, "outer_all_reduce", weight)

    def average(self, tensors: list[torch.Tensor], wire: torch.dtype | None, weight: float | None) -> list:
        """The (weighted) mean of `tensors` over the replicas; by pieces when a replica spans a group of ranks."""
        if self.inner is None:
            return self.outer_average(tensors, wire, weight)
        flat = torch.cat([t.detach().flatten() for t in tensors])
        pieces = list(torch.nn.functional.pad(flat, (0, -flat.numel() % self.parts)).chunk(self.parts))
        mine = self.outer_average([pieces[self.part]], wire, weight)[0]
        gathered = [torch.empty_like(mine) for _ in pieces]  # in full precision: the fast network is not the limit
        self.ledger.record("all_gather", mine.numel() * mine.element_size() * self.parts, self.parts)
        dist.all_gather(gathered, mine, group=self.inner.world.group)
        mean = torch.cat(gathered)[:flat.numel()]
        return [m.view_as(t) for m, t in zip(mean.split([t.numel() for t in tensors]), tensors, strict=True)]

    wire = None  # the weights themselves are averaged in full precision

    def payload(self, params: list[torch.Tensor], anchors: list) -> list[torch.Tensor]:
        """What a replica sends: its weights."""
        return params

    @torch.no_grad()
    def apply(self, params: list[torch.Tensor], anchors: list, mean: list[torch.Tensor]) -> None:
        for p, a, m in zip(params, anchors, mean, strict=True):
            p.copy_(m)
            if a is not None:
                a.copy_(m)

    def outer_state(self) -> dict:
        return {}

    def load_outer_state(self, state: dict) -> None:
        pass

    def checkpoint_layout(self, held: dict) -> dict:
        layout = {f"replica_{self.world.rank}": held}
        if self.anchor:
            layout["outer"] = {"anchor": self.anchor, **self.outer_state()}
        if self.link is not None:  # torchft's count of synchronisations: a replica resumed from an older
            counts = self.link.state_dict()  # checkpoint is behind its peers, and heals
            self.synchronisations.copy_(torch.tensor([counts["step"], counts["batches_committed"]]))
            layout["outer"]["synchronisations"] = self.synchronisations
        return layout

    def resumed(self) -> None:
        if self.link is not None:
            step, batches = self.synchronisations.tolist()
            self.link.load_state_dict({"step": step, "batches_committed": batches})


class DiLoCoStrategy(LocalSGDStrategy):
    name = "diloco"

    @classmethod
    def options(cls, cfg: Config) -> dict:
        par = cfg.parallel
        return {**super().options(cfg), "outer_lr": par.outer_lr, "outer_momentum": par.outer_momentum}

    @classmethod
    def check(cls, cfg: Config) -> None:
        """Its pseudo-gradients may travel in 16 bits (parallel.compression)."""

    def __init__(self, world: World, *, outer_lr: float = 0.7, outer_momentum: float = 0.9, **local):
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        super().__init__(world, **local)

    def wrap(self, net: nn.Module) -> nn.Module:
        model = super().wrap(net)
        self.anchor = self.anchor or {name: p.detach().clone() for name, p in net.named_parameters()}
        self.outer = torch.optim.SGD(self.anchor.values(), lr=self.outer_lr, momentum=self.outer_momentum,
                                     nesterov=self.outer_momentum > 0)
        if self.outer_momentum > 0:  # created now so that a resume has tensors to load into; a zero buffer's
            for a in self.anchor.values():  # first step equals torch's first step from none
                self.outer.state[a]["momentum_buffer"] = torch.zeros_like(a)
        return model

    @property
    def wire(self) -> torch.dtype | None:
        return WIRE_DTYPES[self.compression]  # pseudo-gradients may travel in 16 bits

    def payload(self, params: list[torch.Tensor], anchors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The pseudo-gradient: the change since the last synchronisation."""
        return [a - p for a, p in zip(anchors, params, strict=True)]

    @torch.no_grad()
    def apply(self, params: list[torch.Tensor], anchors: list[torch.Tensor], mean: list[torch.Tensor]) -> None:
        for a, d in zip(anchors, mean, strict=True):
            a.grad = d
        self.outer.step()  # SGD steps only the anchors with a gradient: this fragment's
        for a, p in zip(anchors, params, strict=True):
            a.grad = None
            p.copy_(a)

    def outer_state(self) -> dict:
        return {"momentum": {name: self.outer.state[a]["momentum_buffer"] for name, a in self.anchor.items()
                             if "momentum_buffer" in self.outer.state[a]}}

    @torch.no_grad()
    def load_outer_state(self, state: dict) -> None:
        for name, value in state["momentum"].items():
            self.outer.state[self.anchor[name]]["momentum_buffer"].copy_(value)
