"""Condition kinds: what a network is conditioned on, each kind one part that says in one place everything Islands
does with it (islands/conditions/kind.py lists the questions): its config's rules, the field of an example it
reads, the networks' arguments for it (whose modules, in islands/nets/condition.py, embed it and say what "none"
is), how a sampling request makes one, what a run records about it and what the report shows. Nothing else in
Islands asks which kind a run has: it asks the run's kind (`condition_kind`).

A new kind is a file here with a `ConditionKind` subclass, one line in `KINDS`, and its network module."""

from islands.conditions.classes import ClassKind
from islands.conditions.image import ImageKind
from islands.conditions.kind import NO_REQUEST, ConditionKind, SampleRequest
from islands.conditions.none import NoCondition
from islands.conditions.text import TextKind
from islands.nets import NetworkSpec

KINDS: dict[str, ConditionKind] = {kind.name: kind for kind in (NoCondition(), ClassKind(), TextKind(), ImageKind())}


def condition_kind(model) -> ConditionKind:
    """The condition kind of a model config section (`model.condition`; before it is resolved, a class where there
    are classes, else none)."""
    return KINDS[model.condition or ("class" if model.num_classes else "none")]


def network_spec(model, shape, num_classes: int = 0) -> NetworkSpec:
    """What the network of `model` is built for: examples of `shape`, and its condition as its kind gives it."""
    return condition_kind(model).network_spec(model, tuple(shape), num_classes)


__all__ = ["KINDS", "NO_REQUEST", "ConditionKind", "SampleRequest", "condition_kind", "network_spec"]
