"""The data sources by name. Each lives in the module of its format; this table alone names them all, and no source
module imports it, so the sources' imports make no circle (sources.py holds the base and the array sources; emoji,
shards, indexed tars and Hugging Face datasets each their own module, imported when named: their packages are
optional extras)."""

import importlib

SOURCES = {
    "mnist5k": ("islands.data.sources", "Mnist5k"),
    "fashion_mnist": ("islands.data.sources", "FashionMnist"),
    "folder": ("islands.data.sources", "ImageFolder"),
    "npz": ("islands.data.sources", "ArrayFile"),
    "emoji": ("islands.data.emoji", "EmojiSource"),
    "shards": ("islands.data.shards", "ShardSource"),
    "hf": ("islands.data.hf", "HfSource"),
}


def build_source(name, **options):
    """Construct a source by name; options are the class's keyword arguments."""
    if name not in SOURCES:
        raise ValueError(f"unknown data source {name!r}; choose from {', '.join(SOURCES)}")
    module, cls = SOURCES[name]
    source = getattr(importlib.import_module(module), cls)(**options)
    source.options = (name, *sorted(options.items()))
    return source
