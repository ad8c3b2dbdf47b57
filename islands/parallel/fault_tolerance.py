"""Replicas that are separate jobs and may drop out and rejoin: the outer synchronisation of local SGD and DiLoCo
through torchft (`parallel.lighthouse`).

Each job (one process, or a torchrun job whose ranks train one replica with DDP) is one replica. At every
synchronisation its ranks ask torchft's `Manager` for a quorum, which the lighthouse forms from the replicas that are
alive and asking; the exchange then runs on torchft's reconfigurable gloo group over exactly those replicas, and is
committed only if every one of them got through it. So:

- a replica that dies or hangs does not stop the others: once its heartbeat stops the lighthouse leaves it out of
  the next quorum, and the weighted average is renormalised over the replicas present (each sends its weight
  beside its tensors). A live replica that falls behind is waited for (up to `parallel.quorum_timeout_s`) unless
  the replicas asking are a majority of the live ones: the lighthouse never lets a minority go ahead (split-brain
  prevention), so of two replicas a slow one holds the other back, of three or more the others go ahead after the
  lighthouse's `join_timeout_ms` and the slow one heals when it asks;
- a synchronisation broken by a peer dying inside it is discarded: no replica applies it, each keeps its own weights,
  and the next one starts from a fresh quorum;
- a replica that restarts (from its own last checkpoint, or from nothing) is behind the quorum's count of
  synchronisations, so torchft heals it at its next synchronisation: it receives a peer's last synchronised weights,
  outer state, EMA and image count, takes part in that synchronisation with weight zero (it consumed nothing of the
  round), and continues on its peers' clock.

Healing sends the state as safetensors over HTTP (`SafetensorsTransport`): torchft's own transports unpickle what a
peer sends, and another island is not trusted with that. The server has no authentication: replicas must meet on a
network that only they reach (README). A healing state is checked where it arrives, before any of it is applied:
safetensors, torchft's two counters, the hash of the peer's config (`replica_config_sha256`: the keys that decide a
trajectory) equal to this replica's, and the names, shapes and dtypes of this replica's own state (`fitting`). One
that fails is refused with one line naming the peer, and the replica leaves the quorum (its manager shut down, the
run stopped with `HealRefused`) rather than ask the same peer again at every synchronisation.
torchft's `LocalSGD` and `DiLoCo` wrappers are not used:
Islands' strategies already implement both methods (with the image clock, weighting and streaming the trainer
needs); only the exchange and the membership come from torchft.
"""

import json
import logging
import os
import socket
import threading
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# torchft's Rust side logs every quorum at INFO: quiet unless the user says otherwise (RUST_LOG), read when it loads
os.environ.setdefault("RUST_LOG", "warn")

import torch  # noqa: E402
from safetensors import SafetensorError  # noqa: E402
from safetensors.torch import load as load_safetensors  # noqa: E402
from safetensors.torch import save as save_safetensors  # noqa: E402
from torchft.checkpointing.transport import CheckpointTransport  # noqa: E402
from torchft.manager import Manager  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402

from islands.config import BESIDE_THE_RUN, RESUMABLE_CHANGES, Config, to_dict  # noqa: E402
from islands.config import flatten as flatten_config  # noqa: E402
from islands.errors import CheckpointError  # noqa: E402
from islands.parallel.launch import World  # noqa: E402
from islands.parallel.ledger import Ledger  # noqa: E402


class HealRefused(CheckpointError):
    """A peer's healing state that this replica will not take (not safetensors, another config, other tensors)."""


# ...and its manager warns at every new quorum that it cannot reset NCCL's flight recorder, which gloo has not; a
# refused heal is said once, in one line, by the run itself (torchft would log it with its traceback)
logging.getLogger("torchft.manager").addFilter(
    lambda record: "flight recorder" not in record.getMessage() and not (
        record.exc_info and isinstance(record.exc_info[1], HealRefused)))

# Keys that may differ between the replicas of one run: where each keeps its run and data, who it is.
_OWN_TO_A_REPLICA = ("parallel.replica_id",)
_PATH_KEY_ENDS = ("path", "root", "folder", "dir")


def replica_config_sha256(cfg: Config) -> str:
    """The sha256 of what decides a replica's trajectory: its resolved config without the keys a resume may change
    (RESUMABLE_CHANGES), its replica id, and the data's file locations (each machine keeps its own copy; its bytes
    are checked by their fingerprint). Replicas that heal one another must agree on it."""
    import hashlib

    keys = {key: value for key, value in flatten_config(to_dict(cfg)).items()
            if not (key in RESUMABLE_CHANGES or key.split(".")[0] in RESUMABLE_CHANGES or key in BESIDE_THE_RUN
                    or key in _OWN_TO_A_REPLICA or (key.startswith("data.") and key.endswith(_PATH_KEY_ENDS)))}
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()


def leaves(state: dict, prefix: str = ""):
    """(the "/"-joined key, the value) of every tensor and number in a nested dict."""
    for key, value in state.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}/")
        else:
            yield f"{prefix}{key}", value


def flatten(state: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A nested dict of tensors and numbers -> (tensors by "/"-joined key, the numbers as JSON by key)."""
    tensors, numbers = {}, {}
    for name, value in leaves(state):
        if isinstance(value, torch.Tensor):
            tensors[name] = value.detach().cpu().contiguous()
        else:
            numbers[name] = json.dumps(value)
    return tensors, numbers


def unflatten(tensors: dict[str, torch.Tensor], numbers: dict[str, str]) -> dict:
    state: dict = {}
    for name, value in [*tensors.items(), *((k, json.loads(v)) for k, v in numbers.items())]:
        *path, leaf = name.split("/")
        node = state
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = value
    return state


def to_bytes(state: dict) -> bytes:
    tensors, numbers = flatten(state)
    return save_safetensors(tensors, metadata={"numbers": json.dumps(numbers)})


def from_bytes(data: bytes) -> dict:
    """Parse what a peer sent: safetensors, so a hostile peer can send wrong numbers but never code."""
    try:
        tensors = load_safetensors(data)  # checks the header against the data before anything is read
        header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
        numbers = json.loads(header.get("__metadata__", {}).get("numbers", "{}"))
    except (SafetensorError, ValueError) as err:
        raise ValueError(f"a peer sent healing state that is not safetensors: {err}") from None
    return unflatten(tensors, numbers)


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    return f"a number ({type(value).__name__})"


def fitting(received: dict, own: dict) -> dict:
    """`received`, a peer's healing state, if every name in it has this replica's shape and dtype and none is missing
    or added; otherwise a CheckpointError naming the first that differs, before anything is applied. (`copy_` would
    broadcast a wrong shape, and a missing name would leave a state half-applied.)"""
    theirs, ours = ({name: _kind(value) for name, value in leaves(state)} for state in (received, own))
    for name in sorted(theirs.keys() | ours.keys()):
        if theirs.get(name) != ours.get(name):
            raise CheckpointError(f"a peer's healing state does not fit this replica: {name} is "
                                  f"{theirs.get(name, 'missing')} there, {ours.get(name, 'missing')} here (does the "
                                  "peer train another config?); refusing it")
    return received


class SafetensorsTransport(CheckpointTransport):
    """torchft's checkpoint transport for healing, serving the state a peer asks for as safetensors bytes from a
    small HTTP server on `host`. What a peer sends is given to `check` (this replica's, raising a CheckpointError)
    where it arrives; a refusal is kept in `refused`, one line naming the peer, for the replica to act on."""

    def __init__(self, host: str, timeout: timedelta, check: Callable[[dict], None] = lambda state: None):
        self.timeout, self.payload, self.step, self.check = timeout, b"", -1, check
        self.refused: str | None = None
        self.ready = threading.Event()
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                step = int(self.path.rstrip("/").rsplit("/", 1)[-1])
                if not transport.ready.wait(transport.timeout.total_seconds()) or step != transport.step:
                    self.send_error(404, f"no state for synchronisation {step} (serving {transport.step})")
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(transport.payload)))
                self.end_headers()
                self.wfile.write(transport.payload)

            def log_message(self, *args):  # one line per request on stderr would drown the run's own output
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.address = f"http://{host}:{self.server.server_address[1]}/state/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def metadata(self) -> str:
        return self.address

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict, timeout: timedelta) -> None:
        self.payload, self.step = to_bytes(state_dict), step  # serialised now: the weights move on after this
        self.ready.set()

    def disallow_checkpoint(self) -> None:
        self.ready.clear()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict:
        with urllib.request.urlopen(f"{metadata}{step}", timeout=timeout.total_seconds()) as response:
            data = response.read()
        try:
            state = from_bytes(data)
            # torchft takes its two counters from it as they are
            fitting({"torchft": state.get("torchft", {})}, {"torchft": {"step": step, "batches_committed": 0}})
            self.check(state.get("user", {}).get("default", {}))
        except (CheckpointError, ValueError) as err:
            self.refused = (f"refused the healing state of the peer at {metadata} (replica {src_rank} of the quorum, "
                            f"synchronisation {step}): {err}; this replica leaves the quorum")
            raise HealRefused(self.refused) from None
        return state

    def shutdown(self, wait: bool = True) -> None:
        self.server.shutdown()
        self.server.server_close()


def checked(load: Callable[[dict], None], state: Callable[[], dict]) -> Callable[[dict], None]:
    """`load`, given only a peer's state that fits this replica's own `state()`."""
    return lambda received: load(fitting(received, state()))


def same_config(received: dict, config_sha256: str) -> None:
    """A peer's healing state comes from a replica of this same config (its `replica_config_sha256`)."""
    theirs = received.get("config_sha256", "none")
    if theirs != config_sha256:
        raise HealRefused(f"its config's sha256 is {str(theirs)[:16]}..., this replica's {config_sha256[:16]}... "
                          "(does the peer train another config?)")


def labelled(state: Callable[[], dict], config_sha256: str) -> Callable[[], dict]:
    """`state()`, with the hash of the config it comes from, for the healing peer to check."""
    return lambda: {**state(), "config_sha256": config_sha256}


def unlabelled(load: Callable[[dict], None]) -> Callable[[dict], None]:
    return lambda received: load({k: v for k, v in received.items() if k != "config_sha256"})


class ReplicaLink:
    """The synchronisation of one replica with the others present: quorum, weighted all-reduce, commit.

    `state()` is what a rejoining peer must receive, `load(state)` takes it in (the strategy's); both see plain
    nested dicts of tensors and numbers."""

    def __init__(self, lighthouse: str, replica_id: int, world: World, host: str | None, min_replicas: int,
                 timeout_s: float, quorum_timeout_s: float, state: Callable[[], dict], load: Callable[[dict], None],
                 config_sha256: str = ""):
        host = host or socket.gethostname()
        lighthouse = lighthouse if "://" in lighthouse else f"http://{lighthouse}"
        timeout = timedelta(seconds=timeout_s)
        self.store = None  # kept: the store lives as long as this object
        if "MASTER_ADDR" in os.environ:  # under torchrun: the job's own store
            store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:  # one process: the store its manager and torchft's process group meet at
            self.store = torch.distributed.TCPStore(host, 0, 1, is_master=True, wait_for_workers=False)
            store_addr, store_port = host, self.store.port
        sent = labelled(state, config_sha256)

        def check(received: dict) -> None:  # in torchft's quorum thread, while the training thread waits for it
            same_config(received, config_sha256)
            fitting(received, sent())

        self.transport = SafetensorsTransport(host, timeout, check)
        # init_sync=False: every replica draws the same initial weights from the config's seed
        self.manager = Manager(ProcessGroupGloo(timeout=timeout), checked(unlabelled(load), sent), sent,
                               min_replica_size=min_replicas,
                               use_async_quorum=False, timeout=timeout,
                               quorum_timeout=timedelta(seconds=quorum_timeout_s),
                               connect_timeout=timeout, rank=world.rank, world_size=world.size,
                               store_addr=store_addr, store_port=store_port, lighthouse_addr=lighthouse,
                               replica_id=f"islands_{replica_id}", hostname=host,
                               checkpoint_transport=self.transport, init_sync=False)
        self.total = 1.0

    def begin(self, weight: float) -> None:
        """Join this synchronisation's quorum (healing first if this replica is behind) and learn the sum of the
        weights of the replicas present."""
        self.manager.start_quorum()
        if self.transport.refused:  # asking again would meet the same peer: leave, and say why once
            self.close()
            raise HealRefused(self.transport.refused)
        total = torch.tensor([weight], dtype=torch.float64)
        self.manager.allreduce(total, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        self.total = float(total)

    def average(self, tensors: list[torch.Tensor], ledger: Ledger, wire: torch.dtype | None,
                weight: float) -> list[torch.Tensor]:
        """The weighted mean of `tensors` over the replicas of this quorum (sent in `wire`, if given)."""
        flat = torch.cat([t.detach().flatten() for t in tensors]) * weight
        payload = flat if wire is None else flat.to(wire)
        ledger.record("outer_all_reduce", payload.numel() * payload.element_size(), self.manager.num_participants())
        self.manager.allreduce(payload, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        mean = payload.to(flat.dtype) / max(self.total, 1e-30)
        return [m.view_as(t) for m, t in zip(mean.split([t.numel() for t in tensors]), tensors, strict=True)]

    def commit(self) -> bool:
        """Whether every replica of the quorum got through the exchange; if not, no one applies it."""
        return self.manager.should_commit() and self.total > 0

    def state_dict(self) -> dict[str, int]:
        return self.manager.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.manager.load_state_dict(state)

    def close(self) -> None:
        if self.manager is not None:  # once: a refused heal closes the link before the run's end does
            self.manager.shutdown(wait=False)
            self.transport.shutdown()
            self.manager = None
