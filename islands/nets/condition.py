"""What a network is conditioned on, and how it takes it: the network owns its condition's embedding, its "none"
and how a dropped condition reads, so that the data, the objectives and the samplers pass a condition along without
knowing its kind: a class index (`ClassCondition`) or a caption's embedding (`TextCondition`, packed into one tensor
by `pack_text`). Every condition module answers the same four questions (`NetworkCondition`): what it adds to the
time embedding (`embed`), what cross-attention reads (`context`), which channels join the input (`inputs`,
`channels`), and what "none" is (`null`, `drop`); a network asks them without knowing the kind. The kinds as a whole
(their data, sampling requests, records) are islands/conditions/.

Dropping is drawn by the objective from each example's stream (reproducible and resumable, DESIGN.md section 3);
it asks the network's condition module what a dropped condition is (`drop`), so the network itself stays
deterministic. The "none" condition is what classifier-free guidance (Ho & Salimans 2022) uses for the unconditional
prediction; `None` in place of a condition tensor means none for every example.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class NetworkCondition:
    """The questions a network asks its condition module; the answers here are those of a condition that adds to the
    time embedding only (a class, a caption's pooled vector)."""

    channels = 0  # channels the condition adds to the network's input

    def embed(self, condition: Tensor | None, batch: int, device) -> Tensor | None:
        """(batch, hidden_size), added to the time embedding; None: nothing."""
        return None

    def context(self, condition: Tensor | None, batch: int, device) -> tuple:
        """What cross-attention reads; () for nothing."""
        return ()

    def inputs(self, x: Tensor, condition: Tensor | None) -> Tensor:
        """The network's input: the noisy example, with the condition's channels after it where it has some."""
        return x

    def or_null(self, condition: Tensor | None, batch: int, device) -> Tensor:
        """`condition` if given, else none (`null`, the kind's own) for every example."""
        return self.null(batch, device) if condition is None else condition


class ClassLabels(NetworkCondition):
    """A class index in [0, num_classes), and `num_classes` for none: what a network that embeds its classes itself
    (a diffusers network, islands/nets/diffusers_net.py) is told."""

    kind = "class"

    def __init__(self, num_classes: int):
        self.num_classes = num_classes

    def null(self, batch: int, device) -> Tensor:
        """No class, for `batch` examples."""
        return torch.full((batch,), self.num_classes, dtype=torch.long, device=device)

    def drop(self, condition: Tensor, dropped: Tensor) -> Tensor:
        """`condition` with the examples where `dropped` is True made none."""
        return torch.where(dropped, torch.full_like(condition, self.num_classes), condition)


class ClassCondition(ClassLabels, nn.Module):
    """Class labels embedded by a table with one extra row, index `num_classes`, for none."""

    def __init__(self, num_classes: int, hidden_size: int):
        nn.Module.__init__(self)
        ClassLabels.__init__(self, num_classes)
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size)  # the weight name checkpoints hold

    def embed(self, condition: Tensor | None, batch: int, device) -> Tensor:
        """(batch, hidden_size): each example's class, or the none row."""
        return self.embedding_table(self.or_null(condition, batch, device))

    def forward(self, condition: Tensor) -> Tensor:
        return self.embedding_table(condition)


def pack_text(tokens: Tensor, mask: Tensor, pooled: Tensor) -> Tensor:
    """A caption's embedding as one condition tensor, batch first, so that everything that moves conditions (batches,
    samplers, guidance, routing, ranks) moves it as it moves a class: (n, 1 + L, D + 1), D = max(width,
    pooled_width). Row 0 holds the pooled vector and, in its last column, 1 (a caption; 0: none); rows 1..L hold the
    token states and, in the last column, the attention mask."""
    n, length, width = tokens.shape
    depth = max(width, pooled.shape[1])
    packed = tokens.new_zeros(n, 1 + length, depth + 1, dtype=torch.float32)
    packed[:, 0, :pooled.shape[1]] = pooled
    packed[:, 0, depth] = 1.0
    packed[:, 1:, :width] = tokens
    packed[:, 1:, depth] = mask.to(packed.dtype)
    return packed


@dataclass(frozen=True)
class TextWidths:
    """What a text-conditioned network is built for: its text encoder's token and pooled widths, and the most tokens
    a caption of its data has (the cross-attention's context length, which FLOP counts price)."""

    width: int
    pooled_width: int
    tokens: int


class PackedCaption(NetworkCondition):
    """What every reader of a packed caption (`pack_text`) shares: its "none", its dropout, and the caption's parts
    with a dropped one's replaced by the learned null (a pooled vector and one token, PixArt-alpha's learned
    `y_embedding`), not the empty caption's embedding, so that the network alone knows what "none" is and sampling
    needs no text encoder for the unconditional branch. Needs `widths`, `width`, `pooled_width`, `depth` and the
    nulls it reads (`null_pooled`, `null_token`)."""

    kind = "text"

    def null(self, batch: int, device) -> Tensor:
        """No caption, for `batch` examples (one empty token row: `given_tokens` puts the learned null there)."""
        return torch.zeros(batch, 2, self.depth + 1, device=device)

    def placeholder(self, batch: int, device) -> Tensor:
        """Captions of the most tokens, all given (zero states): what a FLOP count runs the network on."""
        return pack_text(torch.zeros(batch, self.widths.tokens, self.width, device=device),
                         torch.ones(batch, self.widths.tokens, dtype=torch.bool, device=device),
                         torch.zeros(batch, self.pooled_width, device=device))

    def drop(self, condition: Tensor, dropped: Tensor) -> Tensor:
        """`condition` with the captions where `dropped` is True made none (their flag cleared)."""
        out = condition.clone()
        out[:, 0, self.depth] = condition[:, 0, self.depth] * (~dropped).to(condition.dtype)
        return out

    def given_pooled(self, condition: Tensor | None, batch: int, device) -> Tensor:
        """(batch, pooled_width): each caption's pooled vector, or the learned null's."""
        condition = self.or_null(condition, batch, device)
        given = condition[:, 0, self.depth:].to(self.null_pooled.dtype)  # (batch, 1)
        return given * condition[:, 0, :self.pooled_width] + (1 - given) * self.null_pooled

    def given_tokens(self, condition: Tensor | None, batch: int, device) -> tuple[Tensor, Tensor]:
        """(states (batch, L, width), mask (batch, L) bool): each caption's token states; a dropped caption is the
        learned null token alone."""
        condition = self.or_null(condition, batch, device)
        given = condition[:, :1, self.depth:].to(self.null_token.dtype)  # (batch, 1, 1)
        states = condition[:, 1:, :self.width]
        null = torch.zeros_like(states)
        null[:, 0] = self.null_token
        mask = condition[:, 1:, self.depth] > 0.5
        first = torch.zeros_like(mask)
        first[:, 0] = True
        return given * states + (1 - given) * null, torch.where(given[:, :, 0] > 0.5, mask, first)


class TextCondition(PackedCaption, nn.Module):
    """A caption, packed by `pack_text`: its pooled vector joins the timestep's embedding (SD3's adaLN input), its
    token states are the context that cross-attention reads (PixArt-alpha), each through a projection of its own."""

    def __init__(self, widths: TextWidths, hidden_size: int, tokens: bool = True):
        super().__init__()
        width, pooled_width = widths.width, widths.pooled_width
        self.widths, self.width, self.pooled_width = widths, width, pooled_width
        self.depth = max(width, pooled_width)
        self.pooled = nn.Sequential(nn.Linear(pooled_width, hidden_size), nn.SiLU(),
                                    nn.Linear(hidden_size, hidden_size))
        self.null_pooled = nn.Parameter(torch.zeros(pooled_width))
        if tokens:  # a network that reads the pooled vector alone (a router) holds no parameter it never uses
            self.tokens = nn.Sequential(nn.Linear(width, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size))
            self.null_token = nn.Parameter(torch.zeros(width))

    def embed(self, condition: Tensor | None, batch: int, device) -> Tensor:
        """(batch, hidden_size): each caption's pooled vector, or the learned null's, through the projection."""
        return self.pooled(self.given_pooled(condition, batch, device))

    def context(self, condition: Tensor | None, batch: int, device) -> tuple[Tensor, Tensor]:
        """(tokens (batch, L, hidden_size), mask (batch, L) bool): each caption's token states through the
        projection; a dropped caption reads the learned null token alone."""
        states, mask = self.given_tokens(condition, batch, device)
        return self.tokens(states), mask

    def forward(self, condition: Tensor) -> Tensor:
        return self.embed(condition, condition.shape[0], condition.device)


class TextNull(PackedCaption, nn.Module):
    """A caption passed on as its encoder gave it, to a network that projects it itself (a diffusers network): only
    the learned null, in the encoder's own space, for the parts the network reads."""

    def __init__(self, widths: TextWidths, pooled: bool = True, tokens: bool = True):
        super().__init__()
        self.widths, self.width, self.pooled_width = widths, widths.width, widths.pooled_width
        self.depth = max(widths.width, widths.pooled_width)
        if pooled:  # only the parts read: DDP wants a gradient for every parameter
            self.null_pooled = nn.Parameter(torch.zeros(widths.pooled_width))
        if tokens:
            self.null_token = nn.Parameter(torch.zeros(widths.width))


class ImageCondition(NetworkCondition, nn.Module):
    """A low-resolution image (batch, C, r, r) in [-1, 1], upsampled to the input's size (bicubic, as SR3) and
    concatenated after the noisy example's channels; zeros are "none" (for dropout and guidance), so that the
    unconditional branch reads no image at all. It holds no parameter: the network's first layer takes the channels."""

    kind = "image"

    def __init__(self, channels: int):
        super().__init__()
        self.channels = channels

    def null(self, batch: int, device) -> Tensor:
        return torch.zeros(batch, self.channels, 1, 1, device=device)  # upsampled to zeros of any size

    def drop(self, condition: Tensor, dropped: Tensor) -> Tensor:
        return condition * (~dropped).to(condition.dtype).reshape(-1, 1, 1, 1)

    def inputs(self, x: Tensor, condition: Tensor | None) -> Tensor:
        image = self.or_null(condition, x.shape[0], x.device).to(x.dtype)
        upsampled = F.interpolate(image, size=x.shape[-2:], mode="bicubic", align_corners=False)
        return torch.cat([x, upsampled], dim=1)


def network_condition(hidden_size: int, num_classes: int = 0, text: TextWidths | None = None,
                      text_tokens: bool = True, channels: int = 0) -> NetworkCondition | None:
    """The condition module of a network of width `hidden_size` built for these arguments (its constructor's, which
    the export records: `channels` are those of a condition laid out as the example); None: unconditional."""
    if text is not None:
        return TextCondition(text, hidden_size, text_tokens)
    if channels:
        return ImageCondition(channels)
    return ClassCondition(num_classes, hidden_size) if num_classes > 0 else None


class Conditioned:
    """A network whose `embed` (islands.nets.layers.ConditionEmbedder) holds its condition module."""

    @property
    def condition(self) -> NetworkCondition | None:
        """How this network embeds and drops its condition; None for an unconditional network."""
        return self.embed.condition
