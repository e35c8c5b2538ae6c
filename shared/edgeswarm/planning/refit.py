"""The closed loop's fit, shared by every kind that plans on measured speeds (HPP training, pipelined and
tensor-parallel serving, split learning's rounds).

A profile is measured once, alone; the devices then compute beside the bus's threads, other jobs, thermal limits or a
neighbour's load, so a device may run at a different speed than profiled, and a link may carry less than its probe
did. Each unit of work (a training round, a served micro-batch) a job knows what every device of its plan took for
its part and what the profile predicted for it: their ratio is the device's ``scale``; and what its tensors of
several chunks took to arrive from each peer (``LinkSample``) beside what the link's profile prices them at: the
link's scale, keyed ``link_key(a, b)``. ``ScaleFit`` keeps each key's ratios of the last units and fits its scale as
their median (one outlier cannot swing it: a key counts as moved only once three units measured it), clipped to
[MIN_SCALE, MAX_SCALE]. ``scaled`` is the cluster profile with every device's times multiplied by its scale and every
fitted link's bandwidth divided by its scale (its per-message costs multiplied): the refitted profile. ``Rebalancer``
decides when to re-plan on it: only when the best plan on the refitted profile is predicted faster than the running
plan re-priced on it by more than ``margin``, on ``confirm`` checks in a row, at least ``min_rounds`` units into a
plan and at most ``max_per_hour`` times an hour. A cluster that is uniformly slower than profiled (every scale alike)
re-plans to the same layout: nothing to gain, so nothing happens. ``RefitPricing`` keeps a kind's plans priced on the
refitted profile (whatever the kind's profile type), and ``ClosedLoop`` ties the fit, the rebalancer and the pricing
together for a serving job's threads.

Pure functions and small state over typed data; the fitted scales come from measurement only (nothing here reads
the emulation's settings).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Generic, Protocol, TypeVar

from edgeswarm.planning.vocabulary import link_matrices, message_matrix
from edgeswarm.values.profiles import MAX_SCALE, MIN_SCALE, ClusterProfile, LinkSample

SLIVER = 0.1  # a device's share of the compute below which its measured time says nothing of its speed
MIN_LINK_S = 0.005  # a link's predicted arrivals in a round below which what it measures is mostly timing noise
LINK = "<->"  # joins a link's two nodes in its key (no node name holds it)


def link_key(a: str, b: str) -> str:
    """The fit's key of the link between nodes ``a`` and ``b``, either way ("a<->b", sorted): the planners price a
    pair by its slower direction, so both directions' samples fit one scale."""
    return LINK.join(sorted((a, b)))


def link_nodes(key: str) -> tuple[str, str] | None:
    """The two nodes of a ``link_key``; None for a device's key (a node name)."""
    a, sep, b = key.partition(LINK)
    return (a, b) if sep else None


def link_fit_inputs(cluster: ClusterProfile, received: dict[str, list[LinkSample]], min_s: float = MIN_LINK_S
                    ) -> tuple[dict[str, float], dict[str, float]]:
    """One round's predicted and measured seconds per link key, from what each device received (``received``:
    receiving node -> its samples). A sample is priced as the planners price the pair (``vocabulary``: the slower
    direction's bandwidth, the larger per-message cost): its bytes over the bandwidth and a message's fixed cost per
    chunk. Samples from or to nodes outside ``cluster`` are left out, and so are links predicted under ``min_s``
    in all. Raises ProfileError when a pair of the cluster's devices has no link measurement."""
    nodes = [entry.device.node for entry in cluster.devices]
    index = {node: i for i, node in enumerate(nodes)}
    bandwidth, _ = link_matrices(cluster.links, nodes)
    message = message_matrix(cluster.links, nodes)
    predicted: dict[str, float] = {}
    measured: dict[str, float] = {}
    for node, samples in received.items():
        for sample in samples:
            i, j = index.get(sample.src), index.get(node)
            if i is None or j is None or i == j:
                continue
            key = link_key(sample.src, node)
            seconds = sample.bytes / float(bandwidth[i, j]) + sample.chunks * float(message[i, j])
            predicted[key] = predicted.get(key, 0.0) + seconds
            measured[key] = measured.get(key, 0.0) + sample.seconds
    kept = [k for k, s in predicted.items() if s >= min_s]
    return {k: predicted[k] for k in kept}, {k: measured[k] for k in kept}


def scaled(cluster: ClusterProfile, scales: dict[str, float]) -> ClusterProfile:
    """``cluster`` with each device's compute times (``ComputeProfile.scaled``) multiplied by its scale (``scales``
    keyed by node; 1 where none), and each link's bandwidth divided by its scale and its per-message costs multiplied
    by it (keyed ``link_key``)."""
    entries = []
    for entry in cluster.devices:
        f = scales.get(entry.device.node, 1.0)
        if f == 1.0:
            entries.append(entry)
            continue
        entries.append(entry.model_copy(update={"compute": entry.compute.scaled(f)}))
    links = []
    for link in cluster.links:
        f = scales.get(link_key(link.src, link.dst), 1.0)
        links.append(link if f == 1.0 else link.model_copy(update={
            "bandwidth_bps": link.bandwidth_bps / f, "message_s": link.message_s * f, "hop_s": link.hop_s * f}))
    return cluster.model_copy(update={"devices": entries, "links": links})


def weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    """The value at which the ``weights`` (non-negative, summing above 0) of the smaller values and of the larger
    ones each reach half the total, the lower one at a tie. Raises ValueError when there is no value or no
    weight."""
    pairs = sorted(zip(values, weights, strict=True))
    total = sum(w for _, w in pairs)
    if not pairs or total <= 0:
        raise ValueError("a weighted median needs a value with a positive weight")
    seen = 0.0
    for value, weight in pairs:
        seen += weight
        if seen >= total / 2:
            return value
    return pairs[-1][0]


@dataclass
class ScaleFit:
    """Each key's (a device's compute, or a link's transfers) measured over predicted seconds, its last ``window``
    rounds: ``add`` one round, ``scales`` the fit (the median, clipped to [MIN_SCALE, MAX_SCALE]), of the rounds on
    the running plan where the key has some (``new_plan``). ``sliver``: see ``add``; ``min_samples``: see ``moved``."""

    window: int = 5
    sliver: float = SLIVER
    min_samples: int = 3
    ratios: dict[str, deque[float]] = field(default_factory=dict)
    weights: dict[str, deque[float]] = field(default_factory=dict)  # each ratio's predicted seconds
    _fresh: dict[str, int] = field(default_factory=dict, init=False)  # each key's last ratios on the running plan

    def add(self, predicted: dict[str, float], measured: dict[str, float],
            units: dict[str, float] | None = None) -> None:
        """One round: ``measured`` seconds per key (a device's forward and backward of one micro-batch, say), beside
        the ``predicted`` ones. A key with no prediction or no positive figure is skipped, and so is one whose
        ``units`` seconds (its prediction without the per-call costs the profile prices for it; ``predicted`` when
        None) are less than ``sliver`` of the busiest key's: for a device, what it measures is then mostly the
        runtime's per-call costs around its few units (a unit profiled at 0 s still takes milliseconds), not its
        speed; its scale stays what earlier rounds fitted. The per-call costs are left out of that comparison
        because the profile prices a call's cold cost as the whole model's: a TX2-like device given MobileNetV2's
        last 2 of 72 units was predicted mostly that cost, over a tenth of the busiest device's seconds, measured
        0.18x of it, and the re-plan that took it for 5x faster gave it 38 units it computed 4x slower than
        predicted."""
        basis = predicted if units is None else units
        floor = self.sliver * max(basis.values(), default=0.0)
        for node, seconds in measured.items():
            expected = predicted.get(node, 0.0)
            if expected > 0 and basis.get(node, 0.0) >= floor and seconds > 0 and math.isfinite(seconds):
                self.ratios.setdefault(node, deque(maxlen=self.window)).append(seconds / expected)
                self.weights.setdefault(node, deque(maxlen=self.window)).append(expected)
                self._fresh[node] = min(self.window, self._fresh.get(node, 0) + 1)

    def new_plan(self) -> None:
        """The job runs on another plan from now on. A profile can be off by more on some units and batch sizes than
        on others (MobileNetV2's Nanos measured 0.7x on a plan's last units and 1.0x-1.3x on its first), so a key's
        ratios on an earlier plan price the running one only until the key has one on it."""
        self._fresh.clear()

    def scales(self) -> dict[str, float]:
        """Each key's fitted scale: measured over profiled, the median of its ratios on the running plan, or of its
        earlier ones while it has none on it."""
        out = {}
        for key, r in self.ratios.items():
            if r:
                fresh = self._fresh.get(key, 0)
                out[key] = min(MAX_SCALE, max(MIN_SCALE, median(list(r)[-fresh:] if fresh else r)))
        return out

    def measured(self) -> dict[str, float]:
        """Each key's scale over every round the window holds, whichever plan ran them: what the job measured of it,
        to save for the next job (clipped). ``scales`` prices the running plan and so prefers its own rounds, but a
        device a re-plan left a few units measures those units' error against the profile: one round of it made a
        TX2-like device's saved speed 0.41x what its three rounds before had measured. So each round counts by its
        predicted seconds (a weighted median): a device 8x slower than profiled, moved off to a few units whose
        per-call costs the profile prices, measured 1.16x there in three rounds of five and was saved at 1.16x."""
        return {key: min(MAX_SCALE, max(MIN_SCALE, weighted_median(r, self.weights[key])))
                for key, r in self.ratios.items() if r}

    def rounds(self) -> dict[str, int]:
        """How many measured rounds each device's scale is fitted from (at most ``window``)."""
        return {node: len(r) for node, r in self.ratios.items()}

    def moved(self, tolerance: float = 0.15) -> dict[str, float]:
        """The scales that moved from 1 by more than ``tolerance`` (a fraction either way), of the keys measured in
        ``min_samples`` rounds or more: a job's first checks would otherwise read the median of one round, that
        round's outlier, and of two, their mean, which one outlier swings."""
        return {n: s for n, s in self.scales().items()
                if len(self.ratios[n]) >= self.min_samples and abs(math.log(s)) > math.log1p(tolerance)}


@dataclass
class Rebalancer:
    """When to re-plan on a refitted profile (see the module's docstring): ``check`` once a round, with the running
    plan's and the best plan's predicted round on it (seconds) and the time now (seconds, monotonic)."""

    margin: float = 0.15
    confirm: int = 3
    min_rounds: int = 3
    max_per_hour: int = 4
    _rounds: int = field(default=0, init=False)  # rounds run on the running plan
    _streak: int = field(default=0, init=False)  # checks in a row that saw the gain
    _done: deque[float] = field(default_factory=lambda: deque(maxlen=64), init=False)  # when it re-planned
    gain: float | None = field(default=None, init=False)  # the last check's: 1 - best over running (None: none yet)

    def round_done(self) -> None:
        """One more round ran on the running plan."""
        self._rounds += 1

    def new_plan(self) -> None:
        """The job runs on another plan from now on (re-planned, recovered, grown): its rounds count afresh."""
        self._rounds = self._streak = 0
        self.gain = None

    def nothing_moved(self) -> None:
        """A check at which no scale had moved: nothing to gain, so the checks in a row start over."""
        self._streak = 0
        self.gain = 0.0

    def check(self, current_s: float, best_s: float, now: float) -> bool:
        """Whether to re-plan now (counted against the hourly cap when True)."""
        gain = self.gain = 1.0 - best_s / current_s if current_s > 0 else 0.0
        self._streak = self._streak + 1 if gain > self.margin else 0
        recent = sum(1 for t in self._done if now - t < 3600.0)
        if self._rounds < self.min_rounds or self._streak < self.confirm or recent >= self.max_per_hour:
            return False
        self._done.append(now)
        return True


def same_fit(a: dict[str, float], b: dict[str, float], tolerance: float = 0.05) -> bool:
    """Whether two fits hold the same devices with every scale within ``tolerance`` (a fraction) of the other's: a
    plan priced on one needs no pricing again on the other."""
    return a.keys() == b.keys() and all(abs(b[n] / a[n] - 1.0) <= tolerance for n in a)


class _Epoched(Protocol):
    @property
    def epoch(self) -> int: ...


PlanT = TypeVar("PlanT", bound=_Epoched)
ProfileT = TypeVar("ProfileT")


@dataclass
class Priced(Generic[PlanT, ProfileT]):
    """A running plan on a refitted profile: the profile, the plan priced on it and (when searched) the best plan."""

    profile: ProfileT
    current: PlanT
    best: PlanT | None


@dataclass
class RefitPricing(Generic[PlanT, ProfileT]):
    """A kind's running plan priced on the refitted profile (``reprice``: its layout kept, its compute priced anew)
    and the best plan on it (``search``), both kept while the plan's epoch stays and the fit stays within
    ``same_fit``: the planner's searches take a while, and every round asks. ``scale`` makes the refitted profile
    from the kind's profile and the fit's scales (``scaled`` for a ClusterProfile)."""

    reprice: Callable[[PlanT, ProfileT], PlanT]
    search: Callable[[PlanT, ProfileT], PlanT]
    scale: Callable[[ProfileT, dict[str, float]], ProfileT]
    _last: tuple[int, dict[str, float], Priced[PlanT, ProfileT]] | None = field(default=None, init=False)

    def priced(self, plan: PlanT, cluster: ProfileT, scales: dict[str, float], best: bool
               ) -> Priced[PlanT, ProfileT]:
        """``plan`` on ``cluster`` scaled by ``scales`` and, with ``best``, the best plan there. Raises what
        ``reprice`` and ``search`` raise (the plan's devices not in ``cluster``, no plan fits)."""
        last = self._last
        if last is not None and last[0] == plan.epoch and same_fit(last[1], scales) and (
                last[2].best is not None or not best):
            return last[2]
        profile = self.scale(cluster, scales)
        out = Priced(profile, self.reprice(plan, profile), self.search(plan, profile) if best else None)
        self._last = (plan.epoch, dict(scales), out)
        return out


@dataclass
class ClosedLoop(Generic[PlanT, ProfileT]):
    """One serving job's closed loop, safe to share between its threads: the fits of each measured unit (``add``:
    the devices' compute and, where measured, the links'), the rebalancer, and its plans priced on the refitted
    profile (``priced``); ``better`` says when to move and where. ``cost``: the seconds of a plan the rebalancer
    compares (lower is better: a pipeline's bottleneck, a prefill)."""

    pricing: RefitPricing[PlanT, ProfileT]
    cost: Callable[[PlanT], float]
    fit: ScaleFit = field(default_factory=ScaleFit)
    # Keyed link_key. No sliver: a link carries what its tensors carry, whatever the busiest link's share.
    link_fit: ScaleFit = field(default_factory=lambda: ScaleFit(sliver=0.0))
    rebalancer: Rebalancer = field(default_factory=Rebalancer)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    # Each link's predicted and measured seconds over the units since its last sample (``add``).
    _links: dict[str, tuple[float, float]] = field(default_factory=dict, init=False)

    def add(self, predicted: dict[str, float], measured: dict[str, float],
            links: tuple[dict[str, float], dict[str, float]] | None = None,
            units: dict[str, float] | None = None) -> None:
        """One unit of work measured (``ScaleFit.add``, ``units`` as there): each device's compute and, with
        ``links``, each link's predicted and measured seconds (``link_fit_inputs`` with no floor); counted on the
        running plan. A served item's tensors may take a few milliseconds on a link: a link's seconds are summed
        over units until their prediction reaches MIN_LINK_S, then fitted as one sample, so timing noise does not
        make its scale."""
        with self._lock:
            self.fit.add(predicted, measured, units)
            if links is not None:
                for key, seconds in links[0].items():
                    before, seen = self._links.pop(key, (0.0, 0.0))
                    summed = (before + seconds, seen + links[1].get(key, 0.0))
                    if summed[0] >= MIN_LINK_S:
                        self.link_fit.add({key: summed[0]}, {key: summed[1]})
                    else:
                        self._links[key] = summed
            self.rebalancer.round_done()

    def scales(self) -> dict[str, float]:
        """Each device's fitted compute scale and each link's (``scaled``'s keys)."""
        with self._lock:
            return self.fit.scales() | self.link_fit.scales()

    def rounds(self) -> dict[str, int]:
        with self._lock:
            return self.fit.rounds() | self.link_fit.rounds()

    def measured(self) -> dict[str, float]:
        """What the job measured of each device and link, to save for the next job (``ScaleFit.measured``)."""
        with self._lock:
            return self.fit.measured() | self.link_fit.measured()

    def new_plan(self) -> None:
        with self._lock:
            self.rebalancer.new_plan()
            self._links.clear()

    def priced(self, plan: PlanT, profile: ProfileT, best: bool) -> Priced[PlanT, ProfileT] | None:
        """``plan`` on ``profile`` refitted (``RefitPricing.priced``); None before the fit has any key. Raises what
        the pricing raises."""
        scales = self.scales()
        return self.pricing.priced(plan, profile, scales, best) if scales else None

    def better(self, plan: PlanT, profile: ProfileT, now: float
               ) -> tuple[Priced[PlanT, ProfileT], dict[str, float]] | None:
        """When the rebalancer says moving off ``plan`` pays (``now``: seconds, monotonic): the plans priced on the
        refitted ``profile`` (its ``best`` is where to go) and the scales that moved; None otherwise. Raises what the
        pricing raises."""
        with self._lock:
            moved = self.fit.moved() | self.link_fit.moved()
            if not moved:
                self.rebalancer.nothing_moved()
                return None
        priced = self.priced(plan, profile, best=True)
        if priced is None or priced.best is None:
            return None
        with self._lock:
            go = self.rebalancer.check(self.cost(priced.current), self.cost(priced.best), now)
        return (priced, moved) if go else None


def speeds(scales: dict[str, float]) -> str:
    """``scales`` for people: "a 3.10x, b 1.02x" (measured over profiled)."""
    return ", ".join(f"{node} {scale:.2f}x" for node, scale in sorted(scales.items()))


def moved_text(moved: dict[str, float]) -> str:
    """What a re-plan's event says moved: "compute measured against the profile: a 3.10x; links measured against
    the profile: a<->b 5.00x" (measured over profiled; either part left out when nothing of it moved)."""
    compute = {k: v for k, v in moved.items() if LINK not in k}
    links = {k: v for k, v in moved.items() if LINK in k}
    parts = ([f"compute measured against the profile: {speeds(compute)}"] if compute else []) + (
        [f"links measured against the profile: {speeds(links)}"] if links else [])
    return "; ".join(parts)
