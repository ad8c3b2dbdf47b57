"""`islands plan` as a function: the shape a config's network learns (read from its data unless given), the cluster,
and the predicted rows written as a plan and its picture."""

from pathlib import Path

from islands.config import Config
from islands.errors import config_errors
from islands.plan.network import load_network
from islands.plan.predict import Planner
from islands.plan.report import table, write_plan


def planned_shape(cfg: Config) -> tuple[tuple, int, float]:
    """(the example shape the network learns, the data's classes, FLOPs spent encoding an example) of a config's
    data: on latents the latents' shape and the encoder's forward."""
    from islands.data import build_data
    from islands.data.latents import open_data_space

    source = build_data(cfg.data, cfg.seed)
    space = open_data_space(cfg, Path(cfg.run_dir))
    with config_errors("data.autoencoder"):
        shape = space.example_shape(tuple(source.shape))
    return shape, source.num_classes, space.flops_per_image(tuple(source.shape))


def plan(cfg: Config, network: str, out: Path | None = None, name: str = "plan",
         sync_every: tuple[int, ...] = (10, 50, 100, 200), shape: tuple | None = None, classes: int | None = None,
         ranks: int = 2) -> tuple[str, Path, Path]:
    """The predicted wall time of `cfg` for every strategy on `network` (a preset, a YAML file, or this-machine:
    measured here with `ranks` processes), written to `out` (default plans/NAME-CLUSTER) with a suffix each; `shape`
    (with `classes`, else model.num_classes) instead of reading the data. -> (the table, the plan's JSON, its
    picture)."""
    encoder = 0.0
    if shape is None:
        shape, classes, encoder = planned_shape(cfg)
    elif classes is None:
        classes = cfg.model.num_classes or 0
    if network == "this-machine":
        from islands.plan.this_machine import this_machine

        cluster = this_machine(cfg, shape, classes, ranks)
    else:
        cluster = load_network(network)
    planner = Planner(cfg, cluster, shape, classes, encoder)
    rows = planner.rows(sync_every)
    data, picture = write_plan(rows, planner, Path(out or f"plans/{name}-{cluster.name}"))
    return table(rows, planner), data, picture
