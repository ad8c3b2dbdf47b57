"""parallel.strategy: one registry (config.STRATEGIES) names the strategies; each strategy's class reads its own keys
of the config (`options`), and the checks across strategies refuse what cannot run with one line naming the key."""

import inspect
import typing

import pytest
import torch
from conftest import write_config

from islands.cli import main
from islands.config import STRATEGIES, ParallelConfig, validate
from islands.parallel.build import build_strategy, strategy_class
from islands.parallel.launch import World


def constructor_arguments(cls) -> set[str]:
    """Every keyword a strategy's constructors (its own and those it passes on to) take, but the world."""
    names = set()
    for c in cls.__mro__:
        if "__init__" in vars(c) and c is not object:
            names |= {n for n, p in inspect.signature(c.__init__).parameters.items()
                      if n not in ("self", "world") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return names


def test_the_registry_is_the_schema_and_each_class_reads_every_argument_it_takes_from_the_config():
    assert typing.get_args(ParallelConfig.model_fields["strategy"].annotation) == tuple(STRATEGIES)
    cfg = validate({"run_dir": "unused"})
    for name, kind in STRATEGIES.items():
        if kind.path is None:  # tstages: groups of ranks that each run ddp, built by the trainer
            with pytest.raises(ValueError, match=f"^parallel.strategy: '{name}' is no strategy of its own"):
                strategy_class(name)
            continue
        cls = strategy_class(name)
        assert cls.name == name
        assert set(cls.options(cfg)) == constructor_arguments(cls), name  # none left at its constructor's default


def test_a_strategy_is_built_from_the_values_of_its_own_keys():
    cfg = validate({"run_dir": "unused", "train": {"batch_size": 12, "precision": "bf16"},
                    "parallel": {"strategy": "diloco", "sync_every": 6, "fragments": 3, "outer_lr": 0.5,
                                 "outer_momentum": 0.2, "compression": "fp16"}})
    strategy = strategy_class("diloco").from_config(cfg, World())
    replicas = strategy.replicas
    assert (replicas.every, replicas.count, replicas.outer_lr, replicas.outer_momentum) == (6, 3, 0.5, 0.2)
    assert (strategy.layout.precision, replicas.wire, strategy.data.schedule.batches) == ("bf16", torch.float16, (12,))


@pytest.mark.parametrize("overrides,message", [
    (["parallel.strategy=fsdp_2d"], "parallel.strategy: Input should be 'none', 'ddp', 'zero1', 'zero2', 'fsdp', "
                                    "'tstages', 'pipeline', 'local_sgd' or 'diloco' (got 'fsdp_2d')"),
    *[([f"parallel.strategy={name}", "train.precision=fp16"],
       f"train.precision: fp16 loss scaling is not supported with {name}; use bf16")
      for name in ("fsdp", "zero2", "pipeline")],
    (["parallel.strategy=ddp"], "parallel.strategy: 'ddp' needs a process group; launch with torchrun"),
    (["parallel.strategy=diloco", "parallel.compression=bf16"], "parallel.strategy: 'diloco' needs a process group"),
])
def test_a_strategy_that_cannot_run_stops_the_run_with_one_line_naming_the_key(tmp_path, capsys, overrides,
                                                                                 message):
    cfg = {"run_dir": str(tmp_path / "run"), "model": {"arch": "mlp", "hidden": 8, "depth": 1},
           "data": {"source": "gmm", "means": [[1, 1], [-1, -1]], "std": 0.3, "size": 64}}
    capsys.readouterr()
    assert main(["train", write_config(tmp_path / "c.yaml", cfg), *overrides, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("islands: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_the_checks_on_the_world_name_the_strategy():
    none, fsdp = validate({"run_dir": "unused"}), validate({"run_dir": "unused", "parallel": {"strategy": "fsdp"}})
    with pytest.raises(ValueError, match="^parallel.strategy: 'none' cannot run with several ranks; choose ddp$"):
        build_strategy(none, World(rank=0, size=2))
    with pytest.raises(ValueError, match=r"^parallel.strategy: inside a group of ranks \(tstages\) each group runs "
                                         "ddp, not 'fsdp'$"):
        build_strategy(fsdp, World(rank=0, size=2, group=object()))
    assert type(build_strategy(none, World())).__name__ == "Strategy"
