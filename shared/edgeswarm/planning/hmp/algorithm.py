"""Algorithm 1 of the Galaxy paper over plain numbers (spec 3.5-3.7 with resolutions A1-A11).

The memory model (spec A2): device d holds ``mem_d = layers * (M_att * a_d / n_h + M_mlp * b_d / f) + a_d *
head_extra + reserved_d`` bytes, where ``head_extra`` is what each query head adds beyond its weights (its share
of the KV cache over all layers) and ``reserved_d`` the replicated parts. Heads move in whole KV groups
(``group`` query heads share one KV head), so a grouped-query model shards its KV heads whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from edgeswarm.planning.hmp.types import HmpPlanError, ShiftMode

# Float slack of the memory test: budgets and footprints are bytes, sums of them are exact to far below this.
_TOLERANCE = 1e-6


def lr_round(weights: Sequence[float], total: int) -> list[int]:
    """``total`` split in proportion to ``weights`` by largest remainders (Hamilton): the parts sum to ``total``
    exactly, ties go to the lower index (spec A1). All-zero weights split equally."""
    n = len(weights)
    if n == 0:
        if total:
            raise ValueError(f"cannot split {total} over no parts")
        return []
    w = [max(0.0, float(x)) for x in weights]
    s = sum(w)
    if s <= 0:
        w, s = [1.0] * n, float(n)
    exact = [total * x / s for x in w]
    parts = [math.floor(e) for e in exact]
    left = total - sum(parts)
    order = sorted(range(n), key=lambda i: (-(exact[i] - parts[i]), i))
    for i in order[:left]:
        parts[i] += 1
    return parts


def equal_split(total: int, parts: int) -> list[int]:
    """``total`` rows over ``parts`` devices: the first ``total mod parts`` get one more (spec A10)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class MemoryProblem:
    """Algorithm 1's input in numbers. ``capacity`` V_d; ``budget`` bytes; ``att_bytes``/``mlp_bytes`` the
    footprint of one whole MHA/MLP block (M_att, M_mlp); ``heads`` n_h in ``group``s; ``columns`` f;
    ``head_extra`` bytes per query head beyond its weights; ``reserved`` R_d; ``margin`` kept free."""

    capacity: Sequence[float]
    budget: Sequence[float]
    layers: int
    heads: int
    columns: int
    att_bytes: float
    mlp_bytes: float
    group: int = 1
    head_extra: float = 0.0
    reserved: Sequence[float] | None = None
    margin: float = 0.0
    column_granule: int = 1  # columns move in multiples of this (a quantized model's blocks)

    @property
    def head_unit(self) -> float:
        """Bytes per query head over all layers."""
        return self.layers * self.att_bytes / self.heads + self.head_extra

    @property
    def column_unit(self) -> float:
        """Bytes per MLP column over all layers."""
        return self.layers * self.mlp_bytes / self.columns

    def reserved_of(self, d: int) -> float:
        return self.reserved[d] if self.reserved is not None else 0.0

    def memory(self, d: int, heads: int, columns: int) -> float:
        """mem_d in bytes for ``heads`` query heads and ``columns`` columns."""
        return heads * self.head_unit + columns * self.column_unit + self.reserved_of(d)

    def limit(self, d: int) -> float:
        return self.budget[d] - self.margin


def _memory_aware_balancing(p: MemoryProblem, shares: list[int], unit: float, mem: list[float],
                            order: list[int], shift: ShiftMode) -> None:
    """Lines 9-19 of Algorithm 1 on ``shares`` (granules of ``unit`` bytes), in place; ``mem`` is updated with
    every move. A recursion level removes at least one device from the candidate list, so there are at most D."""
    candidates = list(order)
    while True:
        oom = [d for d in candidates if mem[d] > p.limit(d) + _TOLERANCE]
        if not oom:
            return
        free = [d for d in candidates if p.limit(d) - mem[d] >= unit - _TOLERANCE]  # A3
        for o in oom:
            waiting = min(shares[o], math.ceil((mem[o] - p.limit(o)) / unit - _TOLERANCE))  # A2
            receivers = [x for x in free if x != o]
            if receivers and waiting > 0:
                moved = _shift(p, receivers, waiting, unit, mem, shift)
                for x, n in moved.items():
                    shares[x] += n
                    mem[x] += n * unit
                total = sum(moved.values())
                shares[o] -= total
                mem[o] -= total * unit
            candidates.remove(o)  # A7: with nobody free it stays OOM and the final check fails


def _shift(p: MemoryProblem, receivers: list[int], waiting: int, unit: float, mem: list[float],
           shift: ShiftMode) -> dict[int, int]:
    """How many granules each receiver takes of ``waiting``: in proportion to capacity (paper), or capped at each
    receiver's free memory with the rest spread over those still free (water-filling, spec A4)."""
    if shift == "paper":
        parts = lr_round([p.capacity[x] for x in receivers], waiting)
        return dict(zip(receivers, parts, strict=True))
    room = {x: max(0, math.floor((p.limit(x) - mem[x]) / unit + _TOLERANCE)) for x in receivers}
    taken = dict.fromkeys(receivers, 0)
    left = waiting
    while left > 0:  # every round places at least one granule, so this ends
        open_ = [x for x in receivers if room[x] > taken[x]]
        if not open_:
            break
        parts = lr_round([p.capacity[x] for x in open_], left)
        for x, n in zip(open_, parts, strict=True):
            n = min(n, room[x] - taken[x])
            taken[x] += n
            left -= n
    return taken


def check_memory(p: MemoryProblem, heads: Sequence[int], columns: Sequence[int], what: str) -> str:
    """Why ``heads``/``columns`` per device do not fit (a sentence naming the device and the bytes), or ""."""
    over = [(d, p.memory(d, heads[d], columns[d]), p.limit(d)) for d in range(len(heads))]
    over = [(d, m, b) for d, m, b in over if m > b + _TOLERANCE]
    if not over:
        return ""
    d, m, b = max(over, key=lambda t: t[1] - t[2])
    return (f"{what} does not fit: device {d} needs {m / 1e9:.2f} GB, over its {b / 1e9:.2f} GB budget"
            + (f" ({len(over)} devices over)" if len(over) > 1 else ""))


def equal_shares(p: MemoryProblem, devices: int) -> tuple[list[int], list[int]]:
    """Megatron-style equal heads (in whole KV groups) and columns over ``devices``."""
    groups = lr_round([1.0] * devices, p.heads // p.group)
    granules = lr_round([1.0] * devices, p.columns // p.column_granule)
    return [g * p.group for g in groups], [c * p.column_granule for c in granules]


def algorithm1(p: MemoryProblem, shift: ShiftMode = "paper") -> tuple[list[int], list[int]]:
    """Query heads and MLP columns per device (Algorithm 1 with A1-A7): capacity-proportional shares, then the
    overflow of devices over budget moved to devices with room, MLP columns first, then heads with a fresh
    candidate list (A5). Raises HmpPlanError, saying which device is short of how much, when a device stays over
    its budget."""
    d_count = len(p.capacity)
    if d_count == 0:
        raise HmpPlanError("no devices to plan on")
    if p.heads % p.group:
        raise ValueError(f"{p.heads} heads are not whole groups of {p.group}")
    g = p.column_granule
    if p.columns % g:
        raise ValueError(f"{p.columns} columns are not whole granules of {g}")
    groups = lr_round(p.capacity, p.heads // p.group)
    granules = lr_round(p.capacity, p.columns // g)
    mem = [p.memory(d, groups[d] * p.group, granules[d] * g) for d in range(d_count)]
    order = list(range(d_count))
    _memory_aware_balancing(p, granules, p.column_unit * g, mem, order, shift)
    _memory_aware_balancing(p, groups, p.head_unit * p.group, mem, order, shift)
    heads = [h * p.group for h in groups]
    columns = [c * g for c in granules]
    short = [(d, mem[d] - p.limit(d)) for d in order if mem[d] > p.limit(d) + _TOLERANCE]
    if short:
        need = p.layers * (p.att_bytes + p.mlp_bytes) + p.heads * p.head_extra + sum(
            p.reserved_of(d) for d in order)
        have = sum(p.limit(d) for d in order)
        worst = ", ".join(f"device {d} by {gap / 1e6:.0f} MB" for d, gap in short)
        raise HmpPlanError(
            f"the model does not fit: {need / 1e9:.2f} GB needed, {have / 1e9:.2f} GB of budget in all; over budget: "
            f"{worst}. Add devices or memory, or plan a smaller model, sequence or KV cache")
    return heads, columns
