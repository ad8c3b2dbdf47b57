"""The command line: config errors, bad data, nothing overwritten, sampling output, help."""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import poisoned_npz, tiny_unet_config, write_config

from islands.cli import build_parser, main
from islands.rundir import latest_checkpoint


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("override,key", [
    ("train.foo=1", "train.foo: unknown key"),
    ("nosuchsection.x=1", "nosuchsection: unknown key"),
    ("train.batch_size=many", "train.batch_size: Input should be a valid integer"),
    ("train.batch_size=0", "train.batch_size: Input should be greater than 0"),
    ("train.precision=fp8", "train.precision"),
    ("flow.t_range=[0.8,0.2]", "flow.t_range: must satisfy"),
    ("model.hidden=3", "model.hidden: not used when arch is 'unet'"),
    ("train.batch_size=7", "train.batch_size: 7 is not divisible by accumulate=2"),
])
def test_config_errors_exit_2_with_one_line_naming_the_key(tmp_path, capsys, image_npz, override, key):
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(tmp_path / "run", image_npz))
    code, out, err = run_cli(capsys, "train", config, override, "--quiet")
    assert code == 2
    assert err.count("\n") == 1 and key in err, err
    assert not (tmp_path / "run").exists()  # nothing was started


def test_unreadable_config_files(tmp_path, capsys):
    code, _, err = run_cli(capsys, "train", str(tmp_path / "missing.yaml"))
    assert code == 2 and "missing.yaml" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  images: [1,\n")
    code, _, err = run_cli(capsys, "train", str(bad))
    assert code == 2 and "bad.yaml" in err and "not valid YAML" in err


def test_corrupt_data_files_are_named(tmp_path, capsys, image_npz):
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(b"PK\x03\x04 this is not a zip archive")
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(tmp_path / "run", corrupt))
    code, _, err = run_cli(capsys, "train", config, "--quiet")
    assert code == 2 and str(corrupt) in err and err.count("\n") == 1

    folder = tmp_path / "images"
    folder.mkdir()
    from PIL import Image

    Image.new("L", (8, 8), 128).save(folder / "good.png")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    cfg = tiny_unet_config(tmp_path / "run2", "unused", data={"source": "folder", "path": str(folder),
                                                              "resolution": 8, "channels": 1})
    del cfg["data"]["flip"]
    cfg["model"]["num_classes"] = 0
    code, _, err = run_cli(capsys, "train", write_config(tmp_path / "c2.yaml", cfg), "--quiet")
    assert code == 2 and "broken.png" in err


def test_a_changed_config_does_not_touch_an_existing_run(tmp_path, capsys, image_npz):
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(tmp_path / "run", image_npz, train={"images": 16}))
    assert run_cli(capsys, "train", config, "--quiet")[0] == 0
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    code, _, err = run_cli(capsys, "train", config, "model.channels=16", "--quiet")
    assert code == 2 and "model.channels: 8 -> 16" in err
    code, _, err = run_cli(capsys, "train", config, "train.lr=oops", "--quiet")
    assert code == 2
    after = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert before == after


def test_a_run_whose_loss_stays_non_finite_exits_1_with_one_line_naming_the_last_good_checkpoint(tmp_path):
    """Steps 4-6 each hold an example whose squared error overflows float32 (the file itself is finite:
    a NaN would be refused when read); with max_nonfinite=3 the run stops after step 6, and the last
    checkpoint is the one after step 3."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((256, 2)).astype(np.float32), np.arange(256) % 2
    data = poisoned_npz(tmp_path / "vectors.npz", x, y, steps={4, 5, 6}, batch=32, seed=0)
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "c.yaml", {
        "run_dir": str(run_dir), "seed": 0, "data": {"source": "npz", "path": str(data)},
        "model": {"arch": "mlp", "hidden": 32, "depth": 2, "num_classes": 2},
        "train": {"images": 640, "batch_size": 32, "checkpoint_every": 96, "max_nonfinite": 3}})
    result = subprocess.run([sys.executable, "-m", "islands", "train", config, "--quiet"], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    last_good = run_dir / "checkpoints" / "000000000096"
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("islands: stopped after 3 steps in a row")
    assert result.stderr.rstrip().endswith(f"(image 192); last good checkpoint: {last_good}")
    assert latest_checkpoint(run_dir) == last_good


def test_sample_writes_npz_and_grid(tmp_path, capsys, image_npz):
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(tmp_path / "run", image_npz, train={"images": 16}))
    assert run_cli(capsys, "train", config, "--quiet")[0] == 0
    out = tmp_path / "out"
    code, stdout, _ = run_cli(capsys, "sample", str(tmp_path / "run"), "--num", "6", "--steps", "3", "--solver",
                              "dpm2m", "--seed", "5", "--guidance", "2", "--out", str(out), "--quiet")
    assert code == 0 and "samples.npz" in stdout
    with np.load(out / "samples.npz", allow_pickle=False) as f:
        x, y = f["x"], f["y"]
    assert x.dtype == np.float32 and x.shape == (6, 1, 8, 8) and x.min() >= -1 and x.max() <= 1
    assert y.tolist() == [0, 1, 2, 3, 0, 1]
    assert (out / "grid.png").stat().st_size > 0
    # one class only, and a class that does not exist
    code, _, _ = run_cli(capsys, "sample", str(tmp_path / "run"), "--num", "2", "--class", "3", "--out", str(out),
                         "--steps", "2", "--quiet")
    with np.load(out / "samples.npz", allow_pickle=False) as f:
        assert code == 0 and f["y"].tolist() == [3, 3]
    code, _, err = run_cli(capsys, "sample", str(tmp_path / "run"), "--num", "2", "--class", "9", "--out", str(out))
    assert code == 2 and "--class" in err
    code, _, err = run_cli(capsys, "sample", str(tmp_path / "nothing"), "--num", "2", "--out", str(out))
    assert code == 2 and "not a run directory" in err


def test_sample_precision_follows_a_bf16_run_where_bf16_is_native(tmp_path, capsys, image_npz, monkeypatch):
    monkeypatch.setattr("islands.parallel.launch.bf16_is_native", lambda device: True)
    config = write_config(tmp_path / "c.yaml", tiny_unet_config(tmp_path / "run", image_npz,
                                                               train={"images": 16, "precision": "bf16"}))
    assert run_cli(capsys, "train", config, "--quiet")[0] == 0
    samples = {}
    for precision in (None, "bf16", "fp32"):
        option = ["--precision", precision] if precision else []
        out = tmp_path / f"out_{precision}"
        assert run_cli(capsys, "sample", str(tmp_path / "run"), "--num", "4", "--steps", "2", "--out", str(out),
                       "--quiet", *option)[0] == 0
        with np.load(out / "samples.npz", allow_pickle=False) as f:
            samples[precision] = f["x"]
    assert np.array_equal(samples[None], samples["bf16"]) and not np.array_equal(samples[None], samples["fp32"])


def test_every_subcommand_explains_every_option():
    parser = build_parser()
    subparsers = parser._subparsers._group_actions[0].choices
    assert set(subparsers) == {"train", "sample", "eval", "partition", "shard", "encode", "ddm", "distill", "plan",
                               "report", "export", "import", "index", "verify"}
    for name, sub in subparsers.items():
        text = sub.format_help()
        for action in sub._actions:
            assert action.help, f"{name}: {action.dest} has no help"
            for opt in action.option_strings:
                assert opt in text
