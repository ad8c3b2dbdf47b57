"""A caption: encoded once per run by the run's text encoder (islands/data/captions.py), packed into one tensor
(`pack_text`) that the network reads as a pooled vector beside the time and token states for cross-attention, a
learned null for none. Its encoder's files are recorded by the run and checked wherever prompts are encoded."""

import torch

from islands.conditions.kind import ConditionKind, SampleRequest
from islands.data.captions import (
    condition_on_captions,
    encode_captions,
    open_run_text_encoder,
    recorded_text_encoder,
)
from islands.data.sources import CAPTION_EMBEDDING
from islands.nets import NetworkSpec
from islands.nets.condition import TextWidths
from islands.nets.text_folder import text_pooling


class TextKind(ConditionKind):
    name = "text"
    field = CAPTION_EMBEDDING
    option = "--prompt"
    keys = {"model": ("text_tokens", "text_width", "text_pooled_width"), "data": ("text_encoder",)}
    partition_features = "text"
    grid_from_data = True

    def check(self, cfg) -> None:
        from islands.config import DIFFUSERS_TEXT, TEXT_ARCHS, reads_text

        model = cfg.model
        if model.num_classes:
            raise ValueError(f"model.condition: 'text' with model.num_classes={model.num_classes} (a class needs "
                             "condition class)")
        if model.arch == "diffusers" and model.class_name not in DIFFUSERS_TEXT:
            raise ValueError(f"model.condition: 'text' for a {model.class_name}; of the diffusers classes, "
                             f"{', '.join(DIFFUSERS_TEXT)} read a caption (condition text), the others do not")
        if not reads_text(model):
            raise ValueError(f"model.condition: text is read by {', '.join(TEXT_ARCHS)} networks, not "
                             f"{model.arch!r}")

    def resolve(self, cfg) -> None:
        """The text encoder's widths, from its folder's configs (no weights)."""
        model = cfg.model
        if model.text_width is None or model.text_pooled_width is None:
            from islands.nets.text_folder import text_widths

            model.text_width, model.text_pooled_width = text_widths(cfg.data.text_encoder)

    def network_spec(self, model, shape: tuple, num_classes: int) -> NetworkSpec:
        return NetworkSpec(model, shape, text=TextWidths(model.text_width, model.text_pooled_width,
                                                         model.text_tokens))

    def source(self, cfg, run_dir, source, device="cpu", progress: bool = False):
        return condition_on_captions(cfg, run_dir, source, device, progress)

    def request(self, sampler, num: int, request: SampleRequest) -> torch.Tensor | None:
        """Prompts in turn, encoded by the run's text encoder (its files checked against the run's record) as its
        captions were; no prompt: none."""
        self.refuse_others(sampler, request, self.option)
        if not request.prompts:
            return None
        encoder = open_run_text_encoder(sampler.cfg, sampler.text_encoder_sha256)
        prompts = list(request.prompts)
        return encode_captions(encoder, prompts, sampler.cfg.model.text_tokens)[torch.arange(num) % len(prompts)]

    def evaluation_request(self, evaluator, num: int) -> SampleRequest:
        return SampleRequest(prompts=tuple(evaluator.prompts(num)))  # held out of the prompt judge's training

    def export_record(self, cfg, run_dir, arguments=(), null_caption: str | None = None) -> dict:
        """How a caption reaches a text network: the encoder that made the run's captions (its name and its files'
        sha256), the tokenizer's arguments (every caption `model.text_tokens` tokens, cut or padded: its token states
        are the encoder's last hidden state, every row, pads included; its mask the tokenizer's attention mask), how
        the pooled vector is made, the forward's arguments the class reads, and the file of the null caption (None:
        the network holds it, and reads it where it is given no caption)."""
        return {"text": {"text_encoder": cfg.data.text_encoder, "sha256": recorded_text_encoder(run_dir),
                         "tokenizer": {"padding": "max_length", "truncation": True,
                                       "max_length": cfg.model.text_tokens},
                         **text_pooling(cfg.data.text_encoder), "arguments": list(arguments),
                         "null_caption": null_caption}}

    def first_examples(self, source, indices: list[int]):
        return source.read(indices, (self.field,))[self.field], source.captions(indices)
