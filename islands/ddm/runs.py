"""The runs of a Decentralized Diffusion Model, derived from one config whose run_dir is the ensemble folder.

ENSEMBLE/partition/     the partition (`islands partition CONFIG`)
ENSEMBLE/experts/<k>/   expert k: an ordinary run on cluster k alone (`islands train CONFIG expert=k`)
ENSEMBLE/router/        the router: an ordinary run with the router objective (`islands train CONFIG router`)
ENSEMBLE/ensemble.json  the manifest that sampling reads

Timestep-range experts are derived the same way: RUN/tstages/<i>/ is range i of flow.t_ranges
(`islands train CONFIG tstage=i`), an ordinary run whose flow.t_range is that range in the path's own time.

An expert reads the partition and nothing of the other experts. Compute parity (the paper's recipe): each
expert's batch is the global batch / K and it takes the monolith's number of steps (every count of images
in its schedule shrinks by K), so the K experts together cost what the monolith of the same config costs.
"""

from pathlib import Path

from islands.config import Config, ConfigError, to_dict, validate
from islands.trainer.ranges import tstage_config, tstage_dir


def ensemble_dir(cfg: Config) -> Path:
    return Path(cfg.run_dir)


def partition_dir(cfg: Config) -> Path:
    return ensemble_dir(cfg) / "partition"


def expert_dir(cfg: Config, k: int) -> Path:
    return ensemble_dir(cfg) / "experts" / str(k)


def router_dir(cfg: Config) -> Path:
    return ensemble_dir(cfg) / "router"


def _require_ddm(cfg: Config) -> None:
    if cfg.ddm.k < 2:
        raise ConfigError(f"ddm.k: {cfg.ddm.k}; a decentralized model needs at least 2 experts")


def require_partition(cfg: Config) -> None:
    """A member trains on the partition, which must exist before it starts (deriving its config needs none)."""
    _require_ddm(cfg)
    if not (partition_dir(cfg) / "partition.json").exists():
        raise ConfigError(f"ddm: no partition in {partition_dir(cfg)}; run 'islands partition' with this config first")


def _derived(cfg: Config, run_dir: Path, replace: dict | None = None, **updates) -> Config:
    """cfg as a plain (non-DDM) run in run_dir, with keys of some sections updated and whole sections replaced."""
    raw = to_dict(cfg)
    raw.update(run_dir=str(run_dir), ddm={}, **(replace or {}))
    for name, values in updates.items():
        raw[name] = {**raw[name], **values}
    return validate(raw)


def expert_config(cfg: Config, k: int) -> Config:
    _require_ddm(cfg)
    if not 0 <= k < cfg.ddm.k:
        raise ConfigError(f"expert: {k} is not one of the {cfg.ddm.k} experts (0 to {cfg.ddm.k - 1})")
    batch = cfg.ddm.expert_batch or cfg.train.batch_size // cfg.ddm.k
    if batch < 1 or batch % cfg.train.accumulate:
        raise ConfigError(f"ddm.expert_batch: {batch} does not split into train.accumulate={cfg.train.accumulate}")
    # The monolith's schedule in steps: every count of images shrinks with the batch.
    scale = batch / cfg.train.batch_size
    t = cfg.train
    train = {"batch_size": batch, "images": max(batch, round(t.images * scale)),
             "warmup_images": round(t.warmup_images * scale), "ema_halflife_images": t.ema_halflife_images * scale,
             "checkpoint_every": max(1, round(t.checkpoint_every * scale)),
             "sample_every": round(t.sample_every * scale), "log_every": max(1, round(t.log_every * scale))}
    flow = {"t_ranges": cfg.ddm.t_ranges} if cfg.ddm.t_ranges else {}  # a cluster x range grid: ranges of its own
    return _derived(cfg, expert_dir(cfg, k), data={"partition": str(partition_dir(cfg)), "cluster": k}, train=train,
                    flow=flow)


def expert_runs(cfg: Config, k: int) -> list[Path]:
    """The run directories of cluster k's expert: itself, or its range experts in a cluster x range grid."""
    if not cfg.ddm.t_ranges:
        return [expert_dir(cfg, k)]
    return [tstage_dir(expert_config(cfg, k), r) for r in range(len(cfg.ddm.t_ranges) - 1)]


def router_config(cfg: Config) -> Config:
    _require_ddm(cfg)
    r = cfg.ddm.router
    model = {"arch": "router", "num_classes": cfg.model.num_classes, "outputs": cfg.ddm.k, "depth": r.depth,
             "condition": cfg.model.condition, "text_tokens": cfg.model.text_tokens}  # the experts' condition
    model.update({"hidden": r.hidden or max(16, cfg.model.hidden // 4)} if cfg.model.arch == "mlp" else
                 {"hidden_size": r.hidden_size, "num_heads": r.num_heads, "patch_size": r.patch_size})
    train = {"objective": "router", "batch_size": r.batch_size, "lr": r.lr, "accumulate": 1, "warmup_images": 0,
             "ema_halflife_images": 0.0, "sample_every": 0}
    router = _derived(cfg, router_dir(cfg), replace={"model": model, "eval": {}},  # images: one batch, set below
                      data={"partition": str(partition_dir(cfg)), "cluster": None},
                      train={**train, "images": r.batch_size})
    images = r.images or router_images(cfg, router)
    # no EDM ramp-up: it would cap the half-life at train.ema_rampup (5%) of the images, whatever ema_fraction says
    train = {"images": images, "checkpoint_every": images, "ema_halflife_images": r.ema_fraction * images,
             "ema_rampup": None}
    return router.model_copy(update={"train": router.train.model_copy(update=train)})


def router_images(cfg: Config, router: Config) -> int:
    """Whole batches of router training that cost `ddm.router.flops_fraction` of the experts' training FLOPs, both
    counted on one step by torch's flop counter (islands.train.flops), from the configs alone: every island that
    trains the router derives the same number before any expert has finished."""
    from islands.data import build_data  # the data's shape and classes; loaded only when the budget is derived
    from islands.data.latents import open_data_space
    from islands.train.flops import flops_per_image
    from islands.train.objectives import RouterObjective, build_objective

    source = build_data(cfg.data.model_copy(update={"partition": None, "cluster": None}), cfg.seed)
    space = open_data_space(cfg, partition_dir(cfg))  # on latents, experts and router encode alike
    shape, classes = space.example_shape(tuple(source.shape)), cfg.model.num_classes
    encoder = space.flops_per_image(tuple(source.shape))
    experts = 0.0
    for k in range(cfg.ddm.k):
        e = expert_config(cfg, k)
        micro = e.train.batch_size // e.train.accumulate
        per_image = flops_per_image(e.model, shape, classes, build_objective(e), micro,
                                    checkpointing=e.train.activation_checkpointing)
        experts += (per_image + encoder) * e.train.images
    objective = RouterObjective(cfg.seed, cfg.ddm.k, cfg.train.label_dropout)
    per_image = encoder + flops_per_image(router.model, shape, classes, objective, router.train.batch_size,
                                          checkpointing=router.train.activation_checkpointing)
    batches = max(1, round(cfg.ddm.router.flops_fraction * experts / per_image / router.train.batch_size))
    return batches * router.train.batch_size


def monolith_dir(cfg: Config) -> Path:
    return ensemble_dir(cfg) / "monolith"


def monolith_config(cfg: Config) -> Config:
    """The plain model of the same config and training budget, the ensemble's yardstick."""
    return _derived(cfg, monolith_dir(cfg))


def member_configs(cfg: Config) -> dict[str, Config]:
    """Every run `islands ddm` trains, by name, derived now so that a config error stops it before any starts."""
    members = {}
    for k in range(cfg.ddm.k):
        expert = expert_config(cfg, k)
        if cfg.ddm.t_ranges:
            members.update({f"expert{k}.{r}": tstage_config(expert, r) for r in range(len(cfg.ddm.t_ranges) - 1)})
        else:
            members[f"expert{k}"] = expert
    members["router"] = router_config(cfg)
    if cfg.ddm.monolith:
        members["monolith"] = monolith_config(cfg)
    return members


def distilled_dir(cfg: Config) -> Path:
    return ensemble_dir(cfg) / "distilled"


def distill_config(cfg: Config, teacher: str = "cluster") -> Config:
    """The student: the ensemble config's own network and training settings, on the whole data set, learning
    the velocity of the expert of each image's cluster (or of the routed mixture)."""
    require_partition(cfg)
    if not (ensemble_dir(cfg) / "ensemble.json").exists():
        raise ConfigError(f"distill: {ensemble_dir(cfg)} has no ensemble.json yet; run 'islands ddm' first")
    return _derived(cfg, distilled_dir(cfg), data={"partition": str(partition_dir(cfg)), "cluster": None},
                    train={"objective": "distill", "teacher": teacher})


def split_roles(overrides: list[str]) -> tuple[list[str], list[str]]:
    """The role words among `islands train`'s overrides (`expert=K`, `router`, `monolith`, `tstage=I`), and the config
    overrides besides them."""
    roles = [o for o in overrides if o in ("router", "monolith") or o.startswith(("expert=", "tstage="))]
    return roles, [o for o in overrides if o not in roles]


def config_for_roles(cfg: Config, roles: list[str]) -> Config:
    """The config of the run that `roles` name within `cfg`: a member of its decentralized model (`expert=K`, `router`
    or `monolith`, derived from the ensemble's config), then, with `tstage=I`, that run's timestep-range expert I."""
    from islands.trainer.ranges import tstage_config

    member, ranges = [r for r in roles if not r.startswith("tstage=")], [r for r in roles if r.startswith("tstage=")]
    if len(member) > 1 or len(ranges) > 1:
        raise ConfigError(f"train: give one of expert=K, router and monolith, and at most one tstage=I, "
                          f"not {' '.join(roles)}")
    if member and member[0] != "monolith":
        require_partition(cfg)
    if member == ["router"]:
        cfg = router_config(cfg)
    elif member == ["monolith"]:
        cfg = monolith_config(cfg)
    elif member:
        index = member[0].split("=", 1)[1]
        if not index.isdecimal():
            raise ConfigError(f"expert: {member[0]!r} is not expert=K with K a number")
        cfg = expert_config(cfg, int(index))
    if ranges:  # a timestep-range expert of the run derived so far (an expert's, in a cluster x range grid)
        index = ranges[0].split("=", 1)[1]
        if not index.isdecimal():
            raise ConfigError(f"tstage: {ranges[0]!r} is not tstage=I with I a number")
        cfg = tstage_config(cfg, int(index))
    return cfg
