"""Bad input on the command line: one line naming the key, value or file, exit status 2 (1 when the disk fills), and
nothing written; and the cases that used to crash instead (issue 27 item 14). One tiny conditional run of vectors
and one tiny ensemble of 4 experts on 400 vectors serve every case."""

import errno
import json
import shutil

import numpy as np
import pytest
import torch
from conftest import write_config

from islands.cli import main
from islands.config import validate
from islands.ddm.pipeline import sample_and_evaluate
from islands.rundir import latest_checkpoint, load_weights, weights_file


def run_config(root, run_dir) -> dict:
    """A conditional MLP on 256 labelled 2-D vectors, checkpointed every 64 images."""
    rng = np.random.default_rng(0)
    np.savez(root / "vectors.npz", x=rng.standard_normal((256, 2)).astype(np.float32), y=np.arange(256) % 2)
    return {"run_dir": str(run_dir), "seed": 0, "data": {"source": "npz", "path": str(root / "vectors.npz")},
            "model": {"arch": "mlp", "hidden": 16, "depth": 2, "num_classes": 2},
            "train": {"images": 64, "batch_size": 16, "checkpoint_every": 64, "log_every": 64},
            "sample": {"num": 8, "steps": 2, "solver": "euler"}}


def ensemble_config(run_dir) -> dict:
    """4 experts on a mixture of 400 examples: fewer than the 2000 that the ensemble's scatter plot used to draw."""
    return {"run_dir": str(run_dir), "seed": 1,
            "data": {"source": "gmm", "means": [[2, 2], [-2, 2], [-2, -2], [2, -2]], "std": 0.3, "size": 400},
            "model": {"arch": "mlp", "hidden": 16, "depth": 2},
            "train": {"images": 256, "batch_size": 64, "ema_halflife_images": 100, "checkpoint_every": 256,
                      "log_every": 256},
            "sample": {"num": 16, "steps": 4, "solver": "euler"}, "eval": {"num": 32},
            "ddm": {"k": 4, "partition": {"fine": 16, "balanced": False},
                    "router": {"images": 256, "batch_size": 64, "hidden": 16, "depth": 2}}}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The run, a copy of it without checkpoints, the ensemble (its members trained in this process, then
    `islands ddm`, which used to crash after training on fewer than 2000 vectors), and their configs."""
    root = tmp_path_factory.mktemp("made")
    run_yaml = write_config(root / "run.yaml", run_config(root, root / "run"))
    assert main(["train", run_yaml, "--quiet"]) == 0
    shutil.copytree(root / "run", root / "unfinished", ignore=shutil.ignore_patterns("checkpoints"))
    ddm_yaml = write_config(root / "ddm.yaml", ensemble_config(root / "ensemble"))
    assert main(["partition", ddm_yaml, "--quiet"]) == 0
    for member in ("expert=0", "expert=1", "expert=2", "expert=3", "router"):
        assert main(["train", ddm_yaml, member, "--quiet"]) == 0
    ddm_exit = main(["ddm", ddm_yaml, "--quiet"])
    (root / "a_file").write_text("")
    return {"root": root, "run": root / "run", "unfinished": root / "unfinished", "ensemble": root / "ensemble",
            "run_yaml": run_yaml, "ddm_yaml": ddm_yaml, "file": root / "a_file", "ddm_exit": ddm_exit}


def corrupt_partition(made, name: str, damage) -> list[str]:
    """`islands partition` on a copy of the ensemble's partition whose partition.json `damage` rewrote."""
    folder = made["root"] / name
    shutil.copytree(made["ensemble"] / "partition", folder / "partition")
    meta = folder / "partition" / "partition.json"
    meta.write_text(damage(meta.read_text()))
    return ["partition", made["ddm_yaml"], f"run_dir={folder}"]


def without_data_hash(text: str) -> str:
    """A partition.json of an older format, before it recorded the data's hash."""
    meta = json.loads(text)
    del meta["data_sha256"]
    return json.dumps(meta)


def few_samples(made) -> str:
    path = made["root"] / "three" / "samples.npz"
    path.parent.mkdir(exist_ok=True)
    np.savez(path, x=np.zeros((3, 2), np.float32))
    return str(path)


CASES = {  # name: (the command line from the fixture's paths, what its one line must say)
    "corrupt partition": (lambda m: corrupt_partition(m, "corrupt", lambda text: text[: len(text) // 2]),
                          "corrupt/partition/partition.json"),
    "outdated partition": (lambda m: corrupt_partition(m, "outdated", without_data_hash),
                           "outdated/partition/partition.json"),
    "topk above K": (lambda m: ["sample", str(m["ensemble"]), "--routing", "topk:5"],
                     "--routing: 'topk:5' selects more than the 4 experts"),
    "max-loaded 0": (lambda m: ["sample", str(m["ensemble"]), "--max-loaded", "0"], "--max-loaded: 0"),
    "ensemble class": (lambda m: ["sample", str(m["ensemble"]), "--class", "99"], "not conditioned on a class"),
    "sample num 0": (lambda m: ["sample", str(m["run"]), "--num", "0"], "--num: 0"),
    "eval num 0": (lambda m: ["eval", str(m["run"]), "--num", "0"], "--num: 0"),
    "eval steps 0": (lambda m: ["eval", str(m["run"]), "--steps", "0"], "--steps: 0"),
    "eval batch 0": (lambda m: ["eval", str(m["run"]), "--batch-size", "0"], "--batch-size: 0"),
    "eval num below KID": (lambda m: ["eval", str(m["run"]), "--num", "3"], "eval.num: 3 samples are too few for kid"),
    "samples file below KID": (lambda m: ["eval", few_samples(m), "--run", str(m["run"])],
                               "samples.npz: 3 samples are too few for kid"),
    "config eval.num": (lambda m: ["train", m["run_yaml"], f"run_dir={m['root'] / 'new'}", "eval.num=2"],
                        "eval.num: 2 samples are too few for kid, precision_recall (at least 4)"),
    "images below a batch": (lambda m: ["train", m["run_yaml"], f"run_dir={m['root'] / 'new'}", "train.images=8"],
                             "train.images: 8 is fewer than one batch (train.batch_size=16)"),
    "run_dir a file": (lambda m: ["train", m["run_yaml"], f"run_dir={m['file']}"], "run_dir: names a file"),
    "no checkpoint": (lambda m: ["sample", str(m["unfinished"])], "has no complete checkpoint"),
    # issue 35, items 6 and 8: outputs that are files or folders of other things, counts beyond the machine
    "sample out a file": (lambda m: ["sample", str(m["run"]), "--out", str(m["file"])], "a_file is a file"),
    "sample out the run": (lambda m: ["sample", str(m["run"]), "--out", str(m["run"])],
                           "holds files that islands sample did not write"),
    "sample num beyond memory": (lambda m: ["sample", str(m["run"]), "--num", "10000000000"],
                                 "--num: 10000000000 samples of shape (2,) need"),
    "empty prompt": (lambda m: ["sample", str(m["run"]), "--prompt", ""], "--prompt: an empty prompt"),
    "shard below a file": (lambda m: ["shard", m["run_yaml"], str(m["file"] / "sub")], "sub: cannot be written"),
    "shard into /proc": (lambda m: ["shard", m["run_yaml"], "/proc/x"], "/proc/x: cannot be written"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_line_naming_it(made, capsys, case):
    argv, named = CASES[case]
    argv = argv(made)
    out = made["root"] / f"out-{case.replace(' ', '-')}"
    if argv[0] == "sample":
        argv += ([] if "--out" in argv else ["--out", str(out)]) + ([] if "--num" in argv else ["--num", "2"])
    capsys.readouterr()
    code = main([*argv, "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("islands: ") and err.count("\n") == 1 and named in err, (code, err)
    assert not out.exists() and not (made["root"] / "new").exists()  # nothing was written


def test_islands_ddm_finishes_on_fewer_than_2000_vectors(made):
    assert made["ddm_exit"] == 0
    assert (made["ensemble"] / "samples" / "ancestral.png").stat().st_size > 0


def test_ensemble_evaluations_with_another_grid_are_kept_beside_the_first(made):
    """metrics.json's keys hold the manifest's hash and the grid: the second evaluation does not replace the first."""
    cfg = validate(ensemble_config(made["ensemble"]))
    first = json.loads((made["ensemble"] / "metrics.json").read_text())
    sample_and_evaluate(cfg.model_copy(update={"sample": cfg.sample.model_copy(update={"grid": "logsnr"})}),
                        progress=False)
    entries = json.loads((made["ensemble"] / "metrics.json").read_text())
    assert len(first) == 1 and len(entries) == 2 and first.items() <= entries.items()
    assert all("manifest=" in key and "routing=ancestral" in key for key in entries)
    assert {key.split(" grid=")[1].split()[0] for key in entries} == {"uniform", "logsnr"}


@pytest.mark.parametrize("where", ["shards", "whole weights"])
def test_a_full_disk_stops_the_run_with_one_line_and_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch, where):
    """The run's first checkpoint (64 images) is written; its resume to 128 images finds the disk full, in DCP's
    shards or in the whole-weight exports: exit 1, one line naming the checkpoint, no partial folder left."""
    config = write_config(tmp_path / "c.yaml", run_config(tmp_path, tmp_path / "run"))
    assert main(["train", config, "--quiet"]) == 0
    first = latest_checkpoint(tmp_path / "run")
    weights = {name: load_weights(weights_file(first, ema)) for name, ema in (("model", False), ("ema", True))}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "shards":
        monkeypatch.setattr("torch.distributed.checkpoint.filesystem._write_item", full)
    else:
        monkeypatch.setattr("islands.train.checkpoint.save_weights", full)
    capsys.readouterr()
    code = main(["train", config, "train.images=128", "--quiet"])
    err = capsys.readouterr().err
    second = tmp_path / "run" / "checkpoints" / "000000000128"
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"islands: cannot write checkpoint {second}: No space left on device") and str(first) in err
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == [first]  # no .tmp-000000000128 left
    assert latest_checkpoint(tmp_path / "run") == first
    for name, ema in (("model", False), ("ema", True)):
        again = load_weights(weights_file(first, ema))
        assert all(torch.equal(again[k], weights[name][k]) for k in again)


def test_samples_that_are_not_finite_are_written_and_counted_in_one_warning(made, capsys, monkeypatch):
    """A network that returns NaN for class 1: half the samples (labels cycle 0, 1) are NaN, and the one warning line
    says so."""
    import islands.generate

    load = islands.generate.load_denoiser

    def poisoned(run_dir, use_ema=True):
        denoiser, cfg, info = load(run_dir, use_ema)
        forward = denoiser.net.forward
        denoiser.net.forward = lambda x, t, cond=None: torch.where((cond == 1)[:, None], torch.nan,
                                                                    forward(x, t, cond))
        return denoiser, cfg, info

    monkeypatch.setattr(islands.generate, "load_denoiser", poisoned)
    out = made["root"] / "nan"
    capsys.readouterr()
    assert main(["sample", str(made["run"]), "--num", "6", "--out", str(out), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("islands: warning: 3 of 6 samples are not finite"), err
    with np.load(out / "samples.npz", allow_pickle=False) as f:
        assert np.isnan(f["x"]).any(1).tolist() == [False, True] * 3 and f["y"].tolist() == [0, 1] * 3


def test_sampling_writes_over_its_own_samples_only(made, capsys):
    """Issue 35.6: --out DIR wrote over a person's grid.png and samples.npz. A folder islands sample wrote is
    written again; one holding anything else is refused whole, its files as they were."""
    own, theirs = made["root"] / "own-samples", made["root"] / "their-pictures"
    argv = ["sample", str(made["run"]), "--num", "2", "--quiet", "--out"]
    assert main([*argv, str(own)]) == 0 and main([*argv, str(own), "--seed", "5"]) == 0
    theirs.mkdir()
    (theirs / "grid.png").write_bytes(b"a person's picture")
    capsys.readouterr()
    assert main([*argv, str(theirs)]) == 2
    assert "holds files that islands sample did not write" in capsys.readouterr().err
    assert sorted(p.name for p in theirs.iterdir()) == ["grid.png"]
    assert (theirs / "grid.png").read_bytes() == b"a person's picture"


def test_an_ensemble_member_larger_than_its_weights_is_refused_before_it_is_built(made, tmp_path, capsys):
    """Issue 35.5: a copied ensemble.json may name any size; the member is built on the meta device under its
    weights' parameter count first, so a hidden width of 10^6 is one line, not gigabytes allocated."""
    copy = tmp_path / "ensemble"
    shutil.copytree(made["ensemble"], copy)
    manifest = json.loads((copy / "ensemble.json").read_text())
    manifest["experts"][0]["model"]["hidden"] = 1_000_000
    (copy / "ensemble.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["sample", str(copy), "--num", "2", "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "implies more than the" in err and "parameters its weights hold" in err, err
