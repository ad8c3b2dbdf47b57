"""An `AutoencoderKL` from a folder in the layout of the public SD VAEs (`config.json` and
`diffusion_pytorch_model.safetensors`), a user's or one Islands trained (RUN/autoencoder), read as untrusted input.

Exactly those two files are read, once each, from the folder itself (no link out of it): the weights in safetensors
only, never a pickle, and the bytes that are hashed are the bytes that are loaded, since diffusers'
`from_pretrained(local_files_only=True, use_safetensors=True)` reads them from a private copy of the two files. The
config must name `AutoencoderKL` (diffusers builds no custom code for a model), and weights that leave any of its
parameters uninitialised, or hold others, are refused instead of loaded half random. A run that uses an autoencoder
records its `sha256` and passes it back on every load, so a file changed under the run stops it.
"""

import contextlib
import hashlib
import json
import tempfile
from pathlib import Path

import torch

from islands.errors import DataError
from islands.nets.autoencoder import DiffusersAutoencoder

CONFIG, WEIGHTS = "config.json", "diffusion_pytorch_model.safetensors"
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def _inside(folder: Path, name: str, what: str) -> Path:
    """folder/name, refused unless it is a file that lies in the folder (a link out of it is not)."""
    path = folder / name
    if not path.is_file():
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLED) if folder.is_dir() else []
        if name == WEIGHTS and pickled:
            raise DataError(f"{what} {folder} holds pickled weights only ({', '.join(pickled)}); "
                            f"Islands reads safetensors only: convert them to {WEIGHTS}")
        raise DataError(f"{what} {folder}: {name} is missing (the layout of diffusers' save_pretrained: "
                        f"{CONFIG} and {WEIGHTS})")
    if path.resolve().parent != folder.resolve():
        raise DataError(f"{what} {folder}: {name} leads out of the folder (to {path.resolve()})")
    return path


def read_config(folder: str | Path, what: str = "autoencoder folder",
                classes: tuple[str, ...] = ("AutoencoderKL",)) -> dict:
    """The config of a diffusers folder (`what`: an autoencoder's, by default) that holds its weights in safetensors,
    refused unless it names one of `classes` (a folder of one class may leave it unnamed)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{what} {folder} does not exist or is not a folder")
    config_path, _ = _inside(folder, CONFIG, what), _inside(folder, WEIGHTS, what)
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{what} {folder}: {CONFIG} is not readable JSON ({err})") from None
    unnamed = classes[0] if len(classes) == 1 else None
    if not isinstance(config, dict) or config.get("_class_name", unnamed) not in classes:
        kind = config.get("_class_name") if isinstance(config, dict) else type(config).__name__
        expected = f"an {classes[0]}" if len(classes) == 1 else f"one of {', '.join(classes)}"
        raise DataError(f"{what} {folder}: {CONFIG} describes {kind!r}, not {expected}")
    return config


def read_folder(folder: str | Path, what: str = "autoencoder folder",
                classes: tuple[str, ...] = ("AutoencoderKL",)) -> tuple[dict, bytes, str]:
    """(config, the weights' bytes, their sha256) of a diffusers folder, checked as `read_config` checks it."""
    config = read_config(folder, what, classes)
    weights = _inside(Path(folder), WEIGHTS, what).read_bytes()
    return config, weights, hashlib.sha256(weights).hexdigest()


def load_autoencoder(folder: str | Path, sha256: str | None = None, device="cpu") -> DiffusersAutoencoder:
    """The autoencoder in `folder`; with `sha256` (what the run recorded), refused unless its weights still hash to
    it. Its `sha256` says what was loaded, for the run to record."""
    config, weights, digest = read_folder(folder)
    if sha256 is not None and digest != sha256:
        raise DataError(f"autoencoder folder {folder}: {WEIGHTS} changed since the run recorded it "
                        f"(sha256 {digest[:12]}..., recorded {sha256[:12]}...)")
    from diffusers import AutoencoderKL
    from diffusers.utils import logging as diffusers_logging

    # from_pretrained initialises the model before loading it: the global generator, which seeds a run's network,
    # is left as it was
    with (tempfile.TemporaryDirectory(prefix="islands-vae-") as private, _quiet(diffusers_logging),
          torch.random.fork_rng(devices=[])):
        (Path(private) / CONFIG).write_text(json.dumps(config))
        (Path(private) / WEIGHTS).write_bytes(weights)
        try:
            vae, info = AutoencoderKL.from_pretrained(private, local_files_only=True, use_safetensors=True,
                                                      low_cpu_mem_usage=False, output_loading_info=True)
        except (ValueError, TypeError, KeyError, RuntimeError, OSError) as err:
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise DataError(f"autoencoder folder {folder} cannot be loaded as an AutoencoderKL: {reason}") from None
    wrong = {k: v for k in ("missing_keys", "mismatched_keys", "unexpected_keys") if (v := info.get(k))}
    if wrong:
        kind, names = next(iter(wrong.items()))
        raise DataError(f"autoencoder folder {folder}: {WEIGHTS} does not fit its {CONFIG} "
                        f"({kind.replace('_', ' ')}: {', '.join(map(str, names[:3]))}"
                        f"{', ...' if len(names) > 3 else ''})")
    return DiffusersAutoencoder(vae, digest).to(device)


@contextlib.contextmanager
def _quiet(diffusers_logging):
    """diffusers' own warnings off while loading: what matters is refused above, in one line."""
    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(level)
