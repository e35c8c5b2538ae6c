"""Sample pruning of already-learned samples (edgeswarm.splitfed.pruning; spec §5.4)."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from edgeswarm.errors import ConfigError
from edgeswarm.splitfed.pruning import PruningSpec, RoundPruner, expected_active_fraction, prune_step

SPEC = PruningSpec(seed=7)


def test_the_lowest_fifth_is_learned_and_four_fifths_of_it_go() -> None:
    ids = np.arange(100, 200)
    losses = np.random.default_rng(0).permutation(100) / 10.0  # distinct: exactly 20 at or below the 20th pct
    step = prune_step(ids, losses, SPEC, device=3, round_index=2, epoch=1)
    assert step.threshold == pytest.approx(np.percentile(losses, 20))
    assert len(step.learned) == 20 and set(step.learned) == set(ids[losses <= step.threshold])
    assert len(step.dropped) == 16 and set(step.dropped) <= set(step.learned)
    assert len(step.active) == 84 and set(step.active) | set(step.dropped) == set(ids)
    assert np.all(np.diff(step.active) > 0)
    again = prune_step(ids, losses, SPEC, device=3, round_index=2, epoch=1)
    assert np.array_equal(step.dropped, again.dropped), "seeded"
    other = prune_step(ids, losses, SPEC, device=4, round_index=2, epoch=1)
    assert not np.array_equal(step.dropped, other.dropped), "each device draws its own"
    # The order the losses come in does not matter.
    order = np.random.default_rng(1).permutation(100)
    assert np.array_equal(prune_step(ids[order], losses[order], SPEC, device=3, round_index=2).dropped, step.dropped)


def test_a_round_prunes_epoch_after_epoch_and_the_next_round_brings_all_back() -> None:
    ids = np.arange(500)
    pruner = RoundPruner(ids, SPEC, device=1, round_index=0)
    rng = np.random.default_rng(2)
    sizes = [len(pruner.active)]
    dropped: set[int] = set()
    for _ in range(4):
        active = pruner.active
        step = pruner.end_epoch(active, rng.random(len(active)))
        assert not set(step.dropped) & set(pruner.active)
        dropped |= set(step.dropped.tolist())
        sizes.append(len(pruner.active))
    assert sizes == [500, 420, 353, 296, 248]  # 20th percentile by interpolation: 60 of 296 learned
    assert dropped.isdisjoint(pruner.active.tolist()), "a dropped sample stays out for the rest of the round"
    assert pruner.epoch == 4
    pruner.new_round(1)
    assert np.array_equal(pruner.active, ids) and pruner.epoch == 0
    # The planner's expectation matches the measured mean over a 5-epoch round within rounding.
    assert expected_active_fraction(5, SPEC) == pytest.approx(np.mean(sizes) / 500, abs=2e-3)


def test_pruning_off_and_degenerate_losses() -> None:
    ids = np.arange(10)
    off = prune_step(ids, np.arange(10.0), PruningSpec(enabled=False))
    assert np.array_equal(off.active, ids) and len(off.dropped) == 0
    assert expected_active_fraction(5, PruningSpec(enabled=False)) == 1.0
    # Equal losses: every sample is at the threshold, so all are learned; one sample always stays.
    tied = prune_step(ids, np.ones(10), PruningSpec(prune_ratio=1.0))
    assert len(tied.learned) == 10 and len(tied.active) == 1
    # NaN losses are never learned, and no finite loss means nothing is pruned.
    nan = prune_step(ids, np.array([np.nan] * 5 + [1.0, 2.0, 3.0, 4.0, 5.0]), SPEC)
    assert set(nan.learned.tolist()) <= {5, 6, 7, 8, 9} and {0, 1, 2, 3, 4} <= set(nan.active.tolist())
    assert len(prune_step(ids, np.full(10, np.nan), SPEC).dropped) == 0


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ConfigError, match="one loss per active sample"):
        prune_step(np.arange(3), np.zeros(2), SPEC)
    with pytest.raises(ConfigError, match="repeat"):
        prune_step(np.array([1, 1]), np.zeros(2), SPEC)
    with pytest.raises(ConfigError, match="epoch must be an integer >= 1"):
        prune_step(np.arange(3), np.zeros(3), SPEC, epoch=0)
    pruner = RoundPruner(np.arange(10), SPEC)
    with pytest.raises(ConfigError, match="not active"):
        pruner.end_epoch(np.array([11]), np.zeros(1))
    with pytest.raises(ConfigError, match="non-empty"):
        RoundPruner(np.array([], dtype=np.int64), SPEC)
    with pytest.raises(ValidationError):
        PruningSpec(percentile=120)
    with pytest.raises(ValidationError):
        PruningSpec(prune_ratio=-0.1)
    with pytest.raises(ConfigError, match="epochs"):
        expected_active_fraction(0, SPEC)
