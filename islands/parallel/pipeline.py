"""Pipeline parallelism: the network cut into stages on different ranks, micro-batches flowing through them.

torch.distributed.pipelining is the engine (its `PipelineStage` and its GPipe, 1F1B and interleaved 1F1B
schedules); this file only cuts the network and feeds it. A `StagedNetwork` is stem -> blocks -> head over a
carried tuple of tensors, so a cut may fall between any two blocks: what the next blocks need (DiT's tokens and
condition vector, the U-Net's pending skips) travels as the stage's outputs, and its gradient comes back the
same way, so no parameter is shared between stages and none needs reducing across them.

The cut balances the stages' forward FLOPs (counted on one example), stage s lives on pipeline rank s mod S
(the interleaved schedule's loop), and each rank keeps only its stages' modules: `net` keeps the whole
network's parameter names, so checkpoints are the same files as under any other strategy, each rank writing
the shards of its stages. With `parallel.data = D`, the D x S ranks form a 2-D mesh (data, pipe) and each
stage is data parallel over its column (its gradients averaged after each schedule step).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.utils.flop_counter import FlopCounterMode

from islands.config import Config, TrainConfig
from islands.data.batch import Batch
from islands.parallel.costs import Costs
from islands.parallel.data_plan import DataPlan
from islands.parallel.launch import World
from islands.parallel.layout import WIRE_DTYPES, Layout, averaged
from islands.parallel.ledger import Ledger
from islands.parallel.strategies import Strategy

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


class Stage(nn.Module):
    """Blocks [start, stop) of a `StagedNetwork`, behind its stem if first and before its head if last. It holds
    just those modules, so its parameters are its own: the schedule scales and the data-parallel wrapper reduces
    exactly these."""

    def __init__(self, net: nn.Module, blocks: range, first: bool, last: bool):
        super().__init__()
        self.blocks, self.first, self.last = blocks, first, last
        self.owned = nn.ModuleList(net.blocks[i] for i in blocks)
        self.stem_parts = nn.ModuleList(getattr(net, n) for n in net.stem_modules) if first else None
        self.head_parts = nn.ModuleList(getattr(net, n) for n in net.head_modules) if last else None
        self.run_stem, self.run_block, self.run_head = net.stem, net.block_forward, net.head  # not submodules

    def forward(self, *inputs):
        for t in inputs:
            if t.requires_grad:  # what goes back to the previous stage; autograd may return another layout
                t.register_hook(torch.Tensor.contiguous)
        carry = self.run_stem(*inputs) if self.first else inputs
        for i in self.blocks:
            carry = self.run_block(i, carry)
        # gloo sends only contiguous tensors (DESIGN.md 6), and the receiver's buffers take the layout of these
        return self.run_head(carry) if self.last else tuple(t.contiguous() for t in carry)


class CountingStage(PipelineStage):
    """A `PipelineStage` that books in the ledger the tensors it sends to another rank: activations forward,
    their gradients back (stages on the same rank hand them over without sending)."""

    def __init__(self, *args, ledger, **kwargs):
        super().__init__(*args, **kwargs)
        self.ledger = ledger

    def get_fwd_send_ops(self, fwd_chunk_id):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.ledger.record("pipeline_activations", _bytes(op.tensor for op in ops))
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.ledger.record("pipeline_gradients", _bytes(op.tensor for op in ops))
        return ops


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def block_costs(net: nn.Module, example: tuple) -> list[float]:
    """Forward FLOPs of each block on one example, the stem's added to the first and the head's to the last (and
    one FLOP each, so that blocks without arithmetic still count)."""
    def counted(fn, *args):
        with FlopCounterMode(display=False) as counter:
            out = fn(*args)
        return out, counter.get_total_flops()

    with torch.no_grad():
        carry, stem = counted(net.stem, *example)
        costs = []
        for i in range(len(net.blocks)):
            carry, flops = counted(net.block_forward, i, carry)
            costs.append(flops + 1.0)
        _, head = counted(net.head, carry)
    costs[0] += stem
    costs[-1] += head
    return costs


def balanced_cut(costs: list[float], parts: int) -> list[range]:
    """Contiguous, non-empty ranges of blocks whose largest summed cost is as small as it can be (the linear
    partition problem, by dynamic programming over the number of blocks in the first parts)."""
    n = len(costs)
    if n < parts:
        raise ValueError(f"parallel.stages: the network has {n} blocks, too few for {parts} stages "
                         "(stages x virtual_stages)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[p][i]: the smallest largest-part cost of blocks [0, i) in p parts; cut[p][i]: where the last part starts
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for p in range(1, parts + 1):
        for i in range(p, n + 1):
            for j in range(p - 1, i):
                worst = max(best[p - 1][j], prefix[i] - prefix[j])
                if worst < best[p][i]:
                    best[p][i], cut[p][i] = worst, j
    ranges, stop = [], n
    for p in range(parts, 0, -1):
        ranges.append(range(cut[p][stop], stop))
        stop = cut[p][stop]
    return ranges[::-1]


class PipelineLayout(Layout):
    """S stages (S x V with the interleaved schedule) on the S ranks of a pipeline row, each stage data parallel over
    its column of the (data, pipe) mesh."""

    def __init__(self, world: World, ledger: Ledger, compression: str, precision: str, compile: bool,
                 activation_checkpointing: bool, *, stages: int, data: int, microbatches: int, schedule: str,
                 virtual_stages: int, mesh):
        super().__init__(world, ledger, compression, precision, compile, activation_checkpointing)
        self.stages, self.data, self.microbatches = stages, data, microbatches
        self.schedule_name, self.virtual = schedule, virtual_stages
        self.pipe_group, self.data_group = mesh.get_group("pipe"), mesh.get_group("data")
        self.pipe_rank = mesh.get_local_rank("pipe")
        self.owners: dict[str, tuple[int, torch.Size, torch.dtype]] = {}  # whole state dict: key -> (owner, ...)

    def check_training(self, train: TrainConfig) -> None:
        if train.objective != "diffusion":  # a router or a student is not cut in stages
            raise ValueError(f"parallel.strategy: a pipeline trains denoisers (train.objective=diffusion), "
                             f"not {train.objective!r}")
        if train.accumulate != 1 or train.batch_size // self.data % self.microbatches:
            raise ValueError(f"train.accumulate: a pipeline cuts each rank's {train.batch_size // self.data} images "
                             f"into parallel.microbatches={self.microbatches} equal pieces itself; set accumulate to 1 "
                             "and a batch that they divide")

    def wrap(self, net: nn.Module) -> nn.Module:
        """Cut `net` and keep in it only this rank's stages, which the schedule (`self.schedule`) runs."""
        if not hasattr(net, "block_forward"):
            raise ValueError(f"parallel.strategy: pipeline cuts networks with blocks (unet, dit, mlp), "
                             f"not {type(net).__name__}")
        total = self.stages * self.virtual
        cuts = balanced_cut(block_costs(net, example_input(net)), total)
        mine = [s for s in range(total) if s % self.stages == self.pipe_rank]
        owner_of_block = {i: s % self.stages for s, r in enumerate(cuts) for i in r}
        net = super().wrap(net)  # activation checkpointing and compilation, per block
        stages = [Stage(net, cuts[s], s == 0, s == total - 1) for s in mine]
        self.owners = {k: (_owner(k, net, owner_of_block), v.shape, v.dtype)
                       for k, v in net.state_dict().items()}
        _keep_only(net, stages)
        self.pipeline = [CountingStage(module, s, total, self.world.device, group=self.pipe_group, ledger=self.ledger)
                         for s, module in zip(mine, stages, strict=True)]
        schedule = SCHEDULES[self.schedule_name]
        self.schedule = schedule(self.pipeline if self.virtual > 1 else self.pipeline[0], self.microbatches,
                                 loss_fn=self._loss, scale_grads=True)
        return net

    def _average_gradients(self) -> None:
        """Data parallelism between the copies of each stage: its gradients averaged over its column of the mesh,
        as DDP would (one flat all-reduce per stage after the schedule; DDP's own reducer, wrapped around a stage,
        fails on the second step in torch 2.13 because the schedule's shape inference runs a backward of its
        own), optionally sent in 16 bits."""
        for stage in self.pipeline:
            params = [p for p in stage.submod.parameters() if p.requires_grad]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            mean = averaged(grads, self.ledger, self.data_group, self.data, WIRE_DTYPES[self.compression])
            for p, g in zip(params, mean, strict=True):
                p.grad = g

    def forward_backward(self, model, loss, micro_batches: list[Batch], scaler) -> torch.Tensor:
        """One schedule step over this rank's batch: stage 0 gets the noised inputs, the last stage the targets;
        the schedule splits both into `parallel.microbatches` and averages the gradients over them."""
        regression = loss.regression(Batch.cat(micro_batches))
        if regression is None:
            raise ValueError(f"parallel.strategy: a pipeline trains regressions of the network's output, which "
                             f"{type(loss).__name__} is not")
        inputs, target, self.score, losses = regression.inputs, regression.target, regression.loss, []
        first = any(stage.is_first for stage in self.pipeline)
        last = any(stage.is_last for stage in self.pipeline)
        with self.autocast():
            self.schedule.step(*(inputs if first else ()), target=target if last else None,
                               losses=losses if last else None)
        if self.data > 1:
            self._average_gradients()
        mean = torch.stack(losses).float().mean() if last else torch.zeros((), device=self.world.device)
        dist.broadcast(mean, group=self.pipe_group, group_src=self.stages - 1)  # every stage logs the loss
        return mean

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.score(output, target).mean()  # the schedule hands it each micro-batch's part of the target

    def clip_grad_norm(self, params: list, max_norm: float) -> torch.Tensor:
        """The norm of the whole network's gradient: each rank's share of its square, summed over the pipeline."""
        grads = [p.grad for p in params if p.grad is not None]
        square = torch.zeros((), dtype=torch.float64, device=self.world.device)
        if grads:
            square = torch.nn.utils.get_total_norm(grads).double().square()
        dist.all_reduce(square, group=self.pipe_group)
        norm = square.sqrt().float()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def full_state_dict(self, state: dict) -> dict:
        """The whole network's tensors on pipeline rank 0 of every data row, each sent there by its owner; the
        other ranks get their own."""
        whole = {}
        for key, (owner, shape, dtype) in self.owners.items():
            if owner == 0:
                if self.pipe_rank == 0:
                    whole[key] = state[key].detach().cpu()
            elif self.pipe_rank == owner:
                dist.send(state[key].detach().contiguous(), group=self.pipe_group, group_dst=0)
            elif self.pipe_rank == 0:
                whole[key] = torch.empty(shape, dtype=dtype, device=self.world.device)
                dist.recv(whole[key], group=self.pipe_group, group_src=owner)
                whole[key] = whole[key].cpu()
        return whole if self.pipe_rank == 0 else {k: v.detach().cpu() for k, v in state.items()}


class PipelineCosts(Costs):
    """A pipeline's bytes depend on where the network is cut (costs.carry_bytes; `islands plan` prices the cut)."""

    def bytes_per_step(self, net, world, accumulate=1, compression="none", precision="fp32", sync_every=1,
                       replicas=None) -> dict[str, float]:
        raise ValueError("parallel.strategy: a pipeline's bytes depend on its cut; see costs.carry_bytes")

    @staticmethod
    def micro_batches(cfg: Config, stages: int) -> int:
        """The micro-batches a plan prices: the config's own when it runs a pipeline (1F1B keeps one per stage in
        flight), else two per stage."""
        return max(cfg.parallel.microbatches, stages) if cfg.parallel.strategy == "pipeline" else 2 * stages


class PipelineStrategy(Strategy):
    """parallel.strategy=pipeline: S stages (S x V with the interleaved schedule) on S ranks, times D copies."""

    name = "pipeline"
    several_ranks = True
    in_a_group = False  # its mesh spans the whole job
    fp16 = False  # per-stage loss scales would drift apart
    costs = PipelineCosts()

    @classmethod
    def options(cls, cfg: Config) -> dict:
        par = cfg.parallel
        return {**super().options(cfg), "stages": par.stages, "microbatches": par.microbatches,
                "schedule": par.schedule, "virtual_stages": par.virtual_stages, "data": par.data}

    def __init__(self, world: World, compression: str = "none", precision: str = "fp32", compile: bool = False,
                 activation_checkpointing: bool = False, stages: int = 2, microbatches: int = 4,
                 schedule: str = "1f1b", virtual_stages: int = 1, data: int | None = None):
        super().__init__(world, compression, precision, compile, activation_checkpointing)
        if data is None and world.size % stages:
            raise ValueError(f"parallel.stages: {stages} stages do not divide the {world.size} ranks")
        data = data or world.size // stages
        if data * stages != world.size:
            raise ValueError(f"parallel.data: {data} data-parallel copies of {stages} stages need "
                             f"{stages * data} ranks, not {world.size}")
        if schedule == "1f1b" and microbatches < stages:  # torch's 1F1B keeps S micro-batches in flight
            raise ValueError(f"parallel.microbatches: the 1f1b schedule needs at least one per stage ({stages}), "
                             f"not {microbatches}")
        mesh = init_device_mesh(world.device.type, (data, stages), mesh_dim_names=("data", "pipe"))
        self.layout = PipelineLayout(world, self.ledger, compression, precision, compile, activation_checkpointing,
                                     stages=stages, data=data, microbatches=microbatches, schedule=schedule,
                                     virtual_stages=virtual_stages, mesh=mesh)
        self.data = DataPlan(mesh.get_local_rank("data"), data)  # the stages of one data row read the same share


def example_input(net: nn.Module) -> tuple:
    """One input the network accepts, to count its blocks' FLOPs (without a condition: a looked-up "none" costs what
    any condition does)."""
    device = next(net.parameters()).device
    return torch.zeros(1, *net.input_shape, device=device), torch.full((1,), 0.5, device=device)


def _owner(key: str, net: nn.Module, owner_of_block: dict) -> int:
    """The pipeline rank holding a state-dict entry: its block's, the stem's (root buffers too) or the head's."""
    top = key.split(".")[0]
    if top == "blocks":
        return owner_of_block[int(key.split(".")[1])]
    if top in net.head_modules:
        return owner_of_block[len(net.blocks) - 1]
    return owner_of_block[0]


def _keep_only(net: nn.Module, stages: list[Stage]) -> None:
    """Drop from `net` every module no stage of this rank holds: its parameters, EMA and optimizer state then
    exist only on the rank that trains them, under the whole network's names."""
    kept = {i for stage in stages for i in stage.blocks}
    for i in range(len(net.blocks)):
        if i not in kept:
            net.blocks[i] = nn.Identity()
    if not any(stage.first for stage in stages):
        for name in net.stem_modules:
            setattr(net, name, None)
        for name in list(net._buffers):
            setattr(net, name, None)
    if not any(stage.last for stage in stages):
        for name in net.head_modules:
            setattr(net, name, None)
