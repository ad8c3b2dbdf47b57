"""A class label: an index in [0, num_classes), `num_classes` for none (the extra row of the network's table,
islands/nets/condition.py). Samples cycle through the classes unless one is asked for (`--class`)."""

import torch

from islands.conditions.kind import ConditionKind, SampleRequest
from islands.data.sources import LABEL
from islands.errors import ConfigError
from islands.nets import NetworkSpec


class ClassKind(ConditionKind):
    name = "class"
    field = LABEL
    option = "--class"
    keys = {"model": ("num_classes",)}

    def check(self, cfg) -> None:
        super().check(cfg)
        if not cfg.model.num_classes:
            raise ValueError("model.condition: 'class' with model.num_classes=0 (a class needs num_classes > 0)")

    def network_spec(self, model, shape: tuple, num_classes: int) -> NetworkSpec:
        return NetworkSpec(model, shape, num_classes)

    def request(self, sampler, num: int, request: SampleRequest) -> torch.Tensor | None:
        self.refuse_others(sampler, request, self.option)
        return class_labels(num, sampler.num_classes, request.class_label)


def class_labels(num: int, num_classes: int, class_label: int | None = None) -> torch.Tensor | None:
    """Labels cycle through the classes (one class per grid column) unless one class is asked for; None for a
    network without classes."""
    if num_classes == 0:
        return None
    if class_label is not None:
        if not 0 <= class_label < num_classes:
            raise ConfigError(f"--class: {class_label} is not a class of this model ({num_classes} classes)")
        return torch.full((num,), class_label, dtype=torch.long)
    return torch.arange(num) % num_classes
