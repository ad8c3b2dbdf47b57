"""A run's start on tars indexed where they lie (issue 36, section 6): seconds from launch to the first step, bytes
read, resident memory per process and per loader worker, at 10k and 100k examples; `islands index` against `islands
shard` on the same tars; the loader on img2dataset-layout JPEG tars against the training step.

1. Webdataset tars of 4096 examples (`{key}.png` 32x32 RGB, `{key}.txt` a caption, `{key}.cls` a class: three
   members, 144 bytes of index and sha256 per example), written here with tarfile, indexed with `islands index`.
   A tiny one-step `islands train` on them (data.source shards, 2 loader workers) is launched as a subprocess and
   timed from its launch to its first optimizer step (a hook in the subprocess notes the time, /proc/self/io and the
   VmRSS and PSS of the process and of its workers, then lets the step run). The bytes it reads are counted apart,
   in a second launch under `strace -f -y`, by file: the tars, the index folder (manifest, indices, sha256 files),
   the rest (Python's own files). In-process, `build_data(check=True)` and the first batch (0 workers) are timed
   and their bytes counted by /proc/self/io's rchar; "before section 5" adds to that the sha256 of every tar, which
   the start made before (and a shard folder of format /1 still makes).
2. `islands index` and `islands shard` (reading the indexed tars as its source, writing its own shards) on the
   same tars, as subprocesses: examples/s and MB/s of tar read.
3. img2dataset-layout tars (`{key}.jpg` 256x256 quality 90, `{key}.txt`, `{key}.json`; `_stats.json` and
   `.parquet` beside) indexed and read at data.resolution 64 by `stream_loader` at 0, 1 and 2 workers, against the
   bare bf16 training step of configs/fashion_mnist.yaml's U-Net at batch 128 (benchmarks/loader.py's), each ratio
   taken within its round.

    python -m benchmarks data_startup
"""

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from benchmarks.common import FIGURES, cpu_seconds, median, others_share, save, setup, table

SIZES = (10_000, 100_000)
PER_TAR = 4096
POOL = 2048  # distinct images, reused in turn (every one is decoded while indexing all the same)
RESOLUTION = 32
RUN_BATCH = 64
WORKERS = 2
STARTS = 3  # timed launches per size, alternating between sizes
JPEGS = 4096
JPEG_SIDE = 256
JPEG_RESOLUTION = 64
LOADER_ROUNDS = 3
LOADER_BATCHES = 12  # timed batches of 128 per loader and round, after the workers' start and a full queue
ROOT = Path(__file__).parent.parent
MB = 1e6

HOOK = r"""
import json, os, sys, time
t0 = float(os.environ["DATA_STARTUP_T0"])
import islands.trainer.loop as loop
import islands.trainer.parts as parts
when = {}

def status(pid, key):
    try:
        for line in open(f"/proc/{pid}/{'status' if key == 'VmRSS' else 'smaps_rollup'}"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None

def io_of(pid):
    try:
        return {k: int(v) for k, v in (line.split(": ") for line in open(f"/proc/{pid}/io"))}
    except OSError:
        return {}

real_build = parts.build_data

def build_data(*args, **kwargs):
    when["build_data_called"] = time.time() - t0
    try:
        return real_build(*args, **kwargs)
    finally:
        when["build_data_returned"] = time.time() - t0

real_batches = loop.training_batches

def training_batches(*args, **kwargs):
    when["first_batch_asked"] = time.time() - t0
    with open(os.environ["DATA_STARTUP_MARK"], "rb") as mark:  # under strace: the start ends here
        mark.read()
    yield from real_batches(*args, **kwargs)

real_step = loop.optimizer_step

def optimizer_step(*args, **kwargs):
    if "first_step" not in when:
        when["first_step"] = time.time() - t0
        me = os.getpid()
        children = [int(c) for t in os.listdir(f"/proc/{me}/task")
                    for c in open(f"/proc/{me}/task/{t}/children").read().split()]
        json.dump({"seconds": when["first_step"], "when": when, "io": io_of(me), "rss": status(me, "VmRSS"),
                   "pss": status(me, "Pss"), "workers": [{"rss": status(c, "VmRSS"), "pss": status(c, "Pss"),
                                                           "io": io_of(c)} for c in children]},
                  open(os.environ["DATA_STARTUP_OUT"], "w"))
    return real_step(*args, **kwargs)

parts.build_data, loop.training_batches, loop.optimizer_step = build_data, training_batches, optimizer_step
from islands.cli import main
sys.exit(main(sys.argv[1:]))
"""


# --- the data ---------------------------------------------------------------------------------------------------------

def _images(count: int, side: int, fmt: str, seed: int) -> list[bytes]:
    """`count` textured RGB images (a random coarse grid upsampled, plus grain), encoded as `fmt`."""
    rng, out = np.random.default_rng(seed), []
    for _ in range(count):
        coarse = Image.fromarray(rng.integers(0, 256, (max(4, side // 32),) * 2 + (3,), dtype=np.uint8))
        img = np.asarray(coarse.resize((side, side), Image.BICUBIC)).astype(np.int16)
        img = np.clip(img + rng.integers(-12, 13, img.shape), 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(img).save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        out.append(buffer.getvalue())
    return out


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 1_700_000_000
    tar.addfile(info, io.BytesIO(data))


def write_png_tars(folder: Path, examples: int, pool: list[bytes]) -> None:
    """webdataset's layout (ShardWriter's): `{key}.cls`, `{key}.png`, `{key}.txt` per example, 4096 to a tar."""
    folder.mkdir(parents=True)
    for t, lo in enumerate(range(0, examples, PER_TAR)):
        with tarfile.open(folder / f"data-{t:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(lo, min(examples, lo + PER_TAR)):
                key = f"{i:09d}"
                _add(tar, f"{key}.cls", str(i % 10).encode())
                _add(tar, f"{key}.png", pool[i % len(pool)])
                _add(tar, f"{key}.txt", f"a synthetic picture, number {i}, of class {i % 10}".encode())


def write_img2dataset_tars(folder: Path, examples: int, pool: list[bytes]) -> None:
    """img2dataset's layout: keys `{shard:05d}{index:04d}`, members `.jpg`, `.json`, `.txt` in sorted order,
    `_stats.json` and `.parquet` beside each tar."""
    folder.mkdir(parents=True)
    per_tar = examples // 2
    for t in range(2):
        with tarfile.open(folder / f"{t:05d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for k in range(per_tar):
                key, caption = f"{t:05d}{k:04d}", f"a photo of texture {t}-{k}"
                meta = {"url": f"http://example.com/{key}.jpg", "key": key, "status": "success", "caption": caption,
                        "width": JPEG_SIDE, "height": JPEG_SIDE, "error_message": None}
                _add(tar, f"{key}.jpg", pool[(t * per_tar + k) % len(pool)])
                _add(tar, f"{key}.json", json.dumps(meta).encode())
                _add(tar, f"{key}.txt", caption.encode())
        (folder / f"{t:05d}_stats.json").write_text(json.dumps({"count": per_tar, "successes": per_tar}))
        (folder / f"{t:05d}.parquet").write_bytes(b"PAR1 not read by islands index")


def tar_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.tar"))


# --- subprocesses -----------------------------------------------------------------------------------------------------

def islands(*args, env=None) -> float:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "islands", *map(str, args), "--quiet"], capture_output=True,
                            text=True, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return time.perf_counter() - start


def run_config(tmp: Path, index: Path, name: str) -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "run_dir": str(tmp / "runs" / name), "seed": 0,
        "data": {"source": "shards", "path": str(index), "resolution": RESOLUTION, "workers": WORKERS},
        "model": {"arch": "unet", "num_classes": 10, "channels": 8, "channel_mult": [1, 2], "num_res_blocks": 1,
                  "attention_resolutions": []},
        "train": {"images": RUN_BATCH, "batch_size": RUN_BATCH, "lr": 1e-3, "ema_halflife_images": 0,
                  "checkpoint_every": RUN_BATCH, "sample_every": 0, "log_every": RUN_BATCH, "threads": 2},
        "sample": {"num": 4, "steps": 1, "solver": "euler"},
    }, sort_keys=False))
    return path


def launch(tmp: Path, index: Path, name: str, strace: bool = False) -> dict:
    """One `islands train` of one step from launch: the hook's record, the whole run's seconds, and under strace
    the bytes each kind of file gave to read(2)/pread64(2) calls."""
    config = run_config(tmp, index, name)
    shutil.rmtree(tmp / "runs" / name, ignore_errors=True)
    cache = tmp / "cache" / name  # a cold start: nothing remembered of an earlier check
    shutil.rmtree(cache, ignore_errors=True)
    out, trace = tmp / f"{name}.json", tmp / f"{name}.strace"
    command = [sys.executable, "-c", HOOK, "train", str(config), "--quiet"]
    if strace:
        command = ["strace", "-f", "-y", "-qq", "-s", "0", "-e", "signal=none", "-o", str(trace),
                   "-e", "trace=read,pread64,readv,preadv,preadv2", *command]
    mark = tmp / "start-ends-here"
    mark.write_bytes(b"mark")
    env = {**os.environ, "ISLANDS_CACHE": str(cache), "DATA_STARTUP_OUT": str(out), "DATA_STARTUP_MARK": str(mark)}
    env["DATA_STARTUP_T0"] = repr(time.time())
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    whole = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    record = {**json.loads(out.read_text()), "whole_run_seconds": whole}
    if strace:
        record["read_by_file"] = _bytes_by_file(trace, index, mark)
        trace.unlink()
    return record


CALL = re.compile(r"^\d+\s+(?:read|pread64|readv|preadv2?)\((\d+)<([^>]*)>.*\)\s+=\s+(\d+)")


def _bytes_by_file(trace: Path, index: Path, mark: Path) -> dict:
    """Bytes returned by the read calls of every process of the run, by kind of file, before the loader is asked for
    its first batch (the start: up to the read of `mark`) and after it (the loader's first batches, up to the end of
    the run). The index folder's files are named by their real path; a tar by its `.tar` name."""
    got = {f"{kind}_{when}": 0 for when in ("start", "batches") for kind in ("tars", "index_folder", "other")}
    got |= {"tar_reads_start": 0, "tar_reads_batches": 0}
    folder, marker, when = str(index.resolve()), str(mark.resolve()), "start"
    for line in trace.read_text(errors="replace").splitlines():
        m = CALL.match(line)
        if not m:
            continue
        path, n = m.group(2), int(m.group(3))
        if path == marker:
            when = "batches"
        elif path.endswith(".tar"):
            got[f"tars_{when}"] += n
            got[f"tar_reads_{when}"] += 1
        elif path.startswith(folder + "/"):
            got[f"index_folder_{when}"] += n
        else:
            got[f"other_{when}"] += n
    return got


# --- in-process -------------------------------------------------------------------------------------------------------

def rchar() -> int:
    return int(next(line for line in open("/proc/self/io") if line.startswith("rchar:")).split()[1])


def in_process_start(tmp: Path, index: Path, name: str, before: bool = False) -> dict:
    """build_data(check=True) and the first batch, in this process, cold (its own cache folder), with /proc/self/io's
    rchar over it; `before`: every tar hashed whole too, as the start did before section 5."""
    from islands.config import validate
    from islands.data import build_data
    from islands.data.loader import stream_loader
    from islands.untrusted import file_sha256

    cfg = validate(yaml.safe_load(run_config(tmp, index, name).read_text()))
    old = os.environ.get("ISLANDS_CACHE")
    os.environ["ISLANDS_CACHE"] = str(tmp / "cache" / f"{name}-in")
    shutil.rmtree(os.environ["ISLANDS_CACHE"], ignore_errors=True)
    try:
        r0, t0 = rchar(), time.perf_counter()
        source = build_data(cfg.data, 0, check=True)
        t1 = time.perf_counter()
        hashed = [file_sha256(t) for t in source.tars] if before else []
        r1, t2 = rchar(), time.perf_counter()
        next(iter(stream_loader(source, RUN_BATCH, seed=0, workers=0)))
        t3 = time.perf_counter()
        r2 = rchar()
    finally:
        if old is None:
            del os.environ["ISLANDS_CACHE"]
        else:
            os.environ["ISLANDS_CACHE"] = old
    return {"build_seconds": t1 - t0, "hash_seconds": t2 - t1, "first_batch_seconds": t3 - t2,
            "seconds": t3 - t0, "start_seconds": t2 - t0, "rchar_start": r1 - r0, "rchar_first_batch": r2 - r1,
            "tars_hashed": len(hashed)}


# --- 3: the loader on JPEG tars ---------------------------------------------------------------------------------------

def loader_rate(source, workers: int, round_: int, batch: int) -> float:
    from islands.data.loader import stream_loader

    loader = iter(stream_loader(source, batch, seed=round_, start=round_ * 7 * batch, workers=workers))
    for _ in range(2 + 4 * workers):
        next(loader)
    start = time.perf_counter()
    for _ in range(LOADER_BATCHES):
        next(loader)
    rate = LOADER_BATCHES * batch / (time.perf_counter() - start)
    del loader
    return rate


def jpeg_loader(tmp: Path) -> dict:
    from benchmarks.common import BareLoop, build_net
    from benchmarks.loader import BATCH, CONFIG, PRECISION, step_rate
    from islands.data.shards import ShardSource

    pool = _images(512, JPEG_SIDE, "JPEG", seed=1)
    write_img2dataset_tars(tmp / "laion", JPEGS, pool)
    seconds = islands("index", tmp / "laion", tmp / "laion-index")
    source = ShardSource(tmp / "laion-index", resolution=JPEG_RESOLUTION)
    print(f"  {len(source)} img2dataset-layout examples ({tar_bytes(tmp / 'laion') / MB:.0f} MB of tars, JPEG "
          f"{np.mean([len(p) for p in pool]) / 1e3:.1f} kB) indexed in {seconds:.1f} s", flush=True)
    loop = BareLoop(build_net(yaml.safe_load(CONFIG.read_text())["model"]), PRECISION, batch=BATCH)
    rounds, since = [], cpu_seconds()
    for r in range(LOADER_ROUNDS):
        measured = {"step": step_rate(loop)}
        for workers in (0, 1, 2):
            measured[f"{workers} workers"] = loader_rate(source, workers, r, BATCH)
        rounds.append(measured)
        print(f"  round {r + 1}/{LOADER_ROUNDS}: step {measured['step']:.0f} img/s, loader "
              + ", ".join(f"{measured[f'{w} workers']:.0f}" for w in (0, 1, 2)) + " ex/s at 0, 1, 2 workers",
              flush=True)
    others = others_share(since)
    rows = [[f"training step (Fashion U-Net, {PRECISION}, batch {BATCH})", median([m["step"] for m in rounds]), 1.0]]
    for workers in (0, 1, 2):
        key = f"{workers} workers"
        rows.append([f"indexed JPEG tars at {JPEG_RESOLUTION}, {key}", median([m[key] for m in rounds]),
                     median([m[key] / m["step"] for m in rounds])])
    return {"examples": len(source), "tar_bytes": tar_bytes(tmp / "laion"), "index_seconds": seconds,
            "jpeg_bytes_mean": float(np.mean([len(p) for p in pool])), "rounds": rounds, "table": rows,
            "others_cpu_share": others, "precision": PRECISION, "batch": BATCH}


# --- the whole ------------------------------------------------------------------------------------------------------

def run() -> dict:
    setup()
    have_strace = shutil.which("strace") is not None
    assert have_strace, "strace counts the bytes each file gives a run: apt-get install strace"
    result = {"settings": {"sizes": SIZES, "per_tar": PER_TAR, "resolution": RESOLUTION, "run_batch": RUN_BATCH,
                           "workers": WORKERS, "starts": STARTS, "pool": POOL, "jpegs": JPEGS,
                           "jpeg_side": JPEG_SIDE, "jpeg_resolution": JPEG_RESOLUTION}}
    since_all = cpu_seconds()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pool = _images(POOL, RESOLUTION, "PNG", seed=0)
        data = {}
        for n in SIZES:
            start = time.perf_counter()
            write_png_tars(tmp / f"tars-{n}", n, pool)
            written = time.perf_counter() - start
            index_s = islands("index", tmp / f"tars-{n}", tmp / f"index-{n}")
            files = list((tmp / f"index-{n}").iterdir())
            data[n] = {"tar_bytes": tar_bytes(tmp / f"tars-{n}"), "tars": len(list((tmp / f"tars-{n}").glob("*.tar"))),
                       "write_seconds": written, "index_seconds": index_s,
                       "index_folder_bytes": sum(p.stat().st_size for p in files),
                       "manifest_bytes": (tmp / f"index-{n}" / "manifest.json").stat().st_size}
            print(f"  {n} examples: {data[n]['tars']} tars, {data[n]['tar_bytes'] / MB:.0f} MB, written in "
                  f"{written:.1f} s, islands index {index_s:.1f} s; index folder "
                  f"{data[n]['index_folder_bytes'] / MB:.2f} MB ({data[n]['index_folder_bytes'] / n:.0f} "
                  "bytes/example)", flush=True)

        # 2. islands shard of the smaller set's indexed tars, beside islands index of the same tars
        n = SIZES[0]
        config = run_config(tmp, tmp / f"index-{n}", "shard")
        shard_s = islands("shard", config, tmp / "own")
        index_again = islands("index", tmp / f"tars-{n}", tmp / "index-again")
        shard = {"examples": n, "shard_seconds": shard_s, "index_seconds": index_again,
                 "shard_out_bytes": tar_bytes(tmp / "own")}
        print(f"  {n} examples: islands shard {shard_s:.1f} s, islands index again {index_again:.1f} s", flush=True)

        # 1. the start: launches alternating between sizes; one traced launch per size; in-process, cold
        launches = {n: [] for n in SIZES}
        for k in range(STARTS):
            for n in SIZES:
                launches[n].append(launch(tmp, tmp / f"index-{n}", f"run-{n}"))
            print(f"  launch {k + 1}/{STARTS}: " + ", ".join(
                f"{n}: first step at {launches[n][-1]['seconds']:.2f} s" for n in SIZES), flush=True)
        traced = {n: launch(tmp, tmp / f"index-{n}", f"traced-{n}", strace=True) for n in SIZES}
        in_process_start(tmp, tmp / f"index-{SIZES[0]}", "warm-up")  # imports and first-call costs, not measured
        inproc, before = {n: [] for n in SIZES}, {n: [] for n in SIZES}
        for _ in range(STARTS):
            for n in SIZES:
                inproc[n].append(in_process_start(tmp, tmp / f"index-{n}", f"in-{n}"))
                before[n].append(in_process_start(tmp, tmp / f"index-{n}", f"before-{n}", before=True))

        # 3. the loader on JPEG tars
        jpeg = jpeg_loader(tmp)
    others = others_share(since_all)

    # --- tables
    start_rows, byte_rows, memory_rows = [], [], []
    for n in SIZES:
        d, ls, rb = data[n], launches[n], traced[n]["read_by_file"]
        at = {k: median([r["when"][k] for r in ls]) for k in ls[0]["when"]}
        d.update(launch_seconds=median([r["seconds"] for r in ls]), launch_seconds_all=[r["seconds"] for r in ls],
                 launch_when=at, whole_run_seconds=median([r["whole_run_seconds"] for r in ls]),
                 in_process_seconds=median([r["seconds"] for r in inproc[n]]),
                 in_process_start_seconds=median([r["start_seconds"] for r in inproc[n]]),
                 before_start_seconds=median([r["start_seconds"] for r in before[n]]),
                 in_process_all=inproc[n], before_all=before[n],
                 rchar_start=median([r["rchar_start"] for r in inproc[n]]),
                 rchar_first_batch=median([r["rchar_first_batch"] for r in inproc[n]]),
                 traced=traced[n], rss=median([r["rss"] for r in ls]), pss=median([r["pss"] or 0 for r in ls]),
                 worker_rss=median([w["rss"] for r in ls for w in r["workers"]]),
                 worker_pss=median([w["pss"] or 0 for r in ls for w in r["workers"]]),
                 workers_seen=[len(r["workers"]) for r in ls])
        start_rows.append([n, d["launch_seconds"], at["build_data_called"],
                           at["build_data_returned"] - at["build_data_called"], at["first_batch_asked"],
                           d["launch_seconds"] - at["first_batch_asked"], d["in_process_start_seconds"],
                           d["before_start_seconds"],
                           d["launch_seconds"] + d["before_start_seconds"] - d["in_process_start_seconds"]])
        byte_rows.append([n, d["tar_bytes"], rb["tars_start"], f"{100 * rb['tars_start'] / d['tar_bytes']:.4f}%",
                          rb["index_folder_start"], f"{rb['index_folder_start'] / n:.0f}", d["rchar_start"],
                          rb["other_start"], rb["tars_batches"], f"{100 * rb['tars_batches'] / d['tar_bytes']:.2f}%"])
        memory_rows.append([n, d["rss"] / 2**20, d["pss"] / 2**20, d["worker_rss"] / 2**20, d["worker_pss"] / 2**20])
    n = shard["examples"]
    throughput_rows = [["islands index", shard["index_seconds"], n / shard["index_seconds"],
                        data[n]["tar_bytes"] / MB / shard["index_seconds"], 1.0],
                       ["islands shard (reading the indexed tars)", shard["shard_seconds"], n / shard["shard_seconds"],
                        data[n]["tar_bytes"] / MB / shard["shard_seconds"],
                        shard["shard_seconds"] / shard["index_seconds"]]]
    throughput_rows += [[f"islands index, {n} examples", data[n]["index_seconds"], n / data[n]["index_seconds"],
                         data[n]["tar_bytes"] / MB / data[n]["index_seconds"], "-"] for n in SIZES]
    print(table(["examples", "launch to first step, s", "to build_data", "build_data(check)",
                 "to first batch asked", "first batch (2 workers)", "in-process start, s",
                 "in-process start, tars hashed (before), s", "launch to first step before (estimate)"],
                start_rows))
    print(table(["examples", "data (tar bytes)", "tar bytes read at start", "of the data",
                 "index folder bytes read at start", "per example", "in-process rchar of the start",
                 "other files read at start (Python, torch)", "tar bytes the first batches read", "of the data"],
                byte_rows))
    print(table(["examples", "main RSS MiB", "main PSS MiB", "worker RSS MiB", "worker PSS MiB"], memory_rows))
    print(table(["command", "seconds", "examples/s", "MB/s of tars", "seconds over index's"], throughput_rows))
    print(table(["consumer or loader", "examples/s (median)", "over the step (median of rounds)"], jpeg["table"]))

    small, large = (data[n] for n in SIZES)
    growth = large["launch_seconds"] / small["launch_seconds"]
    fraction = max(data[n]["traced"]["read_by_file"]["tars_start"] / data[n]["tar_bytes"] for n in SIZES)
    index_fraction = max(data[n]["traced"]["read_by_file"]["index_folder_start"] / data[n]["tar_bytes"]
                         for n in SIZES)
    read, flat = fraction < 0.01, growth <= 1.25
    met = read and flat
    print(f"target bytes of the data (the tars) read at start < 1%: {'met' if read else 'NOT met'} "
          f"({100 * fraction:.4f}%); with the index folder read at start counted too: "
          f"{'under' if fraction + index_fraction < 0.01 else 'NOT under'} 1% ({100 * index_fraction:.2f}% of the "
          f"tars' size); start-up flat from {SIZES[0]} to {SIZES[1]} examples (<= 1.25x): "
          f"{'met' if flat else 'NOT met'} ({growth:.2f}x); the loader on JPEG tars at 2 workers "
          f"{jpeg['table'][3][2]:.1f}x the step; other processes took {others:.0%} of the CPUs")
    result.update(data={str(n): data[n] for n in SIZES}, shard=shard, jpeg_loader=jpeg, start_rows=start_rows,
                  byte_rows=byte_rows, memory_rows=memory_rows, throughput_rows=throughput_rows, growth=growth,
                  fraction_read=fraction, index_fraction=index_fraction, met=met, bytes_met=read, flat=flat,
                  others_cpu_share=others)
    figure(data)
    save("data_startup", result)
    return result


def figure(data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = list(SIZES)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(n, [data[k]["launch_seconds"] for k in n], "o-", label="islands train: launch to first step")
    a.plot(n, [data[k]["launch_when"]["build_data_returned"] - data[k]["launch_when"]["build_data_called"]
               for k in n], "s-", label="of which build_data(check=True)")
    a.plot(n, [data[k]["before_start_seconds"] for k in n], "^--",
           label="build_data + every tar hashed (before section 5)")
    a.set(xscale="log", yscale="log", xlabel="examples", ylabel="seconds", title="Start-up")
    a.legend(fontsize=8)
    b.plot(n, [data[k]["tar_bytes"] for k in n], "k--", label="the data's tar bytes (read at start before section 5)")
    b.plot(n, [data[k]["traced"]["read_by_file"]["index_folder_start"] for k in n], "s-",
           label="manifest, indices, sha256 files read at start")
    b.plot(n, [data[k]["traced"]["read_by_file"]["tars_batches"] for k in n], "o:",
           label="tar bytes the first batches read (after the start)")
    b.text(0.03, 0.94, "tar bytes read at start: " + ", ".join(
        str(data[k]["traced"]["read_by_file"]["tars_start"]) for k in n), fontsize=8, transform=b.transAxes)
    b.set(xscale="log", yscale="log", xlabel="examples", ylabel="bytes", title="Bytes read at start")
    b.legend(fontsize=8)
    fig.tight_layout()
    FIGURES.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURES / "data_startup.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    run()
