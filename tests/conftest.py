import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from islands.config import validate
from islands.parallel.launch import run_local_ranks
from islands.rundir import save_weights

torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)  # two xdist workers share the 2 cores


def random_images(folder):
    """64 random 1x8x8 uint8 images with 4 labels in FOLDER/images.npz: a data set small enough for many short
    runs."""
    rng = np.random.default_rng(0)
    path = folder / "images.npz"
    np.savez(path, x=rng.integers(0, 256, size=(64, 1, 8, 8), dtype=np.uint8), y=np.arange(64) % 4)
    return path


@pytest.fixture
def image_npz(tmp_path):
    return random_images(tmp_path)


def run_ranks(argv: list[str], nproc: int = 2, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """`python -m islands ARGV` on `nproc` ranks started as torchrun starts them but without its agent, whose parser
    would take options such as --num for its own."""
    return run_local_ranks([sys.executable, "-m", "islands", *argv], nproc, timeout)


def rerecorded(ckpt) -> None:
    """A checkpoint whose files a test changed on purpose, its state.json's record of them rewritten to match (what
    an attacker who rewrote the record too would leave, or a test that moves weights by hand)."""
    import json

    from islands.rundir import checkpoint_files

    state = json.loads((ckpt / "state.json").read_text())
    (ckpt / "state.json").write_text(json.dumps({**state, "files": checkpoint_files(ckpt)}))


def write_config(path, cfg: dict) -> str:
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def tiny_unet_config(run_dir, data_path, **sections) -> dict:
    """A complete config dict for a tiny conditional U-Net on `image_npz`; sections update it."""
    cfg = {
        "run_dir": str(run_dir), "seed": 3,
        "data": {"source": "npz", "path": str(data_path), "flip": True},
        "model": {"arch": "unet", "num_classes": 4, "channels": 8, "channel_mult": [1, 2], "num_res_blocks": 1,
                  "attention_resolutions": [4], "dropout": 0.1},
        "train": {"images": 96, "batch_size": 8, "accumulate": 2, "lr": 1e-3, "warmup_images": 32,
                  "ema_halflife_images": 40, "checkpoint_every": 48, "log_every": 16, "sample_every": 48},
        "sample": {"num": 8, "steps": 4, "solver": "euler"},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values} if isinstance(values, dict) else values
    return cfg


def tiny_unet(run_dir, data_path, **sections):
    return validate(tiny_unet_config(run_dir, data_path, **sections))


@pytest.fixture
def float64():
    """Tensors built in float64 for the test's duration, for comparisons against closed forms."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture(autouse=True, scope="session")
def private_cache(tmp_path_factory):
    """Trained feature classifiers and reference statistics go to a fresh folder, never ~/.cache."""
    import os

    os.environ["ISLANDS_CACHE"] = str(tmp_path_factory.mktemp("cache"))


AUTOGROUP = Path("/proc/self/autogroup")  # where the kernel groups a session's processes (CONFIG_SCHED_AUTOGROUP)


def autogroup_nice() -> str | None:
    """The nice value of this session's scheduling group, or None where the kernel shows none: the file is absent
    without CONFIG_SCHED_AUTOGROUP, and empty in some containers (CI's read as empty)."""
    try:
        fields = AUTOGROUP.read_text().split()  # "/autogroup-623 nice 0"
    except OSError:
        return None
    return fields[2] if len(fields) == 3 and fields[1] == "nice" else None


def cpu_seconds() -> tuple[float, float]:
    """(CPU seconds the machine has been busy, of which this process and the children it waited for)."""
    ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    own = sum(u.ru_utime + u.ru_stime for u in usage)
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), own  # all but idle and iowait


@pytest.fixture(autouse=True)
def ahead_of_other_work(request):
    """A timed (serial) test and the processes it starts run ahead of whatever else the machine runs, where the user
    may raise priorities (root, as CI runs): on 2 cores another busy process slowed one-thread steps 2 to 3.5 times,
    by the second, so a prediction measured a few seconds before its run missed it by up to 50%. Yields the cores
    the rest of the machine kept busy on average meanwhile, for the test's message."""
    if request.node.get_closest_marker("serial") is None:
        yield None
        return
    nice, group_nice = os.getpriority(os.PRIO_PROCESS, 0), autogroup_nice()
    try:  # not root, or a container that forbids it: the test still runs, at normal priority
        os.setpriority(os.PRIO_PROCESS, 0, -20)
        raised = True
    except OSError:
        raised = False
    try:  # and the session's group: between sessions the kernel shares by group, whatever each process's nice
        if raised and group_nice is not None:
            AUTOGROUP.write_text("-20")
    except OSError:
        group_nice = None
    before, start = cpu_seconds(), time.perf_counter()

    def others_cores() -> float:
        machine, own = (now - then for now, then in zip(cpu_seconds(), before, strict=True))
        return (machine - own) / (time.perf_counter() - start)

    yield others_cores
    if raised:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        if group_nice is not None:
            AUTOGROUP.write_text(group_nice)


def installed_or_skip(paths, packages: str, what: str) -> None:
    """Skip a test that needs files Debian's `packages` install where one is absent, but fail in CI (CI=true, as
    root), where `make test` installs them: there their absence is a broken install, not a reason to pass with tests
    skipped."""
    import os

    missing = [str(p) for p in paths if not os.path.exists(p)]
    if not missing:
        return
    if os.environ.get("CI", "").lower() in ("true", "1") and os.geteuid() == 0:
        pytest.fail(f"{what} is missing from {missing[0]} in CI, where `make test` installs it "
                    f"(apt-get install {packages})", pytrace=False)
    pytest.skip(f"{packages} absent from {missing[0]} (make test installs it where it can)")


def fashion_mnist_or_skip(path=None) -> None:
    from islands.data import sources

    installed_or_skip([path or sources.FASHION_MNIST_DIR], "dataset-fashion-mnist", "Fashion-MNIST")


def emoji_or_skip() -> None:
    from islands.data import emoji

    installed_or_skip([emoji.EMOJI_FONT, emoji.EMOJI_TEST], "fonts-noto-color-emoji unicode-data",
                      "the emoji font or list")


# Squared, it overflows float32, so the loss of a batch holding it is inf, while its gradients (about 1e18) stay
# finite: alone it makes a rank's loss non-finite without making the averaged gradients so. (A NaN in the file
# itself is refused when the data is read.)
OVERFLOWING = 5e19


def poisoned_npz(path, x: np.ndarray, y: np.ndarray, steps, batch: int, seed: int, rank: int = 0, world: int = 1):
    """Write x, y as an npz where the first example that `rank` of `world` takes in each optimizer step of `steps`
    (1-based) is OVERFLOWING; the loader that will feed the run finds those examples."""
    import itertools

    from islands.data.loader import stream_loader
    from islands.data.registry import build_source

    np.savez(path, x=x, y=y)
    order = stream_loader(build_source("npz", path=path), batch, seed, start=0, rank=rank, world=world).batch_sampler
    for step, items in enumerate(itertools.islice(order, max(steps)), start=1):
        if step in steps:
            x[items[0][0]] = OVERFLOWING
    np.savez(path, x=x, y=y)
    return path


def a_feature_module(folder, name: str) -> str:
    """A user's feature network for 2-D points in FOLDER/NAME.py, which leaves FOLDER/imported when it is imported,
    and its weights beside it; returns 'NAME:build'."""
    (folder / f"{name}.py").write_text("import pathlib\n\nimport torch\n\n"
                                       "pathlib.Path(__file__).with_name('imported').touch()\n\n\n"
                                       "def build():\n    return torch.nn.Linear(2, 4)\n")
    save_weights(torch.nn.Linear(2, 4).state_dict(), folder / "features.safetensors")
    return f"{name}:build"
