"""Replicas that are separate jobs joined through torchft's lighthouse (parallel.lighthouse): they follow the
in-job run exactly while all are present, and one that hangs or dies and restarts does not stop the other and
rejoins it with the current weights. Everything on 127.0.0.1, every process under a timeout."""

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import yaml
from test_local_updates import plain, two_ranks
from test_parallel import final_weights, mlp_config, relative_difference

from islands.config import validate
from islands.errors import CheckpointError, ConfigError
from islands.parallel.fault_tolerance import (  # first: it quiets torchft's INFO logs
    HealRefused,
    SafetensorsTransport,
    checked,
    fitting,
    from_bytes,
    replica_config_sha256,
    same_config,
    to_bytes,
)
from islands.parallel.launch import World
from islands.parallel.local_updates import DiLoCoStrategy, LocalSGDStrategy
from islands.rundir import latest_checkpoint

TIMEOUT_S = 300  # the failure test takes about 50 s alone; far longer on a machine busy with other tests


@pytest.fixture
def lighthouse(request):
    """A lighthouse on 127.0.0.1 that forms a quorum of `min_replicas` (the test's parameter, default 1)."""
    from torchft.coordination import LighthouseServer  # after islands.parallel.fault_tolerance, which quiets it

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=getattr(request, "param", 1), join_timeout_ms=500,
                              heartbeat_timeout_ms=1000)
    yield "127.0.0.1:" + server.address().rsplit(":", 1)[1]
    server.shutdown()


def replica(cfg: dict, tmp_path, replica_id: int, address: str, *overrides: str) -> subprocess.Popen:
    """`islands train` as replica `replica_id` of 2, a job of its own (one process, no torchrun)."""
    path = tmp_path / "replica.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = open(tmp_path / f"r{replica_id}-{time.monotonic_ns()}.log", "w")  # torchft logs every quorum: a file
    keys = [f"run_dir={tmp_path}/r{replica_id}", f"parallel.lighthouse={address}", "parallel.replicas=2",
            f"parallel.replica_id={replica_id}", "parallel.host=127.0.0.1", "parallel.timeout_s=5",
            "parallel.quorum_timeout_s=60"]
    proc = subprocess.Popen([sys.executable, "-m", "islands", "train", str(path), *keys, *overrides, "--quiet"],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def finish(proc: subprocess.Popen, deadline: float) -> subprocess.CompletedProcess:
    """Wait for `proc` until `deadline`; -> its exit status and output, with torchft's INFO lines left out."""
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.log.close()
    lines = open(proc.log.name).read().splitlines()
    return subprocess.CompletedProcess(proc.args, proc.returncode, "",
                                       "\n".join(line for line in lines if "[INFO]" not in line))


def test_the_healing_state_travels_as_safetensors_and_comes_back_whole():
    state = {"user": {"default": {"anchor": {"net.w": torch.randn(3, 2)}, "momentum": {}, "images": 4096,
                                  "ema": {"net.w": torch.ones(2)}}}, "torchft": {"step": 7, "batches_committed": 14}}
    back = from_bytes(to_bytes(state))
    assert torch.equal(back["user"]["default"]["anchor"]["net.w"], state["user"]["default"]["anchor"]["net.w"])
    assert back["user"]["default"]["images"] == 4096 and back["torchft"] == {"step": 7, "batches_committed": 14}
    assert torch.equal(back["user"]["default"]["ema"]["net.w"], torch.ones(2))
    with pytest.raises(ValueError, match="not safetensors"):  # a pickle is refused by the parser, never executed
        from_bytes(b"\x80\x04\x95" + b"\x00" * 64)


def test_torchft_counters_from_a_peer_must_be_two_whole_numbers():
    """torchft sets its step from them as they come; the transport hands it nothing else."""
    transport, timeout = SafetensorsTransport("127.0.0.1", timedelta(seconds=10)), timedelta(seconds=10)
    try:
        for counters in ({"step": 7, "batches_committed": 14}, {"step": "7", "batches_committed": 14}, {"step": 7}):
            transport.send_checkpoint([1], 7, {"user": {"default": {"images": 64}}, "torchft": counters}, timeout)
            if counters == {"step": 7, "batches_committed": 14}:
                assert transport.recv_checkpoint(0, transport.metadata(), 7, timeout)["torchft"] == counters
                continue
            with pytest.raises(CheckpointError, match="torchft/"):
                transport.recv_checkpoint(0, transport.metadata(), 7, timeout)
    finally:
        transport.shutdown()


def a_healing_replica():
    """A DiLoCo strategy's replicas with their anchors and momentum (two fragments keep anchors without torchft), and
    the loader ReplicaLink gives torchft for them."""
    strategy = DiLoCoStrategy(World(rank=0, size=1), sync_every=2, batch_size=1, outer_lr=0.7, outer_momentum=0.9,
                              fragments=2)
    strategy.parallelize(torch.nn.Linear(3, 2))
    return strategy.replicas, checked(strategy.replicas.heal, strategy.replicas.shared_state)


def a_peers_state(replicas) -> dict:
    """The replica's own layout with other values, as a peer's arrives: through the wire."""
    state = from_bytes(to_bytes(replicas.shared_state()))
    for group in ("anchor", "momentum"):
        state[group] = {name: torch.randn_like(value) for name, value in state[group].items()}
    state["images"] = 4096
    return state


@pytest.mark.parametrize("change,name", [
    ("extra", "anchor/extra"),  # the others would be applied, then a KeyError
    ("missing", "momentum/bias"),  # silently half-applied
    ("shape", "anchor/weight"),  # copy_ broadcasts a row into every row
    ("dtype", "anchor/bias"),
    ("number", "images"),
])
def test_a_peers_healing_state_that_does_not_fit_is_refused_before_any_of_it_is_applied(change, name):
    replicas, heal = a_healing_replica()
    held = {**{f"net/{n}": p.detach().clone() for n, p in replicas.net.named_parameters()},
            **{f"{g}/{n}": t.clone() for g in ("anchor", "momentum") for n, t in replicas.shared_state()[g].items()}}
    peer = a_peers_state(replicas)
    if change == "extra":
        peer["anchor"]["extra"] = torch.zeros(2)
    elif change == "missing":
        del peer["momentum"]["bias"]
    elif change == "shape":
        peer["anchor"]["weight"] = torch.randn(1, 3)
    elif change == "dtype":
        peer["anchor"]["bias"] = peer["anchor"]["bias"].double()
    else:
        peer["images"] = "4096"
    with pytest.raises(CheckpointError, match=f"healing state does not fit this replica: {name} is "):
        heal(peer)
    now = {**{f"net/{n}": p.detach() for n, p in replicas.net.named_parameters()},
           **{f"{g}/{n}": t for g in ("anchor", "momentum") for n, t in replicas.shared_state()[g].items()}}
    assert all(torch.equal(now[key], held[key]) for key in held) and replicas.joined is None

    fits = a_peers_state(replicas)  # the control: a state that fits is taken in whole
    heal(fits)
    assert all(torch.equal(p, fits["anchor"][n]) for n, p in replicas.net.named_parameters())
    assert all(torch.equal(t, fits["momentum"][n]) for n, t in replicas.shared_state()["momentum"].items())
    assert replicas.joined == 4096


@pytest.mark.parametrize("lighthouse", [2], indirect=True)
def test_two_replica_jobs_follow_the_two_rank_run_exactly(tmp_path, lighthouse):
    """With both replicas present at every synchronisation (a quorum needs both), DiLoCo across two jobs is the
    in-job DiLoCo of two ranks, bit for bit, and the traffic is logged as every strategy's is."""
    cfg = plain(mlp_config(tmp_path), images=640)
    strategy = ("parallel.strategy=diloco", "parallel.sync_every=4")
    deadline = time.monotonic() + TIMEOUT_S
    jobs = [replica(cfg, tmp_path, r, lighthouse, *strategy) for r in range(2)]
    done = [finish(job, deadline) for job in jobs]
    assert all(d.returncode == 0 for d in done), [d.stderr[-2000:] for d in done]
    in_job = two_ranks(tmp_path, "in_job", cfg, *strategy)
    a, b = final_weights(tmp_path / "r0"), final_weights(tmp_path / "r1")
    assert relative_difference(a, b) == 0.0
    assert relative_difference(a, final_weights(in_job)) < 1e-6
    sent = json.loads((tmp_path / "r0" / "communication.json").read_text())["total_bytes"]
    assert sent == pytest.approx(json.loads((in_job / "communication.json").read_text())["total_bytes"])
    assert "comm_bytes_per_step_per_rank" in (tmp_path / "r0" / "metrics.jsonl").read_text().splitlines()[-1]


def test_a_replica_that_hangs_or_dies_leaves_the_other_training_and_rejoins_with_its_weights(tmp_path, lighthouse):
    """Replica 1 hangs (SIGSTOP) for 3 s, then is killed and restarted from its own last checkpoint: replica 0
    trains on through both, and replica 1 heals each time at its next synchronisation, taking replica 0's weights
    and clock, so both finish with the same weights."""
    cfg = plain(mlp_config(tmp_path), images=64000, checkpoint_every=3200, log_every=3200)
    strategy = ("parallel.strategy=diloco", "parallel.sync_every=4")
    deadline = time.monotonic() + TIMEOUT_S
    survivor, flaky = (replica(cfg, tmp_path, r, lighthouse, *strategy) for r in range(2))
    try:
        first = tmp_path / "r1" / "checkpoints"
        while latest_checkpoint(tmp_path / "r1") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        flaky.send_signal(signal.SIGSTOP)  # hangs: no heartbeat, no synchronisation
        seen, stopped = latest_checkpoint(tmp_path / "r0"), time.monotonic()
        # replica 0 goes on without it (after the collective timeout, 5 s, if it hung inside an exchange)
        while latest_checkpoint(tmp_path / "r0") == seen and time.monotonic() < stopped + 30:
            time.sleep(0.05)
        assert latest_checkpoint(tmp_path / "r0") != seen
        time.sleep(max(0.0, stopped + 3 - time.monotonic()))
        flaky.send_signal(signal.SIGCONT)
        time.sleep(2)
        flaky.kill()  # dies; restarted as a rerun of the same command resumes from its last checkpoint
        flaky.wait()
        restarted = replica(cfg, tmp_path, 1, lighthouse, *strategy)
        done = finish(survivor, deadline), finish(restarted, deadline)
    finally:
        for p in (survivor, flaky):
            if p.poll() is None:
                p.kill()
    assert all(d.returncode == 0 for d in done), [d.stderr[-2000:] for d in done]
    assert "rejoined the other replicas" in done[1].stderr, done[1].stderr[-2000:]
    assert sorted(p.name for p in first.iterdir())[-1] == latest_checkpoint(tmp_path / "r0").name
    assert relative_difference(final_weights(tmp_path / "r0"), final_weights(tmp_path / "r1")) == 0.0


def test_lighthouse_keys_are_checked_in_one_line():
    base = {"run_dir": "x", "parallel": {"strategy": "diloco", "lighthouse": "127.0.0.1:1", "replicas": 2}}
    cases = {"replica_id": ({}, "give parallel.replicas"), "strategy": ({"strategy": "ddp", "replica_id": 0},
                                                                        "local_sgd or diloco replicas"),
             "range": ({"replica_id": 2}, "replica_id: 2 is not one of")}
    for extra, message in cases.values():
        with pytest.raises(ConfigError, match=message):
            validate({**base, "parallel": {**base["parallel"], **extra}})
    with pytest.raises(ValueError, match="parallel.fragments: streamed fragments are not offered"):
        LocalSGDStrategy(World(), sync_every=4, fragments=2, lighthouse="127.0.0.1:1", replicas=2, replica_id=0)


@pytest.mark.parametrize("change", ["config", "shape", "key", "not safetensors"])
def test_a_malformed_heal_is_refused_where_it_arrives_in_one_line_naming_the_peer(change):
    """Issue 39.3: what a peer serves for healing is checked as it arrives (its config's hash, then its tensors'
    names and shapes), and refused with one line naming the peer's address, kept for the replica to leave on."""
    own = {"anchor": {"w": torch.zeros(2, 3)}, "images": 0, "config_sha256": "a" * 64}
    sent = {"anchor": {"w": torch.ones(2, 3)}, "images": 64, "config_sha256": "a" * 64}
    if change == "config":
        sent["config_sha256"] = "b" * 64
    elif change == "shape":
        sent["anchor"]["w"] = torch.ones(3, 2)
    elif change == "key":
        sent["anchor"]["v"] = sent["anchor"].pop("w")
    peer, here = (SafetensorsTransport("127.0.0.1", timedelta(seconds=5), check) for check in (
        lambda state: None, lambda state: (same_config(state, "a" * 64), fitting(state, own))))
    try:
        peer.send_checkpoint([1], 3, {"user": {"default": sent}, "torchft": {"step": 3, "batches_committed": 6}},
                             timedelta(seconds=5))
        if change == "not safetensors":
            peer.payload = b"\x80\x04junk"
        with pytest.raises(HealRefused) as refused:
            here.recv_checkpoint(0, peer.address, 3, timedelta(seconds=5))
        said = str(refused.value)
        assert "\n" not in said and f"the peer at {peer.address}" in said and "leaves the quorum" in said, said
        why = {"config": "config's sha256 is bbbbbbbb", "shape": "anchor/w is float32 [3, 2] there",
               "key": "anchor/v is float32 [2, 3] there, missing here", "not safetensors": "not safetensors"}[change]
        assert why in said and here.refused == said, said
    finally:
        peer.shutdown()
        here.shutdown()
    fine = SafetensorsTransport("127.0.0.1", timedelta(seconds=5), lambda state: same_config(state, "a" * 64))
    try:  # the control: the same exchange with a state that fits goes through
        fine.send_checkpoint([1], 3, {"user": {"default": own}, "torchft": {"step": 3, "batches_committed": 6}},
                             timedelta(seconds=5))
        assert fine.recv_checkpoint(0, fine.address, 3, timedelta(seconds=5))["user"]["default"]["images"] == 0
        assert fine.refused is None
    finally:
        fine.shutdown()


def test_the_config_hash_replicas_agree_on_leaves_out_what_is_their_own():
    cfg = {"run_dir": "r0", "data": {"source": "gmm", "means": [[1.0, 0.0]], "std": 0.2, "size": 64},
           "model": {"arch": "mlp", "hidden": 8, "depth": 2},
           "parallel": {"strategy": "diloco", "lighthouse": "127.0.0.1:1", "replicas": 2, "replica_id": 0}}
    base = replica_config_sha256(validate(cfg))
    other = {**cfg, "run_dir": "r1", "parallel": {**cfg["parallel"], "replica_id": 1, "host": "10.0.0.2"}}
    assert replica_config_sha256(validate(other)) == base
    assert replica_config_sha256(validate({**cfg, "train": {"lr": 1e-2}})) != base


def test_a_replica_of_another_config_is_refused_its_heal_and_leaves_while_the_other_trains_on(tmp_path, lighthouse):
    """Replica 1 starts late with another learning rate, so it must heal from replica 0 at its first synchronisation:
    it is refused in one line naming the peer and exits (it left the quorum, instead of asking again at every
    synchronisation), and replica 0 trains on to the end."""
    cfg = plain(mlp_config(tmp_path), images=32000, checkpoint_every=3200, log_every=3200)
    strategy = ("parallel.strategy=diloco", "parallel.sync_every=4")
    deadline = time.monotonic() + TIMEOUT_S
    survivor = replica(cfg, tmp_path, 0, lighthouse, *strategy)
    other = None
    try:
        while latest_checkpoint(tmp_path / "r0") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        started = time.monotonic()
        other = replica(cfg, tmp_path, 1, lighthouse, *strategy, "train.lr=0.002")
        refused = finish(other, min(deadline, started + 120))
        left_after = time.monotonic() - started
        done = finish(survivor, deadline)
    finally:
        for p in (survivor, other):
            if p is not None and p.poll() is None:
                p.kill()
    assert refused.returncode == 2, refused.stderr[-2000:]
    lines = [line for line in refused.stderr.splitlines() if "refused the healing state" in line]
    assert len(lines) == 1 and "the peer at http://127.0.0.1:" in lines[0] and "config's sha256" in lines[0], \
        refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(latest_checkpoint(tmp_path / "r0").name) == 32000
    print(f"replica 1 was refused and exited {left_after:.1f} s after it started")
