"""The data path at scale (issue 38, section 3): a synthetic set of captioned 16x16 PNGs, at two sizes, through
`islands index` (tars where they lie), `islands shard` (the indexed tars written again as Islands' shards), `islands
encode --text-encoder minilm` (each caption's embedding stored beside its image: a run of a million captions holds no
table of them), the start of a run (the source built and checked, its loader's first batch), `islands partition` on
text features (the captions' MiniLM embeddings, what `islands ddm` partitions by for a captioned set) and the loader:
wall time and peak memory (the largest resident set of the command's processes) of each, and their growth from the
small size to the large one. The captions come from a grammar of 1,600 sentences, and a caption is encoded once
however often it comes: the encoder's cost per distinct caption is benchmarks/text_encoder.py's.

Each step is a command of its own in a fresh process (`islands ...`, or `python -c` for the start and the loader),
so its peak resident set is its own. The images are drawn per example from a seeded generator (a few rectangles of
random greys on a random background) and captioned from what is drawn ("a dark square above a light bar ..."),
written as webdataset tars of 10,000 examples (`{key}.png`, `{key}.txt`), as img2dataset would.

    python -m benchmarks data_scale [SIZE ...] [--skip-partition]     # default 100000 1000000
"""

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from benchmarks.common import cpu_seconds, others_share, save, setup, table

SIZES = (100_000, 1_000_000)
PER_TAR = 10_000
SHARD_SIZE = 4096
SIDE = 16
BATCH = 256
LOADER_BATCHES = 200
TEXT_TOKENS = 8
WORDS = ("dark", "light", "grey", "pale", "deep")
SHAPES = ("square", "bar", "column", "dot")
PLACES = ("above", "below", "left of", "right of")


def example(rng: np.random.Generator) -> tuple[bytes, str]:
    """A 16x16 grey PNG of two rectangles on a background, and a caption that says what is where."""
    a = np.full((SIDE, SIDE), rng.integers(0, 256), dtype=np.uint8)
    words = []
    for _ in range(2):
        shade, shape = rng.integers(len(WORDS)), rng.integers(len(SHAPES))
        h, w = [(4, 4), (3, 10), (10, 3), (2, 2)][shape]
        y, x = rng.integers(0, SIDE - h + 1), rng.integers(0, SIDE - w + 1)
        a[y:y + h, x:x + w] = 40 + 50 * shade
        words.append(f"a {WORDS[shade]} {SHAPES[shape]}")
    buffer = io.BytesIO()
    Image.fromarray(a).save(buffer, format="PNG")
    return buffer.getvalue(), f"{words[0]} {PLACES[rng.integers(len(PLACES))]} {words[1]}"


def write_tars(folder: Path, n: int) -> None:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(n)
    for t in range(-(-n // PER_TAR)):
        with tarfile.open(folder / f"data-{t:06d}.tar", "w") as tar:
            for k in range(t * PER_TAR, min(n, (t + 1) * PER_TAR)):
                png, caption = example(rng)
                for ext, data in (("png", png), ("txt", caption.encode())):
                    info = tarfile.TarInfo(f"{k:09d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


# runs a command and prints the largest resident set of its processes (KiB): that of this launcher's children only
PEAK = "import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); " \
       "print(f'peak-kib {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}'); sys.exit(code)"


def timed(argv: list[str], env: dict) -> dict:
    """One command in a process of its own: its wall time and the peak resident set of it and its children."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PEAK, *argv], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} failed: {done.stderr[-2000:]}")
    lines = done.stdout.strip().splitlines()
    peak = int(lines[-1].split()[-1])
    return {"seconds": seconds, "peak_mib": peak / 1024, "out": "\n".join(lines[:-1])[-400:]}


START = """
import time, sys
from islands.config import load_config
from islands.data import build_data
from islands.data.loader import stream_loader
cfg = load_config(sys.argv[1])
t = time.perf_counter()
source = build_data(cfg.data, cfg.seed, check=True)
loader = iter(stream_loader(source, {batch}, seed=0))
next(loader)
print(f"start {{time.perf_counter() - t:.3f}}")
"""

LOADER = """
import time, sys
from islands.config import load_config
from islands.data import build_data
from islands.data.loader import stream_loader
cfg = load_config(sys.argv[1])
source = build_data(cfg.data, cfg.seed)
loader = iter(stream_loader(source, {batch}, seed=0, start=len(source) // 2 // {batch} * {batch}))
next(loader)
t = time.perf_counter()
for _ in range({batches}):
    next(loader)
print(f"rate {{{batches} * {batch} / (time.perf_counter() - t):.1f}}")
"""


def one_size(work: Path, n: int, env: dict) -> dict:
    islands = [sys.executable, "-m", "islands"]
    tars, index, shards, encoded = (work / f"{name}-{n}" for name in ("tars", "index", "shards", "encoded"))
    start = time.perf_counter()
    write_tars(tars, n)
    made = time.perf_counter() - start
    steps = {"index": timed([*islands, "index", str(tars), str(index), "--quiet"], env)}
    config = work / f"c-{n}.yaml"
    config.write_text(yaml.safe_dump({"run_dir": str(work / f"run-{n}"), "seed": 0, "data": {
        "source": "shards", "path": str(index), "resolution": SIDE, "channels": 1}}))
    steps["shard"] = timed([*islands, "shard", str(config), str(shards), "--shard-size", str(SHARD_SIZE), "--quiet"],
                           env)
    # every caption's embedding stored beside its image once: what a run or a partition of a set too large for a
    # table of embeddings in memory reads (islands/data/captions.py)
    config.write_text(yaml.safe_dump({"run_dir": str(work / f"run-{n}"), "seed": 0, "data": {
        "source": "shards", "path": str(shards)}}))
    steps["encode (text)"] = timed([*islands, "encode", str(config), str(encoded), "--text-encoder", "minilm",
                                    "--text-tokens", str(TEXT_TOKENS), "--shard-size", str(SHARD_SIZE), "--quiet"],
                                   env)
    run = work / f"r-{n}.yaml"
    run.write_text(yaml.safe_dump({
        "run_dir": str(work / f"run-{n}"), "seed": 0, "data": {"source": "shards", "path": str(encoded)},
        "model": {"arch": "dit", "hidden_size": 32, "depth": 2, "num_heads": 2, "patch_size": 4,
                  "text_tokens": TEXT_TOKENS},
        "ddm": {"k": 4, "partition": {"features": "text"}}}))
    steps["run start"] = timed([sys.executable, "-c", START.format(batch=BATCH), str(run)], env)
    if "--skip-partition" not in sys.argv:  # the text encoder's pass over every caption: the slow one on a CPU
        steps["partition (text)"] = timed([*islands, "partition", str(run), "--quiet"], env)
    steps["loader"] = timed([sys.executable, "-c", LOADER.format(batch=BATCH, batches=LOADER_BATCHES), str(run)], env)
    steps["loader"]["examples_per_s"] = float(steps["loader"]["out"].split()[-1])
    steps["run start"]["start_seconds"] = float(steps["run start"]["out"].split()[-1])
    data_bytes = sum(p.stat().st_size for p in tars.iterdir())
    return {"examples": n, "tar_bytes": data_bytes, "make_seconds": made, "steps": steps}


def run() -> dict:
    setup()
    sizes = [int(a) for a in sys.argv[1:] if a.isdigit()] or list(SIZES)
    work = Path(os.environ.get("ISLANDS_BENCH_WORK") or tempfile.mkdtemp(prefix="islands-data-scale-"))
    env = {**os.environ, "OMP_NUM_THREADS": "2", "ISLANDS_CACHE": str(work / "cache")}
    since, results = cpu_seconds(), {}
    for n in sizes:
        results[n] = one_size(work / f"n{n}", n, env)
        print(f"  {n:,} examples: " + ", ".join(f"{k} {v['seconds']:.0f} s / {v['peak_mib']:.0f} MiB"
                                                for k, v in results[n]["steps"].items()), flush=True)
    others = others_share(since)
    small, large = sizes[0], sizes[-1]
    rows = []
    for step in [s for s in results[small]["steps"] if s in results[large]["steps"]]:
        a, b = results[small]["steps"][step], results[large]["steps"][step]
        rows.append([step, a["seconds"], b["seconds"], b["seconds"] / a["seconds"], a["peak_mib"], b["peak_mib"]])
    print(table(["step", f"s at {small:,}", f"s at {large:,}", "time ratio", f"MiB at {small:,}",
                 f"MiB at {large:,}"], rows))
    print(f"examples ratio {large / small:.0f}x; loader {results[small]['steps']['loader']['examples_per_s']:.0f} "
          f"and {results[large]['steps']['loader']['examples_per_s']:.0f} examples/s; other processes took "
          f"{others:.0%} of the CPUs")
    result = {"sizes": sizes, "results": {str(k): v for k, v in results.items()}, "table": rows,
              "others_cpu_share": others, "met": True}
    save("data_scale", result)
    print(json.dumps({str(k): {s: round(v["seconds"], 1) for s, v in r["steps"].items()} for k, r in results.items()}))
    return result


if __name__ == "__main__":
    run()
