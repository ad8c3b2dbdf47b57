"""An `AutoencoderKL` from a folder in the layout of the public SD VAEs (`config.json` and
`diffusion_pytorch_model.safetensors`), a user's or one Islands trained (RUN/autoencoder), read as untrusted input.

Exactly those two files are read, once each, from the folder itself (no link out of it: islands.untrusted.inside):
the weights in safetensors only, never a pickle, and the bytes that are hashed are the bytes that are loaded, since
diffusers' `from_pretrained(local_files_only=True, use_safetensors=True)` reads them from a private copy of the two
files. The config must name `AutoencoderKL` (diffusers builds no custom code for a model), is built on the meta device
first so that one the weights do not fit (`layers_per_block: 1e9`) is refused before anything is allocated, and its
latent scale must be finite and non-zero; weights that leave any of its parameters uninitialised, or hold others, are
refused instead of loaded half random.

A run that uses an autoencoder records its `sha256` and passes it back on every load, so a file changed under the run
stops it. That digest covers every file read, not the weights alone: `config.json` gives the weights their meaning (its
`scaling_factor`, `shift_factor` and `act_fn` change the images decoded from the same latents). It is `listing_sha256`
of the files read: the sha256 of the JSON list `[[name, sha256 of the file], ...]` in name order.
"""

import contextlib
import hashlib
import json
import math
import tempfile
from pathlib import Path

import torch

from islands.errors import DataError
from islands.nets.autoencoder import DiffusersAutoencoder
from islands.untrusted import check_fits, inside

CONFIG, WEIGHTS = "config.json", "diffusion_pytorch_model.safetensors"
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def listing_sha256(files: dict[str, str]) -> str:
    """The digest of a set of files read from a folder, from each one's name in the folder ('/' between folders) and
    its sha256: a file changed, added or dropped changes it."""
    return hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()


def _file(folder: Path, name: str, what: str) -> Path:
    """folder/name, refused unless it lies in the folder and is a file (a missing one says what the folder needs)."""
    path = inside(folder, name, what)
    if not path.is_file():
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLED) if folder.is_dir() else []
        if name == WEIGHTS and pickled:
            raise DataError(f"{what} {folder} holds pickled weights only ({', '.join(pickled)}); "
                            f"Islands reads safetensors only: convert them to {WEIGHTS}")
        raise DataError(f"{what} {folder}: {name} is missing (the layout of diffusers' save_pretrained: "
                        f"{CONFIG} and {WEIGHTS})")
    return path


def _read(folder: str | Path, what: str, classes: tuple[str, ...]) -> tuple[dict, bytes]:
    """(config, its bytes) of a diffusers folder that holds its weights in safetensors, refused unless the config
    names one of `classes` (a folder of one class may leave it unnamed) and its weights hold the network it builds."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{what} {folder} does not exist or is not a folder")
    config_path, weights_path = _file(folder, CONFIG, what), _file(folder, WEIGHTS, what)
    try:
        raw = config_path.read_bytes()
        config = json.loads(raw)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"{what} {folder}: {CONFIG} is not readable JSON ({err})") from None
    unnamed = classes[0] if len(classes) == 1 else None
    if not isinstance(config, dict) or config.get("_class_name", unnamed) not in classes:
        kind = config.get("_class_name") if isinstance(config, dict) else type(config).__name__
        expected = f"an {classes[0]}" if len(classes) == 1 else f"one of {', '.join(classes)}"
        raise DataError(f"{what} {folder}: {CONFIG} describes {kind!r}, not {expected}")
    _check_fits(config.get("_class_name", unnamed), config, weights_path, f"{what} {folder}: {CONFIG}")
    return config, raw


def _check_fits(class_name: str, config: dict, weights: Path, what: str) -> None:
    """The network `config` builds, built on the meta device under the budget of the weights' parameters: one that
    its weights do not fit (a billion layers) is refused in one line before anything is allocated."""
    import diffusers
    from diffusers.utils import logging as diffusers_logging

    arguments = {k: v for k, v in config.items() if not k.startswith("_")}
    with _quiet(diffusers_logging):  # from_config's warnings on keys this diffusers does not know
        check_fits(lambda: getattr(diffusers, class_name).from_config(arguments), [weights], what)


def read_config(folder: str | Path, what: str = "autoencoder folder",
                classes: tuple[str, ...] = ("AutoencoderKL",)) -> dict:
    """The config of a diffusers folder (`what`: an autoencoder's, by default) that holds its weights in safetensors,
    refused unless it names one of `classes` (a folder of one class may leave it unnamed) and its weights fit it."""
    return _read(folder, what, classes)[0]


def read_folder(folder: str | Path, what: str = "autoencoder folder",
                classes: tuple[str, ...] = ("AutoencoderKL",)) -> tuple[dict, bytes, str]:
    """(config, the weights' bytes, the digest of both files as read: `listing_sha256`) of a diffusers folder, checked
    as `read_config` checks it."""
    config, raw = _read(folder, what, classes)
    weights = _file(Path(folder), WEIGHTS, what).read_bytes()
    files = {CONFIG: hashlib.sha256(raw).hexdigest(), WEIGHTS: hashlib.sha256(weights).hexdigest()}
    return config, weights, listing_sha256(files)


def _finite(value) -> bool:
    try:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(float(value))
    except OverflowError:  # an integer past float's range
        return False


def _check_latent_scale(folder, config: dict) -> None:
    """z = (latent - shift) * scale: a scale of 0 or a NaN (which JSON readers accept) would make every latent 0 or
    NaN, and be written into the records of the latents."""
    scale, shift = config.get("scaling_factor", 0.18215), config.get("shift_factor")  # diffusers' defaults
    if not _finite(scale) or scale == 0:
        raise DataError(f"autoencoder folder {folder}: {CONFIG}'s scaling_factor {scale!r} is not a finite, non-zero "
                        "number")
    if shift is not None and not _finite(shift):
        raise DataError(f"autoencoder folder {folder}: {CONFIG}'s shift_factor {shift!r} is not a finite number")


def load_autoencoder(folder: str | Path, sha256: str | None = None, device="cpu") -> DiffusersAutoencoder:
    """The autoencoder in `folder`; with `sha256` (what the run recorded), refused unless its files still hash to it.
    Its `sha256` says what was loaded, for the run to record."""
    config, weights, digest = read_folder(folder)
    if sha256 is not None and digest != sha256:
        raise DataError(f"autoencoder folder {folder} changed since the run recorded it: its {CONFIG} and {WEIGHTS} "
                        f"hash to {digest[:12]}..., the run recorded {sha256[:12]}...")
    _check_latent_scale(folder, config)
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
