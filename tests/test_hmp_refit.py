"""serve-hmp's closed loop, as pure functions (planning.hmp.refit with planning.refit's fit and rebalancer): what a
plan predicts for each rank's own arithmetic, the refitted profiles, the running plan re-priced on them, and the loop
as the coordinator runs it: a device measured slower than profiled moves the job to the plan its true speed gives,
and noise alone never re-plans."""

from __future__ import annotations

import numpy as np
import pytest

from edgeswarm.planning.hmp.plan import plan_hmp
from edgeswarm.planning.hmp.refit import rank_compute_s, reprice, scaled_cluster
from edgeswarm.planning.hmp.synthetic import synthetic_profile
from edgeswarm.planning.hmp.types import HmpCluster, HmpOptions, HmpPlan
from edgeswarm.planning.refit import Rebalancer, RefitPricing, ScaleFit
from edgeswarm.values.profiles import LinkProfile
from edgeswarm.values.text_model import PRESETS

CFG = PRESETS["distilbert"]
SEQ = 128
OPTIONS = HmpOptions(mode="galaxy", prune=False)


def cluster(slowdowns: dict[str, float]) -> HmpCluster:
    devices = [synthetic_profile(node, CFG, SEQ, slowdown=f, budget_bytes=4_000_000_000).model_copy(
        update={"embed_s": 1e-3 * f}) for node, f in slowdowns.items()]
    links = [LinkProfile(src=a, dst=b, bandwidth_bps=125e6, latency_s=1e-4, message_s=5e-4)
             for a in slowdowns for b in slowdowns if a != b]
    return HmpCluster(model=CFG, seq_len=SEQ, devices=devices, links=links)


@pytest.mark.parametrize("mode", ["local", "megatron", "galaxy", "galaxy-tiled", "sp"])
def test_a_homogeneous_plans_busiest_rank_computes_what_the_plan_predicts(mode: str) -> None:
    """On equal devices every rank's arithmetic is the layer's (its share of it): the busiest rank's, the lm_head
    and a tiled plan's extra weight reads included, is the plan's predicted compute."""
    c = cluster({"a": 2.0, "b": 2.0, "c": 2.0})
    tiled = mode == "galaxy-tiled"
    mode = "galaxy" if tiled else mode
    plan = plan_hmp(c, HmpOptions(mode=mode, overlap=tiled, prune=False))  # type: ignore[arg-type]
    assert plan.shares.overlap == tiled
    per_rank = rank_compute_s(c, plan, SEQ)
    assert set(per_rank) == set(plan.devices)
    if mode in ("local", "megatron"):
        assert max(per_rank.values()) == pytest.approx(plan.model.compute_s, rel=1e-9)
    elif mode == "galaxy":  # the prediction adds the received tiles' sums (a tiled plan's weight reads: 7% more)
        assert max(per_rank.values()) == pytest.approx(plan.model.compute_s, rel=0.02)
    else:  # sp's core is a max of parts: within a few percent
        assert max(per_rank.values()) == pytest.approx(plan.model.compute_s, rel=0.1)
    # A pass of half the tokens is priced at half.
    half = rank_compute_s(c, plan, SEQ // 2)
    assert all(half[n] == pytest.approx(per_rank[n] / 2) for n in per_rank)


def test_a_pass_that_answers_no_token_is_priced_without_the_logits() -> None:
    """A request generating no token never computes its prompt's logits: its pass is priced without the lm_head, on
    the rank that would answer (local) or on each rank's share of the vocabulary (megatron splits the head)."""
    cfg = PRESETS["gpt2-tiny"]
    devices = [synthetic_profile(node, cfg, SEQ, slowdown=2.0, budget_bytes=4_000_000_000).model_copy(
        update={"head_s": 0.01}) for node in ("a", "b")]
    links = [LinkProfile(src=a, dst=b, bandwidth_bps=125e6) for a in ("a", "b") for b in ("a", "b") if a != b]
    c = HmpCluster(model=cfg, seq_len=SEQ, devices=devices, links=links)
    for mode, heads in (("local", {"a": 0.01}), ("megatron", {"a": 0.005, "b": 0.005})):
        plan = plan_hmp(c, HmpOptions(mode=mode, prune=False))  # type: ignore[arg-type]
        with_logits, without = rank_compute_s(c, plan, SEQ), rank_compute_s(c, plan, SEQ, logits=False)
        assert {n: with_logits[n] - without[n] for n in plan.devices} == pytest.approx(heads, rel=0.01), mode
        assert plan.logits_s >= max(heads.values())


def test_a_scaled_device_computes_its_scale_times_and_the_others_are_untouched() -> None:
    c = cluster({"a": 1.0, "b": 1.0, "c": 1.0})
    plan = plan_hmp(c, OPTIONS)
    before = rank_compute_s(c, plan, SEQ)
    after = rank_compute_s(scaled_cluster(c, {"b": 3.0}), plan, SEQ)
    assert after["b"] == pytest.approx(3.0 * before["b"])
    assert after["a"] == before["a"] and after["c"] == before["c"]


def test_the_running_plan_repriced_keeps_its_shares_and_slows_with_its_slow_device() -> None:
    c = cluster({"a": 1.0, "b": 1.0, "c": 1.0})
    plan = plan_hmp(c, OPTIONS).model_copy(update={"epoch": 4})
    same = reprice(plan, c, OPTIONS)
    assert same.shares == plan.shares and same.epoch == 4
    assert same.model.total_s == pytest.approx(plan.model.total_s)
    slow = scaled_cluster(c, {"b": 4.0})
    current, best = reprice(plan, slow, OPTIONS), plan_hmp(slow, OPTIONS)
    assert current.shares == plan.shares and current.model.total_s > 2 * plan.model.total_s
    b = best.devices.index("b")
    assert best.shares.heads[b] < plan.shares.heads[b] and best.shares.columns[b] < plan.shares.columns[b]
    assert best.model.total_s < 0.7 * current.model.total_s


def _serve(truth: HmpCluster, profile: HmpCluster, passes: int, noise: float, seed: int = 0
           ) -> tuple[HmpPlan, list[int]]:
    """The coordinator's loop over ``passes`` prefill passes: each rank measures ``truth``'s arithmetic (times a
    uniform noise of +-``noise``) against the plan priced on ``profile``. The plan it ends on and the passes at which
    it re-planned."""
    rng = np.random.default_rng(seed)
    plan = plan_hmp(profile, OPTIONS)
    fit, rebalancer, replans = ScaleFit(), Rebalancer(), []
    pricing: RefitPricing[HmpPlan, HmpCluster] = RefitPricing(
        lambda p, refit: reprice(p, refit, OPTIONS), lambda old, refit: plan_hmp(refit, OPTIONS).model_copy(
            update={"epoch": old.epoch + 1}), scaled_cluster)
    for n in range(passes):
        true = rank_compute_s(truth, plan, SEQ)
        fit.add(rank_compute_s(profile, plan, SEQ), {d: s * (1 + rng.uniform(-noise, noise)) for d, s in true.items()})
        rebalancer.round_done()
        if not fit.moved():
            continue
        priced = pricing.priced(plan, profile, fit.scales(), best=True)
        assert priced.best is not None
        if rebalancer.check(priced.current.model.total_s, priced.best.model.total_s, float(n)):
            plan, profile = priced.best, priced.profile
            fit, replans = ScaleFit(), [*replans, n]
            rebalancer.new_plan()
    return plan, replans


def test_a_device_3x_slower_than_its_profile_moves_the_job_to_the_plan_its_true_speed_gives() -> None:
    truth = cluster({"a": 1.0, "b": 3.0, "c": 1.0})
    wrong = cluster({"a": 1.0, "b": 1.0, "c": 1.0})
    plan, replans = _serve(truth, wrong, passes=12, noise=0.05)
    right = plan_hmp(truth, OPTIONS)
    assert replans and replans[0] < 10, replans
    # The same heads; the columns as the fitted speeds (within the noise of the true ones) split them.
    assert plan.shares.heads == right.shares.heads, (plan.shares, right.shares)
    assert all(abs(a - b) <= 0.01 * CFG.ffn for a, b in zip(plan.shares.columns, right.shares.columns, strict=True))
    # Then the prediction holds: within 10% of what the devices measure.
    measured = max(rank_compute_s(truth, plan, SEQ).values())
    assert measured == pytest.approx(max(rank_compute_s(truth, right, SEQ).values()), rel=0.1)


def test_noise_alone_never_re_plans() -> None:
    c = cluster({"a": 1.0, "b": 2.0, "c": 1.0})
    for seed in range(3):
        _, replans = _serve(c, c, passes=60, noise=0.12, seed=seed)
        assert replans == [], (seed, replans)


@pytest.mark.parametrize("direct", [True, False])
def test_a_decoders_head_is_priced_on_the_ranks_that_compute_it(direct: bool) -> None:
    """Megatron on four equal devices (a head and 64 MLP columns each): with direct syncs each rank computes a
    quarter of the lm_head (the split head, HmpShares.vocab_bounds), without them the rank holding the last row all
    of it; the busiest rank's arithmetic is the plan's predicted compute either way."""
    cfg = PRESETS["gpt2-tiny"]
    devices = [synthetic_profile(n, cfg, SEQ, slowdown=2.0, budget_bytes=4_000_000_000).model_copy(
        update={"head_s": 0.03}) for n in "abcd"]
    links = [LinkProfile(src=a, dst=b, bandwidth_bps=125e6, latency_s=1e-4, message_s=5e-4)
             for a in "abcd" for b in "abcd" if a != b]
    c = HmpCluster(model=cfg, seq_len=SEQ, devices=devices, links=links)
    plan = plan_hmp(c, HmpOptions(mode="megatron", prune=False, direct_syncs=direct))
    per_rank = rank_compute_s(c, plan, SEQ)
    layers = {n: t - (0.03 / 4 if direct else 0.03 if n == plan.devices[-1] else 0.0) for n, t in per_rank.items()}
    assert max(layers.values()) == pytest.approx(min(layers.values()))  # the rest is the layers', alike
    assert max(per_rank.values()) == pytest.approx(plan.model.compute_s, rel=1e-9)
