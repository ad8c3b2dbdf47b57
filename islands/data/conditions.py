"""A source whose examples carry a caption's embedding computed for them once (a table), or stored beside them."""

import torch

from islands.data.sources import CAPTION_EMBEDDING, Source, View


class WithCaptionEmbeddings(View):
    """`source`'s examples, each with row n of `table` as its caption's packed embedding (a text-conditioned run:
    encoded at its start, islands/data/captions.py); with no table, the embeddings the source itself stores
    (`islands encode --text-encoder`). `made_by`: the digest of the encoder that computed them, for the run's record."""

    def __init__(self, source: Source, table: torch.Tensor | None, made_by: str | None = None):
        super().__init__(source)
        self.table, self.made_by = table, made_by
        self.holds = source.holds | {CAPTION_EMBEDDING}

    def read(self, indices, fields) -> dict:
        if self.table is None:
            return self.source.read(indices, fields)
        got = self.source.read(indices, [f for f in fields if f != CAPTION_EMBEDDING])
        if CAPTION_EMBEDDING in fields:
            got[CAPTION_EMBEDDING] = self.table[torch.as_tensor(list(indices), dtype=torch.long)]
        return got
