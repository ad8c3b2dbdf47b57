"""The local updates' candidates for closing the gap to data parallelism (issue 40): a data-parallel warm start, H
growing over the run, overlapping exchanges merged by a mixing factor, the inner optimizer's state reset at a
synchronisation, the EMA of the replicas' mean; each against DDP, a closed form or a hand computation, and each
resumed mid-run bit for bit (gloo on 127.0.0.1, every run under a timeout)."""

import datetime
import json

import pytest
import torch
import torch.distributed as dist
from test_local_updates import plain, two_ranks
from test_parallel import cut_back, exported, free_port, mlp_config, predicted_bytes

from islands.config import validate
from islands.parallel.launch import World
from islands.parallel.local_updates import Candidates, DiLoCoStrategy, Rounds


@pytest.fixture
def one_rank():
    """A one-rank gloo world for the test, taken down after it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def test_a_warm_start_is_ddp_bit_for_bit_and_the_ledger_books_it_as_ddps_all_reduce(tmp_path):
    """DiLoCo whose first 320 of 640 images are a warm start: its checkpoint at 320 images (weights and EMA) is
    DDP's, bit for bit; it sent DDP's all_reduce for those 10 steps, then its outer steps from there."""
    cfg = mlp_config(tmp_path)
    ddp = two_ranks(tmp_path, "ddp", cfg, "parallel.strategy=ddp")
    warm = two_ranks(tmp_path, "warm", cfg, "parallel.strategy=diloco", "parallel.sync_every=4",
                     "parallel.warm_start_images=320")
    assert exported(cut_back(warm, tmp_path / "warm_320", 320)) == exported(cut_back(ddp, tmp_path / "ddp_320", 320))
    assert exported(warm) != exported(ddp)  # apart after it
    sent = json.loads((warm / "communication.json").read_text())["total_bytes"]
    per_step = predicted_bytes("ddp", 1, cfg)["all_reduce"]
    # 10 data-parallel steps; then the rounds count from step 10: exchanges at steps 14, 18 and the last, 20
    assert sent["all_reduce"] == pytest.approx(10 * per_step)
    assert sent["outer_all_reduce"] == pytest.approx(3 * per_step)


def test_after_a_warm_start_the_first_outer_step_is_from_its_end_not_from_the_initialisation(one_rank):
    """One rank, batch 1, a warm start of 2 images then H = 2: steps 1-2 leave the weights to the inner optimizer
    (the EMA takes in the net's own); the exchange at step 4 is one Nesterov step on the change since step 2."""
    strategy = DiLoCoStrategy(World(rank=0, size=1), sync_every=2, batch_size=1,
                              candidates=Candidates(warm_start_images=2))
    net = torch.nn.Linear(3, 2)
    strategy.parallelize(net)
    for step in range(1, 5):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)))
        local = {n: p.detach().clone() for n, p in net.named_parameters()}
        if step == 2:
            anchor = local
        credit = strategy.replicas.after_step(step)
        if step <= 2:
            assert credit is None and strategy.replicas.ema_weights() is None
        elif step == 3:
            assert credit == 0
    assert credit == 2  # the images since the warm start ended
    for n, p in net.named_parameters():
        g = anchor[n] - local[n]
        torch.testing.assert_close(p.detach(), anchor[n] - 0.7 * (g + 0.9 * g), rtol=1e-6, atol=1e-6)


def test_growing_rounds_end_where_the_closed_form_says_whatever_the_order_they_are_asked_in():
    """H0 = 2 growing to H = 10 over 20 steps after a warm start of 3: round lengths 2 + 8 min(r, 20) // 20 at r =
    0, 2, 4, 7, 11, 17, 25, ... steps since the warm start."""
    ends = [5, 7, 10, 14, 20, 28, 38, 48, 58]
    rounds = Rounds(10, [0], warm=3, start=2, ramp=20)
    assert [s for s in range(1, 59) if rounds.exchanged(s)] == ends
    late = Rounds(10, [0], warm=3, start=2, ramp=20)  # a resumed run asks from its place first
    assert late.exchanged(38) == [0] and late.exchanged(37) == [] and late.exchanged(5) == [0]
    assert rounds.landed_before(38) == 28 and rounds.landed_before(5) == 3
    with_delay = Rounds(10, [0], warm=3, start=2, ramp=20, delay=1)
    assert [s for s in range(1, 59) if with_delay.landing(s)] == [e + 1 for e in ends[:-1]]
    # H0 = H is today's fixed rounds
    fixed = Rounds(10, [0], start=10, ramp=20)
    assert [s for s in range(1, 59) if fixed.exchanged(s)] == [10, 20, 30, 40, 50]


def test_growing_h_on_two_ranks_sends_one_exchange_per_round_of_the_closed_form(tmp_path):
    """20 steps, H0 = 2 growing to 8 over 320 images (10 steps): rounds of 2 + 6 min(r, 10) // 10 steps end at
    steps 2, 5, 10, 18, and the last step, 20, synchronises again."""
    cfg = plain(mlp_config(tmp_path))
    run = two_ranks(tmp_path, "grow", cfg, "parallel.strategy=diloco", "parallel.sync_every=8",
                    "parallel.sync_every_start=2", "parallel.sync_every_ramp_images=320")
    sent = json.loads((run / "communication.json").read_text())["total_bytes"]["outer_all_reduce"]
    assert sent == pytest.approx(5 * predicted_bytes("ddp", 1, cfg)["all_reduce"])


@pytest.mark.parametrize("delay,mixing", [(1, 0.5), (0, 0.5), (2, 0.0)])
def test_an_overlapped_exchange_lands_tau_steps_later_merged_by_alpha(delay, mixing, one_rank):
    """One rank, H = 4, two fragments of a Linear (its weight at steps 2, 6, its bias at 4, 8): each exchange's
    pseudo-gradient is taken when it begins and its outer Nesterov step lands tau steps later, where the fragment's
    local weights, trained on meanwhile, become alpha local + (1 - alpha) anchor."""
    strategy = DiLoCoStrategy(World(rank=0, size=1), sync_every=4, batch_size=1, outer_lr=0.7,
                              outer_momentum=0.9, fragments=2,
                              candidates=Candidates(overlap_steps=delay, mixing=mixing))
    net = torch.nn.Linear(3, 2)
    strategy.parallelize(net)
    assert strategy.replicas.fragments == [["weight"], ["bias"]]
    anchor = {n: p.detach().clone() for n, p in net.named_parameters()}
    momentum = {n: torch.zeros_like(p) for n, p in anchor.items()}
    change, begun = {}, {2: "weight", 4: "bias", 6: "weight", 8: "bias"}
    for step in range(1, 10):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)))
        local = {n: p.detach().clone() for n, p in net.named_parameters()}
        if step in begun:
            change[step + delay] = (begun[step], anchor[begun[step]] - local[begun[step]])
        landed = change.pop(step, None)
        if landed:
            name, g = landed
            momentum[name] = 0.9 * momentum[name] + g
            anchor[name] = anchor[name] - 0.7 * (g + 0.9 * momentum[name])
            local[name] = mixing * local[name] + (1 - mixing) * anchor[name]
        credit = strategy.replicas.after_step(step)
        assert credit == (0 if landed is None else step - max([0] + [s for s in range(1, step)
                                                                        if s - delay in begun]))
        for n, p in net.named_parameters():
            torch.testing.assert_close(p.detach(), local[n], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(strategy.replicas.ema_weights()[n], anchor[n], rtol=1e-6, atol=1e-6)


def test_reset_zeroes_the_inner_state_at_each_synchronisation_so_the_next_step_is_a_fresh_adams_first(one_rank):
    """One rank, H = 2, AdamW: after step 1 its state is under way; after the synchronisation at step 2 every moment
    and the step count are zero, and the next step is what a new AdamW takes from the same weights and gradient."""
    strategy = DiLoCoStrategy(World(rank=0, size=1), sync_every=2, batch_size=1,
                              candidates=Candidates(inner_state="reset"))
    net = torch.nn.Linear(3, 2)
    strategy.parallelize(net)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    strategy.replicas.attach_optimizer(opt)

    def step(n):
        opt.zero_grad()
        net(torch.randn(4, 3, generator=torch.Generator().manual_seed(n))).square().sum().backward()
        opt.step()

    step(1)
    assert strategy.replicas.after_step(1) == 0
    assert all(bool(s["exp_avg"].abs().sum() > 0) and float(s["step"]) == 1 for s in opt.state.values())
    step(2)
    assert strategy.replicas.after_step(2) == 2
    assert all(float(v.abs().sum()) == 0 for s in opt.state.values() for v in s.values())
    fresh_net = torch.nn.Linear(3, 2)
    fresh_net.load_state_dict(net.state_dict())
    fresh = torch.optim.AdamW(fresh_net.parameters(), lr=0.1)
    for model, optimizer in ((net, opt), (fresh_net, fresh)):
        optimizer.zero_grad()
        model(torch.randn(4, 3, generator=torch.Generator().manual_seed(3))).square().sum().backward()
        optimizer.step()
    for a, b in zip(net.parameters(), fresh_net.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_ema_of_the_mean_takes_in_the_replicas_mean_before_the_outer_step(one_rank):
    """One rank, H = 1: the EMA's weights after a synchronisation are the anchor minus the averaged change (the
    replicas' mean weights), not the anchor the outer Nesterov step moved past them."""
    strategy = DiLoCoStrategy(World(rank=0, size=1), sync_every=1, batch_size=1,
                              candidates=Candidates(outer_ema="mean"))
    net = torch.nn.Linear(3, 2)
    strategy.parallelize(net)
    for step in (1, 2):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)))
        local = {n: p.detach().clone() for n, p in net.named_parameters()}
        assert strategy.replicas.after_step(step) == 1
        for n, p in net.named_parameters():
            torch.testing.assert_close(strategy.replicas.ema_weights()[n], local[n], rtol=1e-6, atol=1e-6)
            assert not torch.allclose(p.detach(), local[n])  # the outer step moved the net past them


# The candidates that can go together share a run (each run pair costs half a minute on 2 cores); each one's state
# left out of the checkpoint fails its run (tried: the overlap's exchange in flight, the EMA's mean weights)
@pytest.mark.parametrize("options", [
    # a warm start of 7 steps, then H growing from 2, the inner state reset at each synchronisation
    ("parallel.warm_start_images=224", "parallel.sync_every_start=2", "parallel.sync_every_ramp_images=480",
     "parallel.inner_state=reset"),
    # at step 10 an exchange in flight; the EMA of the replicas' mean, fragment by fragment
    ("parallel.fragments=2", "parallel.overlap_steps=1", "parallel.mixing=0.5", "parallel.outer_ema=mean"),
], ids=["warm_start+growing_h+reset", "overlap+ema_of_the_mean"])
def test_a_diloco_candidate_resumed_mid_run_ends_bit_identically(tmp_path, defaults, options):
    """Stopped at step 10 of 20 (the replicas apart), resumed on 2 ranks: it ends where the run that never stopped
    ended, which is not where DiLoCo without the options ends."""
    cfg = plain(mlp_config(tmp_path))
    args = ("parallel.strategy=diloco", "parallel.sync_every=4", *options)
    straight = two_ranks(tmp_path, "straight", cfg, *args)
    moved = cut_back(straight, tmp_path / "moved", 320)
    two_ranks(tmp_path, "moved", {**cfg, "run_dir": str(moved)}, *args)
    assert exported(moved) == exported(straight)
    assert exported(defaults(2 if "parallel.fragments=2" in options else 1)) != exported(straight)


@pytest.fixture(scope="module")
def defaults(tmp_path_factory):
    """DiLoCo at H = 4 without the candidates, whole or in 2 fragments, each run once for the module."""
    runs = {}

    def run(fragments: int):
        if fragments not in runs:
            root = tmp_path_factory.mktemp(f"default-{fragments}")
            runs[fragments] = two_ranks(root, "run", plain(mlp_config(root)), "parallel.strategy=diloco",
                                        "parallel.sync_every=4", f"parallel.fragments={fragments}")
        return runs[fragments]

    return run


def test_the_candidates_refuse_what_they_cannot_be_combined_with_in_one_line():
    base = {"run_dir": "unused", "parallel": {"strategy": "diloco"}}
    for parallel, message in (
            ({"sync_every_start": 200}, "sync_every_start: 200 is more than sync_every=100"),
            ({"sync_every_start": 10, "fragments": 2}, "sync_every_start: a growing H is offered for whole"),
            ({"overlap_steps": 100}, "overlap_steps: 100 steps is not less than the 100 steps"),
            ({"overlap_steps": 10, "sync_every_start": 10}, "overlap_steps: 10 steps is not less than the 10"),
            ({"warm_start_images": 64, "worker_batch": [8, 24]}, "warm_start_images: the data-parallel warm start"),
            ({"mixing": 1.0}, "mixing"),
            ({"sync_every_ramp_images": 64}, "sync_every_ramp_images: H grows only from")):
        with pytest.raises(Exception, match=message) as err:
            validate({**base, "parallel": {**base["parallel"], **parallel}})
        assert len(str(err.value).splitlines()) == 1
