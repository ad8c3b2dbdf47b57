"""An ensemble's experts spread over the ranks when sampling (expert parallelism at inference): cluster experts by
an all-to-all of (sample, expert) pairs, timestep-range experts by a pipeline of batches (`sample_range_pipeline`).

Rank r owns the experts k with k % W == r and loads only those (the `Mixture` loads an expert on first use, and a
rank uses only its own). Every rank samples its own slice of the samples; at each evaluation it routes its slice
(the router, or each sample's ancestral expert), sends every (sample, expert) pair to the expert's rank, which
evaluates all the pairs it received, expert by expert, and sends the velocities back (two all-to-alls); the
weighted sum is then taken at home in the order the single-process `Mixture` takes it. The samples equal single-
process sampling within float tolerance (an expert's batch holds rows from every rank, so its matmuls may round
differently); the `sample` policy draws from a generator in call order, so it differs.
"""

import math
import time
from dataclasses import replace

import torch
from torch import Tensor, nn

from islands.data import streams
from islands.ddm.mixture import Mixture, MixtureView
from islands.ddm.time_gate import TimeGate
from islands.errors import ConfigError
from islands.flow.denoiser import broadcast
from islands.flow.samplers import euler, guided, heun, solver_grid
from islands.generate import Sampler, generate, sampling_precision
from islands.parallel.expert_parallel import exchange, receive_from, send_to
from islands.parallel.launch import World
from islands.parallel.ledger import Ledger


class ExpertParallelMixture(nn.Module):
    def __init__(self, mixture: Mixture, world: World):
        super().__init__()
        self.mixture, self.world = mixture, world
        self.ledger = Ledger(world.size)
        self.time_boundaries = mixture.time_boundaries
        self.evaluations = 0  # (sample, expert) pairs of this rank's samples, wherever they were evaluated

    def for_range(self, i: int) -> MixtureView:
        return MixtureView(self, time_range=i)

    def assigned(self, clusters: Tensor) -> MixtureView:
        """Ancestral routing: each sample of the batch sent to its expert `clusters`, wherever that expert lives."""
        return replace(self.mixture.assigned(clusters), mixture=self)

    def guided(self, scale: float, time_range: int | None = None, assigned: Tensor | None = None):
        """Classifier-free guidance inside each expert, as `Mixture.guided`: the expert's rank evaluates both halves."""
        return lambda x, t, cond=None: self.forward(x, t, cond, time_range, assigned, scale)

    def forward(self, x: Tensor, t: Tensor, cond: Tensor | None = None, time_range: int | None = None,
                assigned: Tensor | None = None, scale: float = 1.0) -> Tensor:
        t = torch.as_tensor(t, dtype=x.dtype, device=x.device).expand(x.shape[0])
        weights = self.mixture.selection_weights(x, t, cond, assigned)
        rows, experts = (weights > 0).nonzero(as_tuple=True)
        self.evaluations += rows.numel() * (2 if cond is not None and scale != 1.0 else 1)
        home = experts % self.world.size  # the rank that owns each pair's expert
        outgoing = []
        for rank in range(self.world.size):
            pick = rows[home == rank]
            slots = [x[pick], t[pick], experts[home == rank]]
            outgoing.append(slots if cond is None else [*slots, cond[pick]])
        answers = []
        for xs, ts, ks, *cs in exchange(outgoing, self.world, self.ledger):
            v = torch.empty_like(xs)

            def call(expert, at, xs=xs, ts=ts, cs=cs):
                v_cond = expert(xs[at], ts[at], cs[0][at] if cs else None)
                if cs and scale != 1.0:  # guided: the unconditional half at the same expert
                    v_uncond = expert(xs[at], ts[at], None)
                    v_cond = v_uncond + scale * (v_cond - v_uncond)
                return v_cond

            for k in ks.unique().tolist():
                at = (ks == k).nonzero().squeeze(1)
                v[at] = self.mixture.in_calls(call, self.mixture.expert(k, time_range), at).to(x.dtype)
            answers.append([v])
        velocity = x.new_empty((rows.numel(), *x.shape[1:]))
        for rank, (v,) in enumerate(exchange(answers, self.world, self.ledger)):
            velocity[home == rank] = v
        out = torch.zeros_like(x)
        for k in experts.unique().tolist():  # the Mixture's fixed order of summation
            at = experts == k
            out[rows[at]] += broadcast(weights[rows[at], k], velocity[at]) * velocity[at]
        return out


def sample_distributed(sampler: Sampler, num: int, seed: int, labels: Tensor | None,
                       world: World) -> tuple[Tensor | None, dict]:
    """`num` samples of the ensemble `sampler` opened, the experts spread over the ranks: every rank draws the same
    number of samples (the last ones beyond `num` are drawn and dropped, so that all ranks take part in every
    exchange), with the noise and ancestral experts of their own indices, drawn as single-process sampling draws
    them (the sampler's own assignment: a prompt's expert from the condition router). -> (the samples on rank 0,
    None elsewhere; {images_per_s, bytes_moved, expert_evaluations_per_sample} over all ranks)."""
    per = math.ceil(num / world.size)
    first = world.rank * per
    # the padding's conditions (a class, or a packed caption) repeat the first ones; its samples are dropped
    mine = None if labels is None else labels.repeat(world.size, *[1] * (labels.dim() - 1))[first:first + per]
    parallel = ExpertParallelMixture(sampler.denoiser, world)
    world.barrier()
    start = time.perf_counter()
    x = generate(parallel, sampler.shape, per, sampler.opts, seed, mine, first=first,
                 for_batch=sampler.assignment(seed, drawn_by=parallel))
    to_main = [[x if rank == 0 else x[:0]] for rank in range(world.size)]
    gathered = exchange(to_main, world)
    seconds = time.perf_counter() - start
    moved, evaluations = world.mean([sum(parallel.ledger.step.values()), float(parallel.evaluations)])
    stats = {"images_per_s": num / seconds, "bytes_moved": moved * world.size,
             "expert_evaluations_per_sample": evaluations / per}
    return (torch.cat([chunk for (chunk,) in gathered])[:num] if world.is_main else None), stats


def sample_range_pipeline(gate: TimeGate, shape: tuple, num: int, opts, seed: int, labels: Tensor | None,
                          world: World) -> tuple[Tensor | None, dict]:
    """`num` samples of timestep-range experts, one range per rank: rank 0 integrates each batch from noise down to
    its range's lower boundary and sends it on to the rank of the next range, then starts the next batch, so that
    every rank works at once on a different batch. Each rank integrates the part of the sampler's grid (boundaries
    included) that lies in its range; a one-step solver's steps depend only on their two times, so the samples
    are those of one process. The world is the whole job. -> (the samples on rank 0, None elsewhere; images/s and
    bytes moved)."""
    if world.size != len(gate.experts):
        raise ConfigError(f"--distributed: {len(gate.experts)} range experts need {len(gate.experts)} ranks, "
                          f"not {world.size}")
    if opts.solver not in ("euler", "heun"):  # a multistep solver's history would cross ranks
        raise ConfigError(f"sample.solver: {opts.solver!r} keeps a history across steps; pipelined ranges take euler "
                          "or heun")
    solve = {"euler": euler, "heun": heun}[opts.solver]
    index = len(gate.experts) - 1 - world.rank  # rank 0 the noisiest range
    lo, hi = gate.boundaries[index], gate.boundaries[index + 1]
    grid = solver_grid(opts.steps, opts.grid, opts.solver, opts.time_shift or 1.0, gate.time_boundaries)
    segment = grid[(grid >= lo) & (grid <= hi)]
    field = guided(gate.experts[index], opts.guidance)
    batches = [(b, min(num, b + opts.batch_size)) for b in range(0, num, opts.batch_size)]
    done, moved = [], 0
    world.barrier()
    start = time.perf_counter()
    for first, last in batches:
        if world.rank == 0:
            x = streams.normal(seed, list(range(first, last)), shape, "sample")
        else:
            x = receive_from((last - first, *shape), world.rank - 1)
        cond = None if labels is None else labels[first:last]
        with sampling_precision(opts.precision, x.device):
            x = solve(lambda x_, t_, c=cond: field(x_, t_, c).to(x_.dtype), x, segment).float()
        if world.rank < world.size - 1:
            moved += send_to(x, world.rank + 1)
        else:
            done.append(x)
    samples = None
    if world.size > 1 and world.rank == world.size - 1:  # the cleanest range hands the samples to rank 0
        send_to(torch.cat(done), 0)
    elif world.size > 1 and world.rank == 0:
        samples = receive_from((num, *shape), world.size - 1)
    else:
        samples = torch.cat(done)
    seconds = time.perf_counter() - start
    (moved,) = world.mean([float(moved)])
    return samples, {"images_per_s": num / seconds, "bytes_moved": moved * world.size}
