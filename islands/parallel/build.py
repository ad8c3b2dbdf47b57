"""parallel.strategy -> its Strategy, built from the keys it reads, after the checks that span strategies."""

import importlib

import torch.distributed as dist

from islands.config import STRATEGIES, Config
from islands.parallel.launch import World
from islands.parallel.strategies import Strategy


def build_strategy(cfg: Config, world: World) -> Strategy:
    """The strategy `parallel.strategy` names, built from the keys of `cfg` it reads (`Strategy.options`)."""
    name = cfg.parallel.strategy
    cls = strategy_class(name)
    if world.distributed and not cls.several_ranks:
        raise ValueError(f"parallel.strategy: {name!r} cannot run with several ranks; choose ddp")
    if world.group is not None and not cls.in_a_group:
        raise ValueError(f"parallel.strategy: inside a group of ranks (tstages) each group runs ddp, not {name!r}")
    if cfg.train.precision == "fp16" and not cls.fp16:
        raise ValueError(f"train.precision: fp16 loss scaling is not supported with {name}; use bf16")
    cls.check(cfg)
    # after the checks of the config alone, so that those fail the same in one process as on many ranks
    # (a replica that is a job of its own, joined to the others through torchft's lighthouse, may be one process)
    if cls.several_ranks and not dist.is_initialized() and cfg.parallel.lighthouse is None:
        raise ValueError(f"parallel.strategy: {name!r} needs a process group; launch with torchrun")
    return cls.from_config(cfg, world)


def strategy_class(name: str) -> type[Strategy]:
    """The class `parallel.strategy` names (config.STRATEGIES), its module imported only now: torch's sharding and
    pipelining modules take seconds to import."""
    path = STRATEGIES[name].path
    if path is None:
        raise ValueError(f"parallel.strategy: {name!r} is no strategy of its own; islands train splits the ranks "
                         "into groups that each run ddp")
    module, cls = path.split(".")
    return getattr(importlib.import_module(f"islands.parallel.{module}"), cls)
