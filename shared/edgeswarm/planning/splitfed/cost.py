"""The central manager's cost model (spec 4.2): device memory per cut, the feasible cuts, the per-iteration and
per-round times with the MEC shared among its devices, and the bytes that cross a cut per iteration.

A cut ``j`` (1..V-h) keeps units 1..j (the front) and the last ``h`` (the tail) on the device and runs
j+1..V-h on the MEC; ``j = V-h`` offloads nothing (local training). Three latency models (spec 12.4):

- ``usplit`` (default): forward and backward of every unit, four transfers per iteration (activations and
  gradients at the cut and before the tail), E epochs of ceil(|D|/B) iterations, and the device part's
  parameters downloaded and uploaded once per round. Each transfer is also priced at the device's
  ``link_message_s`` per message it takes (``vocabulary.messages``: one per 1 MiB chunk): for a small model the
  messages, not the bytes, are most of a split iteration's time on the wire.
- ``vanilla`` (the SplitFed baseline): no tail, two transfers at the cut (the labels travel with the
  activations), same round structure.
- ``paper``: Eq. 4 read literally, one iteration with one transfer of O(j), no tail, no round structure, no
  per-message cost.

Every model adds the device's ``setup_s`` to its round whatever the cut: what its earlier rounds measured before
their first step (the part built, the weights loaded, the data read; 0 until measured).

Units: bytes, FLOPs, FLOP/s, bytes per second, seconds.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from edgeswarm.planning.splitfed.recompute import device_segments, plan_recompute
from edgeswarm.planning.splitfed.types import ModelCost, SplitOptions, SplitPlanError, UnitCost
from edgeswarm.planning.vocabulary import messages

if TYPE_CHECKING:
    from collections.abc import Sequence

    from edgeswarm.planning.splitfed.types import LatencyModel, SplitDevice, SplitMec

LABEL_BYTES = 8  # an int64 class index per sample: what the vanilla split sends besides the activations


def unit_memory(unit: UnitCost, optimizer_states: int) -> int:
    """M(u) = P(u)(2 + s_opt) + A(u) bytes: weights, gradients, optimizer state and saved activations."""
    return unit.param_bytes * (2 + optimizer_states) + unit.act_bytes


def effective_tail(model: ModelCost, options: SplitOptions) -> int:
    """h: the units kept on the device after the MEC's part; 0 for the vanilla split and the paper's Eq. 4,
    which have no tail. Raises SplitPlanError when the tail leaves no unit to cut after."""
    h = options.tail if options.latency_model == "usplit" else 0
    if h >= len(model.units):
        raise SplitPlanError(f"a tail of {h} units leaves no cut in {model.name}'s {len(model.units)} units: "
                             "use a tail shorter than the model (the default is 1)")
    return h


@dataclass(frozen=True)
class CutCosts:
    """The per-cut quantities of one model, index ``j - 1`` for cut ``j`` in 1..V-h: device memory (bytes),
    device and MEC FLOPs per iteration, bytes and messages crossing per iteration, device-side parameter bytes and
    the messages of their download and upload in a round, and under cost-aware recomputation (theta = l_peak) the
    device memory M_persist + l_peak and the extra forward FLOPs per iteration."""

    memory: np.ndarray
    device_flops: np.ndarray
    mec_flops: np.ndarray
    transfer_bytes: np.ndarray
    transfer_messages: np.ndarray
    device_params: np.ndarray
    sync_messages: np.ndarray
    lean_memory: np.ndarray
    recompute_flops: np.ndarray

    @property
    def cuts(self) -> int:
        return int(self.memory.shape[0])


def device_memory(model: ModelCost, cut: int, tail: int, overhead_bytes: int = 0, buffers: bool = True) -> int:
    """M_dev(j) bytes (spec 4.2): front and tail units' M(u), the send/receive buffers 2(O(j) + O(V-h)) (only
    what crosses: nothing at j = V-h, no O(V-h) without a tail) and a fixed overhead."""
    units = model.units
    v = len(units)
    if not 1 <= cut <= v - tail:
        raise ValueError(f"cut {cut} outside 1..{v - tail}")
    front = sum(unit_memory(u, model.optimizer_states) for u in units[:cut])
    back = sum(unit_memory(u, model.optimizer_states) for u in units[v - tail:])
    crossing = 0
    if buffers and cut < v - tail:
        crossing = 2 * (units[cut - 1].out_bytes + (units[v - tail - 1].out_bytes if tail else 0))
    return front + back + crossing + overhead_bytes


def iteration_tensors(model: ModelCost, cut: int, tail: int, latency_model: LatencyModel) -> list[int]:
    """Bytes of each tensor crossing the device-MEC link in one iteration (U11): U-split the activations up and their
    gradient down at the cut (O(j) each) and, with a tail, the middle's output down and its gradient up (O(V-h)
    each); vanilla O(j) up and down (the labels travel with the activations); the paper's Eq. 4 one O(j); none at
    j = V-h."""
    units = model.units
    v = len(units)
    if cut >= v - tail:
        return []
    o_cut = units[cut - 1].out_bytes
    if latency_model == "paper":
        return [o_cut]
    if latency_model == "vanilla" or not tail:
        return [o_cut, o_cut]
    o_tail = units[v - tail - 1].out_bytes
    return [o_cut, o_tail, o_tail, o_cut]


def iteration_bytes(model: ModelCost, cut: int, tail: int, latency_model: LatencyModel) -> int:
    """Bytes crossing the device-MEC link in one iteration: ``iteration_tensors``, and under the vanilla split the
    batch's labels."""
    tensors = iteration_tensors(model, cut, tail, latency_model)
    labels = LABEL_BYTES * model.batch_size if latency_model == "vanilla" and tensors else 0
    return sum(tensors) + labels


def iteration_messages(model: ModelCost, cut: int, tail: int, latency_model: LatencyModel) -> int:
    """Messages crossing the device-MEC link in one iteration: ``iteration_tensors``, each sent as
    ``vocabulary.messages``; none for the paper's Eq. 4, which prices bytes only."""
    if latency_model == "paper":
        return 0
    return sum(messages(t) for t in iteration_tensors(model, cut, tail, latency_model))


def unit_work(model: ModelCost, share: Sequence[float]) -> np.ndarray:
    """Each unit's FLOPs of one training iteration (forward and backward), redistributed by ``share`` (each unit's
    share of the iteration's seconds in a node's profile) when given: the model's FLOPs in all, so the node's speed
    (FLOP/s over its whole iteration) prices them as its profile timed each unit. A small unit at full resolution
    (LeNet-5's first convolution) takes a larger share of the seconds than of the FLOPs. Raises SplitPlanError for
    shares of another model's units, or none above 0."""
    flops = np.array([u.flops_fwd + u.flops_bwd for u in model.units], dtype=np.float64)
    if not share:
        return flops
    weights = np.asarray(share, dtype=np.float64)
    if weights.shape != flops.shape or not weights.sum() > 0:
        raise SplitPlanError(f"unit shares of {len(share)} units do not fit {model.name}'s {len(flops)} units: "
                             "profile the nodes on the job's model")
    return float(flops.sum()) * weights / float(weights.sum())


def split_work(model: ModelCost, tail: int, share: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(device, MEC) FLOPs of one iteration at every cut 1..V-``tail`` (``unit_work`` by ``share``): the device's
    front and tail, and the middle the MEC runs."""
    work = unit_work(model, share)
    n_cuts = len(work) - tail
    front = np.cumsum(work)[:n_cuts]
    return front + float(work[n_cuts:].sum()), float(work[:n_cuts].sum()) - front


def parties_costs(costs: CutCosts, model: ModelCost, options: SplitOptions, device: Sequence[float],
                  mec: Sequence[float]) -> CutCosts:
    """``costs`` with the device's FLOPs priced by its unit shares ``device`` and the MEC's by the MEC's ``mec``
    (``unit_work``; empty: the FLOPs as they are)."""
    tail = effective_tail(model, options)
    return replace(costs, device_flops=split_work(model, tail, device)[0] if device else costs.device_flops,
                   mec_flops=split_work(model, tail, mec)[1] if mec else costs.mec_flops)


def cut_costs(model: ModelCost, options: SplitOptions) -> CutCosts:
    """Every cut's memory, FLOPs, transfer and device parameters under ``options`` (tail, buffers, overhead,
    latency model)."""
    tail = effective_tail(model, options)
    units = model.units
    v = len(units)
    params = np.array([u.param_bytes for u in units], dtype=np.float64)
    tail_params = float(params[v - tail:].sum())
    n_cuts = v - tail
    device_flops, mec_flops = split_work(model, tail, ())
    lean = [lean_memory(model, j, tail, options.overhead_bytes, options.comm_buffers) for j in range(1, n_cuts + 1)]
    device_params = np.cumsum(params)[:n_cuts] + tail_params
    return CutCosts(
        memory=np.array([device_memory(model, j, tail, options.overhead_bytes, options.comm_buffers)
                         for j in range(1, n_cuts + 1)], dtype=np.float64),
        device_flops=device_flops,
        mec_flops=mec_flops,
        transfer_bytes=np.array([iteration_bytes(model, j, tail, options.latency_model)
                                 for j in range(1, n_cuts + 1)], dtype=np.float64),
        transfer_messages=np.array([iteration_messages(model, j, tail, options.latency_model)
                                    for j in range(1, n_cuts + 1)], dtype=np.float64),
        device_params=device_params,
        sync_messages=2.0 * np.array([messages(int(p)) for p in device_params], dtype=np.float64),
        lean_memory=np.array([m for m, _ in lean], dtype=np.float64),
        recompute_flops=np.array([f for _, f in lean], dtype=np.float64),
    )


def lean_memory(model: ModelCost, cut: int, tail: int, overhead_bytes: int = 0,
                buffers: bool = True) -> tuple[int, float]:
    """(bytes, FLOPs): the device memory of cut ``cut`` under cost-aware recomputation with theta = l_peak,
    M_persist + l_peak (parameters, gradients and optimizer state, the checkpoints, i.e. expensive units' saved
    activations, buffers and overhead, plus the largest backward footprint l_peak), and the extra forward
    FLOPs per iteration its plan costs (spec 4.2's ``plan_with_recompute``, 6.3)."""
    units = model.units
    v = len(units)
    side = units[:cut] + units[v - tail:]
    full = device_memory(model, cut, tail, overhead_bytes, buffers)
    cheap_act = sum(u.act_bytes for u in side if not u.expensive)
    l_peak = max(u.backward_bytes for u in side)
    plan = plan_recompute(device_segments(model, cut, tail), float(l_peak), "peak", "always",
                          l_peak_bytes=l_peak)
    return full - cheap_act + l_peak, plan.extra_flops


def iterations(samples: int, batch_size: int, epochs: int) -> int:
    """E * ceil(|D| / B): the iterations a device trains in a round."""
    return epochs * -(-samples // batch_size)


def iteration_time(costs: CutCosts, cut: int, speed_flops: float, link_bytes_s: float,
                   mec_speed_flops: float, sharing: int = 1, message_s: float = 0.0) -> float:
    """t_iter(i, j) seconds (spec 4.2, Eq. 3-4 without memory-IO terms): device FLOPs / device speed, MEC FLOPs /
    (MEC speed / ``sharing``, the devices the MEC trains for at once), transferred bytes / link rate and the
    iteration's messages at ``message_s`` seconds each."""
    k = cut - 1
    return float(costs.device_flops[k] / speed_flops
                 + costs.mec_flops[k] * max(1, sharing) / mec_speed_flops
                 + costs.transfer_bytes[k] / link_bytes_s + costs.transfer_messages[k] * message_s)


@dataclass(frozen=True)
class CostTable:
    """One round's devices x cuts: what the objective and solvers read. Row ``i`` is ``devices[i]`` (its id is its
    position), column ``j - 1`` is cut j. ``fixed_s`` is each (device, cut)'s round time without the MEC compute,
    ``mec_work`` the MEC FLOPs it needs in the round, so T_i(j) = fixed_s + mec_work * n_m / speed_m (processor sharing
    among the n_m selected devices of MEC m). Of ``fixed_s``, ``compute_s`` is the device's own compute (recomputation
    included) and ``transfer_s`` its iterations' transfers; the rest is its part's weights down and up and its
    ``setup_s``. ``feasible`` is J_i (memory within budget, device available, and restricted by
    ``local_only``/``fixed_cut``)."""

    nodes: tuple[str, ...]
    mec_names: tuple[str, ...]
    mec_of: np.ndarray          # (N,) int index into mec_names
    mec_speed: np.ndarray       # (M,) FLOP/s
    memory: np.ndarray          # (N, J) bytes
    feasible: np.ndarray        # (N, J) bool
    fixed_s: np.ndarray         # (N, J) seconds
    compute_s: np.ndarray       # (N, J) seconds
    transfer_s: np.ndarray      # (N, J) seconds
    mec_work: np.ndarray        # (N, J) FLOPs
    dis: np.ndarray             # (N,) nats
    samples: np.ndarray         # (N,) int
    classes: int

    @property
    def eligible(self) -> np.ndarray:
        """Devices with J_i non-empty."""
        return self.feasible.any(axis=1)

    def times(self, rows: np.ndarray, cuts: np.ndarray, sharing: np.ndarray) -> np.ndarray:
        """T_i(j_i) seconds for devices ``rows`` at 1-based ``cuts``, their MEC shared ``sharing`` ways."""
        k = cuts - 1
        speed = self.mec_speed[self.mec_of[rows]]
        return self.fixed_s[rows, k] + self.mec_work[rows, k] * np.maximum(sharing, 1) / speed

    def best_times(self) -> np.ndarray:
        """min over J_i of T_i(j) without MEC contention (n_m = 1); +inf where J_i is empty."""
        t = self.fixed_s + self.mec_work / self.mec_speed[self.mec_of][:, None]
        return np.where(self.feasible, t, np.inf).min(axis=1)


def cost_table(model: ModelCost, devices: Sequence[SplitDevice], mecs: Sequence[SplitMec],
               options: SplitOptions) -> CostTable:
    """Build the round's table. Raises SplitPlanError when a device or MEC is named twice, a device names an unknown
    MEC, or ``fixed_cut`` lies beyond the model's cuts."""
    for what, names in (("device", [d.node for d in devices]), ("MEC", [m.node for m in mecs])):
        twice = sorted(n for n, count in Counter(names).items() if count > 1)
        if twice:
            raise SplitPlanError(f"each {what} is listed once; {twice[:5]} are listed more than once")
    costs = cut_costs(model, options)
    n_cuts = costs.cuts
    mec_names = tuple(m.node for m in mecs)
    index = {name: k for k, name in enumerate(mec_names)}
    unknown = sorted({d.mec for d in devices} - set(index))
    if unknown:
        raise SplitPlanError(f"devices name MECs the planner was not given: {unknown[:5]}; list every MEC")
    allowed = np.ones(n_cuts, dtype=bool)
    if options.local_only:
        allowed[:] = False
        allowed[n_cuts - 1] = True
    elif options.fixed_cut is not None:
        if options.fixed_cut > n_cuts:
            raise SplitPlanError(f"fixed cut {options.fixed_cut} is beyond {model.name}'s last cut {n_cuts} "
                                 f"(V={len(model.units)}, tail {len(model.units) - n_cuts}): pick 1..{n_cuts}")
        allowed[:] = False
        allowed[options.fixed_cut - 1] = True
    speed = np.array([d.speed_flops for d in devices], dtype=np.float64)[:, None]
    link = np.array([d.link_bytes_s for d in devices], dtype=np.float64)[:, None]
    message = np.array([d.link_message_s for d in devices], dtype=np.float64)[:, None]
    budget = np.array([d.budget_bytes for d in devices], dtype=np.float64)[:, None]
    available = np.array([d.available for d in devices], dtype=bool)[:, None]
    if options.latency_model == "paper":
        iters = np.ones((len(devices), 1))
        sync = np.zeros((len(devices), n_cuts))
    else:
        iters = np.array([iterations(d.samples, model.batch_size, options.epochs) for d in devices],
                         dtype=np.float64)[:, None]
        sync = 2.0 * costs.device_params[None, :] / link + costs.sync_messages[None, :] * message
    setup = np.array([d.setup_s for d in devices], dtype=np.float64)[:, None]
    mec_work = {m.node: parties_costs(costs, model, options, (), m.unit_share).mec_flops for m in mecs}
    device_work = np.array([parties_costs(costs, model, options, d.unit_share, ()).device_flops for d in devices],
                           dtype=np.float64).reshape(len(devices), n_cuts)
    compute = iters * device_work / speed
    transfer = iters * (costs.transfer_bytes[None, :] / link + costs.transfer_messages[None, :] * message)
    memory = np.broadcast_to(costs.memory, (len(devices), n_cuts)).copy()
    fits = memory <= budget
    if options.plan_with_recompute:
        # Where the full activations do not fit but the cost-aware footprint does, the device recomputes.
        lean = ~fits & (costs.lean_memory[None, :] <= budget)
        memory = np.where(lean, costs.lean_memory[None, :], memory)
        compute = compute + np.where(lean, iters * costs.recompute_flops[None, :] / speed, 0.0)
        fits = fits | lean
    return CostTable(
        nodes=tuple(d.node for d in devices),
        mec_names=mec_names,
        mec_of=np.array([index[d.mec] for d in devices], dtype=np.int64),
        mec_speed=np.array([m.speed_flops for m in mecs], dtype=np.float64),
        memory=memory,
        feasible=fits & available & allowed[None, :],
        fixed_s=compute + transfer + sync + setup,
        compute_s=compute,
        transfer_s=transfer,
        mec_work=iters * np.array([mec_work[d.mec] for d in devices],
                                  dtype=np.float64).reshape(len(devices), n_cuts),
        dis=np.array([d.dis for d in devices], dtype=np.float64),
        samples=np.array([d.samples for d in devices], dtype=np.int64),
        classes=model.classes,
    )


def feasible_cuts(model: ModelCost, device: SplitDevice, options: SplitOptions) -> list[int]:
    """J_i: the cuts whose device memory (or, with ``plan_with_recompute``, cost-aware footprint) fits the
    device's budget; empty when it cannot train this round. Ignores ``local_only``/``fixed_cut``."""
    costs = cut_costs(model, options)
    if not device.available:
        return []
    return [j + 1 for j in range(costs.cuts) if costs.memory[j] <= device.budget_bytes
            or (options.plan_with_recompute and costs.lean_memory[j] <= device.budget_bytes)]


def round_time(model: ModelCost, device: SplitDevice, mec: SplitMec, cut: int, options: SplitOptions,
               sharing: int = 1, recompute_s: float = 0.0) -> float:
    """T_i(j) seconds (spec 4.2): E ceil(|D|/B) t_iter + 2 P_dev(j) / r (and their messages) + T_recompute;
    under ``paper`` Eq. 4 literally (one iteration's t_iter); either with the device's measured ``setup_s``."""
    costs = parties_costs(cut_costs(model, options), model, options, device.unit_share, mec.unit_share)
    t = iteration_time(costs, cut, device.speed_flops, device.link_bytes_s, mec.speed_flops, sharing,
                       device.link_message_s)
    if options.latency_model == "paper":
        return t + device.setup_s
    its = iterations(device.samples, model.batch_size, options.epochs)
    return (its * t + 2.0 * float(costs.device_params[cut - 1]) / device.link_bytes_s
            + float(costs.sync_messages[cut - 1]) * device.link_message_s + recompute_s + device.setup_s)


def device_compute_s(costs: CutCosts, cut: int, iterations: int, speed_flops: float) -> float:
    """Seconds a device of ``speed_flops`` FLOP/s computes in ``iterations`` iterations at ``cut`` (its forward,
    backward and update, as ``cost_table`` prices them from ``costs``, ``parties_costs`` with the device's unit
    shares; no recomputation): the closed loop's prediction of what the device reports (``DeviceReport.compute_s``)."""
    return iterations * float(costs.device_flops[cut - 1]) / speed_flops


def skew_scale(classes: int, normalise: bool) -> float:
    """The divisor of Dis in the objective: ln C when normalising (maps Dis to [0, 1]), else 1."""
    return math.log(classes) if normalise else 1.0
