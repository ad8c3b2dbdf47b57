"""Timestep-range experts as one Denoiser (Balaji et al. 2022, eDiff-I): expert i answers for the canonical times
of its range, and a gate by t picks it.

With boundaries 0 = b_0 < b_1 < ... < b_R = 1, expert i owns (b_i, b_{i+1}] (expert 0 owns t = 0 too). The gate
tells samplers its inner boundaries (`time_boundaries`), which put them into their time grids and integrate each
range with that range's expert alone (`for_range`), so that no solver step, not even Heun's corrector on a
boundary, mixes two experts. Called directly at a boundary, the gate answers with the expert below it.
"""

from pathlib import Path

import torch
from torch import Tensor, nn

from islands.data.latents import recorded_sha256
from islands.errors import CheckpointError
from islands.flow.denoiser import Denoiser
from islands.generate import load_denoiser


class TimeGate(nn.Module):
    def __init__(self, experts: list[Denoiser], boundaries: list[float]):
        super().__init__()
        if len(boundaries) != len(experts) + 1 or boundaries[0] != 0 or boundaries[-1] != 1 \
                or sorted(set(boundaries)) != list(boundaries):
            raise ValueError(f"{len(experts)} range experts need {len(experts) + 1} boundaries rising from 0 to 1, "
                             f"got {boundaries}")
        self.experts = list(experts)
        self.boundaries = [float(b) for b in boundaries]
        self._inner = torch.tensor(self.boundaries[1:-1], dtype=torch.float64)
        self.evaluations = 0  # (sample, expert) pairs evaluated, over all calls

    @property
    def time_boundaries(self) -> list[float]:
        """The times at which one expert hands over to the next, for the samplers' grids."""
        return self.boundaries[1:-1]

    def for_range(self, i: int) -> Denoiser:
        """Range i's expert alone, for a sampler integrating that range (counted as the gate's evaluations)."""
        def answer(x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor:
            self.evaluations += x.shape[0]
            return self.experts[i](x, t, cond)

        return answer

    def expert_index(self, t: Tensor) -> Tensor:
        """The expert of each canonical time: the number of inner boundaries strictly below it, compared in t's own
        dtype (a grid's 0.3 reaches a float32 network as 0.30000001, which must still count as the boundary)."""
        t = t.detach().cpu()
        return torch.searchsorted(self._inner.to(t.dtype), t.contiguous(), right=False)

    def forward(self, x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor:
        t = torch.as_tensor(t, dtype=x.dtype, device=x.device).expand(x.shape[0])
        which = self.expert_index(t).to(x.device)
        out = torch.empty_like(x)
        for i in which.unique().tolist():
            rows = (which == i).nonzero().squeeze(1)
            out[rows] = self.experts[i](x[rows], t[rows], None if cond is None else cond[rows]).to(x.dtype)
            self.evaluations += rows.numel()
        return out


def load_time_gate(run_dir: Path, use_ema: bool = True) -> tuple[TimeGate, object, dict]:
    """The range experts of RUN/tstages/<i> (`islands train CONFIG tstage=i`) behind their gate, with the first
    expert's config and model description. Every range must be trained, on the boundaries the others were."""
    run_dir = Path(run_dir)
    stages = sorted((p for p in (run_dir / "tstages").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    if not stages:
        raise CheckpointError(f"{run_dir}: no range experts in {run_dir / 'tstages'}")
    loaded = [load_denoiser(stage, use_ema) for stage in stages]
    bounds = loaded[0][1].flow.t_ranges
    if bounds is None or any(cfg.flow.t_ranges != bounds for _, cfg, _ in loaded) or len(bounds) != len(stages) + 1:
        found = [p.name for p in stages]
        raise CheckpointError(f"{run_dir}: the range experts {found} do not make up one set of flow.t_ranges "
                              f"({bounds}); train each range with 'islands train CONFIG tstage=I'")
    if len({recorded_sha256(stage) for stage in stages}) > 1:
        raise CheckpointError(f"{run_dir}: the range experts trained on different autoencoders (their "
                              "autoencoder.json); their samples are not in one latent space")
    return TimeGate([denoiser for denoiser, _, _ in loaded], bounds), loaded[0][1], loaded[0][2]
