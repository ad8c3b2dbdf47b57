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
network that only they reach (README). A state whose names, shapes or dtypes differ from this replica's own is
refused before any of it is applied (`fitting`). torchft's `LocalSGD` and `DiLoCo` wrappers are not used:
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

from islands.errors import CheckpointError  # noqa: E402
from islands.parallel.launch import World  # noqa: E402
from islands.parallel.ledger import Ledger  # noqa: E402

# ...and its manager warns at every new quorum that it cannot reset NCCL's flight recorder, which gloo has not
logging.getLogger("torchft.manager").addFilter(lambda record: "flight recorder" not in record.getMessage())


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
    small HTTP server on `host`."""

    def __init__(self, host: str, timeout: timedelta):
        self.timeout, self.payload, self.step = timeout, b"", -1
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
            state = from_bytes(response.read())
        # torchft takes its two counters from it as they are; this replica's own state is checked where it is applied
        fitting({"torchft": state.get("torchft", {})}, {"torchft": {"step": step, "batches_committed": 0}})
        return state

    def shutdown(self, wait: bool = True) -> None:
        self.server.shutdown()
        self.server.server_close()


def checked(load: Callable[[dict], None], state: Callable[[], dict]) -> Callable[[dict], None]:
    """`load`, given only a peer's state that fits this replica's own `state()`."""
    return lambda received: load(fitting(received, state()))


class ReplicaLink:
    """The synchronisation of one replica with the others present: quorum, weighted all-reduce, commit.

    `state()` is what a rejoining peer must receive, `load(state)` takes it in (the strategy's); both see plain
    nested dicts of tensors and numbers."""

    def __init__(self, lighthouse: str, replica_id: int, world: World, host: str | None, min_replicas: int,
                 timeout_s: float, quorum_timeout_s: float, state: Callable[[], dict], load: Callable[[dict], None]):
        host = host or socket.gethostname()
        lighthouse = lighthouse if "://" in lighthouse else f"http://{lighthouse}"
        timeout = timedelta(seconds=timeout_s)
        self.store = None  # kept: the store lives as long as this object
        if "MASTER_ADDR" in os.environ:  # under torchrun: the job's own store
            store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:  # one process: the store its manager and torchft's process group meet at
            self.store = torch.distributed.TCPStore(host, 0, 1, is_master=True, wait_for_workers=False)
            store_addr, store_port = host, self.store.port
        self.transport = SafetensorsTransport(host, timeout)
        # init_sync=False: every replica draws the same initial weights from the config's seed
        self.manager = Manager(ProcessGroupGloo(timeout=timeout), checked(load, state), state,
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
        self.manager.shutdown(wait=False)
        self.transport.shutdown()
