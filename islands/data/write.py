"""`islands shard` and `islands encode` as one function: a config's data written into shards, as its examples, or
with an autoencoder as their latents' posteriors, and with a text encoder each caption's embedding beside them. The
writers compose: each makes the members of an example that the one inside it does not."""

from pathlib import Path

from islands.data import build_data, storage
from islands.data.captions import CaptionWriter
from islands.data.encode import LatentWriter
from islands.data.shards import ExampleWriter, refuse_written_over, write_shards
from islands.errors import ConfigError, config_errors
from islands.nets.text_folder import open_text_encoder
from islands.nets.vae_folder import load_autoencoder


def write_data(cfg, out: Path | str, shard_size: int = 4096, autoencoder: str | None = None,
               text_encoder: str | None = None, text_tokens: int = 32, batch_size: int = 64, rank: int = 0,
               ranks: int = 1, barrier=lambda: None, device="cpu", progress: bool = True,
               shuffle_seed: int | None = None) -> dict | None:
    """Shards of `cfg`'s data in `out` (absent or empty); under several ranks each writes its own shards and rank 0
    the manifest, which it returns (None on the others). A bad input stops before any shard is written. `out` may be
    a URL (storage.py: s3://bucket/prefix/ and the like): each shard is put there as it is finished, the manifest
    last. `shuffle_seed`: the examples in a seeded shuffled order (shards.write_part), not the source's."""
    out = storage.location(out)
    refuse_written_over(out)
    source = build_data(cfg.data, cfg.seed, check=True)
    writer = None
    if autoencoder is not None:
        loaded = load_autoencoder(autoencoder, device=device)
        with config_errors("data"):  # images the autoencoder cannot encode
            writer = LatentWriter(source, loaded, batch_size, device, cfg.data.flip)
    if text_encoder is not None:
        if not source.captioned:
            raise ConfigError(f"--text-encoder: the data ({cfg.data.source}) has no captions")
        encoder = open_text_encoder(text_encoder, device=device)
        writer = CaptionWriter(writer or ExampleWriter(source), encoder, text_encoder, text_tokens)
    return write_shards(source, out, shard_size, cfg.data.model_dump(), rank, ranks, barrier, progress=progress,
                        writer=writer, shuffle_seed=shuffle_seed)
