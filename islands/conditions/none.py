"""No condition: an unconditional network. Guidance has nothing to guide by, and a request for a condition is
refused."""

from islands.conditions.kind import ConditionKind


class NoCondition(ConditionKind):
    name = "none"

    def check(self, cfg) -> None:
        super().check(cfg)
        if cfg.model.num_classes:
            raise ValueError(f"model.condition: 'none' with model.num_classes={cfg.model.num_classes} (a class needs "
                             "condition class)")
