"""The training loop: learning a known distribution, exact resume, accumulation, guards, EMA."""

import dataclasses
import warnings

import pytest
import torch
from conftest import random_images, tiny_unet

from islands.conditions import network_spec
from islands.config import load_config, validate
from islands.data import streams
from islands.data.batch import Batch
from islands.data.gmm import GaussianMixture
from islands.data.loader import stream_loader
from islands.data.registry import build_source
from islands.errors import CheckpointError, IslandsWarning, TrainingStopped
from islands.generate import generate, load_denoiser
from islands.nets import build_network
from islands.rundir import latest_checkpoint, list_checkpoints, load_weights, read_state, read_trainer
from islands.train import objectives
from islands.train.ema import EMA
from islands.train.logbook import read_metrics
from islands.trainer import train


def test_the_defaults_learn_the_weights_of_16_narrow_unequal_modes(tmp_path):
    """Vector data with its source, network and learning rate named (configs/gmm2d.yaml's 2e-3): the defaults for
    the rest (uniform t for an MLP, EDM's EMA) put every mode near its weight (total variation 0.038, the smallest
    mode at 0.87 of its weight). The previous defaults (logit-normal t, no EMA) left 0.060 and the smallest modes at
    half their weight; 8000 samples alone leave about 0.017 (docs/BENCHMARKS.md, mode_weights)."""
    means = [[-3.0 + 2 * (i % 4), -3.0 + 2 * (i // 4)] for i in range(16)]
    weights = [0.85**k for k in range(16)]  # the largest mode 13x the smallest
    cfg = validate({"run_dir": str(tmp_path / "gmm"), "seed": 0,
                    "data": {"source": "gmm", "means": means, "std": 0.1, "weights": weights, "size": 20000},
                    "model": {"arch": "mlp", "hidden": 128, "depth": 3},
                    "train": {"images": 200_000, "batch_size": 256, "lr": 2e-3, "checkpoint_every": 200_000,
                              "log_every": 50_000},
                    "sample": {"num": 16}})
    assert (cfg.flow.time_sampler, cfg.train.ema_halflife_images) == ("uniform", 500_000)
    run_dir = train(cfg, progress=False)
    denoiser, cfg, _info = load_denoiser(run_dir)
    x = generate(denoiser, (2,), 8000, cfg.sample.model_copy(update={"batch_size": 8000}), seed=1).double()
    truth = GaussianMixture(means, 0.1, weights)
    nearest = torch.cdist(x, truth.means).min(1)
    # on the modes, if wider than they are (3x at this budget): points spread evenly would put 44% this near
    assert (nearest.values < 0.75).double().mean() > 0.7
    mass = torch.bincount(nearest.indices, minlength=16).double() / len(x)
    error = (mass - truth.weights).abs()
    assert 0.5 * error.sum() < 0.05, (mass, truth.weights)
    assert (error < 0.02).all() and (mass > 0.6 * truth.weights).all(), (mass, truth.weights)
    losses = [r["loss"] for r in read_metrics(run_dir)]
    assert losses[-1] < losses[0]


def _weights(run_dir):
    ckpt = latest_checkpoint(run_dir)
    return (load_weights(ckpt / "model.safetensors"), load_weights(ckpt / "ema.safetensors"),
            read_state(ckpt).progress)  # not its files: DCP writes a fresh id into each


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_interrupted_and_resumed_run_is_bit_identical(tmp_path, image_npz, precision):
    straight = train(tiny_unet(tmp_path / "straight", image_npz, train={"precision": precision}), progress=False)
    # The interrupted run stops after its first checkpoint, leaves a half-written checkpoint behind,
    # and is then rerun with the full length.
    first = tiny_unet(tmp_path / "resumed", image_npz, train={"precision": precision, "images": 48})
    train(first, progress=False)
    broken = tmp_path / "resumed" / "checkpoints" / "000000000080"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"half written")
    resumed = train(tiny_unet(tmp_path / "resumed", image_npz, train={"precision": precision}), progress=False)
    (m1, e1, s1), (m2, e2, s2) = _weights(straight), _weights(resumed)
    assert s1 == s2 and s1["images"] == 96
    for name in m1:
        assert torch.equal(m1[name], m2[name]), name
        assert torch.equal(e1[name], e2[name]), name
    assert [p.name for p in list_checkpoints(resumed)] == ["000000000048", "000000000096"]
    # fp16 alone carries extra state, the loss scaler: its scale and its count of steps since the last
    # overflow (which a fresh scaler would restart at the interruption) must resume too.
    scalers = [read_trainer(latest_checkpoint(run))["scaler"] for run in (straight, resumed)]
    assert scalers[0] == scalers[1]
    if precision == "fp16":
        assert scalers[0]["scale"] > 0 and scalers[0]["_growth_tracker"] > 3  # more steps than after the resume


def test_rerunning_a_finished_run_changes_nothing(tmp_path, image_npz, capsys):
    cfg = tiny_unet(tmp_path / "run", image_npz, train={"images": 16})
    run_dir = train(cfg, progress=False)
    before = (latest_checkpoint(run_dir) / "model.safetensors").read_bytes()

    def stamps() -> dict:
        """Every file's and folder's identity and modification time: a deterministic retraining would
        rewrite the same bytes, but into new files. config.yaml and model.json are written by every start."""
        return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in run_dir.rglob("*")
                if p.name not in ("config.yaml", "model.json")}

    files, log = stamps(), (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    train(cfg, progress=True)
    assert (latest_checkpoint(run_dir) / "model.safetensors").read_bytes() == before
    assert capsys.readouterr().out == f"{run_dir}: already trained on 16 images; nothing to do\n"
    assert stamps() == files and (run_dir / "metrics.jsonl").read_text() == log


def _relative_distance(a: dict, b: dict, origin: dict) -> float:
    """||a - b|| / ||a - origin|| over all weights: how far apart two runs ended, per unit of travel."""
    diff = sum(((a[k] - b[k]) ** 2).sum() for k in a).sqrt()
    travel = sum(((a[k] - origin[k]) ** 2).sum() for k in a).sqrt()
    return (diff / travel).item()


def test_gradient_accumulation_matches_one_big_batch(tmp_path, image_npz):
    def run(name, **train_keys):
        cfg = tiny_unet(tmp_path / name, image_npz, train={"images": 32, **train_keys}, model={"dropout": 0.0})
        return cfg, _weights(train(cfg, progress=False))[0]

    cfg, one = run("a1", accumulate=1)
    _, four = run("a4", accumulate=4)
    _, other_lr = run("lr", accumulate=1, lr=1e-3 * 1.01)
    torch.manual_seed(cfg.seed)
    init = build_network(network_spec(cfg.model, (1, 8, 8), 4)).state_dict()
    # Adam normalises each gradient, so float summation order shows up at ~1e-3 of the distance travelled;
    # a 1% change of learning rate, for comparison, moves it by far more.
    assert _relative_distance(one, four, init) < 2e-3
    assert _relative_distance(one, other_lr, init) > 5 * _relative_distance(one, four, init)


def test_non_finite_steps_are_skipped_then_the_run_stops_keeping_the_last_good_checkpoint(
        tmp_path, image_npz, monkeypatch):
    real_loss = objectives.regression_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        loss = real_loss(*args, **kwargs)
        if loss.device.type == "meta":  # the FLOP count's shape-only replay, not a step
            return loss
        calls["n"] += 1  # 2 micro-batches per step: steps 7+ are poisoned, after the checkpoint at image 48
        return loss * float("nan") if calls["n"] > 12 else loss

    monkeypatch.setattr(objectives.DiffusionObjective, "loss_of", staticmethod(poisoned))
    cfg = tiny_unet(tmp_path / "nan", image_npz, train={"max_nonfinite": 3})
    with pytest.raises(TrainingStopped, match="3 steps in a row with non-finite.*000000000048"):
        train(cfg, progress=False)
    model, ema, state = _weights(tmp_path / "nan")
    assert state["images"] == 48 and state["skipped"] == 0
    assert all(torch.isfinite(t).all() for t in [*model.values(), *ema.values()])


def test_one_skipped_step_is_counted_and_training_goes_on(tmp_path, image_npz, monkeypatch):
    real_loss = objectives.regression_loss
    calls = {"n": 0}

    def one_bad_step(*args, **kwargs):
        loss = real_loss(*args, **kwargs)
        if loss.device.type == "meta":  # the FLOP count's shape-only replay, not a step
            return loss
        calls["n"] += 1
        return loss * float("inf") if calls["n"] in (3, 4) else loss

    monkeypatch.setattr(objectives.DiffusionObjective, "loss_of", staticmethod(one_bad_step))
    run_dir = train(tiny_unet(tmp_path / "skip", image_npz), progress=False)
    state = read_state(latest_checkpoint(run_dir)).progress
    assert state["skipped"] == 1 and state["images"] == 96
    assert read_metrics(run_dir)[-1]["skipped"] == 1


def test_ema_follows_the_half_life_formula():
    net = torch.nn.Linear(3, 1)
    with torch.no_grad():
        net.weight.zero_()
        net.bias.zero_()
    ema = EMA(net, halflife_images=100, rampup=None)
    with torch.no_grad():
        net.weight.fill_(1.0)
    for _ in range(10):
        ema.update(net, images_seen=10_000, batch=10)
    # after 100 images with half-life 100, the average has moved half way to the constant weights
    assert torch.allclose(ema.params["weight"], torch.full((1, 3), 0.5), atol=1e-6)
    ramped = EMA(net, halflife_images=100, rampup=0.05)
    assert ramped.beta(images_seen=200, batch=10) == pytest.approx(0.5 ** (10 / 10))


def test_activation_checkpointing_gives_the_same_gradients_and_keys(tmp_path, image_npz):
    from islands.nets.unet import UNet
    from islands.parallel.activation_checkpointing import checkpoint_blocks

    torch.manual_seed(0)
    plain = UNet(1, 8, channels=8, channel_mult=(1, 2), num_res_blocks=1, attention_resolutions=(4,))
    wrapped = UNet(1, 8, channels=8, channel_mult=(1, 2), num_res_blocks=1, attention_resolutions=(4,))
    wrapped.load_state_dict(plain.state_dict())
    assert checkpoint_blocks(wrapped) == len(wrapped.blocks)
    assert list(plain.state_dict()) == list(wrapped.state_dict())
    x, t = torch.randn(4, 1, 8, 8), torch.rand(4)
    for net in (plain, wrapped):
        net(x, t).square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name
    # the wrapper really recomputes: a layer inside a block runs twice per step, once more in backward
    calls = []
    conv = next(m for m in wrapped.blocks[0].modules() if isinstance(m, torch.nn.Conv2d))
    conv.register_forward_hook(lambda *a: calls.append(1))
    wrapped(x, t).square().mean().backward()
    assert len(calls) == 2


def test_compiled_blocks_train_the_same_run_and_keep_the_keys(tmp_path):
    """train.compile=true: torch.compile of each block, after activation checkpointing. Inductor fuses and reorders
    float arithmetic, so the run ends near the eager one, not on it; the weights file is the same format."""
    import torch._dynamo

    def run(name, **train_keys):
        cfg = load_config("configs/gmm2d.yaml", [f"run_dir={tmp_path / name}", "model.hidden=32", "model.depth=2",
                                                 "train.images=2048", "train.batch_size=256", "train.warmup_images=0",
                                                 "train.checkpoint_every=2048", "train.log_every=2048",
                                                 "sample.num=16", "sample.steps=2",
                                                 "train.activation_checkpointing=true",
                                                 *[f"train.{k}={v}" for k, v in train_keys.items()]])
        return _weights(train(cfg, progress=False))[0]

    eager = run("eager")
    torch._dynamo.reset()
    counts = torch._dynamo.utils.counters
    counts.clear()
    compiled = run("compiled", compile="true")
    assert counts["stats"]["unique_graphs"] >= 1  # the blocks really ran compiled
    assert list(eager) == list(compiled)
    distance = max(((eager[k] - compiled[k]).norm() / eager[k].norm().clamp_min(1e-12)).item() for k in eager)
    assert distance < 1e-3, distance


def test_run_directory_holds_config_metrics_tensorboard_and_sample_grids(tmp_path, image_npz):
    run_dir = train(tiny_unet(tmp_path / "files", image_npz), progress=False)
    assert (run_dir / "config.yaml").is_file() and (run_dir / "model.json").is_file()
    assert [r["images"] for r in read_metrics(run_dir)] == [16, 32, 48, 64, 80, 96]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (run_dir / "samples").glob("*.png")) == ["000000000048.png", "000000000096.png"]


def test_loader_workers_and_fp16_loss_scaling(tmp_path, image_npz):
    """Worker processes feed the same examples in the same order; fp16 trains with a saved loss scale."""
    base = {"model": {"dropout": 0.0}, "train": {"images": 32, "accumulate": 1}}
    in_process = _weights(train(tiny_unet(tmp_path / "w0", image_npz, **base), progress=False))[0]
    workers = _weights(train(tiny_unet(tmp_path / "w2", image_npz, data={"workers": 2}, **base), progress=False))[0]
    assert all(torch.equal(in_process[k], workers[k]) for k in in_process)

    run_dir = train(tiny_unet(tmp_path / "fp16", image_npz, train={"precision": "fp16"}), progress=False)
    model, _, state = _weights(run_dir)
    assert all(torch.isfinite(t).all() for t in model.values())
    scaler = read_trainer(latest_checkpoint(run_dir))["scaler"]
    assert scaler["scale"] > 0 and state["images"] == 96
    assert read_metrics(run_dir)[-1]["loss"] < 10


def test_the_loader_draws_each_examples_noise_time_and_label_dropout_from_its_position(tmp_path, image_npz):
    """What the loader's workers draw is the stream of each example's position (DESIGN.md section 3), and the
    objective turns it into the same inputs, bit for bit, as when it draws them itself for a batch that comes
    without them; micro-batches keep each example's draws."""
    cfg = tiny_unet(tmp_path, image_npz, train={"label_dropout": 0.5})
    batch = next(iter(stream_loader(build_source("npz", path=image_npz), 8, cfg.seed, start=16, workers=2)))
    positions = list(range(16, 24))
    assert batch.positions.tolist() == positions
    assert torch.equal(batch.noise, streams.normal(cfg.seed, positions, (1, 8, 8)))
    assert torch.equal(batch.u_time, streams.uniform(cfg.seed, positions, "time"))
    assert torch.equal(batch.u_drop, streams.uniform(cfg.seed, positions, "label_drop"))
    objective = objectives.build_objective(cfg)
    objective.prepare(build_network(network_spec(cfg.model, (1, 8, 8), 4)))
    bare = dataclasses.replace(batch, noise=None, u_time=None, u_drop=None)
    drawn, bare = objective.regression(batch), objective.regression(bare)
    inputs = drawn.inputs
    assert all(torch.equal(a, b) for a, b in zip([*inputs, drawn.target], [*bare.inputs, bare.target], strict=True))
    dropped = inputs[2] == 4  # the "no label" token
    assert torch.equal(dropped, batch.u_drop < 0.5) and 0 < int(dropped.sum()) < 8
    halves = batch.chunk(2)
    assert [h.positions.tolist() for h in halves] == [positions[:4], positions[4:]]
    joined = Batch.cat(halves)
    assert all(torch.equal(a, b) for a, b in zip(joined.tensors().values(), batch.tensors().values(), strict=True))


def test_flop_count_equals_the_matmul_count_of_a_known_network():
    """Each Linear costs 2 in*out per image forward and twice that backward (gradients of weights and of
    inputs), except that no input gradient is computed for layers fed by data or fixed time features."""
    from islands.train.flops import flops_per_image

    cfg = validate({"run_dir": "unused", "data": {"source": "gmm", "means": [[0.0, 0.0], [1.0, 1.0]]},
                    "model": {"arch": "mlp", "hidden": 32, "depth": 2}})
    net = build_network(network_spec(cfg.model, (2,), 0))
    linear = {n: m.in_features * m.out_features for n, m in net.named_modules() if isinstance(m, torch.nn.Linear)}
    expected = 6 * sum(linear.values()) - 2 * (linear["proj_in"] + linear["embed.time.mlp.0"])
    assert flops_per_image(cfg.model, (2,), 0, objectives.build_objective(cfg), micro_batch=8) == expected


SHORT = {"images": 32, "checkpoint_every": 16, "sample_every": 0}


@pytest.fixture(scope="module")
def never_interrupted(tmp_path_factory):
    """A tiny run of 48 images, checkpointed every 16, and its data."""
    root = tmp_path_factory.mktemp("straight")
    data = random_images(root)
    return train(tiny_unet(root / "run", data, train={**SHORT, "images": 48}), progress=False), data


@pytest.mark.parametrize("damaged", ["trainer.pt", "sharded/__0_0.distcp", "state.json"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before_it_bit_identically(tmp_path, never_interrupted,
                                                                                     damaged):
    """A file truncated under its checkpoint's marker (a disk that filled, a copy cut short): the resume warns once,
    takes the checkpoint before it, and the run ends where a run never interrupted ends."""
    straight, image_npz = never_interrupted
    short = SHORT
    run = train(tiny_unet(tmp_path / "resumed", image_npz, train=short), progress=False)
    earlier, latest = list_checkpoints(run)
    assert (earlier.name, latest.name) == ("000000000016", "000000000032")
    whole = (latest / damaged).read_bytes()
    (latest / damaged).write_bytes(whole[:len(whole) // 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(tiny_unet(run, image_npz, train={**short, "images": 48}), progress=False)
    said = [str(w.message) for w in caught if issubclass(w.category, IslandsWarning)]
    assert len(said) == 1 and said[0].startswith(f"checkpoint {latest} cannot be read ("), said
    assert said[0].endswith(f"); resumed from {earlier}, the latest that can be")
    (m1, e1, s1), (m2, e2, s2) = _weights(straight), _weights(run)
    assert s1 == s2 and s1["images"] == 48
    for name in m1:
        assert torch.equal(m1[name], m2[name]), name
        assert torch.equal(e1[name], e2[name]), name
    if damaged == "trainer.pt":  # none readable: refused, not begun again
        for ckpt in list_checkpoints(run):
            (ckpt / damaged).write_bytes(b"")
        with pytest.raises(CheckpointError, match=f"no checkpoint of {run} can be read"):
            train(tiny_unet(run, image_npz, train={**short, "images": 64}), progress=False)
