"""A plan as a person reads it: a table on the terminal, a bar chart, and the numbers in JSON."""

import json
from pathlib import Path

from islands.images import save_bars
from islands.plan.predict import Planner, Row
from islands.rundir import atomic_write_text


def duration(hours: float) -> str:
    seconds = hours * 3600
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


def table(rows: list[Row], planner: Planner) -> str:
    n, cfg = planner.net_desc, planner.cfg
    encoding = f", {planner.encoder_flops / 1e9:.2f} of them encoding it" if planner.encoder_flops else ""
    head = (f"{cfg.model.arch} ({planner.params / 1e6:.1f}M parameters, {planner.flops / 1e9:.2f} GFLOP per "
            f"training image{encoding}), {cfg.train.images:,} images at batch {planner.batch} "
            f"({planner.steps:,} steps) on "
            f"{n.name}: {n.islands} island(s) x {n.nodes_per_island} node(s) x {n.gpus_per_node} = {planner.W} "
            f"accelerators at {n.gpu_tflops:g} TFLOP/s x MFU {n.mfu:g}, overlap {n.overlap:g}")
    lines = [head, f"{'strategy':<20} {'layout':<34} {'MB/step/gpu':>12} {'compute ms':>11} {'comm ms':>10} "
                   f"{'exposed ms':>11} {'time':>10} {'state GiB':>9}  slowest link"]
    for r in rows:
        lines.append(f"{r.strategy:<20} {r.layout:<34} {sum(r.bytes_per_step.values()) / 1e6:>12.2f} "
                     f"{r.compute_s * 1e3:>11.2f} {r.comm_s * 1e3:>10.2f} {r.exposed_s * 1e3:>11.2f} "
                     f"{duration(r.hours):>10} {r.state_gib:>9.2f}  {r.slowest}")
    return "\n".join(lines)


def write_plan(rows: list[Row], planner: Planner, out: Path) -> tuple[Path, Path]:
    """OUT.json (every row's numbers and the network) and OUT.png (time per strategy, compute and exposed
    communication)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"network": planner.net_desc.model_dump(), "params": planner.params,
              "flops_per_image": planner.flops, "encoder_flops_per_image": planner.encoder_flops,
              "images": planner.images, "batch": planner.batch,
              "steps": planner.steps, "rows": [r.as_dict() for r in rows]}
    data = atomic_write_text(out.with_suffix(".json"), json.dumps(record, indent=1))
    hours = {"compute": [r.steps * r.compute_s / 3600 for r in rows],
             "exposed communication": [r.hours - r.steps * r.compute_s / 3600 for r in rows]}
    picture = save_bars([r.strategy for r in rows], hours, out.with_suffix(".png"), "hours (log scale)",
                        f"{planner.cfg.model.arch}, {planner.images:,} images on {planner.net_desc.name}")
    return data, picture
