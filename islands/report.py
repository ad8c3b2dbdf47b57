"""`islands report`: one self-contained HTML page of what a run or an ensemble folder holds.

The page is read from the folder and from nothing else: the description and config, sample grids, the partition,
the routers' calibration, loss and evaluation curves (drawn here from metrics.jsonl and eval.jsonl), every entry of
metrics.json, the communication ledger, the FLOP accounting and the comparison with the monolith, each section only
where its files are. Pictures are inlined as data: URIs and the style sheet sits in the page; its Content-Security-
Policy allows nothing else (no script, no request), so it opens offline, anywhere. A folder may come from anyone:
every string from it is escaped, and a file whose real path leads out of the folder (a symlink) is left out.
"""

import html
import json
import math
import os
import re
from base64 import b64encode
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any

import yaml
from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

from islands.conditions import KINDS
from islands.config import ConfigError
from islands.data.clusters import PartitionRecord
from islands.ddm.condition_router import ROUTER_FOLDER, ROUTER_REPORT
from islands.ddm.ensemble import MANIFEST
from islands.ddm.partition import META_FILE
from islands.ddm.records import ConditionRouterReport, EnsembleManifest
from islands.errors import CheckpointError, DataError
from islands.images import curves_png
from islands.rundir import (
    CONFIG,
    MARKER,
    MODEL,
    CheckpointState,
    LogLine,
    Record,
    RunDescription,
    atomic_write_text,
    one_line,
)
from islands.train.flops import FlopsRecord

REPORT = "report.html"
GENERATOR = '<meta name="generator" content="islands report">'  # how a report is told from any other file
LARGEST_FILE = 64 << 20  # bytes read of any one file; a larger one is left out
NOT_MEMBERS = {"checkpoints", "tensorboard", "samples", "logs", "launch", "partition", ROUTER_FOLDER, "autoencoder"}
STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1180px; padding: 1em 2em; color: #222; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; margin-top: 1.8em; }
nav a { margin-right: 1em; } .note { color: #845; } .muted { color: #777; }
table { border-collapse: collapse; margin: 0.5em 0 1em; } td, th { border: 1px solid #ddd; padding: 2px 8px; }
th { background: #f4f4f4; text-align: left; font-weight: 600; } td.n { text-align: right; font-variant: tabular-nums; }
th.entry { max-width: 22em; font-weight: 400; font-size: 0.85em; word-break: break-word; }
.gallery { display: flex; flex-wrap: wrap; gap: 1em; align-items: flex-start; }
figure { margin: 0 0 1em; } figcaption { font-size: 0.9em; color: #555; max-width: 520px; word-break: break-word; }
img { max-width: 100%; } img.grid { image-rendering: pixelated; min-width: 320px; max-width: 520px; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 12px; } summary { cursor: pointer; }
.wide { overflow-x: auto; }
"""


@dataclass
class Folder:
    """The target folder, the only place anything is read from, and what was left out of the page (and why)."""

    root: Path
    left_out: list[str] = field(default_factory=list)

    def path(self, rel: str | Path, kind: str = "file") -> Path | None:
        """root/rel if it is a file (or, with kind="dir", a folder) whose real path lies inside the folder."""
        try:
            real = (self.root / rel).resolve(strict=True)
        except (OSError, RuntimeError):  # absent, or a loop of links
            return None
        if not real.is_relative_to(self.root):
            self.left_out.append(f"{rel}: it leads out of the folder")
            return None
        return real if (real.is_dir() if kind == "dir" else real.is_file()) else None

    def read(self, rel: str | Path) -> bytes | None:
        path = self.path(rel)
        if path is None:
            return None
        if path.stat().st_size > LARGEST_FILE:
            self.left_out.append(f"{rel}: larger than {LARGEST_FILE >> 20} MB")
            return None
        return path.read_bytes()

    def text(self, rel: str | Path) -> str | None:
        data = self.read(rel)
        return None if data is None else data.decode("utf-8", errors="replace")

    def json(self, rel: str | Path):
        """The file's JSON (None where absent); malformed JSON raises ValueError, which its section reports."""
        text = self.text(rel)
        return None if text is None else json.loads(text)

    def record(self, rel: str | Path, model):
        """The file read through its model (None where absent): JSON that does not parse raises its ValueError, a
        file its model refuses one line naming it and the key (a CheckpointError); its section shows either as one
        line on the page."""
        raw = self.json(rel)
        if raw is None:
            return None
        try:
            return model.model_validate(raw)
        except ValidationError as err:
            raise CheckpointError(one_line(err, rel)) from None

    def log(self, rel: str | Path) -> list[LogLine]:
        """The lines of a JSON-lines log (metrics.jsonl, eval.jsonl); a line cut short by a run that stopped mid-write
        is skipped, one that is not a log line left out by name."""
        lines = []
        for n, line in enumerate((self.text(rel) or "").splitlines(), 1):
            try:
                raw = json.loads(line)
            except ValueError:
                continue
            try:
                lines.append(LogLine.model_validate(raw))
            except ValidationError as err:
                self.left_out.append(one_line(err, f"{rel}, line {n}"))
        return lines

    def entries(self, rel: str | Path, kind: str = "file") -> list[str]:
        """Names of the files (or folders) directly in root/rel, in natural order, links included: reading one
        checks it again."""
        folder = self.path(rel, "dir")
        if folder is None:
            return []
        try:
            found = [e.name for e in os.scandir(folder) if (e.is_dir() if kind == "dir" else e.is_file())]
        except OSError as err:  # a folder we may not list
            self.left_out.append(f"{rel}: {err.strerror}")
            return []
        return sorted(found, key=natural)

    def png(self, rel: str | Path) -> str | None:
        """A PNG file as a data: URI, once Pillow has checked it is one."""
        data = self.read(rel)
        if data is None:
            return None
        try:
            with Image.open(BytesIO(data)) as image:
                image.verify()
                if image.format != "PNG":
                    raise UnidentifiedImageError(f"a {image.format} file")
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as err:
            self.left_out.append(f"{rel}: not a PNG picture ({err})")
            return None
        return png_uri(data)


def natural(name: str) -> tuple:
    """expert2 before expert10."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name))


def png_uri(data: bytes) -> str:
    return "data:image/png;base64," + b64encode(data).decode()


# --- the files only the page reads, as their models ------------------------------------------------------------------

class RouterAccuracy(Record):
    """RUN/router_accuracy.json (trainer/reporters.py): a router's top-1 accuracy at each t and, where the data's
    exact posterior was computed, the exact posterior's accuracy and the router's calibration against it."""

    images: int = Field(ge=0)
    t: list[float]
    accuracy: list[float]
    exact_accuracy: list[float] | None = None
    tv: list[float] | None = None
    kl: list[float] | None = None
    ece: list[float] | None = None
    majority_cluster_share: float


class CommunicationLedger(Record):
    """RUN/communication.json (parallel/ledger.py's summary): the optimizer steps, and the bytes one rank sent by
    collective, per step and in all."""

    steps: int = Field(ge=0)
    bytes_per_step: dict[str, float]
    total_bytes: dict[str, int | float]


class Versus(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ensemble: int | float
    monolith: int | float


# ENSEMBLE/comparison.json (ddm/pipeline.py): each measure of the ensemble beside the monolith's
Comparison = RootModel[dict[str, Versus]]
# RUN/metrics.json (eval/evaluate.py's `record`): each evaluation's measures under the key that names it
Evaluations = RootModel[dict[str, dict[str, Any]]]


# --- building blocks of the page -----------------------------------------------------------------------------------

def esc(value) -> str:
    return html.escape(str(value), quote=True)


def fmt(value) -> str:
    """A value from the folder as short text: numbers to 5 significant digits, lists and tables cut short."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10000 else str(value)
    if isinstance(value, float):
        return f"{value:.5g}"
    if isinstance(value, list):
        shown = ", ".join(fmt(v) for v in value[:12])
        return f"[{shown}{', ...' if len(value) > 12 else ''}]"
    if isinstance(value, dict):
        text = json.dumps(value, default=str)
        return text if len(text) <= 240 else text[:240] + "..."
    return str(value)


def numeric(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def table(header: list[str] | None, rows: list[list], entry_header: bool = False) -> str:
    """Rows of values (numbers right-aligned) under a header (none: rows of (what, value)), every cell escaped;
    entry_header: long header cells in small type."""
    head = "".join(f'<th{" class=entry" if entry_header and i else ""}>{esc(h)}</th>'
                   for i, h in enumerate(header or []))
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in rows)
    return f'<div class=wide><table>{f"<tr>{head}</tr>" if head else ""}{body}</table></div>'


def cell(value) -> str:
    """A table cell: a number right-aligned, nothing for a value the row lacks."""
    return f'<td{" class=n" if numeric(value) else ""}>{"" if value is None else esc(fmt(value))}</td>'


def picture(uri: str | None, caption: str, grid: bool = False) -> str:
    if uri is None:
        return ""
    return (f'<figure><img{" class=grid" if grid else ""} src="{uri}" alt="{esc(caption)}">'
            f"<figcaption>{esc(caption)}</figcaption></figure>")


def note(text: str) -> str:
    return f"<p class=note>{esc(text)}</p>"


def details(summary: str, body: str) -> str:
    return f"<details><summary>{esc(summary)}</summary>{body}</details>" if body else ""


def config_block(folder: Folder, rel: Path, label: str) -> str:
    text = folder.text(rel / CONFIG)
    return details(f"{label}: {rel / CONFIG}", f"<pre>{esc(text)}</pre>") if text is not None else ""


def run_name(rel: Path) -> str:
    return "this run" if rel == Path() else rel.as_posix()


def sections_of(folder: Folder, rel: Path) -> dict:
    """The run's config.yaml as a dict of sections ({} where it is no mapping)."""
    raw = yaml.safe_load(folder.text(rel / CONFIG) or "{}")
    return raw if isinstance(raw, dict) else {}


# --- what the folder holds -----------------------------------------------------------------------------------------

def is_run(folder: Folder, rel: Path) -> bool:
    return folder.path(rel / CONFIG) is not None and folder.path(rel / MODEL) is not None


def find_runs(folder: Folder, rel: Path = Path(), depth: int = 4) -> list[Path]:
    """Run directories below root/rel (an ensemble's experts, router, monolith, distilled student; range experts'
    tstages/I), in natural order; checkpoints, logs and pictures are not searched, nor linked folders."""
    found = []
    for name in folder.entries(rel, "dir"):
        sub = rel / name
        if name in NOT_MEMBERS or name.startswith("."):
            continue
        if (folder.root / sub).is_symlink():
            folder.left_out.append(f"{sub}: a linked folder, not searched")
            continue
        if is_run(folder, sub):
            found.append(sub)
        if depth > 1:
            found += find_runs(folder, sub, depth - 1)
    return found


def latest_checkpoint(folder: Folder, rel: Path) -> Path | None:
    """The run's newest complete checkpoint (a folder of digits holding its marker)."""
    done = [n for n in folder.entries(rel / "checkpoints", "dir") if n.isdigit()
            and folder.path(rel / "checkpoints" / n / MARKER) is not None]
    return rel / "checkpoints" / done[-1] if done else None


def weights_size(folder: Folder, rel: Path) -> int | None:
    """The numbers in the run's latest weights (its parameters and buffers), summed from the safetensors file's
    header (8 bytes of length, then JSON) without reading the weights."""
    ckpt = latest_checkpoint(folder, rel)
    path = folder.path(ckpt / "model.safetensors") if ckpt else None
    if path is None:
        return None
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > LARGEST_FILE:
            raise ValueError(f"{path.name}: a header of {length} bytes is no safetensors header")
        header = json.loads(f.read(length))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def trained_images(folder: Folder, rel: Path) -> int | None:
    ckpt = latest_checkpoint(folder, rel)
    state = folder.record(ckpt / "state.json", CheckpointState) if ckpt else None
    return state.progress.get("images") if state is not None else None


# --- sections ------------------------------------------------------------------------------------------------------

def used_keys(section: str, values: dict, condition) -> dict:
    """The section's keys less those that only condition kinds other than the run's read (`ConditionKind.keys`; a
    resolved config holds them all), so that a class-conditional run does not list a text encoder it never opened;
    all of them where it names none."""
    unused = {k for name, kind in KINDS.items() if condition is not None and name != condition
              for k in kind.keys.get(section, ())}
    return {k: v for k, v in values.items() if k not in unused}


def describe(folder: Folder, rel: Path) -> list[list]:
    """A run's (or an ensemble's) description as rows (what, value): its network, its size, its data, its
    training; of the model and data, only the keys the run's kinds use."""
    cfg, ckpt = sections_of(folder, rel), latest_checkpoint(folder, rel)
    built = folder.record(rel / MODEL, RunDescription)
    model, data, flow, train = (cfg.get(k) if isinstance(cfg.get(k), dict) else {}
                                for k in ("model", "data", "flow", "train"))
    condition = model.get("condition")
    model, data = used_keys("model", model, condition), used_keys("data", data, condition)
    strategy = cfg.get("parallel", {}).get("strategy") if isinstance(cfg.get("parallel"), dict) else None
    rows = [["model", "; ".join(f"{k} {fmt(v)}" for k, v in model.items() if v not in (None, [], {}))],
            ["weights", f"{weights:,} numbers (parameters and buffers)" if (weights := weights_size(folder, rel))
             else None],
            ["built for", f"examples of shape {fmt(list(built.shape))}, {fmt(built.num_classes)} classes"
             if built else None],
            ["data", "; ".join(f"{k} {fmt(v)}" for k, v in data.items() if v not in (None, [], {}, False))],
            ["flow", "; ".join(f"{k} {fmt(flow.get(k))}" for k in ("path", "prediction") if k in flow)],
            ["training", "; ".join(f"{k} {fmt(train[k])}" for k in ("objective", "images", "batch_size", "lr")
                                   if k in train) + (f"; strategy {strategy}" if strategy else "")],
            ["trained", f"{fmt(trained_images(folder, rel))} images ({ckpt.name})" if ckpt else None],
            ["seed", cfg.get("seed")]]
    return [row for row in rows if row[1] not in (None, "")]


def description(folder: Folder, runs: list[Path]) -> str:
    """The folder's own config described (a run's network, weights and progress too); an ensemble's experts as its
    manifest lists them; every run below the folder; the configs themselves, folded away."""
    parts = [table(None, describe(folder, Path()))]
    manifest = folder.record(MANIFEST, EnsembleManifest)
    if manifest is not None:
        parts.append(f"<p>An ensemble of {esc(fmt(manifest.k))} experts, partition "
                     f"{esc(fmt(manifest.partition))}, cluster prior {esc(fmt(manifest.prior))}.</p>")
        keys = ("name", "run", "images", "cluster", "size", "path", "prediction", "sha256")
        rows = [[e.name, e.run, e.images, e.cluster, e.size, e.path, e.prediction,
                 e.sha256[:16] if e.sha256 is not None else None] for e in manifest.experts]
        parts.append(table(list(keys), rows))
    members = [r for r in runs if r != Path()]
    if members:
        rows = []
        for rel in members:
            cfg = sections_of(folder, rel)
            model, train = cfg.get("model") or {}, cfg.get("train") or {}
            rows.append([rel.as_posix(), model.get("arch"), train.get("objective"), weights_size(folder, rel),
                         trained_images(folder, rel)])
        parts.append("<h3>Runs in this folder</h3>" + table(["run", "network", "objective", "weights",
                                                               "images trained"], rows))
    parts.append(config_block(folder, Path(), "the config"))
    parts += [config_block(folder, rel, "config of") for rel in members]
    return "".join(parts)


def prompts_beside(folder: Folder, rel: Path) -> str:
    """prompts.txt beside a grid (as `islands sample --prompt` writes it): the prompt of each sample."""
    text = folder.text(rel / "prompts.txt")
    if not text:
        return ""
    lines = [line for line in text.splitlines() if line.strip()]
    shown = "".join(f"<li>{esc(line)}</li>" for line in lines[:64])
    return details(f"the prompts ({len(lines)}, {rel / 'prompts.txt'})", f"<ol>{shown}</ol>")


def grids(folder: Folder, rel: Path) -> tuple[list[str], list[str]]:
    """A run's or an ensemble's samples/*.png: those drawn for something (an ensemble's routing policies, its
    monolith) shown, then the grid a run drew last as it trained; and the names of the earlier ones."""
    names = [n for n in folder.entries(rel / "samples") if n.endswith(".png")]
    during = [n for n in names if n[:-4].isdigit()]  # named by the images trained
    shown = [picture(folder.png(rel / "samples" / n), n[:-4] if rel == Path() else f"{rel.as_posix()}: {n[:-4]}",
                     grid=True)
             for n in names if n not in during]
    if during:
        shown.append(picture(folder.png(rel / "samples" / during[-1]),
                             f"{run_name(rel)} after {int(during[-1][:-4]):,} images", grid=True))
    return [s for s in shown if s], during[:-1]


def samples(folder: Folder, runs: list[Path]) -> str:
    """The folder's own grids (the earlier ones of a run folded away) and the prompts beside them; then the latest
    grid of each of its runs."""
    shown, earlier = grids(folder, Path())
    body = f"<div class=gallery>{''.join(shown)}</div>" if shown else ""
    if earlier:
        step = math.ceil(len(earlier) / 8)  # at most eight, evenly spaced, the last one kept
        before = [picture(folder.png(Path("samples") / n), f"after {int(n[:-4]):,} images", grid=True)
                  for n in earlier[::-1][::step][::-1]]
        body += details(f"earlier grids ({len(earlier)})", f"<div class=gallery>{''.join(before)}</div>")
    body += prompts_beside(folder, Path("samples"))
    members = [picture for rel in runs if rel != Path() for picture in grids(folder, rel)[0]]
    if members:
        body += f"<h3>Each run's latest grid</h3><div class=gallery>{''.join(members)}</div>"
    return body


def partition(folder: Folder) -> str:
    meta = folder.record(Path("partition") / META_FILE, PartitionRecord)
    if meta is None:
        return ""
    sizes = meta.sizes
    total = sum(sizes) or 1
    body = (f"<p>{esc(fmt(meta.k))} clusters of {esc(fmt(meta.n))} examples by {esc(fmt(meta.method))} on "
            f"{esc(fmt(meta.features_name))} (balanced: {esc(fmt(meta.balanced))}, seed {esc(fmt(meta.seed))}).</p>")
    body += picture(folder.png(Path("partition") / "clusters.png"), "examples of each cluster (partition/clusters.png)")
    body += table(["cluster", "examples", "share"], [[k, s, s / total] for k, s in enumerate(sizes)])
    by_class = meta.sizes_by_class
    if by_class:
        width = max(len(row) for row in by_class)
        body += details("examples of each class in each cluster",
                        table(["cluster", *map(str, range(width))], [[k, *row] for k, row in enumerate(by_class)]))
    return body


def condition_router(folder: Folder) -> str:
    """p(cluster | text) of a text-conditioned ensemble: its held-out calibration."""
    found = folder.record(Path(ROUTER_FOLDER) / ROUTER_REPORT, ConditionRouterReport)
    if found is None:
        return ""
    calibration = found.calibration
    scalars = [[k, v] for k, v in calibration.model_dump(exclude_unset=True).items() if not isinstance(v, list)]
    body = (f"<p>An MLP of width {esc(fmt(found.hidden))} on the pooled caption embedding "
            f"({esc(fmt(found.width))} wide) to {esc(fmt(found.clusters))} clusters, measured on "
            "held-out examples:</p>") + table(None, scalars)
    predicted, empirical = calibration.shares_predicted, calibration.shares_empirical
    if predicted is not None and empirical is not None:
        body += table(["cluster", "predicted share", "held-out share"],
                      [[k, p, e] for k, (p, e) in enumerate(zip(predicted, empirical, strict=False))])
    return body


ACCURACY = "top-1 accuracy"
CALIBRATION = "against the exact posterior (TV, KL nats, ECE)"


def router_panels(found: RouterAccuracy) -> dict:
    """router_accuracy.json as panels against t: the router's accuracy beside the exact posterior's (the most any
    router reaches), and the distances between the two."""
    lines = {ACCURACY: {"router": found.accuracy, "exact posterior": found.exact_accuracy},
             CALIBRATION: {"tv": found.tv, "kl": found.kl, "ece": found.ece}}
    return series_panels({panel: {label: (found.t, ys) for label, ys in by_label.items() if ys is not None}
                          for panel, by_label in lines.items()})


def router_accuracy(folder: Folder, runs: list[Path]) -> str:
    """Each router's accuracy against t and, where it was measured, its calibration against the exact posterior."""
    body = ""
    for rel in runs:
        found = folder.record(rel / "router_accuracy.json", RouterAccuracy)
        if found is None:
            continue
        body += (f"<h3>{esc(run_name(rel))}</h3><p>after {esc(fmt(found.images))} images; the largest "
                 f"cluster holds {esc(fmt(found.majority_cluster_share))} of the examples (the accuracy of "
                 "always naming it).</p>")
        panels = router_panels(found)
        if panels:
            body += picture(png_uri(curves_png(panels, "t (0 data, 1 noise)", columns=2, shares=(ACCURACY,))),
                            f"{run_name(rel)}: accuracy and calibration against t")
        columns = {name: ys for name, ys in (("accuracy", found.accuracy), ("exact_accuracy", found.exact_accuracy),
                                             ("tv", found.tv), ("kl", found.kl), ("ece", found.ece))
                   if ys is not None}
        rows = [[x, *(ys[i] if i < len(ys) else None for ys in columns.values())] for i, x in enumerate(found.t)]
        body += details("the numbers by t", table(["t", *columns], rows))
    return body


def comparison(folder: Folder) -> str:
    found = folder.record("comparison.json", Comparison)
    shown = picture(folder.png("comparison.png"), "the ensemble and the monolith, the same noise (comparison.png)")
    if found is not None:
        shown += table(["", "ensemble", "monolith"], [[name, row.ensemble, row.monolith]
                                                      for name, row in found.root.items()])
    return shown


def metrics(folder: Folder, runs: list[Path]) -> str:
    """Every entry of every metrics.json (the folder's own, then each run's): one column per entry."""
    body = ""
    for rel in [Path(), *[r for r in runs if r != Path()]]:
        found = folder.record(rel / "metrics.json", Evaluations)
        if found is None or not found.root:
            continue
        entries = found.root
        names = list(dict.fromkeys(name for value in entries.values() for name in value))
        rows = [[name, *(entry.get(name) for entry in entries.values())] for name in names]
        body += f"<h3>{esc((rel / 'metrics.json').as_posix())}</h3>"
        body += table(["", *entries], rows, entry_header=True)
    return body


def series_panels(panels: dict) -> dict:
    """The numbers of each line (x, y) only, pairs whose either side is no finite number dropped, at most 2000
    points a line: a log of any length plots."""
    cleaned = {}
    for name, lines in panels.items():
        kept = {}
        for label, (xs, ys) in lines.items():
            pairs = [(float(x), float(y)) for x, y in zip(xs, ys, strict=False) if numeric(x) and numeric(y)
                     and math.isfinite(x) and math.isfinite(y)]
            pairs = pairs[::math.ceil(len(pairs) / 2000)] if pairs else []
            if pairs:
                kept[label] = ([x for x, _ in pairs], [y for _, y in pairs])
        if kept:
            cleaned[name] = kept
    return cleaned


def log_panels(folder: Folder, runs: list[Path], log: str, skip: set) -> dict:
    """{metric: {run: (images, values)}} of every numeric value of each run's `log`.jsonl, by its name."""
    panels = {}
    for rel in runs:
        lines = [(line.images, line.values) for line in folder.log(rel / f"{log}.jsonl")]
        names = dict.fromkeys(k for _, values in lines for k, v in values.items() if numeric(v) and k not in skip)
        for name in names:
            shown = [(images, values[name]) for images, values in lines if numeric(values.get(name))]
            panels.setdefault(name, {})[run_name(rel)] = ([x for x, _ in shown], [y for _, y in shown])
    return series_panels(panels)


def curves(folder: Folder, runs: list[Path]) -> str:
    """Training logs, one figure per objective (a router's loss is not a denoiser's), and the evaluations."""
    by_objective = {}
    for rel in runs:
        train = sections_of(folder, rel).get("train")
        by_objective.setdefault(train.get("objective", "") if isinstance(train, dict) else "", []).append(rel)
    body = ""
    for objective, members in by_objective.items():
        panels = log_panels(folder, members, "metrics", {"images", "step", "skipped"})
        if panels:
            caption = f"training log (metrics.jsonl){f', {objective} objective' if objective else ''}: " + \
                      ", ".join(run_name(r) for r in members)
            body += picture(png_uri(curves_png(panels, "images", columns=4)), caption)
    evaluations = log_panels(folder, runs, "eval", {"images", "num_samples"})
    if evaluations:
        body += picture(png_uri(curves_png(evaluations, "images", columns=4)),
                        "evaluations during training (eval.jsonl)")
    return body


def flops(folder: Folder, runs: list[Path]) -> str:
    """Each run's flops.json; in an ensemble, what its experts and router cost together."""
    rows, ensemble, counted = [], 0.0, None
    for rel in runs:
        found = folder.record(rel / FlopsRecord.FILE, FlopsRecord)
        if found is not None:
            counted = counted or found.counted_by
            rows.append([run_name(rel), found.flops_per_image, found.images, found.training_flops,
                         found.encoder_flops_per_image])
            if rel.parts[:1] in (("experts",), ("router",)):
                ensemble += found.training_flops
    if not rows:
        return ""
    if ensemble:
        rows.append(["ensemble: experts and router", None, None, ensemble, None])
    return table(["run", "FLOPs per image", "images", "training FLOPs", "encoder FLOPs per image"], rows) + \
        (f"<p class=muted>counted by {esc(counted)}</p>" if counted else "")


def communication(folder: Folder, runs: list[Path]) -> str:
    """Each run's communication ledger (communication.json): bytes one rank sent, by collective."""
    body = ""
    for rel in runs:
        found = folder.record(rel / "communication.json", CommunicationLedger)
        if found is None:
            continue
        per_step, total = found.bytes_per_step, found.total_bytes
        rows = [[name, per_step.get(name), total.get(name)] for name in dict.fromkeys([*per_step, *total])]
        body += (f"<h3>{esc(run_name(rel))}</h3><p>{esc(fmt(found.steps))} optimizer steps; bytes one rank "
                 "sent, by collective:</p>") + table(["collective", "bytes per step", "bytes in all"], rows)
    return body


# --- the page ------------------------------------------------------------------------------------------------------

def open_target(target: Path) -> tuple[Folder, list[Path], bool]:
    """The folder, its runs (itself first, where it is one) and whether it is a run; a folder that is neither a run
    nor holds runs or a partition is refused."""
    if not target.is_dir():
        raise DataError(f"report: {target} is not a folder")
    folder = Folder(target.resolve())
    own_run = is_run(folder, Path())
    runs = ([Path()] if own_run else []) + find_runs(folder)
    if not own_run and not (folder.path(CONFIG) and (runs or folder.path(Path("partition") / META_FILE))):
        raise DataError(f"report: {target} is neither a run directory ({CONFIG} and {MODEL}) nor an ensemble "
                        f"({CONFIG} beside its partition or runs)")
    return folder, runs, own_run


def guarded(folder: Folder, title: str, render, *args) -> str:
    """A section's body; a file that does not hold what it should (the folder may come from anyone) becomes a line
    on the page, not the end of the report."""
    try:
        return render(folder, *args)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError,
            yaml.YAMLError) as err:
        return note(f"{title}: could not be shown ({type(err).__name__}: {err})")


def build_page(target: Path) -> str:
    folder, runs, own_run = open_target(Path(target))
    kind = "run" if own_run else "ensemble" if folder.path(MANIFEST) or folder.path(Path("partition") / META_FILE) \
        else "folder of runs"
    parts = {"Description": (description, runs), "Samples": (samples, runs),
             "Partition": (partition,), "Condition router": (condition_router,),
             "Router accuracy and calibration against t": (router_accuracy, runs),
             "Ensemble against the monolith": (comparison,), "Metrics": (metrics, runs),
             "Loss and evaluation curves": (curves, runs), "FLOP accounting": (flops, runs),
             "Communication ledger": (communication, runs)}
    bodies = {title: guarded(folder, title, render, *args) for title, (render, *args) in parts.items()}
    if folder.left_out:
        shown = "".join(f"<li>{esc(line)}</li>" for line in dict.fromkeys(folder.left_out))
        bodies["Files left out"] = f"<ul>{shown}</ul>"
    bodies = {title: body for title, body in bodies.items() if body}
    anchors = {title: f"s{i}" for i, title in enumerate(bodies)}
    nav = "".join(f'<a href="#{anchors[t]}">{esc(t)}</a>' for t in bodies)
    sections = "".join(f'<section><h2 id="{anchors[t]}">{esc(t)}</h2>{body}</section>' for t, body in bodies.items())
    name = folder.root.name
    return (f"<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>{GENERATOR}"
            "<meta http-equiv=Content-Security-Policy content=\"default-src 'none'; img-src data:; "
            "style-src 'unsafe-inline'\"><link rel=icon href=\"data:,\">"
            f"<title>{esc(name)}: Islands report</title><style>{STYLE}</style></head><body>"
            f"<h1>{esc(name)}</h1><p class=muted>Islands report of the {kind} in {esc(folder.root)}</p>"
            f"<nav>{nav}</nav>{sections}</body></html>\n")


def write_report(target: Path, out: Path | None = None) -> Path:
    """The page, written whole to `out` (default TARGET/report.html), which may be absent or a report written
    before, never any other file."""
    out = Path(out) if out is not None else Path(target) / REPORT
    if out.is_dir():
        raise ConfigError(f"--out: {out} is a folder; give the path of the page to write")
    if out.exists() and GENERATOR.encode() not in head_of(out):
        raise ConfigError(f"--out: {out} exists and is no report of islands; give another path")
    page = build_page(Path(target))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return atomic_write_text(out, page)
    except OSError as err:
        raise DataError(f"report: cannot write {out}: {err.strerror or err}") from None


def head_of(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(512)
    except OSError as err:
        raise ConfigError(f"--out: cannot read {path}: {err.strerror or err}") from None
