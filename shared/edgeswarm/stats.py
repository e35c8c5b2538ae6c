"""Latency percentiles, a robust line through predicted and measured seconds and the non-decreasing fit of times
measured at growing shares: one definition for the coordinator's progress, the closed loops, the profilers, the CLI
and the benchmark."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0 < q <= 1) of ascending ``values`` by nearest rank; None when there are none."""
    if not values:
        return None
    return values[min(len(values) - 1, max(0, round(q * len(values)) - 1))]


def affine_fit(xs: Sequence[float], ys: Sequence[float], *, min_spread: float = 1.2,
               slope_bounds: tuple[float, float] = (0.25, 16.0)) -> tuple[float, float] | None:
    """A robust ``y = slope * x + intercept`` through the pairs (predicted seconds ``xs``, measured ``ys``): the
    Theil-Sen slope (the median of the pairwise slopes) when the xs spread by at least ``min_spread`` (largest over
    smallest), clipped to ``slope_bounds``, else a slope of 1; the intercept is the median of ``y - slope * x``, at
    least 0 (a fixed cost is never negative). Without the spread, times measured below their predictions are a
    slope (the median of ``y / x``, clipped) and no fixed cost, since a negative fixed cost is none. One outlier pair
    moves neither. None without a pair."""
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if x > 0 and y >= 0]
    if not pairs:
        return None
    slope = 1.0
    low, high = min(x for x, _ in pairs), max(x for x, _ in pairs)
    spread = len(pairs) >= 3 and high >= min_spread * low
    if spread:
        slopes = sorted((y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(pairs) for x2, y2 in pairs[i + 1:]
                        if x2 != x1)
        slope = min(slope_bounds[1], max(slope_bounds[0], slopes[len(slopes) // 2]))
    rests = sorted(y - slope * x for x, y in pairs)
    intercept = rests[len(rests) // 2]
    if intercept < 0 and not spread:
        ratios = sorted(y / x for x, y in pairs)
        return min(slope_bounds[1], max(slope_bounds[0], ratios[len(ratios) // 2])), 0.0
    return slope, max(0.0, intercept)


def non_decreasing(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (isotonic regression, pool adjacent
    violators): each run that falls is replaced by its mean. For times measured at growing shares of the same work,
    where a larger share computes a superset of a smaller one, so a dip is noise that a planner must not buy."""
    blocks: list[tuple[float, int]] = []  # (mean, count) of each pooled run
    for v in values:
        mean, count = float(v), 1
        while blocks and blocks[-1][0] > mean:
            before, n = blocks.pop()
            mean, count = (before * n + mean * count) / (n + count), n + count
        blocks.append((mean, count))
    return [mean for mean, count in blocks for _ in range(count)]
