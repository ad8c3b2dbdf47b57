"""An ensemble's experts spread over the ranks when sampling (expert parallelism at inference).

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

import torch
from torch import Tensor, nn

from islands.ddm.ensemble import ancestral_preparation
from islands.ddm.mixture import Mixture
from islands.flow.denoiser import broadcast
from islands.generate import generate
from islands.parallel.expert_parallel import exchange
from islands.parallel.launch import World
from islands.parallel.ledger import Ledger


class ExpertParallelMixture(nn.Module):
    def __init__(self, mixture: Mixture, world: World):
        super().__init__()
        self.mixture, self.world = mixture, world
        self.ledger = Ledger(world.size)
        self.time_boundaries = mixture.time_boundaries
        self.evaluations = 0  # (sample, expert) pairs of this rank's samples, wherever they were evaluated

    def owner(self, k: int) -> int:
        return k % self.world.size

    def forward(self, x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor:
        t = torch.as_tensor(t, dtype=x.dtype, device=x.device).expand(x.shape[0])
        weights = self.mixture.selection_weights(x, t, cond)
        rows, experts = (weights > 0).nonzero(as_tuple=True)
        self.evaluations += rows.numel()
        home = experts % self.world.size
        outgoing = []
        for rank in range(self.world.size):
            pick = rows[home == rank]
            slots = [x[pick], t[pick], experts[home == rank]]
            outgoing.append(slots if cond is None else [*slots, cond[pick]])
        answers = []
        for xs, ts, ks, *cs in exchange(outgoing, self.world, self.ledger):
            v = torch.empty_like(xs)
            for k in ks.unique().tolist():
                at = (ks == k).nonzero().squeeze(1)
                v[at] = self.mixture.expert(k)(xs[at], ts[at], cs[0][at] if cs else None).to(x.dtype)
            answers.append([v])
        velocity = x.new_empty((rows.numel(), *x.shape[1:]))
        for rank, (v,) in enumerate(exchange(answers, self.world, self.ledger)):
            velocity[home == rank] = v
        out = torch.zeros_like(x)
        for k in experts.unique().tolist():  # the Mixture's fixed order of summation
            at = experts == k
            out[rows[at]] += broadcast(weights[rows[at], k], velocity[at]) * velocity[at]
        return out


def sample_distributed(mixture: Mixture, manifest: dict, shape: tuple, num: int, opts, seed: int,
                       labels: Tensor | None, world: World) -> tuple[Tensor | None, dict]:
    """`num` samples of the ensemble, the experts spread over the ranks: every rank draws the same number of
    samples (the last ones beyond `num` are drawn and dropped, so that all ranks take part in every exchange), with
    the noise and ancestral experts of their own indices, as single-process sampling does. -> (the samples on rank
    0, None elsewhere; {images_per_s, bytes_moved, expert_evaluations_per_sample} over all ranks)."""
    per = math.ceil(num / world.size)
    first = world.rank * per
    # the padding's labels repeat the first ones; its samples are dropped
    mine = None if labels is None else labels.repeat(world.size)[first:first + per]
    parallel = ExpertParallelMixture(mixture, world)
    world.barrier()
    start = time.perf_counter()
    x = generate(parallel, shape, per, opts, seed, mine, first=first,
                 prepare=ancestral_preparation(mixture, manifest, seed))
    to_main = [[x if rank == 0 else x[:0]] for rank in range(world.size)]
    gathered = exchange(to_main, world)
    seconds = time.perf_counter() - start
    moved, evaluations = world.mean([sum(parallel.ledger.step.values()), float(parallel.evaluations)])
    stats = {"images_per_s": num / seconds, "bytes_moved": moved * world.size,
             "expert_evaluations_per_sample": evaluations * world.size / (per * world.size)}
    return (torch.cat([chunk for (chunk,) in gathered])[:num] if world.is_main else None), stats
