"""What a network is conditioned on, and how it takes it: the network owns its condition's embedding, its "none"
and how a dropped condition reads, so that the data, the objectives and the samplers pass a condition along without
knowing its kind. Today the kind is a class index; a text embedding is another module with the same methods.

Dropping is drawn by the objective from each example's stream (reproducible and resumable, DESIGN.md section 3);
it asks the network's condition module what a dropped condition is (`drop`), so the network itself stays
deterministic. The "none" condition is what classifier-free guidance (Ho & Salimans 2022) uses for the unconditional
prediction; `None` in place of a condition tensor means none for every example.
"""

import torch
from torch import Tensor, nn


class ClassCondition(nn.Module):
    """A class index in [0, num_classes): an embedding table with one extra row, index `num_classes`, for none."""

    kind = "class"

    def __init__(self, num_classes: int, hidden_size: int):
        super().__init__()
        self.num_classes = num_classes
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size)  # the weight name checkpoints hold

    def null(self, batch: int, device) -> Tensor:
        """No class, for `batch` examples."""
        return torch.full((batch,), self.num_classes, dtype=torch.long, device=device)

    def or_null(self, condition: Tensor | None, batch: int, device) -> Tensor:
        """`condition` if given, else none for every example."""
        return self.null(batch, device) if condition is None else condition

    def drop(self, condition: Tensor, dropped: Tensor) -> Tensor:
        """`condition` with the examples where `dropped` is True made none."""
        return torch.where(dropped, torch.full_like(condition, self.num_classes), condition)

    def embed(self, condition: Tensor | None, batch: int, device) -> Tensor:
        """(batch, hidden_size): each example's class, or the none row."""
        return self.embedding_table(self.or_null(condition, batch, device))

    def forward(self, condition: Tensor) -> Tensor:
        return self.embedding_table(condition)


class Conditioned:
    """A network whose `embed` (islands.nets.layers.ConditionEmbedder) holds its condition module."""

    @property
    def condition(self) -> ClassCondition | None:
        """How this network embeds and drops its condition; None for an unconditional network."""
        return self.embed.condition
