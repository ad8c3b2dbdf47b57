"""parallel.strategy -> its Strategy, with the checks that span strategies."""

import importlib

import torch.distributed as dist

from islands.parallel.launch import World
from islands.parallel.strategies import Strategy

# imported when chosen: the sharding and pipelining modules of torch take seconds to import
STRATEGIES = {"none": "strategies.Strategy", "ddp": "strategies.DDPStrategy", "zero1": "sharding.Zero1Strategy",
              "zero2": "sharding.Zero2Strategy", "fsdp": "sharding.FSDPStrategy",
              "pipeline": "pipeline.PipelineStrategy", "local_sgd": "local_updates.LocalSGDStrategy",
              "diloco": "local_updates.DiLoCoStrategy"}
LOCAL = ("sync_every", "batch_size", "fragments", "replicas", "worker_batch", "worker_sync_every", "lighthouse",
         "replica_id", "host", "min_replicas", "timeout_s", "quorum_timeout_s")
EXTRA = {"pipeline": ("stages", "microbatches", "schedule", "virtual_stages", "data"),
         "local_sgd": LOCAL, "diloco": (*LOCAL, "outer_lr", "outer_momentum")}


def build_strategy(name: str, world: World, compression: str = "none", precision: str = "fp32",
                   compile: bool = False, activation_checkpointing: bool = False, **options) -> Strategy:
    """The strategy `parallel.strategy` names; `options` holds the keys some strategies read (EXTRA): the pipeline's
    parallel.stages, microbatches, schedule, virtual_stages and data, the local updates' sync_every, outer_lr,
    outer_momentum, fragments, replicas, worker_batch and worker_sync_every, torchft's lighthouse, replica_id, host,
    min_replicas, timeout_s and quorum_timeout_s, and the global batch_size."""
    if name == "none" and world.distributed:
        raise ValueError("parallel.strategy: 'none' cannot run with several ranks; choose ddp")
    if world.group is not None and name not in ("ddp", "none"):  # FSDP's mesh and ZeRO's partitions span the whole job
        raise ValueError(f"parallel.strategy: inside a group of ranks (tstages) each group runs ddp, not {name!r}")
    if name in ("fsdp", "zero2", "pipeline") and precision == "fp16":
        # GradScaler would find infinities in each rank's shard separately and let the scales drift apart.
        raise ValueError(f"train.precision: fp16 loss scaling is not supported with {name}; use bf16")
    if name == "local_sgd" and compression != "none":
        raise ValueError("parallel.compression: local_sgd averages the weights themselves, which 16 bits would "
                         "round; diloco sends its pseudo-gradients in 16 bits")
    # after the checks of the config alone, so that those fail the same in one process as on many ranks
    # (a replica that is a job of its own, joined to the others through torchft's lighthouse, may be one process)
    if name != "none" and not dist.is_initialized() and options.get("lighthouse") is None:
        raise ValueError(f"parallel.strategy: {name!r} needs a process group; launch with torchrun")
    extra = {k: options[k] for k in EXTRA.get(name, ()) if k in options}
    return strategy_class(name)(world, compression, precision, compile, activation_checkpointing, **extra)


def strategy_class(name: str) -> type[Strategy]:
    """The class `parallel.strategy` names, its module imported only now."""
    module, cls = STRATEGIES[name].split(".")
    return getattr(importlib.import_module(f"islands.parallel.{module}"), cls)
