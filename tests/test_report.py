"""`islands report`: one self-contained page of a run (two local-SGD replicas, so that it has a communication ledger)
and of an ensemble with its monolith, checked by parsing it and by opening it in headless Chromium."""

import base64
import html
import io
import json
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import yaml
from conftest import random_images, run_ranks, tiny_unet_config, write_config
from PIL import Image
from safetensors.torch import load_file
from test_ddm import tiny_ddm_config

from islands.cli import main
from islands.config import validate
from islands.ddm.condition_router import fit_condition_router, save_condition_router
from islands.ddm.pipeline import monolith_images
from islands.rundir import latest_checkpoint


class Page(HTMLParser):
    """The tags of a page with their attributes, and its text."""

    def __init__(self, text: str):
        super().__init__()
        self.tags, self.text = [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)

    def images(self) -> list[Image.Image]:
        """Every <img>, decoded from its data: URI (a PNG, which Pillow opens)."""
        found = []
        for tag, attrs in self.tags:
            if tag == "img":
                head, _, data = attrs["src"].partition(",")
                assert head == "data:image/png;base64", attrs["src"][:80]
                image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
                image.load()
                assert image.format == "PNG" and image.width > 10 and image.height > 10
                found.append(image)
        return found


def report(target: Path, *args: str) -> tuple[str, Page]:
    assert main(["report", str(target), *args]) == 0
    out = Path(args[args.index("--out") + 1]) if "--out" in args else target / "report.html"
    text = out.read_text()
    return text, Page(text)


def assert_self_contained(text: str, page: Page) -> None:
    """Nothing on the page is fetched: every src and href is inline, and no script runs."""
    assert not {tag for tag, _ in page.tags} & {"script", "iframe", "object", "embed", "base"}
    for _, attrs in page.tags:
        for name in ("src", "href"):
            value = attrs.get(name, "")
            assert not value.lower().startswith(("http:", "https:", "//", "file:")), value
            assert not value or value.startswith(("data:", "#")), value
    assert "could not be shown" not in text  # every file of a real run reads


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny U-Net trained by two local-SGD replicas, evaluated during training and once by `islands eval`."""
    root = tmp_path_factory.mktemp("report_run")
    cfg = tiny_unet_config(root / "run", random_images(root), eval={"every": 48, "num": 16, "features": "pixels",
                                                                     "metrics": ["fd", "precision_recall"]},
                           parallel={"strategy": "local_sgd", "sync_every": 2})
    ranks = run_ranks(["train", write_config(root / "run.yaml", cfg), "--quiet"])
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    assert main(["eval", str(root / "run"), "--num", "16", "--features", "pixels", "--metrics", "fd", "--quiet"]) == 0
    return root / "run"


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory):
    """Two experts, a router and the monolith of the same FLOPs, each trained in this process for a few hundred
    images; then `islands ddm` finds them done and only samples, evaluates and compares."""
    root = tmp_path_factory.mktemp("report_ddm")
    cfg = tiny_ddm_config()
    cfg["data"]["size"] = 400
    cfg["eval"].update(num=64, metrics=["fd", "swd"])
    cfg["ddm"].update(monolith=True)
    cfg["ddm"]["router"]["images"] = 64
    path, given = write_config(root / "ddm.yaml", cfg), [f"run_dir={root / 'ens'}", "--quiet"]
    assert main(["partition", path, *given]) == 0
    for member in ("expert=0", "expert=1", "router"):
        assert main(["train", path, member, *given]) == 0
    images = monolith_images(validate({**cfg, "run_dir": str(root / "ens")}))
    assert main(["train", path, "monolith", f"train.images={images}", *given]) == 0
    assert main(["ddm", path, *given]) == 0
    return root / "ens"


def test_a_run_report_holds_its_description_pictures_curves_metrics_flops_and_ledger(run):
    text, page = report(run)
    assert_self_contained(text, page)
    images = page.images()
    # the last grid and the one before it (folded away), the training log's and the evaluations' curves
    assert len(images) == 4, len(images)
    words = " ".join(page.text)
    weights = load_file(latest_checkpoint(run) / "model.safetensors")
    assert f"{sum(t.numel() for t in weights.values()):,}" in words  # parameters and buffers, read from the header only
    for title in ("Description", "Samples", "Loss and evaluation curves", "Metrics", "FLOP accounting",
                  "Communication ledger"):
        assert f">{title}</h2>" in text
    assert "Partition" not in text and "Router accuracy" not in text  # nothing the folder lacks
    ledger = json.loads((run / "communication.json").read_text())
    for collective, sent in ledger["total_bytes"].items():
        assert f"<td>{collective}</td>" in text and f"<td class=n>{sent:.5g}</td>" in text
    flops = json.loads((run / "flops.json").read_text())
    assert f"<td class=n>{flops['training_flops']:.5g}</td>" in text
    for key, entry in json.loads((run / "metrics.json").read_text()).items():
        assert html.escape(key) in text
        for name in entry:
            assert f"<td>{name}</td>" in text
    assert html.escape((run / "config.yaml").read_text()) in text  # the whole config, folded away


def test_an_ensemble_report_shows_the_partition_routers_comparison_and_every_run(ensemble):
    text, page = report(ensemble, "--out", str(ensemble.parent / "elsewhere" / "page.html"))
    assert_self_contained(text, page)
    # the ensemble's and the monolith's grids; each run's last; the clusters; the router against t; the comparison;
    # a training figure for the denoisers and one for the router
    assert len(page.images()) == 2 + 3 + 1 + 1 + 1 + 2
    partition = json.loads((ensemble / "partition" / "partition.json").read_text())
    for k, size in enumerate(partition["sizes"]):
        assert f"<tr><td class=n>{k}</td><td class=n>{size}</td>" in text
    for name, row in json.loads((ensemble / "comparison.json").read_text()).items():
        assert f"<tr><td>{name}</td><td class=n>{row['ensemble']:.5g}</td><td class=n>{row['monolith']:.5g}</td>" \
            in text
    assert len(json.loads((ensemble / "metrics.json").read_text())) == 2  # the ensemble's entry and the monolith's
    for key in json.loads((ensemble / "metrics.json").read_text()):
        assert html.escape(key) in text
    accuracy = json.loads((ensemble / "router" / "router_accuracy.json").read_text())
    assert f"<td class=n>{accuracy['t'][0]:.5g}</td><td class=n>{accuracy['accuracy'][0]:.5g}</td>" in text
    members = sum(json.loads((ensemble / r / "flops.json").read_text())["training_flops"]
                  for r in ("experts/0", "experts/1", "router"))
    assert f"<td>ensemble: experts and router</td><td></td><td></td><td class=n>{members:.5g}</td>" in text
    for run in ("experts/0", "experts/1", "router", "monolith"):
        assert f"<td>{run}</td>" in text


def test_a_text_ensembles_condition_router_shows_its_held_out_calibration(ensemble, tmp_path):
    """The condition router's file as a text ensemble writes it (fitted here on vectors whose first coordinate's sign
    is the cluster, in place of pooled captions), beside the ensemble's own."""
    copy = tmp_path / "ens"
    shutil.copytree(ensemble, copy, ignore=shutil.ignore_patterns("checkpoints", "tensorboard", "report.html"))
    pooled = torch.randn(300, 8, generator=torch.Generator().manual_seed(0))
    router, calibration = fit_condition_router(pooled, (pooled[:, 0] > 0).long(), 2, seed=0, steps=100)
    save_condition_router(router, copy, calibration)
    text, page = report(copy)
    assert_self_contained(text, page)
    assert ">Condition router</h2>" in text and calibration["accuracy"] > 0.8
    for name in ("held_out", "log_loss", "prior_log_loss", "accuracy", "ece"):
        value = calibration[name]
        assert f"<tr><td>{name}</td><td class=n>{value if isinstance(value, int) else f'{value:.5g}'}</td></tr>" in text
    for k, (predicted, held_out) in enumerate(zip(calibration["shares_predicted"], calibration["shares_empirical"],
                                                  strict=True)):
        assert f"<tr><td class=n>{k}</td><td class=n>{predicted:.5g}</td><td class=n>{held_out:.5g}</td></tr>" in text


def test_what_the_folder_says_is_escaped_no_link_leads_out_of_it_and_a_bad_file_is_one_line(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy, symlinks=True, ignore=shutil.ignore_patterns("report.html"))
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg["model"]["arch"] = "<script>alert('arch')</script>"
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    (copy / "samples" / "prompts.txt").write_text('a cat <img src=x onerror="alert(1)">\n')
    (copy / "metrics.json").write_text(json.dumps({"</th><script>alert(2)</script>": {"fd": 1.0}}))
    outside = tmp_path / "secret.png"
    Image.new("RGB", (40, 40), (255, 0, 0)).save(outside)
    (copy / "samples" / "999999999999.png").symlink_to(outside)  # would be the newest grid
    (copy / "flops.json").unlink()
    (copy / "flops.json").symlink_to(run / "flops.json")  # the same file, but outside the folder
    (copy / "communication.json").write_text('{"steps": 12, "bytes_per')  # cut short
    (copy / "elsewhere").symlink_to(run, target_is_directory=True)  # a run, but not this folder's
    text, page = report(copy)
    assert "<script" not in text.lower() and "<img src=x" not in text
    assert "&lt;script&gt;alert(&#x27;arch&#x27;)&lt;/script&gt;" in text
    assert "a cat &lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in text
    assert "&lt;/th&gt;&lt;script&gt;alert(2)&lt;/script&gt;" in text
    assert base64.b64encode(outside.read_bytes()).decode() not in text
    assert "FLOP accounting" not in text
    left_out = "Files left out</h2>"
    assert left_out in text and "samples/999999999999.png: it leads out of the folder" in text
    assert "flops.json: it leads out of the folder" in text
    assert "elsewhere: a linked folder, not searched" in text and "Runs in this folder" not in text
    # a file that does not hold what it should is a line on the page, and the rest of the page is there
    assert "<p class=note>Communication ledger: could not be shown (JSONDecodeError: " in text
    assert ">Loss and evaluation curves</h2>" in text
    assert not any(img.size == (40, 40) for img in page.images())


def test_a_file_its_model_refuses_is_one_line_naming_the_file_and_the_key_and_the_page_renders(run, tmp_path):
    """The page reads every record through its model (issue 37): a file that fails it is one line naming the file
    and the key, in its section or among the files left out, and the rest of the page is there."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("report.html"))
    (copy / "router_accuracy.json").write_text(json.dumps({"images": 8, "t": [0.5], "accuracy": "high",
                                                           "majority_cluster_share": 0.5}))
    with open(copy / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"loss": 0.5}) + "\n")  # a line without its images
    lines = (copy / "metrics.jsonl").read_text().count("\n")
    model = json.loads((copy / "model.json").read_text())
    (copy / "model.json").write_text(json.dumps({**model, "version": 2}))
    text, _ = report(copy)
    assert ("Router accuracy and calibration against t: could not be shown (CheckpointError: router_accuracy.json: "
            "accuracy: Input should be a valid list)") in text
    assert f"metrics.jsonl, line {lines}: images: Field required" in text
    assert "Description: could not be shown (CheckpointError: model.json: version: 2 is not a version this Islands " \
           "reads (1 to 1))" in text
    for section in ("Loss and evaluation curves", "Communication ledger", "FLOP accounting", "Samples"):
        assert f">{section}</h2>" in text


def test_only_a_report_is_replaced_and_a_folder_of_nothing_is_refused(run, tmp_path, capsys):
    other = tmp_path / "notes.html"
    other.write_text("<p>mine</p>")
    assert main(["report", str(run), "--out", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("islands: config error: --out: ") and len(err.splitlines()) == 1
    assert other.read_text() == "<p>mine</p>"
    page = tmp_path / "page.html"
    assert main(["report", str(run), "--out", str(page)]) == 0
    page.write_text(page.read_text().replace("<h1>", "<h1>stale "))  # a report written before: replaced
    assert main(["report", str(run), "--out", str(page)]) == 0 and "stale" not in page.read_text()
    capsys.readouterr()
    for bad in (tmp_path / "absent", tmp_path):  # nothing, and a folder of no run
        assert main(["report", str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"islands: report: {bad} is ")
    assert not (tmp_path / "report.html").exists()


def chromium_or_skip() -> str:
    """Debian's chromium; `make test` installs it where it is root (CI), where its absence is a failure."""
    found = shutil.which("chromium")
    if found:
        return found
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail("chromium is missing in CI, where `make test` installs it (apt-get install chromium)",
                    pytrace=False)
    pytest.skip("skipped: no chromium")


def open_in_chromium(chromium: str, page: Path, shot: Path, profile: Path) -> list[str]:
    """Load the page in headless Chromium and screenshot it -> the lines its console printed."""
    # as root in a container: no sandbox, and /tmp for shared memory (a container's /dev/shm is often 64 MB)
    done = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           f"--screenshot={shot}", "--window-size=1200,2000", f"--user-data-dir={profile}",
                           "--enable-logging=stderr", "--v=0", page.as_uri()],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    return [line for line in done.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def test_the_report_renders_in_headless_chromium(request, tmp_path):
    chromium = chromium_or_skip()  # before the folders are built
    for target in (request.getfixturevalue("run"), request.getfixturevalue("ensemble")):
        out, shot = tmp_path / f"{target.name}.html", tmp_path / f"{target.name}.png"
        assert main(["report", str(target), "--out", str(out)]) == 0
        # every message the page writes to the console (a script's error, a blocked request, a refused policy)
        console = open_in_chromium(chromium, out, shot, tmp_path / "profile")
        assert console == [], console
        with Image.open(shot) as image:
            colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
        assert image.size == (1200, 2000) and colours is not None and len(colours) > 50  # not one blank colour
        # the browser decodes every picture: the page's images on a page of our own whose script may say their sizes
        sources = [attrs["src"] for tag, attrs in Page(out.read_text()).tags if tag == "img"]
        probe = tmp_path / f"{target.name}-images.html"
        probe.write_text("".join(f'<img src="{src}">' for src in sources) + "<script>window.onload = () => { for "
                         "(const img of document.images) console.log(`decoded ${img.naturalWidth}`) }</script>")
        decoded = [line.split('"decoded ')[1].split('"')[0] for line in
                   open_in_chromium(chromium, probe, tmp_path / "probe.png", tmp_path / "profile")]
        assert len(decoded) == len(sources) > 0 and all(int(width) > 10 for width in decoded), decoded


def test_a_description_lists_only_the_keys_its_condition_uses(tmp_path):
    """A resolved config holds every key of its kinds' sections: a class-conditional run's description names no text
    encoder and no caption tokens, which it never used, and a text run's names them and no class count."""
    from islands.config import to_dict
    from islands.report import Folder, describe

    def rows(name, model):
        cfg = validate({"run_dir": str(tmp_path / name), "data": {"source": "mnist5k"}, "model": model})
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
        assert "text_encoder" in to_dict(cfg)["data"] and "text_tokens" in to_dict(cfg)["model"]
        return dict(describe(Folder(tmp_path / name), Path()))

    by_class = rows("class", {"arch": "unet", "num_classes": 10})
    assert "num_classes 10" in by_class["model"] and "condition class" in by_class["model"]
    assert "text" not in by_class["model"] and "text_encoder" not in by_class["data"], by_class
    by_text = rows("text", {"arch": "unet", "condition": "text", "text_width": 384, "text_pooled_width": 384})
    assert "text_tokens 32" in by_text["model"] and "text_encoder minilm" in by_text["data"], by_text
    assert "num_classes" not in by_text["model"]
