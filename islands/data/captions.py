"""A text-conditioned run's condition (`model.condition: text`): each example's caption, encoded once by the run's
text encoder (`data.text_encoder`) into a table of packed embeddings (islands/nets/condition.pack_text), which the
source hands the loader in place of a label. Training never runs the text encoder: the table is computed when the
run starts (or read from the cache, keyed on the encoder's weights, the token count and every caption), so a caption's
embedding is the same at every step and after a resume. Captions longer than `model.text_tokens` tokens are cut.

The run records the encoder (RUN/text_encoder.json: its name and the digest of every file it is read from, its
config and tokenizer as well as its weights: text_folder.py) and every later start and every prompt it samples from
is encoded by that same encoder or refused.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from islands.data.conditions import WithCaptionEmbeddings
from islands.data.encode import npy_bytes
from islands.data.fingerprint import cache_dir
from islands.data.shards import CAPTION_MEMBER, CaptionEmbeddings, ExampleWriter
from islands.data.sources import Source
from islands.errors import DataError
from islands.nets.condition import pack_text
from islands.nets.text_encoder import TextEncoder
from islands.nets.text_folder import MINILM_SHA256, open_text_encoder
from islands.rundir import WeightsRecord, latest_checkpoint, recorded_weights


class TextEncoderRecord(WeightsRecord):
    """RUN/text_encoder.json: the text encoder a text-conditioned run names, and its files' digest."""

    FILE: ClassVar[str] = "text_encoder.json"
    text_encoder: str
BATCH = 256  # captions encoded at once
KNOWN_BYTES = 256 * 2**20  # what a writer keeps of captions it encoded, for the captions that come again


def encode_captions(encoder: TextEncoder, captions: list[str], tokens: int, progress: bool = False,
                    known: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Captions -> their packed embeddings (n, 1 + tokens, D + 1), float32 on the CPU, `BATCH` at a time. Each
    distinct caption is encoded once (captions repeat: class names, templates, alt text copied across pages), and
    none that `known` holds already; what is encoded is added to `known`."""
    known = {} if known is None else known
    missing = [c for c in dict.fromkeys(captions) if c not in known]
    for lo in tqdm(range(0, len(missing), BATCH), disable=not progress, desc="captions", unit="batch"):
        e = encoder.encode(missing[lo:lo + BATCH], pad_to=tokens)
        packed = pack_text(e.tokens.float(), e.mask, e.pooled.float()).cpu()
        known.update(zip(missing[lo:lo + BATCH], packed, strict=True))
    return torch.stack([known[c] for c in captions])


def caption_table(source: Source, encoder: TextEncoder, tokens: int, progress: bool = False) -> torch.Tensor:
    """Every caption of `source` encoded, read from the cache where the same encoder (by its files' digest) encoded
    the same captions at the same token count before. The table is held whole: a set whose table would not fit in
    memory is refused, and encoded into its shards instead (`islands encode --text-encoder`), which a run reads
    example by example."""
    row = (1 + tokens) * (max(encoder.width, encoder.pooled_width) + 1) * 4
    needed, available = len(source) * row, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 2 * needed > available:  # the table, and the rows it is stacked from
        raise DataError(f"data.path: {len(source):,} captions make a {needed / 2**30:.1f} GiB table of embeddings "
                        f"(held twice while it is made), more than half of this machine's {available / 2**30:.1f} "
                        "GiB; encode them into the shards once with `islands encode CONFIG OUT --text-encoder NAME`")
    captions = source.captions(range(len(source)))
    key = hashlib.sha256(json.dumps([encoder.sha256, tokens, captions]).encode()).hexdigest()
    path = cache_dir() / "captions" / f"{key}.safetensors"
    if path.exists():  # written whole by this code (renamed into place), read without unpickling
        return load_file(path)["table"]
    table = encode_captions(encoder, captions, tokens, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")  # ranks of one machine may write it at once
    save_file({"table": table.contiguous()}, partial)
    partial.replace(path)
    return table


def recorded_text_encoder(run_dir: Path) -> str | None:
    """The digest of the text encoder's files a run trained with (RUN/text_encoder.json), None without one."""
    return recorded_weights(run_dir, TextEncoderRecord)


def open_run_text_encoder(cfg, sha256: str | None, device="cpu") -> TextEncoder:
    """The text encoder `cfg` names, checked against `sha256` (what the run or ensemble recorded; None: unbound) and
    against the widths its network was built for."""
    encoder = open_text_encoder(cfg.data.text_encoder, sha256, device)
    model = cfg.model
    if (encoder.width, encoder.pooled_width) != (model.text_width, model.text_pooled_width):
        raise DataError(f"data.text_encoder: {cfg.data.text_encoder} gives {encoder.width}-wide tokens and a "
                        f"{encoder.pooled_width}-wide pooled vector; the network reads {model.text_width} and "
                        f"{model.text_pooled_width}")
    return encoder


def condition_on_captions(cfg, run_dir: Path, source: Source, device="cpu", progress: bool = False) -> Source:
    """`source` as a text-conditioned run reads it: each example with its caption's embedding, stored beside it in
    shards or encoded now (islands/conditions/text.py)."""
    if source.stored_captions is not None:
        return WithCaptionEmbeddings(source, None, _check_stored(cfg, run_dir, source.stored_captions))
    if not source.captioned:
        raise DataError(f"model.condition: text, but the data ({cfg.data.source}) has no captions")
    bound = latest_checkpoint(run_dir) is not None  # a start binds once the run has trained on the encoder
    encoder = open_run_text_encoder(cfg, recorded_text_encoder(run_dir) if bound else None, device)
    return WithCaptionEmbeddings(source, caption_table(source, encoder, cfg.model.text_tokens, progress),
                                 encoder.sha256)


def _check_stored(cfg, run_dir: Path, stored: CaptionEmbeddings) -> str:
    """The sha256 of the encoder that made stored caption embeddings, refused unless they are what this run's
    network reads: its encoder (the bundled one's pinned weights, the run's record), its token count and widths."""
    model, name = cfg.model, cfg.data.text_encoder
    expected = MINILM_SHA256 if name == "minilm" else recorded_text_encoder(run_dir)
    if latest_checkpoint(run_dir) is None and name != "minilm":
        expected = None  # a folder's weights are bound once the run has trained on them
    found = (stored.tokens, stored.width, stored.pooled_width)
    if found != (model.text_tokens, model.text_width, model.text_pooled_width):
        raise DataError(f"data.path: {cfg.data.path} holds caption embeddings of {found[0]} tokens, {found[1]} and "
                        f"{found[2]} wide; model.text_tokens is {model.text_tokens}, the encoder's widths "
                        f"{model.text_width} and {model.text_pooled_width}")
    if expected is not None and stored.sha256 != expected:
        raise DataError(f"data.text_encoder: the caption embeddings in {cfg.data.path} were encoded by other weights "
                        f"(sha256 {stored.sha256[:12]}..., expected {expected[:12]}...)")
    return stored.sha256


def record_text_encoder(cfg, run_dir: Path, source: Source) -> None:
    """RUN/text_encoder.json for a text-conditioned run: the encoder it names and its files' digest."""
    if isinstance(source, WithCaptionEmbeddings):
        TextEncoderRecord(text_encoder=cfg.data.text_encoder, sha256=source.made_by).write(
            Path(run_dir) / TextEncoderRecord.FILE)


class CaptionWriter(ExampleWriter):
    """`islands encode --text-encoder`: the members another writer makes of each example, and its caption's packed
    embedding (`caption.npy`, float32, the run's `model.text_tokens` tokens), so that a run on the shards never runs
    the text encoder; the manifest says which encoder made them."""

    def __init__(self, inner: ExampleWriter, encoder: TextEncoder, name: str, tokens: int):
        self.inner, self.encoder, self.tokens, self.known = inner, encoder, tokens, {}
        self.members = [*inner.members, CAPTION_MEMBER]
        self.depth = depth = max(encoder.width, encoder.pooled_width) + 1
        self.manifest = {**inner.manifest, "caption_embeddings": {
            "text_encoder": name, "sha256": encoder.sha256, "tokens": tokens, "width": encoder.width,
            "pooled_width": encoder.pooled_width, "shape": [1 + tokens, depth], "dtype": "float32"}}

    def __call__(self, x: torch.Tensor, captions: list[str] | None = None) -> list[dict[str, bytes]]:
        if len(self.known) * (1 + self.tokens) * self.depth * 4 > KNOWN_BYTES:
            self.known.clear()  # a bound, not a cache policy: a set of mostly distinct captions gains nothing here
        packed = encode_captions(self.encoder, captions, self.tokens, known=self.known)
        return [{**example, CAPTION_MEMBER: npy_bytes(packed[j])} for j, example in enumerate(self.inner(x, captions))]
