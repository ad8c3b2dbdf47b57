"""diffusers denoisers as Islands networks (`model.arch: diffusers`).

The diffusers model is built from its class and constructor arguments, then taken apart: its stem and head modules
become the adapter's own children under their diffusers names, and its down-mid-up blocks or transformer blocks, in
the order its forward runs them, become `blocks`, so that activation checkpointing, FSDP and pipeline cuts find them
(islands/nets/layers.py, `StagedNetwork`). `stem`, `block_forward` and `head` follow each class's own forward step
for step; the tests check the result against calling the diffusers model itself. Each class is told what it expects:

- the time: the network receives its path's own time tau in [0, 1] (islands/flow/denoiser.py). The UNets and DiT
  take DDPM's timestep, 1000 tau (the step n itself on `vp_discrete` with 1000 steps); SD3 takes sigma x 1000, which
  on rectified flow is 1000 tau too; Flux takes tau and multiplies by 1000 itself.
- the condition: a class index with `num_classes` for none (DiT's own null class, `num_embeds_ada_norm`, is that
  index); a caption packed by `pack_text`, its token states as `encoder_hidden_states` (with its mask where the
  class takes one) and its pooled vector as `pooled_projections`, a dropped caption replaced by a learned null in
  the encoder's own space (`TextNull`). SD3 and Flux read every token row, so their captions always have
  `model.text_tokens` rows, the null's too.
- DiT's own label dropout (10% from torch's global generator in train mode) is switched off: Islands drops labels
  from each example's stream (islands/train/objectives.py), so that runs stay reproducible and resumable.
- the output: DiT's learned sigma is sliced off; Flux's 2x2-packed latents are unpacked.
"""

import inspect

import diffusers
import torch
import torch.nn.functional as F
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.embeddings import LabelEmbedding
from torch import nn

from islands.errors import DataError
from islands.nets.condition import ClassLabels, TextNull, TextWidths
from islands.nets.layers import StagedNetwork
from islands.nets.vae_folder import CONFIG, WEIGHTS, read_folder


def _fill(arguments: dict, key: str, value, why: str) -> None:
    """arguments[key] = value where it is left out; refused where it is given otherwise."""
    given = arguments.setdefault(key, value)
    if given != value:
        raise ValueError(f"config.{key}: {given!r}, but {why} makes it {value!r}")


def _same_size(config: dict, shape: tuple) -> None:
    """A network that maps images to images of the data's channels and size."""
    _fill(config, "in_channels", shape[0], "the data's channels")
    _fill(config, "out_channels", shape[0], "the data's channels")
    _fill(config, "sample_size", shape[1], "the data's size")


def _refuse_unless(arguments: dict, key: str, allowed: tuple, default) -> None:
    if arguments.get(key, default) not in allowed:
        raise ValueError(f"config.{key}: {arguments[key]!r} is not one the adapter maps (it maps "
                         f"{', '.join(map(repr, allowed))})")


class DiffusersNetwork(StagedNetwork):
    """A diffusers model's modules under their own names, its blocks gathered in `blocks`; subclasses say which
    children hold the blocks (`block_lists`, in forward order) and which make the head (`head_names`)."""

    block_lists: tuple[str, ...] = ()
    head_names: tuple[str, ...] = ()
    caption_arguments: tuple[str, ...] = ()  # the forward's arguments a caption becomes (a text network's)

    @staticmethod
    def arguments(config: dict, shape: tuple, num_classes: int, text: TextWidths | None) -> dict:
        """The constructor's arguments: `config` with what the data decides filled in, checked."""
        return config

    def __init__(self, model: nn.Module, shape: tuple, num_classes: int, text: TextWidths | None):
        super().__init__()
        self.class_name = type(model).__name__
        self.diffusers_config = {k: v for k, v in model.config.items() if not k.startswith("_")}
        self.input_shape = tuple(shape)
        self.labels = ClassLabels(num_classes) if num_classes else None
        for name, p in model._parameters.items():
            self.register_parameter(name, p)
        for name, b in model._buffers.items():
            self.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
        blocks, self.block_names = [], []
        for name, child in model._modules.items():
            if name not in self.block_lists:
                setattr(self, name, child)
        for name in self.block_lists:
            child = model._modules.get(name)
            if isinstance(child, nn.ModuleList):
                blocks += list(child)
                self.block_names += [f"{name}.{i}" for i in range(len(child))]
            elif child is not None:
                blocks.append(child)
                self.block_names.append(name)
        self.blocks = nn.ModuleList(blocks)
        self.text = self.text_null(text) if text is not None else None
        self.stem_modules = tuple(n for n, m in self.named_children()
                                  if m is not None and n not in (*self.head_names, "blocks"))
        self.head_modules = tuple(n for n in self.head_names if getattr(self, n, None) is not None)

    def text_null(self, text: TextWidths) -> TextNull:
        return TextNull(text)

    @property
    def condition(self) -> ClassLabels | TextNull | None:
        """How this network's condition is dropped and what none is; None for an unconditional network."""
        return self.text if self.text is not None else self.labels

    def class_labels(self, cond, batch: int, device) -> torch.Tensor:
        return self.labels.or_null(cond, batch, device)

    # the weights under diffusers' own names: for its save_pretrained, and from a pretrained folder
    def diffusers_key(self, key: str) -> str:
        """A state-dict key under diffusers' own name (blocks.i.* -> down_blocks.j.*, transformer_blocks.j.*, ...)."""
        top, _, rest = key.partition(".")
        if top != "blocks":
            return key
        i, _, rest = rest.partition(".")
        return f"{self.block_names[int(i)]}.{rest}"

    def diffusers_state_dict(self) -> dict:
        """The diffusers model's weights under its own names (a text network's learned null is Islands' own and
        left out)."""
        return {self.diffusers_key(k): v for k, v in self.state_dict().items() if not k.startswith("text.")}

    def to_diffusers(self) -> nn.Module:
        """The diffusers model itself, holding these weights (for its `save_pretrained`)."""
        model = getattr(diffusers, self.class_name)(**self.diffusers_config)
        model.load_state_dict(self.diffusers_state_dict())  # strict: every weight under its diffusers name
        return model.eval()

    def load_diffusers_state_dict(self, weights: dict) -> None:
        """Load weights named as diffusers names them; a name missing on either side, or a shape that differs, is
        refused by name (ValueError)."""
        index = {name: i for i, name in enumerate(self.block_names)}
        own = {}
        for key, value in weights.items():
            parts = key.split(".")
            block = next((p for p in (".".join(parts[:2]), parts[0]) if p in index), None)
            own[f"blocks.{index[block]}{key[len(block):]}" if block else key] = value
        expected = {k: v for k, v in self.state_dict().items() if not k.startswith("text.")}
        missing, extra = sorted(expected.keys() - own.keys()), sorted(own.keys() - expected.keys())
        if missing or extra:
            first = f"no {self.diffusers_key(missing[0])}" if missing else f"an unknown {extra[0]}"
            raise ValueError(f"the weights do not fit the {self.class_name}: {first} "
                             f"({len(missing)} missing, {len(extra)} unknown)")
        for key, value in own.items():
            if tuple(value.shape) != tuple(expected[key].shape):
                raise ValueError(f"the weights do not fit the {self.class_name}: {self.diffusers_key(key)} is "
                                 f"{tuple(value.shape)} there, {tuple(expected[key].shape)} here")
        self.load_state_dict(own, strict=False)


def _unpatchify(hidden: torch.Tensor, patch: int, channels: int) -> torch.Tensor:
    """(B, g * g, p * p * C) tokens -> (B, C, g p, g p), as diffusers' transformers unpatchify."""
    side = int(hidden.shape[1] ** 0.5)
    hidden = hidden.reshape(-1, side, side, patch, patch, channels)
    return torch.einsum("nhwpqc->nchpwq", hidden).reshape(-1, channels, side * patch, side * patch)


class UNet2D(DiffusersNetwork):
    """`UNet2DModel`: DDPM's U-Net, classes through an embedding of num_classes + 1 rows (`num_class_embeds`)."""

    block_lists, head_names = ("down_blocks", "mid_block", "up_blocks"), ("conv_norm_out", "conv_act", "conv_out")

    @staticmethod
    def arguments(config, shape, num_classes, text):
        _same_size(config, shape)
        _refuse_unless(config, "time_embedding_type", ("positional",), "positional")
        _refuse_unless(config, "class_embed_type", (None,), None)
        skips = [t for t in (*config.get("down_block_types", ()), *config.get("up_block_types", ())) if "Skip" in t]
        if skips:
            raise ValueError(f"config: {skips[0]} (score-SDE's skip blocks) is not a block the adapter maps")
        if num_classes:
            _fill(config, "num_class_embeds", num_classes + 1, f"{num_classes} classes and the null class")
        elif config.get("num_class_embeds"):
            raise ValueError(f"config.num_class_embeds: {config['num_class_embeds']}, but model.num_classes is 0")
        return config

    def __init__(self, model, shape, num_classes, text):
        super().__init__(model, shape, num_classes, text)
        self.num_down, self.has_mid = len(model.down_blocks), model.mid_block is not None
        self.taken = [len(block.resnets) for block in model.up_blocks]  # skips each up block joins
        self.center = bool(model.config.center_input_sample)

    def embedding(self, x, t, cond):
        """DDPM's timestep embedding, plus the class's."""
        emb = self.time_embedding(self.time_proj(1000 * t).to(x.dtype))
        if self.labels is not None:
            emb = emb + self.class_embedding(self.class_labels(cond, x.shape[0], x.device)).to(emb.dtype)
        return emb

    def stem(self, x, t, cond=None):
        x = 2 * x - 1.0 if self.center else x
        emb = self.embedding(x, t, cond)
        h = self.conv_in(x)
        return h, emb, h

    def down(self, block, h, emb, context):
        return block(hidden_states=h, temb=emb)

    def middle(self, block, h, emb, context):
        return block(h, emb)

    def up(self, block, h, emb, skips, context, size):
        return block(h, skips, emb)

    def context_of(self, rest):
        """(the caption's part of the carry, the skips)."""
        return (), rest

    def block_forward(self, i, carry):
        h, emb, *rest = carry
        context, skips = self.context_of(rest)
        if i < self.num_down:
            h, res = self.down(self.blocks[i], h, emb, context)
            return h, emb, *context, *skips, *res
        if i == self.num_down and self.has_mid:
            return self.middle(self.blocks[i], h, emb, context), emb, *context, *skips
        j = i - self.num_down - self.has_mid
        taken, skips = skips[-self.taken[j]:], skips[:-self.taken[j]]
        # diffusers gives the next skip's size to every up block but the last where the sides do not halve evenly
        uneven = any(side % 2 ** (len(self.taken) - 1) for side in self.input_shape[1:])
        size = skips[-1].shape[2:] if uneven and j < len(self.taken) - 1 else None
        return self.up(self.blocks[i], h, emb, tuple(taken), context, size), emb, *context, *skips

    def head(self, carry):
        return self.conv_out(self.conv_act(self.conv_norm_out(carry[0])))


class UNet2DCondition(UNet2D):
    """`UNet2DConditionModel`: Stable Diffusion's U-Net, its cross-attention reading the caption's token states
    (`cross_attention_dim` = the encoder's width) under their mask; the pooled vector is not read."""

    caption_arguments = ("encoder_hidden_states", "encoder_attention_mask")

    @staticmethod
    def arguments(config, shape, num_classes, text):
        _same_size(config, shape)
        _fill(config, "cross_attention_dim", text.width, "the text encoder's width")
        _refuse_unless(config, "time_embedding_type", ("positional",), "positional")
        for key in ("class_embed_type", "num_class_embeds", "addition_embed_type", "encoder_hid_dim",
                    "time_cond_proj_dim", "time_embed_act"):
            _refuse_unless(config, key, (None,), None)
        return config

    def __init__(self, model, shape, num_classes, text):
        super().__init__(model, shape, num_classes, text)
        self.center = bool(model.config.center_input_sample)

    def text_null(self, text):
        return TextNull(text, pooled=False)

    def stem(self, x, t, cond=None):
        x = 2 * x - 1.0 if self.center else x
        emb = self.time_embedding(self.time_proj(1000 * t).to(x.dtype))
        states, mask = self.text.given_tokens(cond, x.shape[0], x.device)
        bias = ((1 - mask.to(x.dtype)) * -10000.0).unsqueeze(1)  # diffusers' encoder_attention_mask, as its forward
        h = self.conv_in(x)
        return h, emb, states.to(x.dtype), bias, h

    def context_of(self, rest):
        return tuple(rest[:2]), rest[2:]

    def down(self, block, h, emb, context):
        if getattr(block, "has_cross_attention", False):
            return block(hidden_states=h, temb=emb, encoder_hidden_states=context[0], encoder_attention_mask=context[1])
        return block(hidden_states=h, temb=emb)

    def middle(self, block, h, emb, context):
        if getattr(block, "has_cross_attention", False):
            return block(h, emb, encoder_hidden_states=context[0], encoder_attention_mask=context[1])
        return block(h, emb)

    def up(self, block, h, emb, skips, context, size):
        if getattr(block, "has_cross_attention", False):
            return block(hidden_states=h, temb=emb, res_hidden_states_tuple=skips, encoder_hidden_states=context[0],
                         upsample_size=size, encoder_attention_mask=context[1])
        return block(hidden_states=h, temb=emb, res_hidden_states_tuple=skips, upsample_size=size)


class _FirstDiTBlock(BasicTransformerBlock):
    """DiT's block 0, which also returns the head's conditioning: diffusers computes it with block 0's label
    embedder, so it is computed inside block 0's call, where FSDP has gathered those weights and a pipeline keeps
    them (on stage 0), and travels to the head in the carry."""

    def forward(self, hidden_states, timestep, class_labels):
        hidden = super().forward(hidden_states, timestep=timestep, class_labels=class_labels)
        return hidden, self.norm1.emb(timestep, class_labels, hidden_dtype=hidden.dtype)


class DiT(DiffusersNetwork):
    """`DiTTransformer2DModel`: classes through its own tables, whose extra row `num_embeds_ada_norm` is none."""

    block_lists, head_names = ("transformer_blocks",), ("norm_out", "proj_out_1", "proj_out_2")

    @staticmethod
    def arguments(config, shape, num_classes, text):
        _fill(config, "in_channels", shape[0], "the data's channels")
        _fill(config, "sample_size", shape[1], "the data's size")
        if config.get("out_channels") not in (None, shape[0], 2 * shape[0]):
            raise ValueError(f"config.out_channels: {config['out_channels']}; a DiT predicts the data's {shape[0]} "
                             f"channels, or twice as many with its learned sigma")
        if num_classes:
            _fill(config, "num_embeds_ada_norm", num_classes, f"{num_classes} classes")
        else:
            config.setdefault("num_embeds_ada_norm", 0)  # unconditional: its table is the null row alone
        return config

    def __init__(self, model, shape, num_classes, text):
        for module in model.modules():  # Islands' dropout, drawn from each example's stream, is the only one
            if isinstance(module, LabelEmbedding):
                module.dropout_prob = 0.0
        model.transformer_blocks[0].__class__ = _FirstDiTBlock
        super().__init__(model, shape, num_classes, text)
        self.null_class = model.config.num_embeds_ada_norm
        self.patch, self.out_channels = model.config.patch_size, model.out_channels

    def class_labels(self, cond, batch, device):
        if self.labels is None:
            return torch.full((batch,), self.null_class, dtype=torch.long, device=device)
        return super().class_labels(cond, batch, device)

    def stem(self, x, t, cond=None):
        return self.pos_embed(x), 1000 * t, self.class_labels(cond, x.shape[0], x.device)

    def block_forward(self, i, carry):
        hidden, timestep, labels, *conditioning = carry
        # a pipeline stage first runs on uninitialised inputs to learn their shapes: any label must index the table
        labels = labels.clamp(0, self.null_class)
        if i == 0:
            hidden, first = self.blocks[0](hidden, timestep, labels)
            return hidden, timestep, labels, first
        return self.blocks[i](hidden, timestep=timestep, class_labels=labels), timestep, labels, *conditioning

    def head(self, carry):
        hidden, _, _, conditioning = carry
        shift, scale = self.proj_out_1(F.silu(conditioning)).chunk(2, dim=1)
        hidden = self.proj_out_2(self.norm_out(hidden) * (1 + scale[:, None]) + shift[:, None])
        out = _unpatchify(hidden, self.patch, self.out_channels)
        return out[:, :self.input_shape[0]]  # a learned sigma's channels are not Islands' prediction


class _TextTransformer(DiffusersNetwork):
    """What SD3 and Flux share: the caption's token states and pooled vector read as they come, every row read."""

    caption_arguments = ("encoder_hidden_states", "pooled_projections")

    def text_null(self, text):
        return _FullLengthNull(text)

    def caption(self, cond, x):
        pooled = self.text.given_pooled(cond, x.shape[0], x.device).to(x.dtype)
        states, _ = self.text.given_tokens(cond, x.shape[0], x.device)  # no mask: every row is read
        return states.to(x.dtype), pooled


class _FullLengthNull(TextNull):
    """For networks that read every token row: no caption has `model.text_tokens` rows, as every caption has, so
    that none and a dropped caption are the same input."""

    def null(self, batch, device):
        return torch.zeros(batch, 1 + self.widths.tokens, self.depth + 1, device=device)


class SD3(_TextTransformer):
    """`SD3Transformer2DModel`: MM-DiT; timestep sigma x 1000; the caption's states through `context_embedder`
    (`joint_attention_dim` = the encoder's width) and its pooled vector (`pooled_projection_dim`)."""

    block_lists, head_names = ("transformer_blocks",), ("norm_out", "proj_out")

    @staticmethod
    def arguments(config, shape, num_classes, text):
        _same_size(config, shape)
        _fill(config, "joint_attention_dim", text.width, "the text encoder's width")
        _fill(config, "pooled_projection_dim", text.pooled_width, "the text encoder's pooled width")
        return config

    def __init__(self, model, shape, num_classes, text):
        super().__init__(model, shape, num_classes, text)
        self.patch, self.out_channels = model.config.patch_size, model.out_channels

    def stem(self, x, t, cond=None):
        states, pooled = self.caption(cond, x)
        temb = self.time_text_embed(1000 * t, pooled)
        return self.pos_embed(x).contiguous(), self.context_embedder(states), temb

    def block_forward(self, i, carry):
        hidden, context, temb = carry if len(carry) == 3 else (carry[0], None, carry[1])
        context, hidden = self.blocks[i](hidden_states=hidden, encoder_hidden_states=context, temb=temb)
        return (hidden, temb) if context is None else (hidden, context, temb)  # the last block ends the caption

    def head(self, carry):
        hidden, temb = carry[0], carry[-1]
        return _unpatchify(self.proj_out(self.norm_out(hidden, temb)), self.patch, self.out_channels)


class Flux(_TextTransformer):
    """`FluxTransformer2DModel`: 2x2 patches packed into channels (in_channels = 4 x the data's), rotary positions
    from img_ids (0, row, column) and txt_ids (zeros), double- then single-stream blocks; its timestep in [0, 1],
    which it multiplies by 1000 itself. Guidance-distilled Flux (`guidance_embeds`) is not what Islands trains."""

    block_lists, head_names = ("transformer_blocks", "single_transformer_blocks"), ("norm_out", "proj_out")

    @staticmethod
    def arguments(config, shape, num_classes, text):
        if shape[1] % 2:
            raise ValueError(f"config: Flux packs 2x2 patches, which do not tile images of side {shape[1]}")
        _fill(config, "in_channels", 4 * shape[0], "2x2 patches of the data's channels")
        _fill(config, "out_channels", 4 * shape[0], "2x2 patches of the data's channels")
        _fill(config, "patch_size", 1, "packing 2x2 patches")
        _fill(config, "joint_attention_dim", text.width, "the text encoder's width")
        _fill(config, "pooled_projection_dim", text.pooled_width, "the text encoder's pooled width")
        _refuse_unless(config, "guidance_embeds", (False,), False)
        return config

    def __init__(self, model, shape, num_classes, text):
        super().__init__(model, shape, num_classes, text)
        # its rotary embedding has no weights: computed wherever a block needs it, not sent between stages
        self.stem_modules = tuple(n for n in self.stem_modules if n != "pos_embed")

    def stem(self, x, t, cond=None):
        b, c, h, w = x.shape
        packed = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 4 * c)
        hidden = self.x_embedder(packed)
        states, pooled = self.caption(cond, x)
        temb = self.time_text_embed(t.to(hidden.dtype) * 1000, pooled)
        return hidden, self.context_embedder(states), temb

    def rotary(self, tokens: int, device) -> tuple:
        side = self.input_shape[1] // 2
        img_ids = torch.zeros(side, side, 3, device=device)
        img_ids[..., 1] = torch.arange(side, device=device)[:, None]
        img_ids[..., 2] = torch.arange(side, device=device)[None, :]
        return self.pos_embed(torch.cat([torch.zeros(tokens, 3, device=device), img_ids.reshape(-1, 3)]))

    def block_forward(self, i, carry):
        hidden, context, temb = carry
        rotary = self.rotary(context.shape[1], hidden.device)
        context, hidden = self.blocks[i](hidden_states=hidden, encoder_hidden_states=context, temb=temb,
                                         image_rotary_emb=rotary)
        return hidden, context, temb

    def head(self, carry):
        hidden, _, temb = carry
        out = self.proj_out(self.norm_out(hidden, temb))
        b, (c, side) = out.shape[0], (self.input_shape[0], self.input_shape[1])
        return out.view(b, side // 2, side // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, side, side)


# a text network's learned null caption, exported beside its weights as the forward takes a caption (islands/export.py)
NULL_CAPTION = "islands_null_caption.safetensors"

ADAPTERS = {"UNet2DModel": UNet2D, "UNet2DConditionModel": UNet2DCondition, "DiTTransformer2DModel": DiT,
            "SD3Transformer2DModel": SD3, "FluxTransformer2DModel": Flux}


def build_diffusers(class_name: str, config: dict, shape: tuple, num_classes: int,
                    text: TextWidths | None) -> DiffusersNetwork:
    """The adapter of `class_name`, its model built from `config` (the data's sizes filled in). ValueError names the
    config key that does not fit."""
    adapter = ADAPTERS[class_name]
    arguments = adapter.arguments(dict(config), shape, num_classes, text)
    cls = getattr(diffusers, class_name)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = sorted(set(arguments) - accepted)
    if unknown:
        raise ValueError(f"config.{unknown[0]}: not an argument of {class_name}")
    try:
        model = cls(**arguments)
    except (TypeError, ValueError, KeyError, AssertionError, NotImplementedError, RuntimeError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"config: {class_name} cannot be built from it: {reason}") from None
    return adapter(model, shape, num_classes, text)


def load_pretrained(net: DiffusersNetwork, folder: str) -> str:
    """Put the weights of the diffusers folder `folder` (read as untrusted: islands/nets/vae_folder.py) into `net`,
    whose class and constructor arguments must be the folder's; the digest of the files read (its config and weights:
    vae_folder.listing_sha256), for the run to record."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    config, weights, digest = read_folder(folder, "diffusers folder", tuple(ADAPTERS))
    if config["_class_name"] != net.class_name:
        raise DataError(f"diffusers folder {folder} holds a {config['_class_name']}, not the run's {net.class_name}")
    for key, value in config.items():
        if not key.startswith("_") and _plain(net.diffusers_config.get(key)) != _plain(value):
            raise DataError(f"diffusers folder {folder}: its {CONFIG} gives {key} {value!r}, the run's network "
                            f"{net.diffusers_config.get(key)!r}")
    try:
        net.load_diffusers_state_dict(load(weights))
    except (SafetensorError, ValueError) as err:
        raise DataError(f"diffusers folder {folder}: {WEIGHTS}: {err}") from None
    return digest


def _plain(value):
    """A config value as JSON holds it (lists, not tuples)."""
    return list(map(_plain, value)) if isinstance(value, (list, tuple)) else value
