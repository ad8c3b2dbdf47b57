"""Timestep-range experts as runs of their own: range I of flow.t_ranges is the config's run in RUN/tstages/I,
trained on that range only (its flow.t_range, in the path's own time). `islands train CONFIG tstage=I` trains one;
`parallel.strategy=tstages` trains them all at once under torchrun, each on its own group of ranks."""

from pathlib import Path

import torch

from islands.config import Config, to_dict, validate
from islands.errors import ConfigError
from islands.flow.paths import build_path


def tstage_dir(cfg: Config, i: int) -> Path:
    return Path(cfg.run_dir) / "tstages" / str(i)


def tstage_config(cfg: Config, i: int, parallel: dict | None = None) -> Config:
    """Range expert i: the config's run trained on [t_ranges[i], t_ranges[i + 1]] only (canonical t, converted to
    the path's own time), in RUN/tstages/i; `parallel` replaces keys of its parallel section."""
    bounds = cfg.flow.t_ranges
    if bounds is None:
        raise ConfigError("tstage: flow.t_ranges is not set; give the ranges' boundaries, e.g. "
                          "flow.t_ranges=[0,0.3,0.7,1]")
    if not 0 <= i < len(bounds) - 1:
        raise ConfigError(f"tstage: {i} is not one of the {len(bounds) - 1} ranges of flow.t_ranges "
                          f"(0 to {len(bounds) - 2})")
    path = build_path(cfg.flow.path, **cfg.flow.path_options())
    lo, hi = path.own_time(torch.tensor(bounds[i:i + 2], dtype=torch.float64)).tolist()
    raw = to_dict(cfg)
    raw.update(run_dir=str(tstage_dir(cfg, i)), flow={**raw["flow"], "t_range": [lo, hi]},
               parallel={**raw["parallel"], **(parallel or {})})
    return validate(raw)
