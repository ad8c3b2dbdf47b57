"""ODE samplers on the canonical path, from t = 1 (noise) to t = 0 (data).

Every solver sees only a `Denoiser` (x, t, cond) -> velocity. It knows nothing of experts, routers or
parallelism. All solvers share one signature, as in k-diffusion.

The multistep solvers (dpm2m, unipc) work in the data-prediction form of DPM-Solver++ (Lu et al. 2022,
arXiv 2211.01095, Sec. 4): on x_t = alpha_t x0 + sigma_t eps with alpha = 1 - t, sigma = t and the half
log-SNR lambda = log(alpha / sigma), the exact solution from s to t < s is

    x_t = (sigma_t / sigma_s) x_s + sigma_t * int_{lambda_s}^{lambda_t} e^lambda x0(lambda) dlambda,

where x0 = x - t v is the data prediction. Writing x0(lambda_s + r h) = sum_k D_k r^k / k!, with
h = lambda_t - lambda_s and D_k = h^k d^k x0 / dlambda^k, integrates exactly to

    x_t = (sigma_t / sigma_s) x_s + alpha_t * sum_k h phi_{k+1}(-h) D_k,

with phi_1(z) = (e^z - 1) / z and phi_{k+1}(z) = (phi_k(z) - 1 / k!) / z. The step from t = 1 (lambda = -inf)
is then x_t = t x_1 + (1 - t) x0 and the step to t = 0 is x_0 = x0: both exact when x0 is constant.
"""

import math
from collections.abc import Callable

import torch
from torch import Tensor

from islands.flow.denoiser import Denoiser, GuidesItself, SplitInTime
from islands.flow.timesteps import shift_time

SOLVERS = ("euler", "heun", "dpm2m", "unipc")
GRIDS = ("uniform", "edm", "shifted", "logsnr")

# Heun's last step is its only first-order one (a corrector at t = 0 is not available), so its grids stop at
# this time before that step, as diffusers' flow-matching schedulers do: over [1e-3, 0] an Euler step is
# nearly exact. Ending at exactly 0 made the Euler step cover a whole interval and doubled Heun's error at 16
# evaluations. The other solvers end their grids at 0: their last step is the data prediction at the last
# time they evaluate anyway, and stopping at 1e-3 would spend that evaluation where nothing is left to do.
HEUN_T_MIN = 1e-3

# The logsnr grid spends the N - 1 times between t = 1 and t = 0 on a window of the half log-SNR
# lambda = log((1 - t) / t) centred on LOGSNR_CENTRE (t ~ 0.35), of width LOGSNR_WIDTH[0] ln N - LOGSNR_WIDTH[1]: a
# budget of N evaluations cannot resolve more than that, and the window widens as it grows (at 4 evaluations it
# spans t = 0.64 .. 0.14, at 32 t = 0.97 .. 0.009). Inside, lambda_i = centre + width / 2 sinh(k s_i) / sinh(k) with
# s_i evenly spaced in [-1, 1]: steps of lambda about 2.4x finer in the middle, where the modes separate, than at
# the ends, where x0 barely changes. The constants are a fit, for unipc, of the best window at 4 to 32 evaluations
# on six Gaussian mixtures (2-D to 24-D, 3 to 16 modes, std 0.05 to 0.4), none of them the benchmark's.
LOGSNR_CENTRE = 0.6
LOGSNR_WIDTH = (2.8, 1.5)
LOGSNR_WARP = 1.5


def _fractions(steps: int, t_min: float) -> Tensor:
    """Decreasing float64 fractions: steps + 1 from 1 to 0, or with t_min > 0, steps from 1 to t_min and a 0."""
    if t_min <= 0:
        return torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return torch.cat([torch.linspace(1.0, t_min, steps, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)])


def time_grid(steps: int, kind: str = "uniform", shift: float = 3.0, rho: float = 7.0, t_min: float = 0.0) -> Tensor:
    """A decreasing float64 grid of steps + 1 times from exactly 1 to exactly 0.

    uniform: equal steps in t. shifted: Esser et al. 2024 (eq. 23) t' = shift t / (1 + (shift - 1) t), more steps
    at high noise. For both, t_min > 0 puts the last time before 0 at t_min (shifted: at t_min shifted), as
    diffusers' flow-matching schedulers do (their t_min is 1e-3).
    edm: Karras et al. 2022 (eq. 5) spacing of sigma = t / (1 - t) between 80 and 0.002 with rho = 7; the first
    point is moved to t = 1 so sampling starts from pure noise. It ends at sigma = 0.002 (t ~ 0.002) on its own.
    logsnr: t = 1, then N - 1 times spaced in lambda = log((1 - t) / t) over a window that widens with N (see
    LOGSNR_*), then 0. It ends at its own smallest time; t_min does not apply to edm and logsnr.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if kind == "uniform":
        return _fractions(steps, t_min)
    if kind == "shifted":
        return shift_time(_fractions(steps, t_min), shift)
    if kind == "edm":
        smax, smin = 80.0 ** (1 / rho), 0.002 ** (1 / rho)
        i = torch.arange(steps, dtype=torch.float64)
        frac = i / max(steps - 1, 1)
        sigma = (smax + frac * (smin - smax)) ** rho
        t = torch.cat([sigma / (1 + sigma), torch.zeros(1, dtype=torch.float64)])
        t[0] = 1.0
        return t
    if kind == "logsnr":
        n = steps - 1  # times strictly between 1 and 0
        width = max(LOGSNR_WIDTH[0] * math.log(steps) - LOGSNR_WIDTH[1], 0.0)
        s = torch.linspace(-1.0, 1.0, n, dtype=torch.float64) if n > 1 else torch.zeros(n, dtype=torch.float64)
        lam = LOGSNR_CENTRE + 0.5 * width * torch.sinh(LOGSNR_WARP * s) / math.sinh(LOGSNR_WARP)
        one, zero = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        return torch.cat([one, torch.sigmoid(-lam), zero])  # t = 1 / (1 + e^lambda)
    raise ValueError(f"unknown time grid {kind!r}; choose from {GRIDS}")


def solver_grid(steps: int, grid: str, solver: str, time_shift: float = 1.0, boundaries=()) -> Tensor:
    """The times `sample` steps through: the `grid` (ending at HEUN_T_MIN for heun), shifted by `time_shift` (SD3's
    resolution shift, Esser et al. 2024 eq. 23, the one the network trained with: islands.flow.timesteps.shift_time),
    with `boundaries` put in exactly."""
    ts = time_grid(steps, grid, t_min=HEUN_T_MIN if solver == "heun" else 0.0)
    if time_shift != 1:
        ts = shift_time(ts, time_shift)
    return with_boundaries(ts, boundaries)


def with_boundaries(grid: Tensor, boundaries) -> Tensor:
    """The decreasing grid with every one of `boundaries` in it, exactly (a grid point within 1e-12 of one is moved
    onto it, else the boundary is added), so that no step crosses one: timestep-range experts hand over there."""
    grid = grid.clone()
    extra = []
    for b in boundaries:
        near = (grid - b).abs() <= 1e-12
        if near.any():
            grid[near] = b
        else:
            extra.append(float(b))
    return torch.cat([grid, torch.tensor(extra, dtype=grid.dtype)]).sort(descending=True).values


def guided(denoiser: Denoiser, scale: float) -> Denoiser:
    """Classifier-free guidance (Ho & Salimans 2022): v = v_uncond + scale * (v_cond - v_uncond)."""
    if scale == 1.0:
        return denoiser
    if isinstance(denoiser, GuidesItself):  # a mixture guides inside each expert
        return denoiser.guided(scale)

    def velocity(x: Tensor, t: Tensor, cond: Tensor | None = None) -> Tensor:
        if cond is None:
            return denoiser(x, t, None)
        v_cond, v_uncond = denoiser(x, t, cond), denoiser(x, t, None)
        return v_uncond + scale * (v_cond - v_uncond)

    return velocity


def _times(t: float, x: Tensor) -> Tensor:
    return torch.full((x.shape[0],), t, dtype=x.dtype, device=x.device)


def _lambda(t: float) -> float:
    """Half log-SNR of the rectified-flow path, log((1 - t) / t): -inf at t = 1, +inf at t = 0."""
    if t >= 1.0:
        return -math.inf
    if t <= 0.0:
        return math.inf
    return math.log((1 - t) / t)


def euler(v: Callable, x: Tensor, grid: Tensor) -> Tensor:
    for t, t_next in zip(grid[:-1].tolist(), grid[1:].tolist(), strict=True):
        x = x + (t_next - t) * v(x, _times(t, x))
    return x


def heun(v: Callable, x: Tensor, grid: Tensor) -> Tensor:
    """Second-order Heun (Karras et al. 2022, Algorithm 1); the last step to t = 0 is an Euler step."""
    for t, t_next in zip(grid[:-1].tolist(), grid[1:].tolist(), strict=True):
        d = v(x, _times(t, x))
        x_euler = x + (t_next - t) * d
        if t_next == 0.0:
            x = x_euler
        else:
            d_next = v(x_euler, _times(t_next, x))
            x = x + (t_next - t) * 0.5 * (d + d_next)
    return x


def dpm2m(v: Callable, x: Tensor, grid: Tensor) -> Tensor:
    """DPM-Solver++(2M) (Lu et al. 2022, Algorithm 2) with alpha = 1 - t, sigma = t.

    The data prediction is x0 = x - t v. The first step has no earlier prediction and the last (to t = 0, where
    h is infinite) cannot use one: both are first order, the exact DDIM update there. Every other step is second
    order, the second one included when the grid starts below t = 1 (a step from t = 1 has h = inf, so r = inf
    and the correction it would give the next step vanishes).
    """
    x0_prev, h_prev = None, math.inf
    ts = grid.tolist()
    for t, t_next in zip(ts[:-1], ts[1:], strict=True):
        x0 = x - t * v(x, _times(t, x))
        h = _lambda(t_next) - _lambda(t)
        if x0_prev is None or math.isinf(h) or math.isinf(h_prev):
            d = x0
        else:
            r = h_prev / h
            d = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * x0_prev
        # x_next = (sigma' / sigma) x + (alpha' - alpha sigma' / sigma) D, i.e. sigma'/sigma x - alpha'(e^-h - 1) D.
        ratio = t_next / t
        x = ratio * x + ((1 - t_next) - (1 - t) * ratio) * d
        x0_prev, h_prev = x0, h
    return x


def _phi(k: int, h: float) -> float:
    """phi_k(-h) for h > 0; a Taylor series near 0, where the recursion would cancel."""
    z = -h
    if h < 0.5:
        return sum(z**j / math.factorial(j + k) for j in range(20))
    p = math.expm1(z) / z
    for j in range(1, k):
        p = (p - 1 / math.factorial(j)) / z
    return p


def _exponential_step(x: Tensor, t: float, t_next: float, x0: Tensor, points: list, h: float) -> Tensor:
    """x at t_next from x at t < 1 (eq. at the top of this file), with x0 the data prediction at t and
    `points` pairs (r, x0 at lambda_t + r h) whose polynomial fit through (0, x0) gives D_1, D_2, ..."""
    n = len(points)
    out = (t_next / t) * x + (1 - t_next) * -math.expm1(-h) * x0
    if n:
        # Solve sum_k D_k r_i^k / k! = x0_i - x0 for D_1..D_n; the matrix is n x n with n <= 3.
        a = torch.tensor([[r**k / math.factorial(k) for k in range(1, n + 1)] for r, _ in points], dtype=torch.float64)
        w = torch.linalg.inv(a).tolist()
        diffs = [xi - x0 for _, xi in points]
        for k in range(n):
            d_k = sum(w[k][i] * diffs[i] for i in range(n))
            out = out + (1 - t_next) * h * _phi(k + 2, h) * d_k
    return out


# unipc keeps the corrector's last correction through its final step when the last time is at most this (see unipc)
UNIPC_KEEP_LAST_CORRECTION = 0.1
# unipc's predictor order: 2, and 3 from this many steps on. On six Gaussian mixtures with the logsnr grid, order 3
# had 3% less error than order 2 at 12 steps, 12% at 16, 22% at 24 and 32% at 32, and more below 12: extrapolating
# a quadratic pays once the steps are short.
UNIPC_ORDER_3_FROM = 16


def unipc(v: Callable, x: Tensor, grid: Tensor, order: int | None = None) -> Tensor:
    """UniPC (Zhao et al. 2023, arXiv 2302.04867): a UniP predictor of `order` and a UniC corrector of order + 1.

    One evaluation per step; `order` None is 2, or 3 on grids of UNIPC_ORDER_3_FROM steps or more. Data-prediction
    form on the rectified-flow path, with the exact phi-function coefficients of the Taylor expansion at the top of
    this file (UniPC's varying-coefficient form) rather than its B(h) approximations (diffusers' bh1/bh2). Each step:
      evaluate x0_i at the predicted x_i;
      UniC: redo the step that produced x_i with x0_i included in the fit (order + 1, no extra evaluation);
      UniP: from the corrected x_i, extrapolate the last `order` data predictions to t_{i+1}.
    Lower orders while there is not yet enough history. The step from t = 1 (lambda = -inf, where no polynomial
    in lambda fits) is the exact first-order one, and UniC-1 corrects it with its coefficient 1/2: x0 averaged
    over the step's two ends.
    The last step, to t = 0, is first order (higher terms diverge as h -> inf). diffusers' UniPC returns the data
    prediction at the predicted point, x_p - t v(x_p), dropping the last correction. Near the data, where
    dx0/dx -> I, the data prediction at the corrected point is x_c - t v(x_p), which keeps it; further out
    dx0/dx shrinks and it over-corrects. So the correction is kept when the last time is at most
    UNIPC_KEEP_LAST_CORRECTION. On six Gaussian mixtures with the logsnr grid, keeping it cut the error by 10-17%
    at 6 to 10 evaluations (last times 0.09 to 0.05) and changed it by 3% or less at 16 to 32; at 4 evaluations
    (last time 0.14) it cost 13%.
    """
    ts = grid.tolist()
    if order is None:
        order = 3 if len(ts) - 1 >= UNIPC_ORDER_3_FROM else 2
    history: list[tuple[float, Tensor]] = []  # (lambda, x0) at the times evaluated so far, newest last
    previous = None  # (x at the start of the step just taken, its time, its predictor order)
    for t, t_next in zip(ts[:-1], ts[1:], strict=True):
        velocity = v(x, _times(t, x))
        x_predicted, x0 = x, x - t * velocity
        lam = _lambda(t)
        if previous is not None:  # UniC on the step that led here
            x_s, t_s, p = previous
            lam_s, x0_s = history[-1]
            if math.isinf(lam_s):
                x = t * x_s + (1 - t) * 0.5 * (x0_s + x0)
            else:
                h = lam - lam_s
                past = [((lam_j - lam_s) / h, x0_j) for lam_j, x0_j in reversed(history[:-1])
                        if not math.isinf(lam_j)][: p - 1]
                x = _exponential_step(x_s, t_s, t, x0_s, past + [(1.0, x0)], h)
        history.append((lam, x0))
        if t_next == 0.0:
            return x - t * velocity if t <= UNIPC_KEEP_LAST_CORRECTION else x_predicted - t * velocity
        if math.isinf(lam):
            previous = (x, t, 1)
            x = t_next * x + (1 - t_next) * x0
            continue
        h = _lambda(t_next) - lam
        usable = [(lam_j, x0_j) for lam_j, x0_j in reversed(history[:-1]) if not math.isinf(lam_j)]
        p = min(order, 1 + len(usable))
        previous = (x, t, p)
        x = _exponential_step(x, t, t_next, x0, [((lam_j - lam) / h, x0_j) for lam_j, x0_j in usable[: p - 1]], h)
    return x


_SOLVERS = {"euler": euler, "heun": heun, "dpm2m": dpm2m, "unipc": unipc}


@torch.no_grad()
def sample(
    denoiser: Denoiser,
    noise: Tensor,
    *,
    steps: int = 32,
    solver: str = "heun",
    grid: str = "uniform",
    guidance: float = 1.0,
    cond: Tensor | None = None,
    time_shift: float = 1.0,
) -> Tensor:
    """Integrate dx/dt = v(x, t) from noise at t = 1 to t = 0 and return the samples. `time_shift` moves the grid's
    times towards noise as the network's training times were moved (`solver_grid`)."""
    if solver not in _SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose from {SOLVERS}")
    # A denoiser made of timestep-range experts says where they hand over (`time_boundaries`) and which denoiser
    # answers inside range i (`for_range(i)`, ranges counted from t = 0): each range is integrated on its own part
    # of the grid with its own expert, so no step, not even Heun's corrector on a boundary, mixes two experts (and
    # a multistep solver starts its history again in each range).
    bounds = sorted(denoiser.time_boundaries) if isinstance(denoiser, SplitInTime) else []
    ts = solver_grid(steps, grid, solver, time_shift, bounds)
    if not bounds:
        return _SOLVERS[solver](_velocity(denoiser, guidance, cond), noise, ts)
    edges = [0.0, *bounds, 1.0]
    x = noise
    for i in reversed(range(len(edges) - 1)):  # from the noisiest range down
        segment = ts[(ts >= edges[i]) & (ts <= edges[i + 1])]
        if len(segment) > 1:
            x = _SOLVERS[solver](_velocity(denoiser.for_range(i), guidance, cond), x, segment)
    return x


def _velocity(denoiser: Denoiser, guidance: float, cond: Tensor | None) -> Callable:
    field = guided(denoiser, guidance)

    def v(x: Tensor, t: Tensor) -> Tensor:
        return field(x, t, cond).to(x.dtype)

    return v


def evaluations_per_sample(solver: str, steps: int, guidance: float = 1.0) -> int:
    """Network evaluations one sample costs (Heun skips its corrector on the step to t = 0; the multistep
    solvers evaluate once per step, UniC reusing the next step's evaluation)."""
    if solver not in _SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose from {SOLVERS}")
    per_eval = 1 if guidance == 1.0 else 2
    n = 2 * steps - 1 if solver == "heun" else steps
    return n * per_eval
