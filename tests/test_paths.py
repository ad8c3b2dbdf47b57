"""The cosine path with Nichol & Dhariwal's offset and DDPM's discrete schedule, against the paper's closed form,
diffusers' `DDPMScheduler` and a diffusers network fed integer steps."""

import json
import math

import diffusers
import pytest
import torch

from islands.config import ConfigError, validate
from islands.data.batch import Batch
from islands.ddm.ensemble import _entry, _expert
from islands.ddm.mixture import ExpertSlot, Mixture, PriorRouter
from islands.flow.denoiser import EPSILON_T_MAX, NetworkDenoiser
from islands.flow.paths import Cosine, VPDiscrete, build_path
from islands.flow.samplers import sample
from islands.flow.timesteps import TimeSampler
from islands.generate import load_denoiser
from islands.train.objectives import build_objective
from islands.trainer import train

N = 1000
DIFFUSERS_SCHEDULE = {"linear": "linear", "cosine": "squaredcos_cap_v2"}


pytestmark = pytest.mark.usefixtures("float64")  # exact comparisons: tensors built in float64


@pytest.fixture
def float32(float64):
    """For a real training run, whose networks are built in the default dtype."""
    torch.set_default_dtype(torch.float32)


def paper_alpha_bar(tau: float) -> float:
    """Nichol & Dhariwal 2021, eq. 17, written out on its own."""
    f = lambda v: math.cos((v + 0.008) / (1 + 0.008) * math.pi / 2) ** 2  # noqa: E731
    return f(tau) / f(0.0)


def diffusers_alphas_cumprod(schedule: str) -> torch.Tensor:
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=N, beta_schedule=DIFFUSERS_SCHEDULE[schedule])
    return scheduler.alphas_cumprod.double()


def test_cosine_path_is_the_papers_schedule_offset_included():
    path = Cosine()
    tau = torch.linspace(0, 1, 101)
    expected = torch.tensor([paper_alpha_bar(v) for v in tau.tolist()])
    assert torch.allclose(path.alpha(tau) ** 2, expected, rtol=1e-12, atol=1e-15)
    assert torch.allclose(path.alpha(tau) ** 2 + path.sigma(tau) ** 2, torch.ones(101), atol=1e-14)
    # the offset leaves noise at tau = 1 / N that the unshifted cos(pi tau / 2) would not have
    assert float(path.sigma(torch.tensor(1 / N))) == pytest.approx(math.sqrt(1 - paper_alpha_bar(1 / N)), rel=1e-10)
    assert float(path.sigma(torch.tensor(1 / N))) > 3 * math.sin(math.pi / 2 / N)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_discrete_schedule_equals_diffusers_at_every_step(schedule):
    theirs = diffusers_alphas_cumprod(schedule)  # float32 in diffusers; ours are float64, as in DDPM's code
    ours = VPDiscrete(schedule).alphas_cumprod
    assert ours.shape == theirs.shape == (N,)
    assert (ours - theirs).abs().max() < 5e-7
    assert ((ours - theirs).abs() / ours).max() < 3e-5  # the relative gap peaks at step 999, where alpha_bar ~ 2e-9


def test_cosine_steps_lie_on_the_cosine_path_except_the_clipped_last_one():
    """alphas_cumprod[n] = alpha_bar((n + 1) / N) of eq. 17 until beta clips at 0.999: at n = N - 1 only."""
    ours = VPDiscrete("cosine").alphas_cumprod
    on_path = torch.tensor([paper_alpha_bar((n + 1) / N) for n in range(N)])
    assert torch.allclose(ours[:-1], on_path[:-1], rtol=1e-12, atol=0)
    assert on_path[-1] < 1e-30  # alpha_bar(1) = 0: beta would be 1 there
    assert float(ours[-1]) == pytest.approx(paper_alpha_bar((N - 1) / N) * 0.001, rel=1e-12)
    try:
        theirs = diffusers_alphas_cumprod("cosine")
    except pytest.skip.Exception:
        return
    assert torch.allclose(theirs[:-1], Cosine().alpha_bar((torch.arange(N - 1) + 1.0) / N), rtol=3e-5, atol=5e-7)
    assert theirs[-1] > 1e20 * on_path[-1]


def test_linear_steps_are_ddpms_betas():
    """Ho et al. 2020, section 4: 1000 betas linear from 1e-4 to 0.02; alpha_bar_n is their running product."""
    path = VPDiscrete("linear")
    product, expected = 1.0, []
    for n in range(N):
        product *= 1 - (1e-4 + (0.02 - 1e-4) * n / (N - 1))
        expected.append(product)
    assert torch.allclose(path.alphas_cumprod, torch.tensor(expected), rtol=1e-12, atol=0)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_discrete_time_maps_invert_each_other_and_land_on_the_steps(schedule):
    path = VPDiscrete(schedule)
    steps = torch.arange(N) / N
    assert torch.allclose(path.alpha(steps) ** 2, path.alphas_cumprod, rtol=1e-13, atol=0)
    t_steps = path.canonical_time(steps)
    assert (t_steps[1:] > t_steps[:-1]).all()
    assert (path.own_time(t_steps) - steps).abs().max() < 1e-14  # 1e-11 of a step: an embedding of 1000 tau sees n
    t = torch.linspace(float(t_steps[0]), float(t_steps[-1]), 5001)
    tau = path.own_time(t)
    assert (tau[1:] >= tau[:-1]).all()
    assert torch.allclose(path.canonical_time(tau), t, atol=1e-13, rtol=0)
    # outside the steps' range, canonical time clamps to the end steps
    assert torch.equal(path.own_time(torch.tensor([0.0, 0.5 * float(t_steps[0])])), torch.zeros(2))
    assert torch.equal(path.own_time(torch.tensor([0.5 * (1 + float(t_steps[-1])), 1.0])),
                       torch.full((2,), (N - 1) / N))
    # between steps, the derivatives are those of the interpolation
    mid, h = (torch.arange(N - 1) + 0.5) / N, 1e-7
    for value, slope in ((path.alpha, path.d_alpha), (path.sigma, path.d_sigma)):
        assert torch.allclose(slope(mid), (value(mid + h) - value(mid - h)) / (2 * h), rtol=1e-6, atol=1e-8)


class IntegerSteps(torch.nn.Module):
    """A DDPM/diffusers network that takes its step n as the timestep: fed n = tau * N."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, x, tau, cond=None):
        return self.unet(x, tau * N).sample


def tiny_unet(seed: int):
    torch.manual_seed(seed)
    return diffusers.UNet2DModel(sample_size=8, in_channels=1, out_channels=1, block_out_channels=(8, 16),
                                 layers_per_block=1, down_block_types=("DownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4).double().eval()


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
@torch.no_grad()
def test_a_diffusers_epsilon_network_joins_in_the_canonical_frame(schedule):
    unet = tiny_unet(0)
    alphas_cumprod = diffusers_alphas_cumprod(schedule)
    gen = torch.Generator().manual_seed(1)
    x0, eps = torch.randn(6, 1, 8, 8, generator=gen), torch.randn(6, 1, 8, 8, generator=gen)
    steps = torch.tensor([0, 1, 250, 500, 900, 929])  # 929: linear's last step short of sigma / alpha = 80
    # By hand, in DDPM's frame at integer steps: x_n = sqrt(ab) x0 + sqrt(1 - ab) eps, then back to canonical.
    a, s = alphas_cumprod[steps].sqrt().view(-1, 1, 1, 1), (1 - alphas_cumprod[steps]).sqrt().view(-1, 1, 1, 1)
    x_vp = a * x0 + s * eps
    eps_hat = unet(x_vp, steps).sample
    x0_hat = (x_vp - s * eps_hat) / a
    expected = eps_hat - x0_hat
    t, x_rf = (s / (a + s)).flatten(), x_vp / (a + s)
    denoiser = NetworkDenoiser(IntegerSteps(unet), VPDiscrete(schedule), "epsilon")
    got = denoiser(x_rf, t)
    gap = ((got - expected).flatten(1).abs().max(1).values / expected.flatten(1).abs().max(1).values).max()
    assert gap < 2e-5, gap  # 7e-6 measured: diffusers' alpha_bar are float32, DDPM's (and ours) float64
    # nearer pure noise an epsilon network is evaluated at sigma / alpha = 80 (EPSILON_T_MAX), wherever x is
    last = torch.tensor([998, 999])
    a_n, s_n = alphas_cumprod[last].sqrt().view(-1, 1, 1, 1), (1 - alphas_cumprod[last]).sqrt().view(-1, 1, 1, 1)
    x_end = (a_n * x0[:2] + s_n * eps[:2]) / (a_n + s_n)
    assert torch.equal(denoiser(x_end, (s_n / (a_n + s_n)).flatten()), denoiser(x_end, torch.full((2,), EPSILON_T_MAX)))
    # the continuous cosine path queries the network one step early (tau = n / N where alpha_bar is step n - 1's)
    if schedule == "cosine":
        shifted = NetworkDenoiser(IntegerSteps(unet), "cosine", "epsilon")(x_rf[1:5], t[1:5])
        assert ((shifted - expected[1:5]).abs().max() / expected[1:5].abs().max()) > 1e-3

    # and it sits in a Mixture beside a rectified-flow expert: the full mixture is the prior-weighted sum
    flow_expert = NetworkDenoiser(IntegerSteps(tiny_unet(2)))  # any velocity network in the canonical frame
    mixture = Mixture([ExpertSlot("ddpm", lambda: denoiser), ExpertSlot("flow", lambda: flow_expert)],
                      PriorRouter([0.25, 0.75]), routing="full")
    assert torch.allclose(mixture(x_rf, t), 0.25 * denoiser(x_rf, t) + 0.75 * flow_expert(x_rf, t), atol=1e-12)
    assert torch.isfinite(sample(mixture, torch.randn(2, 1, 8, 8, generator=gen), steps=4, solver="euler")).all()


@pytest.mark.parametrize("kind", ["uniform", "logit_normal"])
def test_training_on_the_discrete_schedule_draws_integer_steps(kind):
    cfg = validate({"run_dir": ".", "seed": 5, "flow": {"path": "vp_discrete", "prediction": "epsilon",
                                                          "time_sampler": kind, "train_steps": 10}})
    seen = []

    def net(x, tau, cond=None):
        seen.append(tau.clone())
        return torch.zeros_like(x)

    objective = build_objective(cfg)
    count = 4000
    objective(net, Batch(torch.zeros(count, 2), torch.zeros(count, dtype=torch.long), torch.arange(count)))
    steps = seen[0].double() * 10
    assert torch.equal(steps, steps.round()) and steps.min() >= 0 and steps.max() <= 9
    share = torch.bincount(steps.round().long(), minlength=10).double() / count
    if kind == "uniform":  # Ho et al. 2020, Algorithm 1: every step equally likely
        expected = torch.full((10,), 0.1)
    else:  # step n carries the logit-normal mass of [n / 10, (n + 1) / 10)
        cdf = 0.5 * torch.erfc(-torch.logit(torch.arange(1, 10) / 10) / math.sqrt(2))
        expected = torch.diff(torch.cat([torch.zeros(1), cdf, torch.ones(1)]))
    assert (share - expected).abs().max() < 4 * math.sqrt(0.25 / count)
    # the validation probe sits on steps too
    assert [round(v * 10, 9) for v in objective.times.strata(4)] == [1, 3, 6, 8]


def test_a_timestep_range_expert_draws_the_steps_of_its_range():
    sampler = TimeSampler("uniform", 0.3, 0.6, steps=N)
    steps = sampler(torch.rand(20_000, generator=torch.Generator().manual_seed(6))) * N
    assert torch.equal(steps.round().unique(), torch.arange(300, 600, dtype=steps.dtype))
    with pytest.raises(ValueError, match="holds none"):
        TimeSampler("uniform", 0.9995, 1.0, steps=N)


@pytest.mark.parametrize("flow,message", [
    ({"path": "cosine", "beta_schedule": "cosine"}, "flow.beta_schedule: not used when path is 'cosine'"),
    ({"train_steps": 500}, "flow.train_steps: not used when path is 'rectified_flow'"),
    ({"path": "vp_discrete"}, "flow.prediction: 'velocity' is not defined"),
    ({"path": "vp_discrete", "prediction": "epsilon", "t_range": [0.9995, 1.0]}, "flow.t_range: .* holds none"),
])
def test_discrete_keys_are_refused_where_they_mean_nothing(flow, message):
    with pytest.raises(ConfigError, match=message):
        validate({"run_dir": ".", "flow": flow})


def test_a_discrete_cosine_run_is_loaded_with_its_schedule(tmp_path, float32):
    """Training, load_denoiser and the ensemble manifest all carry the schedule; an old entry gets the defaults."""
    cfg = validate({
        "run_dir": str(tmp_path / "run"), "seed": 1,
        "data": {"source": "gmm", "means": [[1.0, 0.0], [-1.0, 0.0]], "std": 0.3, "size": 64},
        "model": {"arch": "mlp", "hidden": 16, "depth": 2},
        "flow": {"path": "vp_discrete", "prediction": "epsilon", "beta_schedule": "cosine", "train_steps": 500},
        "train": {"images": 64, "batch_size": 32, "checkpoint_every": 64, "log_every": 64},
        "sample": {"num": 4, "steps": 2, "solver": "euler"}})
    run = train(cfg, progress=False)
    cosine = VPDiscrete("cosine", 500).alphas_cumprod
    denoiser, _, _ = load_denoiser(run)
    assert isinstance(denoiser.path, VPDiscrete) and torch.equal(denoiser.path.alphas_cumprod, cosine)
    entry = _entry(tmp_path, run, "expert0")
    assert (entry["path"], entry["beta_schedule"], entry["train_steps"]) == ("vp_discrete", "cosine", 500)
    entry = json.loads(json.dumps(entry))  # as read back from ensemble.json
    expert = _expert(tmp_path, entry, "cpu")
    assert torch.equal(expert.path.alphas_cumprod, cosine)
    x, t = torch.randn(8, 2), torch.rand(8) * 0.9 + 0.05
    assert torch.allclose(expert(x, t), denoiser(x, t))
    # a manifest written before paths took options: no schedule fields, the defaults apply
    old = {key: value for key, value in entry.items() if key not in ("beta_schedule", "train_steps")}
    assert torch.equal(_expert(tmp_path, old, "cpu").path.alphas_cumprod, VPDiscrete().alphas_cumprod)
    old["path"] = "cosine"
    assert isinstance(_expert(tmp_path, old, "cpu").path, Cosine)


def test_options_of_the_discrete_schedule_are_refused_by_other_paths():
    with pytest.raises(ValueError, match="beta_schedule: not used by path 'cosine'"):
        build_path("cosine", beta_schedule="cosine")
    with pytest.raises(ValueError, match="unknown beta_schedule"):
        VPDiscrete("scaled_linear")
