"""Every tensor that meets the model sits on the model's device: the library's code run on `fakegpu`
(tests/fake_gpu.py), a device that refuses, as CUDA does, an operation that mixes its tensors with CPU tensors.

Run by tests/test_devices.py in a process of its own (`pytest tests/fake_gpu_checks.py`), since the device's
registration lasts for the whole process.
"""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from conftest import random_images, tiny_unet_config
from fake_gpu import DEVICE, FakeGpuMode

from islands.conditions import network_spec
from islands.config import SampleConfig, validate
from islands.data.batch import Batch
from islands.data.posterior import ExactPosterior
from islands.ddm.ensemble import LearnedRouter, ancestral_assignment
from islands.ddm.expert_parallel import ExpertParallelMixture
from islands.ddm.mixture import ExpertSlot, Mixture
from islands.ddm.time_gate import TimeGate
from islands.flow.denoiser import NetworkDenoiser
from islands.flow.paths import build_path
from islands.flow.samplers import sample
from islands.flow.timesteps import TimeSampler
from islands.generate import generate
from islands.nets import build_network
from islands.parallel.expert_parallel import exchange
from islands.parallel.launch import World
from islands.parallel.local_updates import DiLoCoStrategy
from islands.parallel.strategies import DDPStrategy
from islands.rundir import latest_checkpoint, read_trainer
from islands.train.ema import EMA
from islands.train.logbook import read_metrics
from islands.train.objectives import DistillObjective, RouterObjective, build_objective
from islands.trainer import loop


@pytest.fixture(autouse=True)
def on_fake_gpu():
    with FakeGpuMode():
        yield


@pytest.fixture
def collectives(monkeypatch):
    """The devices of the tensors each collective is handed, with the collective itself a no-op on one rank."""
    seen = []

    def recorded(name, copy=None):
        def collective(*tensors, **kwargs):
            seen.append((name, *(t.device.type for t in tensors if isinstance(t, torch.Tensor))))
            if copy is not None:
                copy(*tensors)
        return collective

    monkeypatch.setattr(dist, "all_reduce", recorded("all_reduce"))
    monkeypatch.setattr(dist, "all_to_all_single", recorded("all_to_all_single", lambda out, inp: out.copy_(inp)))
    return seen


def test_the_worlds_collectives_run_on_its_device(collectives):
    world = World(rank=0, size=2, device=DEVICE)
    assert world.all_finite(True) and world.mean([1.0, 3.0]) == [0.5, 1.5]  # the no-op all-reduce: one rank's own
    assert collectives == [("all_reduce", "fakegpu")] * 2


def test_ddp_consistency_check_on_the_device(collectives):
    net = torch.nn.Linear(3, 2).to(DEVICE)
    DDPStrategy(World(rank=0, size=2, device=DEVICE)).layout.check_consistency(net)
    assert collectives == [("all_reduce", "fakegpu")] * 2


def test_diloco_streams_its_fragments_on_the_device(collectives):
    strategy = DiLoCoStrategy(World(rank=0, size=2, device=DEVICE), compression="bf16", sync_every=2, fragments=2,
                              batch_size=8)
    net = mlp()
    strategy.parallelize(net)
    replicas = strategy.replicas
    assert replicas.after_step(8) == 8 and replicas.after_step(16, last=True) == 8  # a fragment, then both
    assert collectives == [("all_reduce", "fakegpu")] * 3
    assert all(a.device == DEVICE for a in strategy.replicas.anchor.values())


def test_expert_parallel_exchange_sends_its_counts_where_its_rows_are(collectives):
    rows = torch.arange(6.0, device=DEVICE).reshape(3, 2)
    (received,) = exchange([[rows]], World(device=DEVICE))
    assert torch.equal(received[0].cpu(), rows.cpu())
    assert collectives == [("all_to_all_single", "fakegpu", "fakegpu")] * 2


def test_an_expert_parallel_mixture_on_the_device(collectives):
    parallel = ExpertParallelMixture(Mixture(experts(), LearnedRouter(router_net()), routing="full"),
                                     World(device=DEVICE))
    x = torch.randn(4, 2, device=DEVICE)
    v = parallel.guided(2.0)(x, torch.full((4,), 0.5, device=DEVICE), torch.arange(4, device=DEVICE) % 2)
    assert v.device == DEVICE and parallel.evaluations == 16  # 4 samples x 2 experts x 2 halves


# --- whole runs: loader, steps, loss scaler, EMA, checkpoints, sample grid, evaluation --------------------------

def train_on_fake_gpu(monkeypatch, cfg: dict):
    """The run `cfg` describes, trained by the real loop on `fakegpu` (one process). -> its directory."""
    monkeypatch.setattr(loop, "init_world", lambda timeout_s=600.0: World(device=DEVICE))
    run_dir = loop.train(validate(cfg), progress=False)
    assert latest_checkpoint(run_dir) is not None and list((run_dir / "samples").glob("*.png"))
    return run_dir


def test_a_unet_run_in_fp16_from_loader_workers(monkeypatch, tmp_path):
    cfg = tiny_unet_config(tmp_path / "run", random_images(tmp_path), data={"workers": 1},
                           train={"images": 8, "precision": "fp16", "checkpoint_every": 8, "sample_every": 8},
                           sample={"num": 4, "steps": 2},
                           eval={"every": 8, "num": 8, "val_size": 8, "val_times": 2, "features": "pixels"})
    run_dir = train_on_fake_gpu(monkeypatch, cfg)
    assert read_trainer(latest_checkpoint(run_dir))["scaler"]["scale"] > 0  # the loss scaler took part
    assert {"val_loss", "fd"} <= set(read_metrics(run_dir, "eval")[-1])


def test_a_dit_run(monkeypatch, tmp_path):
    cfg = tiny_unet_config(tmp_path / "run", random_images(tmp_path), sample={"num": 4, "steps": 2},
                           train={"images": 8, "checkpoint_every": 8, "sample_every": 8})
    cfg["model"] = {"arch": "dit", "num_classes": 4, "patch_size": 2, "hidden_size": 16, "depth": 2, "num_heads": 2}
    train_on_fake_gpu(monkeypatch, cfg)


def test_an_mlp_run_with_the_exact_metrics(monkeypatch, tmp_path):
    cfg = {"run_dir": str(tmp_path / "run"), "seed": 5,
           "data": {"source": "gmm", "means": [[1.0, 0.0], [-1.0, 1.0]], "std": 0.2, "size": 256},
           "model": {"arch": "mlp", "hidden": 16, "depth": 2, "num_classes": 2},
           "train": {"images": 32, "batch_size": 16, "checkpoint_every": 32, "sample_every": 32, "log_every": 16},
           "sample": {"num": 8, "steps": 2},
           "eval": {"every": 32, "num": 64, "val_size": 16, "val_times": 2}}
    run_dir = train_on_fake_gpu(monkeypatch, cfg)
    assert {"velocity_mse", "nll", "mode_mass_error"} <= set(read_metrics(run_dir, "eval")[-1])


def test_an_autoencoder_run_and_a_diffusion_run_on_its_latents(monkeypatch, tmp_path):
    """The autoencoder objective, its export, then the latent stage: encoding in the loop, decoding for the grid and
    the evaluation."""
    data = random_images(tmp_path)
    ae = {"run_dir": str(tmp_path / "ae"), "data": {"source": "npz", "path": str(data)},
          "model": {"arch": "autoencoder_kl", "block_out_channels": [8, 16], "latent_channels": 2,
                    "norm_num_groups": 8},
          "train": {"objective": "autoencoder", "images": 8, "batch_size": 8, "checkpoint_every": 8}}
    vae = train_on_fake_gpu(monkeypatch, ae) / "autoencoder"
    cfg = tiny_unet_config(tmp_path / "run", data, data={"autoencoder": str(vae)}, sample={"num": 4, "steps": 2},
                           model={"attention_resolutions": [2]},
                           train={"images": 8, "checkpoint_every": 8, "sample_every": 8},
                           eval={"every": 8, "num": 8, "val_size": 8, "val_times": 2, "features": "pixels"})
    run_dir = train_on_fake_gpu(monkeypatch, cfg)
    assert {"val_loss", "fd"} <= set(read_metrics(run_dir, "eval")[-1])


# --- the parts one by one: objectives, samplers, mixtures, range experts, the EMA ---------------------------------

def mlp(classes: int = 2, **model) -> torch.nn.Module:
    """A small MLP on 2-D vectors, initialised on the CPU (random initialisation is the CPU's) and moved."""
    cfg = validate({"run_dir": ".", "model": {"arch": "mlp", "hidden": 16, "depth": 2, "num_classes": classes,
                                              **model}})
    return build_network(network_spec(cfg.model, (2,), classes)).to(DEVICE)


def vectors(n: int = 8, classes: int = 2, seed: int = 3):
    """A loader's batch of 2-D vectors (their draws made as the loader makes them), on the device."""
    x = torch.randn(n, 2, generator=torch.Generator().manual_seed(seed))
    return Batch(x, torch.arange(n) % classes, torch.arange(100, 100 + n)).drawn(seed).to(DEVICE, non_blocking=True)


def step(net: torch.nn.Module, loss: torch.Tensor) -> None:
    """Backward and one AdamW step."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    loss.mean().backward()
    torch.nn.utils.clip_grad_norm_(list(net.parameters()), 1.0)
    opt.step()


@pytest.mark.parametrize("path, prediction, sampler", [("rectified_flow", "velocity", "logit_normal"),
                                                       ("vp_linear", "epsilon", "uniform"),
                                                       ("cosine", "x0", "logit_normal"),
                                                       ("vp_discrete", "epsilon", "uniform")])
def test_the_diffusion_objective_on_every_path(path, prediction, sampler):
    flow = {"path": path, "prediction": prediction, "time_sampler": sampler, "t_range": [0.1, 0.9]}
    objective = build_objective(validate({"run_dir": ".", "flow": flow, "train": {"label_dropout": 0.5}}))
    net, batch = mlp(), vectors()
    objective.prepare(net)
    step(net, objective(net, batch))
    step(net, objective(net, replace_draws(batch)))  # drawn by the objective itself, as a probe's batch is
    assert len(objective.validation_loss(net, batch, 2)) == 2
    sample(objective.denoiser(net), torch.randn(4, 2, device=DEVICE), steps=2, solver="heun",
           cond=torch.arange(4, device=DEVICE) % 2, guidance=2.0)


def replace_draws(batch):
    """The batch without the loader's draws."""
    return replace(batch, noise=None, u_time=None, u_drop=None)


def router_net(shape: tuple = (2,), classes: int = 2, k: int = 2) -> torch.nn.Module:
    """A router of 2-D vectors (a residual MLP) or of images (a small DiT encoder), on the device."""
    cfg = validate({"run_dir": ".", "model": {"arch": "router", "hidden": 16, "hidden_size": 16, "num_heads": 2,
                                              "depth": 2, "outputs": k, "num_classes": classes}})
    return build_network(network_spec(cfg.model, shape, classes)).to(DEVICE)


@pytest.mark.parametrize("shape", [(2,), (1, 8, 8)])
def test_the_router_objective_and_its_report(shape):
    k, classes, n = 2, 2, 16
    objective = RouterObjective(seed=3, clusters=k, label_dropout=0.5,
                                prior=torch.tensor([[0.7, 0.3], [0.2, 0.8], [0.5, 0.5]]))
    net = router_net(shape, classes, k)
    objective.prepare(net)
    data, labels = torch.randn(n, *shape, generator=torch.Generator().manual_seed(1)), torch.arange(n) % (classes * k)
    batch = Batch(data, labels // k, torch.arange(n), cluster=labels % k).drawn(seed=3).to(DEVICE)
    step(net, objective(net, batch))
    exact = ExactPosterior(data, labels % k, k, labels // k, classes)
    report = objective.report_by_t(net, batch, exact)
    assert len(report["accuracy"]) == 10 and "tv" in report


def experts(count: int = 2) -> list:
    nets = [NetworkDenoiser(mlp()) for _ in range(count)]
    return [ExpertSlot(f"expert{k}", lambda k=k: nets[k]) for k in range(count)]


@pytest.mark.parametrize("teacher", ["ancestral", "full"])
def test_the_distillation_objective_with_a_mixture_teacher(teacher):
    mixture = Mixture(experts(), LearnedRouter(router_net()), routing=teacher)
    objective = DistillObjective(build_path("rectified_flow"), "velocity", TimeSampler(), seed=3, label_dropout=0.5,
                                 teacher=mixture)
    net = mlp()
    objective.prepare(net)
    batch = vectors()
    step(net, objective(net, replace(batch, cluster=batch.positions % 2)))


@pytest.mark.parametrize("solver", ["euler", "heun", "dpm2m", "unipc"])
def test_every_solver_samples_on_the_device(solver):
    opts = SampleConfig(steps=3, solver=solver, grid="logsnr", guidance=2.0, batch_size=4)
    x = generate(NetworkDenoiser(mlp()), (2,), 6, opts, seed=1, condition=torch.arange(6) % 2, device=DEVICE)
    assert x.device.type == "cpu" and x.shape == (6, 2) and bool(torch.isfinite(x).all())


@pytest.mark.parametrize("routing", ["ancestral", "top1", "topk:2", "full", "nucleus:0.9", "sample",
                                     "ancestral_then:topk:1@0.5"])
def test_a_routed_mixture_samples_on_the_device(routing):
    mixture = Mixture(experts(), LearnedRouter(router_net()), routing=routing, seed=2, call_batch=4)
    manifest = {"prior": [0.5, 0.5], "prior_by_class": [[0.9, 0.1], [0.2, 0.8]]}
    opts = SampleConfig(steps=2, solver="heun", guidance=2.0, batch_size=mixture.samples_at_once(4))
    generate(mixture, (2,), 6, opts, seed=1, condition=torch.arange(6) % 2, device=DEVICE,
             for_batch=ancestral_assignment(mixture, manifest, seed=1))
    assert mixture.evaluations > 0


def test_range_experts_sample_on_the_device():
    gate = TimeGate([NetworkDenoiser(mlp()), NetworkDenoiser(mlp())], [0.0, 0.4, 1.0])
    generate(gate, (2,), 4, SampleConfig(steps=3, solver="heun"), seed=1, device=DEVICE)
    generate(gate, (2,), 4, SampleConfig(steps=3, solver="dpm2m"), seed=1, device=DEVICE)
    gate(torch.randn(4, 2, device=DEVICE), torch.tensor([0.1, 0.3, 0.5, 0.9], device=DEVICE))  # without the grid
    assert gate.evaluations > 0


def test_the_ema_takes_in_the_device_weights():
    net = mlp()
    ema = EMA(net, halflife_images=10)
    step(net, net(torch.randn(4, 2, device=DEVICE), torch.rand(4, device=DEVICE), torch.zeros(4, dtype=torch.long,
                                                                                                  device=DEVICE)))
    ema.update(net, images_seen=8, batch=4)
    ema.load_state_dict({k: v.cpu() for k, v in ema.state_dict().items()})  # a checkpoint's tensors, read on the CPU
    assert all(v.device == DEVICE for v in ema.state_dict().values())


@pytest.mark.parametrize("routing", ["sample", "ancestral_then:topk:1@0.5"])  # the router's draws; both selections
def test_the_exported_ensembles_pipeline_samples_on_the_device(routing):
    """islands/export/diffusers_pipeline.py (shipped as an exported ensemble's pipeline.py): a class-conditional DiT and
    DDPM U-Net and a text-conditioned SD3 expert, the router, on the device; labels, captions, noise given on the CPU,
    as a user hands them over."""
    import diffusers
    from test_diffusers_nets import CONFIGS, TEXT

    from islands.export import diffusers_pipeline as shipped

    def on_device(model):
        return model.eval().to(DEVICE)

    dit = on_device(diffusers.DiTTransformer2DModel(**CONFIGS["DiTTransformer2DModel"], in_channels=1, sample_size=8,
                                                    num_embeds_ada_norm=2))
    unet = on_device(diffusers.UNet2DModel(**CONFIGS["UNet2DModel"], in_channels=1, out_channels=1, sample_size=8,
                                           num_class_embeds=3))
    router = on_device(shipped.DDMRouter(sample_size=8, in_channels=1, num_experts=2, patch_size=2, hidden_size=16,
                                         depth=1, num_heads=2, num_classes=2))
    index = {"prior": [0.5, 0.5], "prior_by_class": [[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]], "shape": [1, 8, 8],
             "sample": {"routing": "ancestral", "steps": 2, "guidance": 2.0}}
    pipe = shipped.DDMPipeline([shipped.Expert(dit, 2, None), shipped.Expert(unet, 2, None)], router,
                               diffusers.FlowMatchEulerDiscreteScheduler(), index)
    x = pipe(4, class_labels=torch.tensor([0, 1, 0, 1]), routing=routing, latents=torch.randn(4, 1, 8, 8),
             generator=torch.Generator().manual_seed(0))
    assert x.device.type == DEVICE.type and bool(torch.isfinite(x).all())

    sd3 = on_device(diffusers.SD3Transformer2DModel(**CONFIGS["SD3Transformer2DModel"], in_channels=1, out_channels=1,
                                                    sample_size=8, joint_attention_dim=TEXT["text_width"],
                                                    pooled_projection_dim=TEXT["text_pooled_width"]))
    null = {"encoder_hidden_states": torch.zeros(1, 5, 12, device=DEVICE),
            "pooled_projections": torch.zeros(1, 10, device=DEVICE)}
    text_router = on_device(shipped.DDMRouter(sample_size=8, in_channels=1, num_experts=2, patch_size=2,
                                              hidden_size=16, depth=1, num_heads=2, pooled_width=10))
    pipe = shipped.DDMPipeline([shipped.Expert(sd3, 0, null), shipped.Expert(sd3, 0, null)], text_router,
                               diffusers.FlowMatchEulerDiscreteScheduler(), {**index, "prior_by_class": None})
    caption = shipped.Caption(torch.randn(4, 5, 12), torch.ones(4, 5, dtype=torch.bool), torch.randn(4, 10))
    x = pipe(4, caption=caption, routing=routing, latents=torch.randn(4, 1, 8, 8),
             generator=torch.Generator().manual_seed(0))
    assert x.device.type == DEVICE.type and bool(torch.isfinite(x).all())
