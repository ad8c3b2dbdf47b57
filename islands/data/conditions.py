"""A source whose examples carry a condition computed for them once, in place of their label."""

import torch

from islands.data.sources import Source


class WithConditions(Source):
    """`source`'s examples, each with row n of `table` as its condition in place of its label (a text-conditioned
    run: its caption's packed embedding, islands/train/captions.py)."""

    def __init__(self, source: Source, table: torch.Tensor | None, made_by: str | None = None):
        self.source, self.table, self.made_by = source, table, made_by  # made_by: the sha256 of what computed them
        self.shape, self.num_classes, self.flip = source.shape, source.num_classes, source.flip
        self.read_from, self.quantised, self.captioned = source.read_from, source.quantised, True

    def __len__(self) -> int:
        return len(self.source)

    def get(self, indices):
        x, _ = self.source.get(indices)
        return x, self.conditions(indices)

    def conditions(self, indices) -> torch.Tensor:
        """The examples' conditions alone, without reading the examples."""
        return self.table[torch.as_tensor(list(indices), dtype=torch.long)]

    def captions(self, indices) -> list[str]:
        return self.source.captions(indices)

    def clusters_of(self, indices):
        return self.source.clusters_of(indices)

    def check(self):
        self.source.check()


class WithStoredConditions(WithConditions):
    """`source`'s examples, each with its caption's embedding as the shards store it beside the example."""

    def __init__(self, source: Source, made_by: str):
        super().__init__(source, None, made_by)

    def conditions(self, indices) -> torch.Tensor:
        return self.source.caption_embeddings(indices)
