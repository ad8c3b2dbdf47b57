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
synchronises once per H steps. By default a fragment's local weights are replaced by the synchronised ones at
once (the paper's tau = 0, alpha = 0). With `parallel.overlap_steps` = tau and `parallel.mixing` = alpha (the
paper's Algorithm 2), the exchange that begins at step s lands at step s + tau, when the outer step is taken and
the fragment's local weights, which trained on meanwhile, are merged: theta_m <- alpha theta_m + (1 - alpha) theta.
The exchange itself still blocks (gloo): the overlap changes the trajectory, not the bytes or, here, the wall time.

Candidates from the literature (issue 40), each off by default:
- `parallel.warm_start_images` = N: the steps that begin before image N are data parallel (the replicas average
  their gradients before the inner step, DDP's all_reduce on the ledger), so the replicas stay one; the anchor is
  the weights at its end and the rounds count from there (DiLoCo starts from a pretrained model; Lin et al. 2020's
  post-local SGD switches from mini-batch SGD to local SGD).
- `parallel.sync_every_start` = H0: round k lasts H0 + (H - H0) min(r_k, R) / R steps (integer division), r_k the
  steps since the rounds began and R the steps of `sync_every_ramp_images` (the whole run if not given): H grows
  linearly from H0 to H. Local SGD's analyses and practice grow H as training settles: stagewise (STL-SGD, Shen et
  al. 2021, doubling H at each stage), or as the learning rate decays (Gu et al. 2024's quadratic rule, H ~ 1/lr^2);
  with a constant learning rate here, a linear ramp is the plain form, and the rounds' ends are a pure function of
  the step, so a resumed run keeps its place.
- `parallel.inner_state`: `keep` (the inner AdamW's moments and step count run on across synchronisations, as
  DiLoCo's Algorithm 1 and torchft do) or `reset` (zeroed at each synchronisation, for the parameters synchronised).
- `parallel.outer_ema`: what the EMA takes in at a synchronisation, `anchor` (the outer weights) or `mean` (diloco:
  the replicas' mean weights before the outer step, anchor - averaged pseudo-gradient, which Nesterov's step then
  moves past).

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
under its own name (`replica_<rank>`) and the synchronised state, the same on every rank, under `outer` (with the
results of exchanges still to land, when they overlap). The EMA takes in only synchronised weights (the anchor,
fragment by fragment when streaming), credited with the images since the last synchronisation, so it is the same
on every rank; during a warm start, the replicas' common weights after every step, as under DDP. The last step of
a run synchronises every fragment, so the exported weights are the replicas' common ones.

Replicas that are separate jobs (`parallel.lighthouse`): each job is replica `parallel.replica_id` of
`parallel.replicas`, its ranks one replica (DDP inside it when there are several), and the synchronisation goes
through torchft (islands.parallel.fault_tolerance), so replicas may drop out and rejoin.
"""

import bisect
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.distributed as dist
from torch import nn

from islands.config import Config
from islands.data.schedule import WorkerSchedule
from islands.parallel.checkpoint_layout import CheckpointLayout
from islands.parallel.costs import WIRE_BYTES, Costs, dense_bytes
from islands.parallel.data_plan import DataPlan
from islands.parallel.launch import World
from islands.parallel.layout import WIRE_DTYPES, DataParallel, averaged
from islands.parallel.ledger import Ledger, bytes_sent
from islands.parallel.replicas import Replicas
from islands.parallel.strategies import Strategy


@dataclass(frozen=True)
class Candidates:
    """parallel's keys of the candidates for closing the gap to data parallelism (issue 40), LocalSGD's arguments;
    the defaults are the plain local update."""

    warm_start_images: int = 0
    sync_every_start: int | None = None
    sync_every_ramp_images: int | None = None
    overlap_steps: int = 0
    mixing: float = 0.0
    inner_state: str = "keep"
    outer_ema: str = "anchor"

    @classmethod
    def of(cls, par) -> "Candidates":
        return cls(**{f.name: getattr(par, f.name) for f in fields(cls)})


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


@dataclass
class Rounds:
    """When each fragment's exchange begins and when its result lands, as a pure function of the step (the run's
    tick count after it, from 1), so that a resumed run keeps its place in its rounds.

    Steps 1 .. `warm` are data parallel. After them fragment f exchanges at the steps s with (s - warm) % H ==
    offsets[f], or, when H grows (`start` = H0), the one fragment at the ends of rounds of H0 + (H - H0) min(r, ramp)
    // ramp steps, r the steps since the warm start ended. An exchange lands `delay` steps after it began."""

    every: int
    offsets: list[int]
    warm: int = 0
    start: int | None = None
    ramp: int = 1
    delay: int = 0
    ends: list[int] = field(default_factory=list)  # the growing rounds' ends found so far

    def length(self, since: int) -> int:
        """The steps of the round that begins `since` steps after the warm start."""
        return self.start + (self.every - self.start) * min(since, self.ramp) // self.ramp

    def exchanged(self, step: int) -> list[int]:
        """The fragments whose exchange begins at `step`."""
        if step <= self.warm:
            return []
        if self.start is None:
            return [f for f, offset in enumerate(self.offsets) if (step - self.warm) % self.every == offset]
        self.ends = self.ends or [self.warm]
        while self.ends[-1] < step:
            self.ends.append(self.ends[-1] + self.length(self.ends[-1] - self.warm))
        return [0] if self.ends[bisect.bisect_left(self.ends, step)] == step else []

    def landing(self, step: int) -> list[int]:
        """The fragments whose exchange lands at `step`."""
        return self.exchanged(step - self.delay)

    def in_flight(self, step: int) -> list[int]:
        """The fragments whose exchange began before `step` and has not landed before it (it lands now or later)."""
        return [f for s in range(max(step - self.delay, 1), step) for f in self.exchanged(s)]

    def landed_before(self, step: int) -> int:
        """The last step before `step` at which an exchange landed, or at which the warm start ended (0: none)."""
        return next((s for s in range(step - 1, self.warm, -1) if self.landing(s)), self.warm)


def ticks_reaching(schedule: WorkerSchedule, images: int) -> int:
    """The ticks of `schedule` up to the first that reaches `images` images."""
    return schedule.tick_at(schedule.run_length(images))


class LocalSGD(Replicas):
    """Replicas whose weights are averaged every H steps, fragment by fragment when streaming."""

    wire = None  # the weights themselves are averaged in full precision

    def __init__(self, world: World, ledger: Ledger, schedule: WorkerSchedule, fragments: int, replica: int,
                 replicas: int, outer_group, own: World | None, warm_start_images: int = 0,
                 sync_every_start: int | None = None, sync_every_ramp_images: int | None = None,
                 overlap_steps: int = 0, mixing: float = 0.0, inner_state: str = "keep", outer_ema: str = "anchor",
                 run_images: int = 0):
        self.world, self.ledger, self.schedule, self.replica, self.replicas = world, ledger, schedule, replica, replicas
        # the ranks of the same place in every replica (the slow link), and this replica's own ranks (the fast one)
        self.outer_group, self.own = outer_group, own
        self.part, self.parts = (own.rank, own.size) if own is not None else (0, 1)
        # a rejoining replica is sent the state shared with it, and the clock of the synchronisation
        self.shared, self.images = {}, 0
        # a round of the schedule is a cycle of H = the longest replica's steps (the common sync_every if alike)
        self.every, self.count = schedule.ticks, fragments
        if overlap_steps >= self.every:
            raise ValueError(f"parallel.overlap_steps: {overlap_steps} steps is not less than the {self.every} steps "
                             "of a round")
        # fragment f exchanges at the steps s with s = offsets[f] (mod H); the last fragment at multiples of H
        offsets = [(f + 1) * self.every // fragments % self.every for f in range(fragments)]
        warm = ticks_reaching(schedule, warm_start_images)
        ramp = ticks_reaching(schedule, sync_every_ramp_images or run_images) - warm
        self.rounds = Rounds(self.every, offsets, warm, sync_every_start, max(ramp, 1), overlap_steps)
        self.mixing, self.reset, self.outer_ema = mixing, inner_state == "reset", outer_ema
        self.warming = warm > 0  # whether the step that just ended was data parallel
        self.optimizer: torch.optim.Optimizer | None = None  # the inner one, reset at synchronisations if asked
        self.net: nn.Module | None = None
        self.anchor: dict[str, torch.Tensor] = {}  # the last synchronised weights, where the net does not hold them
        self.pending: dict[str, torch.Tensor] = {}  # exchanges' results not yet landed (overlap)
        self.means: dict[str, torch.Tensor] = {}  # diloco, outer_ema=mean: what the EMA takes in

    def attach(self, net: nn.Module) -> None:
        self.net = net
        named = list(net.named_parameters())
        self.fragments = [[named[i][0] for i in r] for r in fragments_of([p.numel() for _, p in named], self.count)]
        # whole synchronisations that land at once leave the synchronised weights in the net itself; a rejoining
        # replica is sent them
        if self.count > 1 or self.link is not None or self.rounds.delay or self.mixing:
            self.anchor = {name: p.detach().clone() for name, p in named}
        if self.rounds.delay:
            self.pending = {name: torch.zeros_like(p) for name, p in named}

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def before_step(self, params: list[torch.Tensor], images: int) -> None:
        """During the warm start, average the gradients over the replicas as DDP does (its all_reduce, in fp32)."""
        if self.schedule.tick_at(images) >= self.rounds.warm:
            return
        grads = [p.grad for p in params if p.grad is not None]
        for g, mean in zip(grads, averaged(grads, self.ledger, self.outer_group, self.replicas), strict=True):
            g.copy_(mean)

    def after_step(self, images: int, last: bool = False) -> int | None:
        """Land the exchanges due at this step and begin those due, every fragment at once at the end of the run;
        -> the images since the previous landing if one happened now (what the EMA takes in), else 0; None during
        the warm start (the EMA takes in the replicas' common weights, as under DDP)."""
        self.joined = None
        step, rounds = self.schedule.tick_at(images), self.rounds
        self.warming = step <= rounds.warm
        if self.warming:
            if step == rounds.warm:  # the rounds begin from the warm start's weights
                self._begin_rounds()
            return None
        # exchanges begun tau steps ago land now (at the end of the run, every one in flight); the run's last step
        # exchanges every fragment and lands it at once, unmixed, so that the replicas end as one
        held = (rounds.in_flight(step) if last else rounds.landing(step)) if rounds.delay else []
        begun = list(range(self.count)) if last else rounds.exchanged(step)
        if not (held or begun):
            return 0
        # replicas that differ bring what they consumed since the round began (islands.data.schedule)
        weight = None if self.schedule.alike else self.schedule.weights(step - 1)[self.replica]
        if self.link is not None:  # whole synchronisations that land at once only (the config refuses the others)
            self.images = images
            self.link.begin(1.0 if weight is None else weight)  # may heal this replica (self.heal)
            if self.joined is not None:  # it rejoined: it brings nothing and continues on its peers' clock
                images, step, weight = self.joined, self.schedule.tick_at(self.joined), 0.0
            weight = 1.0 if weight is None else weight
        for f in held:
            self._land(f, self._pieces(f, self.pending)[1], self.mixing)
        means = {f: self._average(self._payload(*self._pieces(f)[1:]), self.wire, weight) for f in begun}
        if self.link is not None and not self.link.commit():
            return 0  # a replica failed inside the exchange: nobody applies it, each keeps its own weights
        at_once = last or not rounds.delay
        for f, mean in means.items():
            if at_once:
                self._land(f, mean, 0.0 if last else self.mixing)
            else:  # in flight until it lands
                with torch.no_grad():
                    for p, m in zip(self._pieces(f, self.pending)[1], mean, strict=True):
                        p.copy_(m)
        if not (held or at_once):
            return 0  # only begun: the synchronised weights have not moved yet
        return images - self.schedule.images_after(rounds.landed_before(step))

    @torch.no_grad()
    def _begin_rounds(self) -> None:
        for name, p in self.net.named_parameters():
            for held in (self.anchor, self.means):
                if name in held:
                    held[name].copy_(p)

    def _pieces(self, f: int, held: dict | None = None) -> tuple[list[str], list[torch.Tensor], list]:
        """Fragment f's names, its tensors in `held` (default: the net's parameters), and its anchors (None where
        the net holds them)."""
        held = held if held is not None else dict(self.net.named_parameters())
        names = self.fragments[f]
        return names, [held[n] for n in names], [self.anchor.get(n) for n in names]

    def _land(self, f: int, mean: list[torch.Tensor], mixing: float) -> None:
        """Apply fragment f's synchronised result, merge its local weights with it, reset its inner state if asked."""
        names, params, anchors = self._pieces(f)
        self._apply(names, params, anchors, mean, mixing)
        if self.reset and self.optimizer is not None:
            with torch.no_grad():
                for p in params:
                    for value in self.optimizer.state.get(p, {}).values():
                        if isinstance(value, torch.Tensor):
                            value.zero_()

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
        # the net's own weights during the warm start, and after whole synchronisations that land at once
        return None if self.warming else self.anchor or None

    def _outer_average(self, tensors: list[torch.Tensor], wire: torch.dtype | None, weight: float | None) -> list:
        """The (weighted) mean over the replicas of this rank's `tensors`, through torchft between separate jobs."""
        if self.link is not None:
            return self.link.average(tensors, self.ledger, wire, weight)
        return averaged(tensors, self.ledger, self.outer_group, self.replicas, wire, "outer_all_reduce", weight)

    def _average(self, tensors: list[torch.Tensor], wire: torch.dtype | None, weight: float | None) -> list:
        """The (weighted) mean of `tensors` over the replicas; by pieces when a replica spans a group of ranks."""
        if self.own is None:
            return self._outer_average(tensors, wire, weight)
        flat = torch.cat([t.detach().flatten() for t in tensors])
        pieces = list(torch.nn.functional.pad(flat, (0, -flat.numel() % self.parts)).chunk(self.parts))
        mine = self._outer_average([pieces[self.part]], wire, weight)[0]
        gathered = [torch.empty_like(mine) for _ in pieces]  # in full precision: the fast network is not the limit
        self.ledger.record("all_gather", mine.numel() * mine.element_size() * self.parts, self.parts)
        dist.all_gather(gathered, mine, group=self.own.group)
        mean = torch.cat(gathered)[:flat.numel()]
        return [m.view_as(t) for m, t in zip(mean.split([t.numel() for t in tensors]), tensors, strict=True)]

    def _payload(self, params: list[torch.Tensor], anchors: list) -> list[torch.Tensor]:
        """What a replica sends: its weights."""
        return params

    @torch.no_grad()
    def _apply(self, names: list[str], params: list[torch.Tensor], anchors: list, mean: list[torch.Tensor],
               mixing: float) -> None:
        for p, a, m in zip(params, anchors, mean, strict=True):
            if a is not None:
                a.copy_(m)
            merge(p, m, mixing)

    def outer_state(self) -> dict:
        """The outer optimizer's state, by parameter name (none for local SGD), and the exchanges in flight."""
        return {"pending": self.pending} if self.pending else {}

    def load_outer_state(self, state: dict) -> None:
        pass


@torch.no_grad()
def merge(local: torch.Tensor, synchronised: torch.Tensor, mixing: float) -> None:
    """local <- alpha local + (1 - alpha) synchronised (Streaming DiLoCo's merge); alpha = 0 copies it exactly."""
    if mixing:
        local.lerp_(synchronised, 1 - mixing)
    else:
        local.copy_(synchronised)


class DiLoCo(LocalSGD):
    """Replicas whose averaged change since the last synchronisation is one outer Nesterov SGD step of the anchor."""

    def __init__(self, *args, compression: str = "none", outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 **candidates):
        super().__init__(*args, **candidates)
        self.wire = WIRE_DTYPES[compression]  # pseudo-gradients may travel in 16 bits
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum

    def attach(self, net: nn.Module) -> None:
        super().attach(net)
        self.anchor = self.anchor or {name: p.detach().clone() for name, p in net.named_parameters()}
        if self.outer_ema == "mean":  # the replicas' mean weights at the last synchronisation, fragment by fragment
            self.means = {name: p.detach().clone() for name, p in net.named_parameters()}
        self.outer = torch.optim.SGD(self.anchor.values(), lr=self.outer_lr, momentum=self.outer_momentum,
                                     nesterov=self.outer_momentum > 0)
        if self.outer_momentum > 0:  # created now so that a resume has tensors to load into; a zero buffer's
            for a in self.anchor.values():  # first step equals torch's first step from none
                self.outer.state[a]["momentum_buffer"] = torch.zeros_like(a)

    def ema_weights(self) -> dict[str, torch.Tensor] | None:
        if self.warming:
            return None
        return self.means if self.outer_ema == "mean" else self.anchor

    def _payload(self, params: list[torch.Tensor], anchors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The pseudo-gradient: the change since the last synchronisation."""
        return [a - p for a, p in zip(anchors, params, strict=True)]

    @torch.no_grad()
    def _apply(self, names: list[str], params: list[torch.Tensor], anchors: list[torch.Tensor],
               mean: list[torch.Tensor], mixing: float) -> None:
        if self.outer_ema == "mean":  # before the outer step: the anchor minus the averaged change
            for n, a, d in zip(names, anchors, mean, strict=True):
                self.means[n].copy_(a - d)
        for a, d in zip(anchors, mean, strict=True):
            a.grad = d
        self.outer.step()  # SGD steps only the anchors with a gradient: this fragment's
        for a, p in zip(anchors, params, strict=True):
            a.grad = None
            merge(p, a, mixing)

    def outer_state(self) -> dict:
        momentum = {name: self.outer.state[a]["momentum_buffer"] for name, a in self.anchor.items()
                    if "momentum_buffer" in self.outer.state[a]}
        return {"momentum": momentum, **super().outer_state(),
                **({"means": self.means} if self.outer_ema == "mean" else {})}

    @torch.no_grad()
    def load_outer_state(self, state: dict) -> None:
        for name, value in state["momentum"].items():
            self.outer.state[self.anchor[name]]["momentum_buffer"].copy_(value)


class ReplicaCheckpoint(CheckpointLayout):
    """Between synchronisations the replicas differ: each rank writes its own state under `replica_<rank>`, and
    the synchronised state (the anchor, the outer optimizer's, torchft's count), the same on every rank, under
    `outer`."""

    def __init__(self, replicas: LocalSGD, rank: int):
        self.replicas, self.rank = replicas, rank
        self.synchronisations = torch.zeros(2, dtype=torch.int64)  # torchft's step and batches committed

    def arrange(self, held: dict) -> dict:
        layout = {f"replica_{self.rank}": held}
        if self.replicas.anchor:
            layout["outer"] = {"anchor": self.replicas.anchor, **self.replicas.outer_state()}
        if self.replicas.link is not None:  # torchft's count of synchronisations: a replica resumed from an older
            counts = self.replicas.link.state_dict()  # checkpoint is behind its peers, and heals
            self.synchronisations.copy_(torch.tensor([counts["step"], counts["batches_committed"]]))
            layout["outer"]["synchronisations"] = self.synchronisations
        return layout

    def resumed(self) -> None:
        if self.replicas.link is not None:
            step, batches = self.synchronisations.tolist()
            self.replicas.link.load_state_dict({"step": step, "batches_committed": batches})


class LocalCosts(Costs):
    """One all-reduce of the parameters (local_sgd, fp32) or of their change (diloco, in `compression`'s width) over
    the R replicas every `sync_every` steps, averaged here per step. When each replica is a group of G ranks, every
    rank all-reduces a G-th of the flat parameters (padded to a multiple of G) with its counterparts and the group
    all-gathers the pieces in fp32, and the inner DDP all-reduces the gradients every step."""

    def __init__(self, compressed: bool):
        self.compressed = compressed  # diloco's pseudo-gradients travel in `compression`'s width
        self.plan_compression = "bf16" if compressed else "none"

    def bytes_per_step(self, net: nn.Module, world: int, accumulate: int = 1, compression: str = "none",
                       precision: str = "fp32", sync_every: int = 1, replicas: int | None = None) -> dict[str, float]:
        params = list(net.parameters())
        wire = WIRE_BYTES[compression] / 4
        replicas = replicas or world
        per = world // replicas  # ranks per replica; each exchanges 1/per of the (padded) flat parameters
        numel = sum(p.numel() for p in params)
        piece = -(-numel // per)
        outer = 4 * piece * (wire if self.compressed else 1)
        sent = {"outer_all_reduce": bytes_sent("outer_all_reduce", outer, replicas) / sync_every}
        if per > 1:
            sent["all_reduce"] = bytes_sent("all_reduce", dense_bytes(params), per)
            sent["all_gather"] = bytes_sent("all_gather", 4 * piece * per, per) / sync_every
        return sent

    def state_bytes(self, world: int) -> float:
        return 16 + (8 if self.compressed else 0)  # diloco keeps the anchor and the outer momentum


class LocalSGDStrategy(Strategy):
    name = "local_sgd"
    several_ranks = True  # or a job of its own, one replica of several joined through torchft's lighthouse
    in_a_group = False  # its replicas are groups of the whole job
    costs = LocalCosts(compressed=False)

    @classmethod
    def options(cls, cfg: Config) -> dict:
        par = cfg.parallel
        keys = ("sync_every", "fragments", "replicas", "worker_batch", "worker_sync_every", "lighthouse", "replica_id",
                "host", "min_replicas", "timeout_s", "quorum_timeout_s")
        # replicas that heal one another (parallel.lighthouse) check that they train one config (torchft's module)
        sha256 = None
        if par.lighthouse is not None:
            from islands.parallel.fault_tolerance import replica_config_sha256

            sha256 = replica_config_sha256(cfg)
        return {**super().options(cfg), **{k: getattr(par, k) for k in keys}, "batch_size": cfg.train.batch_size,
                "config_sha256": sha256, "run_images": cfg.train.images, "candidates": Candidates.of(par)}

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
                 min_replicas: int = 1, timeout_s: float = 600.0, quorum_timeout_s: float = 3600.0,
                 config_sha256: str | None = None, run_images: int = 0, candidates: Candidates = Candidates()):
        super().__init__(world, compression, precision, compile, activation_checkpointing)
        if fragments > sync_every:
            raise ValueError(f"parallel.fragments: {fragments} fragments cannot take turns within "
                             f"sync_every={sync_every} steps")
        count, outer_group, own = world.size, world.group, None  # own: a replica's ranks, when it has several
        if lighthouse is not None:  # this job is one replica of `replicas`, its ranks in DDP
            try:  # torchft, imported only by the runs that use it
                from islands.parallel.fault_tolerance import ReplicaLink
            except ImportError as err:
                raise ValueError(f"parallel.lighthouse: needs torchft ({err}); pip install 'islands[ft]'") from None
            if fragments > 1:  # a rejoining replica would have to find its peers' fragment in their cycle
                raise ValueError("parallel.fragments: streamed fragments are not offered with parallel.lighthouse; "
                                 "replicas that are separate jobs synchronise whole (fragments=1)")
            count, own = replicas, world if world.distributed else None
        elif replicas is not None and replicas != world.size:
            if world.size % replicas:
                raise ValueError(f"parallel.replicas: {world.size} ranks do not split into {replicas} equal replicas")
            count, (_, own) = replicas, world.split(replicas)
            # every rank creates every group, in the same order
            across = [dist.new_group([place + r * own.size for r in range(replicas)]) for place in range(own.size)]
            outer_group = across[own.rank]
        per = own.size if own is not None else 1
        replica = replica_id if lighthouse is not None else world.rank // per
        for key, given in (("worker_batch", worker_batch), ("worker_sync_every", worker_sync_every)):
            if given is not None and len(given) != count:
                raise ValueError(f"parallel.{key}: {len(given)} entries for {count} replicas")
        even = WorkerSchedule.even(batch_size, count, sync_every)
        schedule = WorkerSchedule(tuple(worker_batch or even.batches), tuple(worker_sync_every or even.steps))
        if own is not None:  # each replica's ranks are data parallel every step
            self.layout = DataParallel(own, self.ledger, "none", precision, compile, activation_checkpointing)
        self.data = DataPlan(world.rank, world.size, schedule, replica, world.rank % per, per)
        self.replicas = self._replicas(compression, world, self.ledger, schedule, fragments, replica, count,
                                       outer_group, own, run_images=run_images, **asdict(candidates))
        if lighthouse is not None:
            self.replicas.link = ReplicaLink(lighthouse, replica_id, world, host, min_replicas, timeout_s,
                                             quorum_timeout_s, self.replicas.shared_state, self.replicas.heal,
                                             config_sha256)
        self.checkpoint = ReplicaCheckpoint(self.replicas, world.rank)

    def _replicas(self, compression: str, *args, **candidates) -> LocalSGD:
        return LocalSGD(*args, **candidates)  # compression: refused by `check`


class DiLoCoStrategy(LocalSGDStrategy):
    name = "diloco"
    costs = LocalCosts(compressed=True)

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

    def _replicas(self, compression: str, *args, **candidates) -> DiLoCo:
        return DiLoCo(*args, compression=compression, outer_lr=self.outer_lr, outer_momentum=self.outer_momentum,
                      **candidates)
