"""The questions every condition kind answers (`ConditionKind`), and a sampling request (`SampleRequest`): what a
person asked the samples to be conditioned on, whatever the kind."""

from dataclasses import dataclass
from pathlib import Path

import torch

from islands.errors import ConfigError
from islands.nets import NetworkSpec


@dataclass(frozen=True)
class SampleRequest:
    """What samples are asked for: a class (`--class`), prompts (`--prompt`), condition images (`--condition-image`,
    or a cascade's previous stage), each read by its kind only."""

    class_label: int | None = None
    prompts: tuple[str, ...] = ()
    images: torch.Tensor | str | Path | None = None  # (n, C, h, w) in [-1, 1], or a file or folder of images

    def given(self) -> dict[str, str]:
        """The options of the requests made, each with what it conditions on."""
        made = {"--class": (self.class_label, "a class"), "--prompt": (self.prompts or None, "text"),
                "--condition-image": (self.images, "an image")}
        return {option: what for option, (value, what) in made.items() if value is not None}


NO_REQUEST = SampleRequest()  # samples as `islands sample` draws them when nothing is asked: every class in turn


class ConditionKind:
    """One kind of condition. The defaults are those of a kind that reads nothing of an example."""

    name = ""
    field: str | None = None  # the field of an example the network is conditioned on (islands/data/sources.py)
    option: str | None = None  # the `islands sample` option that asks for one
    keys: dict[str, tuple[str, ...]] = {}  # config keys only this kind reads, by section (the report shows them)
    partition_features = "pixels"  # what an ensemble of this kind clusters by default (ddm.partition.features)
    grid_from_data = False  # a sample grid is drawn for the conditions of the first examples, not for each in turn

    def check(self, cfg) -> None:
        """The config's rules for this kind, raised as ValueErrors naming the key (run inside validation)."""
        from islands.config import DIFFUSERS_TEXT

        model = cfg.model
        if model.arch == "diffusers" and model.class_name in DIFFUSERS_TEXT:
            raise ValueError(f"model.condition: {self.name!r} for a {model.class_name}; of the diffusers classes, "
                             f"{', '.join(DIFFUSERS_TEXT)} read a caption (condition text), the others do not")

    def resolve(self, cfg) -> None:
        """Fill in what the network needs from the folders the config names (after validation)."""

    def network_spec(self, model, shape: tuple, num_classes: int) -> NetworkSpec:
        """What the network is built for."""
        return NetworkSpec(model, shape)

    def source(self, cfg, run_dir, source, device="cpu", progress: bool = False):
        """The data as a run of this kind reads it: holding `field`."""
        return source

    def request(self, sampler, num: int, request: SampleRequest) -> torch.Tensor | None:
        """The conditions of `num` samples of `sampler` asked for by `request` (None: none); a request this kind does
        not read is refused in one line."""
        self.refuse_others(sampler, request)
        return None

    def evaluation_request(self, evaluator, num: int) -> SampleRequest:
        """What `num` samples scored against the data are drawn for."""
        return SampleRequest()

    def check_exportable(self, cfg) -> None:
        """Raise a ConfigError where a run of this kind cannot be exported to diffusers."""

    def export_record(self, cfg, run_dir, arguments=(), null_caption: str | None = None) -> dict:
        """What an export records of the condition, beside the network (`arguments`: the forward's arguments that
        carry it; `null_caption`: the file of a learned none the network does not hold)."""
        return {}

    def first_examples(self, source, indices: list[int]):
        """(conditions, captions to print) of a sample grid drawn for the data's own examples (`grid_from_data`)."""
        return source.read(indices, (self.field,))[self.field], None

    def refuse_others(self, sampler, request: SampleRequest, mine: str | None = None) -> None:
        """One line for a request of another kind than this one's."""
        for option, what in request.given().items():
            if option != mine:
                raise ConfigError(f"{option}: {sampler.cfg.run_dir} is not conditioned on {what} "
                                  f"(model.condition: {self.name})")
