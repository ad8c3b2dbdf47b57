"""`islands export RUN OUT/` (islands/export/run.py): the folder loads with plain diffusers in a process where Islands
cannot be imported, and its network and scheduler, stepped from the noise `islands sample` draws, give the samples
`islands sample` gives; a text-conditioned run's, with its prompts encoded by plain transformers as the folder's
record says and its null caption from the folder, the samples `islands sample --prompt` gives under guidance."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import emoji_or_skip, rerecorded, tiny_unet_config, write_config
from test_checkpoint import a_run_with_one_checkpoint
from test_diffusers_nets import TEXT_CLASSES, emoji_diffusers_run, model_config

from islands.cli import main
from islands.conditions import network_spec
from islands.config import validate
from islands.data import streams
from islands.data.shards import file_sha256
from islands.errors import CheckpointError, ConfigError
from islands.export.records import ExportRecord
from islands.export.run import scheduler_for, shipped_source
from islands.flow.paths import build_path
from islands.generate import load_denoiser
from islands.nets.text_folder import minilm_folder
from islands.rundir import describe_run, latest_checkpoint, load_weights, save_weights
from islands.trainer import train

# No Islands in the process that reads the folder: every import of it fails.
WITHOUT_ISLANDS = textwrap.dedent("""
    import sys

    class NoIslands:
        def find_spec(self, name, path=None, target=None):
            if name == "islands" or name.startswith("islands."):
                raise ImportError("Islands is not installed here")

    sys.meta_path.insert(0, NoIslands())
    for name in [m for m in sys.modules if m == "islands" or m.startswith("islands.")]:
        del sys.modules[name]
    try:  # installed in this environment, and yet out of reach
        import islands
        raise SystemExit("islands was imported")
    except ImportError:
        pass
    import diffusers, numpy as np, torch
    torch.set_num_threads(1)
    out, work = sys.argv[1], sys.argv[2]
""")

# Islands' Euler sampler (sample.solver euler, guidance 1) as a diffusers loop: the scheduler's sigmas set to Islands'
# grid, linspace(1, 0, steps + 1) without its final 0, which the scheduler appends (it shifts them itself).
FLOW_MATCH_LOOP = WITHOUT_ISLANDS + textwrap.dedent("""
    model = diffusers.DiTTransformer2DModel.from_pretrained(out, subfolder="transformer").eval()
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(out, subfolder="scheduler")
    x, labels = torch.from_numpy(np.load(f"{work}/noise.npy")), torch.from_numpy(np.load(f"{work}/labels.npy"))
    scheduler.set_timesteps(sigmas=np.linspace(1, 0, int(sys.argv[3]) + 1)[:-1])
    with torch.no_grad():
        for t in scheduler.timesteps:
            velocity = model(x, t.expand(len(x)), class_labels=labels).sample[:, :x.shape[1]]
            x = scheduler.step(velocity, t, x).prev_sample
    assert not any(m == "islands" or m.startswith("islands.") for m in sys.modules)
    np.save(f"{work}/diffusers.npy", x.numpy())
""")

# A DDPM network's epsilon at the scheduler's own steps, and the scheduler's alphas_cumprod.
EPSILON_AT_STEPS = WITHOUT_ISLANDS + textwrap.dedent("""
    model = diffusers.UNet2DModel.from_pretrained(out, subfolder="unet").eval()
    scheduler = diffusers.DDPMScheduler.from_pretrained(out, subfolder="scheduler")
    x, labels = torch.from_numpy(np.load(f"{work}/x.npy")), torch.from_numpy(np.load(f"{work}/labels.npy"))
    steps = torch.from_numpy(np.load(f"{work}/steps.npy"))
    with torch.no_grad():
        eps = model(x, steps, class_labels=labels).sample
    np.save(f"{work}/diffusers.npy", eps.numpy())
    np.save(f"{work}/alphas_cumprod.npy", scheduler.alphas_cumprod.numpy())
    pipeline = diffusers.DiffusionPipeline.from_pretrained(out)  # the folder whole, as diffusers' DDPM folders load
    loaded = [type(m).__name__ for m in (pipeline, pipeline.unet, pipeline.scheduler)]
    assert loaded == ["DDPMPipeline", "UNet2DModel", "DDPMScheduler"], loaded
    ddim = diffusers.DDIMScheduler.from_config(scheduler.config)  # its deterministic sampler, on the same betas
    ddim.set_timesteps(2)  # steps of 1000 // 2: from 800 to 300
    with torch.no_grad():
        step = ddim.step(model(x, 800, class_labels=labels).sample, 800, x).prev_sample
    np.save(f"{work}/ddim.npy", step.numpy())
""")


# Prompts encoded by plain transformers from the encoder's folder as the record's `text` says.
ENCODE_PROMPTS = textwrap.dedent("""
    def encode_prompts(text, prompts, encoder_folder):
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(encoder_folder)
        encoder = transformers.AutoModel.from_pretrained(encoder_folder).eval()
        tokens = tokenizer([p.lower() for p in prompts] if text["lowercase"] else prompts, return_tensors="pt",
                           **text["tokenizer"])
        with torch.no_grad():
            states = encoder(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).last_hidden_state
        mask = tokens["attention_mask"]
        assert text["pooling"] == "mean" and text["normalize"]  # the encoder's: sentence-transformers' mean, L2
        pooled = torch.nn.functional.normalize((states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True), dim=1)
        return {"encoder_hidden_states": states, "encoder_attention_mask": mask, "pooled_projections": pooled}
""")

# A text-conditioned network sampled as Islands samples it for prompts (sample i for prompt i mod P, Euler, guidance
# g: v = v_null + g (v_caption - v_null)): each prompt encoded by plain transformers from the encoder's folder as the
# record says, the null caption read from the folder and stacked with the captions into one batch, as diffusers'
# pipelines guide, and each class called as its diffusers pipeline calls it.
TEXT_LOOP = WITHOUT_ISLANDS + ENCODE_PROMPTS + textwrap.dedent("""
    import json
    from safetensors.torch import load_file

    steps, guidance, encoder_folder = int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    record = json.load(open(f"{out}/islands_export.json"))
    name, text = record["config"]["model"]["class_name"], record["text"]
    prompts = json.load(open(f"{work}/prompts.json"))
    encoded = encode_prompts(text, prompts, encoder_folder)
    null = load_file(f"{out}/{text['null_caption']}")
    assert sorted(null) == sorted(text["arguments"]), null.keys()

    x = torch.from_numpy(np.load(f"{work}/noise.npy"))
    which = torch.arange(len(x)) % len(prompts)
    both = {key: torch.cat([null[key].expand(len(x), *null[key].shape[1:]), encoded[key][which]]) for key in null}
    model = getattr(diffusers, name).from_pretrained(out, subfolder="unet" if "UNet" in name else "transformer").eval()
    h, w = x.shape[2:]
    img_ids = torch.zeros(h // 2, w // 2, 3)  # Flux: FluxPipeline's _prepare_latent_image_ids
    img_ids[..., 1] += torch.arange(h // 2)[:, None]
    img_ids[..., 2] += torch.arange(w // 2)[None, :]

    def velocity(x, t, caption):
        (b, c, h, w), t = x.shape, t.expand(len(x))
        if name == "UNet2DConditionModel":
            return model(x, t, **caption).sample
        if name == "SD3Transformer2DModel":
            return model(x, timestep=t, **caption).sample
        # FluxPipeline's _pack_latents, its timestep / 1000, its ids, and _unpack_latents
        packed = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 4 * c)
        out = model(packed, timestep=t / 1000, img_ids=img_ids.reshape(-1, 3),
                    txt_ids=torch.zeros(caption["encoder_hidden_states"].shape[1], 3), **caption).sample
        return out.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)

    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(out, subfolder="scheduler")
    scheduler.set_timesteps(sigmas=np.linspace(1, 0, steps + 1)[:-1])
    with torch.no_grad():
        for t in scheduler.timesteps:
            v_null, v_caption = velocity(torch.cat([x, x]), t, both).chunk(2)
            x = scheduler.step(v_null + guidance * (v_caption - v_null), t, x).prev_sample
    assert not any(m == "islands" or m.startswith("islands.") for m in sys.modules)
    np.save(f"{work}/diffusers.npy", x.numpy())
""")


# Islands' own network from the folder's islands_networks package (OUT on sys.path, as model_index.json names it),
# sampled as Islands samples it: Euler on Islands' grid, guided by the network's own null (no class, or its learned
# null caption: the forward given no condition) against each sample's class, or its prompt encoded as the record says.
OWN_LOOP = WITHOUT_ISLANDS + ENCODE_PROMPTS + textwrap.dedent("""
    import importlib
    import json
    from safetensors.torch import load_file

    steps, guidance = int(sys.argv[3]), float(sys.argv[4])
    sys.path.insert(0, out)
    index, record = (json.load(open(f"{out}/{name}")) for name in ("model_index.json", "islands_export.json"))
    folder = "unet" if "unet" in index else "transformer"
    library, name = index[folder]
    model = getattr(importlib.import_module(library), name).from_pretrained(out, subfolder=folder).eval()
    # every tensor the network holds is among the saved weights, so that diffusers' loading onto the meta device
    # (low_cpu_mem_usage, where accelerate is installed; not here) leaves none of them behind: built there whole,
    # buffers too, and given the saved weights, it is the model loaded
    saved = load_file(f"{out}/{folder}/diffusion_pytorch_model.safetensors")
    held = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    assert sorted(saved) == sorted(model.state_dict()) == sorted(held), (sorted(saved), sorted(held))
    with torch.device("meta"):
        empty = type(model).from_config(model.config)
    empty.load_state_dict(saved, assign=True)
    assert all(torch.equal(a, b) for a, b in zip(empty.state_dict().values(), model.state_dict().values()))

    x = torch.from_numpy(np.load(f"{work}/noise.npy"))
    if "text" in record:
        prompts = json.load(open(f"{work}/prompts.json"))
        encoded = encode_prompts(record["text"], prompts, sys.argv[5])
        condition = {key: value[torch.arange(len(x)) % len(prompts)] for key, value in encoded.items()}
    else:
        labels = torch.from_numpy(np.load(f"{work}/labels.npy"))
        condition = {"class_labels": labels}
        with torch.no_grad():  # the class `num_classes` is none, as no class given is
            none = torch.full_like(labels, model.config.num_classes)
            assert torch.equal(model(x, 500.0, class_labels=none).sample, model(x, 500.0).sample)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(out, subfolder="scheduler")
    scheduler.set_timesteps(sigmas=np.linspace(1, 0, steps + 1)[:-1])
    with torch.no_grad():
        for t in scheduler.timesteps:
            v_given, v_null = model(x, t, **condition).sample, model(x, t).sample
            x = scheduler.step(v_null + guidance * (v_given - v_null), t, x).prev_sample
    assert not any(m == "islands" or m.startswith("islands.") for m in sys.modules)
    np.save(f"{work}/diffusers.npy", x.numpy())
""")


def run_without_islands(script: str, *argv) -> None:
    done = subprocess.run([sys.executable, "-c", script, *map(str, argv)], capture_output=True, text=True,
                          timeout=240, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture
def trained(tmp_path, image_npz):
    """A tiny class-conditional run of a diffusers class (or of the model config given), trained for a few steps."""
    def run(class_name: str | dict, flow: dict | None = None) -> Path:
        cfg = tiny_unet_config(tmp_path / "run", image_npz, train={"images": 32, "checkpoint_every": 32,
                                                                  "sample_every": 0, "warmup_images": 16})
        cfg["model"] = model_config(class_name, 4) if isinstance(class_name, str) else class_name
        if flow:
            cfg["flow"] = flow
        assert main(["train", write_config(tmp_path / "run.yaml", cfg), "--quiet"]) == 0
        return tmp_path / "run"
    return run


def test_a_rectified_flow_dit_samples_in_plain_diffusers_as_islands_samples_it(trained, tmp_path, capsys):
    torch.set_num_threads(1)
    run = trained("DiTTransformer2DModel", {"time_shift": 2.0})  # sampled on the grid shifted alike
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    num, steps = 4, 6
    assert main(["sample", str(run), "--num", str(num), "--steps", str(steps), "--solver", "euler",
                 "--guidance", "1", "--out", str(tmp_path / "drawn"), "--quiet"]) == 0
    islands = np.load(tmp_path / "drawn" / "samples.npz")
    cfg, info = describe_run(run)
    noise = streams.normal(cfg.seed, list(range(num)), info.shape, "sample")  # as islands/generate.py
    np.save(tmp_path / "noise.npy", noise.numpy())
    np.save(tmp_path / "labels.npy", islands["y"])
    run_without_islands(FLOW_MATCH_LOOP, tmp_path / "out", tmp_path, steps)
    drawn = np.load(tmp_path / "diffusers.npy")
    assert (np.abs(drawn) < 1).mean() > 0.5  # most values are not clamped: the comparison sees them
    np.testing.assert_allclose(drawn.clip(-1, 1), islands["x"], atol=1e-4)

    raw = (tmp_path / "out" / "islands_export.json").read_text()
    # the file as it was written before it had a model: plain JSON indented by 2, in this order, no version (1)
    assert list(json.loads(raw)) == ["islands_version", "run_dir", "checkpoint", "weights", "config_sha256", "config",
                                     "files"] and raw == json.dumps(json.loads(raw), indent=2)
    record = ExportRecord.load(tmp_path / "out" / "islands_export.json")
    weights = tmp_path / "out" / "transformer" / "diffusion_pytorch_model.safetensors"
    assert record.version == 1 and record.text is None and record.checkpoint == latest_checkpoint(run).name
    assert record.files == {"transformer/diffusion_pytorch_model.safetensors": file_sha256(weights)}
    assert record.weights == "ema.safetensors" and record.config["model"]["class_name"] == "DiTTransformer2DModel"
    index = json.loads((tmp_path / "out" / "model_index.json").read_text())
    assert index["transformer"] == ["diffusers", "DiTTransformer2DModel"]
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert json.loads((tmp_path / "out" / "scheduler" / "scheduler_config.json").read_text())["shift"] == 2.0


def test_a_ddpm_unet_predicts_and_steps_in_plain_diffusers_as_in_islands(trained, tmp_path, capsys):
    """Islands samples a vp_discrete network by an ODE on its canonical frame through fractional steps (its uniform
    grid in canonical time), which no diffusers scheduler walks: compared are the network's epsilon at the
    scheduler's own steps, the scheduler's betas, and one DDIM step from step 800 to 300, which is Islands' Euler
    step between the canonical times of those steps (both move x0 and eps, predicted once, to the later time)."""
    torch.set_num_threads(1)
    run = trained("UNet2DModel", {"path": "vp_discrete", "prediction": "epsilon", "beta_schedule": "cosine"})
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    x, labels, steps = torch.randn(3, 1, 8, 8), np.array([0, 2, 3]), np.array([0, 500, 999])
    for name, value in (("x", x.numpy()), ("labels", labels), ("steps", steps)):
        np.save(tmp_path / f"{name}.npy", value)
    run_without_islands(EPSILON_AT_STEPS, tmp_path / "out", tmp_path)
    denoiser, _, _ = load_denoiser(run)
    with torch.no_grad():
        eps = denoiser.net(x, torch.from_numpy(steps) / 1000, torch.from_numpy(labels))
    np.testing.assert_allclose(np.load(tmp_path / "diffusers.npy"), eps.numpy(), atol=1e-5)
    path = build_path("vp_discrete", beta_schedule="cosine")
    np.testing.assert_allclose(np.load(tmp_path / "alphas_cumprod.npy"), path.alphas_cumprod.numpy(), rtol=1e-4)
    tau = torch.tensor([0.8, 0.3], dtype=torch.float64)
    (t, t_next), (scale, scale_next) = path.canonical_time(tau).tolist(), path.scale(tau).tolist()
    x_rf = x / scale  # x at step 800 in the canonical frame
    with torch.no_grad():
        stepped = (x_rf + (t_next - t) * denoiser(x_rf, torch.tensor(t), torch.from_numpy(labels))) * scale_next
    np.testing.assert_allclose(np.load(tmp_path / "ddim.npy"), stepped.numpy(), atol=1e-4)


def test_export_refuses_in_one_line_and_overwrites_nothing(trained, tmp_path, image_npz, capsys):
    _, checkpoint = a_run_with_one_checkpoint(tmp_path)  # an MLP on vectors: nothing in diffusers takes it
    capsys.readouterr()
    assert main(["export", str(checkpoint.parents[1]), str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.arch: 'mlp' has no diffusers counterpart" in err
    assert not (tmp_path / "a").exists()

    own = tmp_path / "own"
    cfg = tiny_unet_config(own, image_npz, train={"images": 16, "checkpoint_every": 16, "sample_every": 0})
    assert main(["train", write_config(tmp_path / "own.yaml", cfg), "--quiet"]) == 0
    capsys.readouterr()

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["export", str(own), str(tmp_path / "full")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not an empty folder" in err
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "b")]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_the_scheduler_has_the_runs_betas_and_a_path_no_scheduler_steps_is_refused_by_name():
    def scheduler(**flow):
        return scheduler_for(validate({"run_dir": ".", "model": model_config("UNet2DModel"), "flow": flow}))

    linear = scheduler(path="vp_discrete", prediction="x0")
    assert linear.config.prediction_type == "sample" and not linear.config.clip_sample
    np.testing.assert_allclose(linear.alphas_cumprod.numpy(), build_path("vp_discrete").alphas_cumprod.numpy(),
                               rtol=1e-4)
    with pytest.raises(ConfigError, match="flow.path: 'cosine'"):
        scheduler(path="cosine", prediction="epsilon")
    with pytest.raises(ConfigError, match="flow.prediction: 'epsilon'"):
        scheduler(path="rectified_flow", prediction="epsilon")


def prompts_sample_alike(run: Path, work: Path, loop: str) -> None:
    """`islands sample --prompt` of `run`, guided, and `loop` on its export work/out, from the same noise, draw the
    same samples."""
    prompts, num, steps, guidance = ["red apple", "grinning face"], 4, 3, 3.0
    assert main(["sample", str(run), "--num", str(num), "--steps", str(steps), "--solver", "euler", "--guidance",
                 str(guidance), "--prompt", prompts[0], "--prompt", prompts[1], "--out", str(work / "drawn"),
                 "--quiet"]) == 0
    islands = np.load(work / "drawn" / "samples.npz")["x"]
    cfg, info = describe_run(run)
    noise = streams.normal(cfg.seed, list(range(num)), info.shape, "sample")  # as islands/generate.py
    np.save(work / "noise.npy", noise.numpy())
    (work / "prompts.json").write_text(json.dumps(prompts))
    run_without_islands(loop, work / "out", work, steps, guidance, minilm_folder())
    drawn = np.load(work / "diffusers.npy")
    assert (np.abs(drawn) < 1).mean() > 0.5  # most values are not clamped: the comparison sees them
    np.testing.assert_allclose(drawn.clip(-1, 1), islands, atol=1e-4)


@pytest.mark.parametrize("class_name", TEXT_CLASSES)
def test_a_text_conditioned_export_samples_prompts_under_guidance_in_plain_diffusers_as_islands_does(
        tmp_path, class_name, capsys):
    """On the emoji's captions: the exported network, its null caption and its scheduler, with prompts encoded by
    plain transformers as the record says, sample what `islands sample --prompt` samples from the same noise, guided
    (the caption's and the null's velocities both)."""
    emoji_or_skip()
    torch.set_num_threads(1)
    run = train(validate(emoji_diffusers_run(tmp_path / "run", class_name)), progress=False)
    # the null made far from its zero start, as a longer run learns it, so that a null shipped wrong shows
    ema = latest_checkpoint(run) / "ema.safetensors"
    weights = load_weights(ema)
    gen = torch.Generator().manual_seed(0)
    for key in [k for k in weights if k.startswith("text.null_")]:
        weights[key] = torch.randn(weights[key].shape, generator=gen)
    save_weights(weights, ema)
    rerecorded(ema.parent)
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    prompts_sample_alike(run, tmp_path, TEXT_LOOP)

    text = ExportRecord.load(tmp_path / "out" / "islands_export.json").text
    assert text.sha256 == json.loads((run / "text_encoder.json").read_text())["sha256"]
    assert text.text_encoder == "minilm" and text.tokenizer["max_length"] == 16


OWN_NETWORKS = {"unet": tiny_unet_config(".", ".")["model"],
                "dit": {"arch": "dit", "num_classes": 4, "patch_size": 2, "hidden_size": 32, "depth": 2,
                        "num_heads": 2}}


def made_far_from_its_start(run: Path) -> None:
    """The run's EMA weights moved far from where a few steps leave them (the zero-started gates, the null's
    embedding), as a longer run moves them, so that a condition or a time read wrong shows in the samples."""
    ema = latest_checkpoint(run) / "ema.safetensors"
    weights = load_weights(ema)
    gen = torch.Generator().manual_seed(0)
    for key in [k for k in weights if weights[k].is_floating_point()]:
        weights[key] = weights[key] + 0.1 * torch.randn(weights[key].shape, generator=gen)
    save_weights(weights, ema)
    rerecorded(ema.parent)


@pytest.mark.parametrize("arch", OWN_NETWORKS)
def test_islands_own_network_samples_in_plain_diffusers_under_guidance_as_islands_samples_it(
        trained, tmp_path, arch, capsys):
    """Its IslandsUNet or IslandsDiT, imported from the folder's islands_networks package and stepped by
    FlowMatchEulerDiscreteScheduler from Islands' noise, guided by the null class against each sample's class."""
    torch.set_num_threads(1)
    run = trained(OWN_NETWORKS[arch], {"time_shift": 2.0})
    made_far_from_its_start(run)
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    num, steps, guidance = 4, 4, 2.5
    assert main(["sample", str(run), "--num", str(num), "--steps", str(steps), "--solver", "euler",
                 "--guidance", str(guidance), "--out", str(tmp_path / "drawn"), "--quiet"]) == 0
    islands = np.load(tmp_path / "drawn" / "samples.npz")
    cfg, info = describe_run(run)
    noise = streams.normal(cfg.seed, list(range(num)), info.shape, "sample")  # as islands/generate.py
    np.save(tmp_path / "noise.npy", noise.numpy())
    np.save(tmp_path / "labels.npy", islands["y"])
    run_without_islands(OWN_LOOP, tmp_path / "out", tmp_path, steps, guidance)
    drawn = np.load(tmp_path / "diffusers.npy")
    assert (np.abs(drawn) < 1).mean() > 0.5  # most values are not clamped: the comparison sees them
    np.testing.assert_allclose(drawn.clip(-1, 1), islands["x"], atol=1e-4)

    out = tmp_path / "out"
    component, class_name = {"unet": ("unet", "IslandsUNet"), "dit": ("transformer", "IslandsDiT")}[arch]
    assert json.loads((out / "model_index.json").read_text())[component] == ["islands_networks", class_name]
    assert json.loads((out / component / "config.json").read_text())["_class_name"] == class_name
    record = ExportRecord.load(out / "islands_export.json")
    shipped = sorted(out.rglob("*.py"))
    assert [p.name for p in shipped] == ["__init__.py", "condition.py", "diffusers_wrapper.py", "dit.py", "layers.py",
                                         "unet.py"]
    assert record.files == {str(p.relative_to(out)): file_sha256(p)
                            for p in [*shipped, out / component / "diffusion_pytorch_model.safetensors"]}
    repo = Path(__file__).parents[1] / "islands" / "nets"
    for path in shipped[1:]:  # the repo's files but for their imports of each other (none of Islands is left: the
        # process that sampled them could import no part of it)
        ours, theirs = (repo / path.name).read_text().splitlines(), path.read_text().splitlines()
        assert len(ours) == len(theirs)
        changed = [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b]
        assert all(a.replace("from islands.nets.", "from .") == b for a, b in changed)


def test_an_export_record_is_read_as_its_model_and_a_wrong_key_is_refused_in_one_line(tmp_path):
    record = {"islands_version": "0.1", "run_dir": "runs/a", "checkpoint": "000000000032", "weights": "ema.safetensors",
              "config_sha256": "0" * 64, "config": {"model": {"arch": "dit"}},
              "text": {"text_encoder": "minilm", "sha256": None, "tokenizer": {"max_length": 16}, "pooling": "mean",
                       "normalize": True, "lowercase": False, "arguments": ["encoder_hidden_states"],
                       "null_caption": None},
              "files": {"transformer/diffusion_pytorch_model.safetensors": "1" * 64}}
    path = tmp_path / "islands_export.json"
    path.write_text(json.dumps(record, indent=2))
    read = ExportRecord.load(path)
    assert (read.version, read.checkpoint, read.text.pooling, read.text.arguments) == (
        1, "000000000032", "mean", ["encoder_hidden_states"])
    read.write(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == path.read_text()  # written back byte for byte, no version added
    for change, message in [(lambda r: r.pop("checkpoint"), "islands_export.json: checkpoint: Field required"),
                            (lambda r: r["files"].update(x=3), "islands_export.json: files.x: Input should be a valid"),
                            (lambda r: r["text"].pop("pooling"), "islands_export.json: text.pooling: Field required")]:
        changed = json.loads(json.dumps(record))
        change(changed)
        path.write_text(json.dumps(changed))
        with pytest.raises(CheckpointError) as err:
            ExportRecord.load(path)
        assert str(err.value).count("\n") == 0 and str(err.value).startswith(str(path)) and message in str(err.value)
    path.write_text("{")
    with pytest.raises(CheckpointError, match="islands_export.json: not an exported folder's record"):
        ExportRecord.load(path)


def test_a_folder_is_built_beside_its_place_and_renamed_into_it_whole_or_not_at_all(tmp_path):
    """rundir.built_beside, the one way exports, imports and the autoencoder's folder are written."""
    from islands.rundir import BUILDING_MARKER, built_beside

    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk full"), built_beside(out) as building:
        (building / "half.safetensors").write_text("half")
        raise OSError("disk full")
    assert sorted(tmp_path.iterdir()) == []  # neither the folder nor its partial sibling
    with built_beside(out) as building:
        assert building == tmp_path / ".out.partial" and (building / BUILDING_MARKER).is_file()
        (building / "a").write_text("first")
        assert not out.exists()  # nothing at its place until it is whole
    assert sorted(p.name for p in out.iterdir()) == ["a"] and sorted(tmp_path.iterdir()) == [out]
    with pytest.raises(OSError), built_beside(out) as building:  # a full folder is replaced only when asked
        (building / "a").write_text("second")
    assert (out / "a").read_text() == "first" and sorted(tmp_path.iterdir()) == [out]
    with built_beside(out, replace=True) as building:
        (building / "b").write_text("second")
    assert sorted(p.name for p in out.iterdir()) == ["b"] and sorted(tmp_path.iterdir()) == [out]
    (tmp_path / ".mine.partial").mkdir()
    with pytest.raises(ConfigError, match="is not a folder Islands was building"), built_beside(tmp_path / "mine"):
        pass
    assert (tmp_path / ".mine.partial").is_dir() and not (tmp_path / "mine").exists()


def test_the_shipped_networks_import_each_other_relatively_and_nothing_else_of_islands():
    assert shipped_source("dit", "from islands.nets.layers import modulate\nx = 'islands.nets.layers'\n") == (
        "from .layers import modulate\nx = 'islands.nets.layers'\n")
    for source in ("from islands.flow.paths import Path\n", "    from islands.nets.mlp import MLP\n",
                   "import islands.nets.layers\n"):
        with pytest.raises(RuntimeError, match="islands/nets/dit.py: .* does not ship"):
            shipped_source("dit", source)


def test_a_text_conditioned_islands_network_samples_prompts_in_plain_diffusers_as_islands_does(tmp_path, capsys):
    """Islands' own DiT on the emoji's captions: no null caption shipped (the network holds its own, read where it
    is given no caption), the prompts encoded by plain transformers as the record says."""
    from test_text_conditioning import emoji_run

    emoji_or_skip()
    torch.set_num_threads(1)
    run = train(validate(emoji_run(tmp_path / "run", images=32, checkpoint_every=32, sample_every=0)),
                progress=False)
    made_far_from_its_start(run)
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    prompts_sample_alike(run, tmp_path, OWN_LOOP)
    text = ExportRecord.load(tmp_path / "out" / "islands_export.json").text
    assert text.null_caption is None and not (tmp_path / "out" / "islands_null_caption.safetensors").exists()
    assert text.sha256 == json.loads((run / "text_encoder.json").read_text())["sha256"]


def test_an_islands_network_of_a_ddpm_run_reads_the_schedulers_steps():
    """A `vp_discrete` run of N steps: the exported network at the scheduler's step n is Islands' at time n / N."""
    from islands.export.run import own_model
    from islands.nets import build_network

    cfg = validate({"run_dir": ".", "model": OWN_NETWORKS["dit"],
                    "flow": {"path": "vp_discrete", "prediction": "epsilon", "train_steps": 500}})
    net = build_network(network_spec(cfg.model, (1, 8, 8), 4))
    made = torch.Generator().manual_seed(0)
    with torch.no_grad():  # away from the zero start, so that the time it is given shows
        for p in net.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=made))
    model = own_model(cfg, network_spec(cfg.model, (1, 8, 8), 4), net)
    assert scheduler_for(cfg).config.num_train_timesteps == model.config.num_train_timesteps == 500
    x, steps, labels = torch.randn(3, 1, 8, 8, generator=made), torch.tensor([0, 250, 499]), torch.tensor([0, 1, 4])
    with torch.no_grad():
        np.testing.assert_allclose(model(x, steps, class_labels=labels).sample.numpy(),
                                   net(x, steps / 500, labels).numpy(), atol=1e-6)
