"""The compute profiler core: per-unit sizes, FLOPs, saved activations and forward/backward times of a model.

Units are those of edgeswarm.models.sequence. Forward and backward run in training mode, the way a stage worker
trains: forward times include autograd recording, backward times cover the input gradient and the weight gradients.
A third time, the inference forward, runs each unit as a served stage does (eval mode, under inference_mode). Units
are timed on the device the worker computes on (``compute``: the CPU, or CUDA, synchronised around every timed
call and warmed up first so the first use of kernels and the allocator is not counted); sizes are measured on the
CPU, so a model's profile is the same on every device. Times are medians in seconds on a grid of batch sizes and
are kept as measured, because they are not linear in the batch size (Asteroid spec section 2.1).

Two ways to get a device's times: "measured" (every unit timed through the device's ``runner``, which on an
emulated device sleeps to look slower) and "calibrated" (the host measured once, then scaled by the device's
speed ratio on a fixed calibration workload: ``measure_speed_ratio`` and ``calibrated_profile``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from edgeswarm.devices.compute import describe, is_accelerator, synchronize
from edgeswarm.devices.emulation import DeviceProfile
from edgeswarm.errors import BatchSizeError, ConfigError, ProfilerError, UnitProfilingError
from edgeswarm.models.saved import saved_for_backward
from edgeswarm.models.sequence import LayerSequence, layer_sequence
from edgeswarm.models.zoo import build_model, example_input, model_fingerprint
from edgeswarm.values.profiles import CHAIN_BOUNDS, ChainFactors, ComputeProfile, ModelProfile, ModelSpec, UnitProfile

log = logging.getLogger(__name__)

T = TypeVar("T")
Runner = Callable[[Callable[[], T]], T]
Progress = Callable[[float, str], None]
Triple = tuple[float, float, float]  # forward, backward and inference forward seconds

# Batch sizes of the size pass: activation memory is fitted as fixed + per_sample * b through these two.
# Two samples rather than one so that BatchNorm on 1x1 feature maps still runs in training mode.
_SIZE_BATCHES = (2, 4)
# Untimed runs of each unit on an accelerator, at least: its first calls pick kernels (cuDNN) and grow the caching
# allocator, which later calls never pay again.
ACCELERATOR_WARMUP = 3


# --- fingerprints ----------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                # x86 says "model name"; many ARM kernels only say "Hardware" or "Model".
                if key.strip() in ("model name", "Hardware", "Model"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_description(compute: torch.device | None = None) -> dict[str, str | int]:
    """What the host fingerprint is made of: CPU model, architecture, core count, torch threads, torch version,
    and the accelerator units are timed on (``compute``) unless that is the CPU (so CPU fingerprints are those of
    profiles measured before accelerators were)."""
    description: dict[str, str | int] = {
        "cpu": _cpu_model(),
        "machine": platform.machine(),
        "cores": os.cpu_count() or 0,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if compute is not None and compute.type != "cpu":
        description["compute"] = describe(compute)
    return description


def _digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def host_fingerprint(compute: torch.device | None = None) -> str:
    """16 hex digits identifying the host's compute (CPU model, cores, torch threads, torch version, and the
    accelerator ``compute`` when it is one): hosts with the same fingerprint can share compute profiles."""
    return _digest(host_description(compute))


def device_fingerprint(device: DeviceProfile, compute: torch.device | None = None) -> str:
    """16 hex digits identifying a device's compute: the host fingerprint (with ``compute``, the device it computes
    on) plus the device class, compute slow-down and emulated flag. The memory budget is left out: it does not
    change timings."""
    return _digest({"host": host_description(compute), "device_class": device.device_class,
                    "slowdown": device.compute_slowdown, "emulated": device.emulated})


@contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Run the block with ``count`` torch intra-op threads (None: leave them as they are), then restore them."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --- measurement helpers ---------------------------------------------------------------------------------


def _timed(fn: Callable[[], object], runner: Runner[Any] | None, compute: torch.device | None = None,
           idle_s: float = 0.0) -> float:
    """Seconds one call of ``fn`` takes, through ``runner`` when given (so its sleeps count), after the device idled
    ``idle_s`` seconds (untimed). On an accelerator (``compute``) the work queued before is waited for first and the
    call's own kernels before the clock stops."""
    if idle_s > 0:
        time.sleep(idle_s)
    call = fn
    if compute is not None:
        synchronize(compute)

        def call() -> None:
            fn()
            synchronize(compute)

    start = time.perf_counter()
    if runner is None:
        call()
    else:
        runner(call)
    return time.perf_counter() - start


def _median_time(fn: Callable[[], object], runner: Runner[Any] | None, repeats: int, warmup: int,
                 compute: torch.device | None = None, idle_s: float = 0.0) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(_timed(fn, runner, compute, idle_s) for _ in range(repeats))


def _stage_input(prev: torch.Tensor) -> torch.Tensor:
    # A leaf that requires grad, as a received activation does on a stage worker; token ids cannot.
    x = prev.detach()
    return x.requires_grad_(True) if x.is_floating_point() else x


def _clear_grads(stage: nn.Module, x: torch.Tensor) -> None:
    for p in stage.parameters():
        p.grad = None
    x.grad = None


def _saved_bytes(stage: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Run ``stage`` on ``x`` and return its output and the bytes autograd saves for backward: distinct
    storages, parameters and buffers excluded (they are counted as weights)."""
    with saved_for_backward(stage) as saved:
        out = stage(x)
    return out, saved.nbytes


def _sdpa_cpu_flops(query_shape: Sequence[int], key_shape: Sequence[int], value_shape: Sequence[int],
                    *args: object, out_shape: object = None, **kwargs: object) -> int:
    # The CPU flash-attention kernel is not in torch's FLOP table: two batched matmuls, QK^T and (QK^T)V.
    *batch, s_q, d = query_shape
    s_k, d_v = key_shape[-2], value_shape[-1]
    return 2 * math.prod(batch) * s_q * s_k * (d + d_v)


_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flops}


def _forward_flops(stage: nn.Module, x: torch.Tensor) -> int:
    counter = FlopCounterMode(display=False, custom_mapping=_FLOP_FORMULAS)
    with counter:
        stage(x)
    return counter.get_total_flops()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _per_sample(total: int, batch: int, what: str, unit: str) -> int:
    if total % batch:
        raise UnitProfilingError(f"{what} of unit {unit} ({total} bytes at batch {batch}) is not proportional to "
                                 "the batch size; the batch must be the first dimension of every activation")
    return total // batch


def validate_batch_sizes(batch_sizes: Sequence[int]) -> list[int]:
    """The grid sorted ascending without duplicates. Raises BatchSizeError when it is empty or holds anything
    but integers >= 1."""
    if isinstance(batch_sizes, str | bytes) or not isinstance(batch_sizes, Sequence) or not batch_sizes:
        raise BatchSizeError(f"batch_sizes must be a non-empty list of integers >= 1, not {batch_sizes!r}")
    bad = [b for b in batch_sizes if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if bad:
        raise BatchSizeError(f"batch sizes must be integers >= 1; invalid: {bad!r}")
    return sorted(set(batch_sizes))


# Timed runs of the units in a row (the whole model, then each half) at each batch size, one per round of every batch
# size, the rounds spread over the profile's passes (``_round_points``), each after CHAIN_WARMUP untimed runs: their
# median sets the batch size's whole column, so a slow moment of the host must weigh in one or two of them, not all.
# Timed back to back, at the end of each batch size's pass, they put a profile timed right after a venv build 1.32x
# (forward) and 1.65x (backward) over the same one 4 minutes later at batch 16, and within 16% at batches 1 to 4, on
# this project's EPYC VM.
CHAIN_WARMUP, CHAIN_ROUNDS = 1, 5
# Seconds the device idles before each call timed cold (``_cold_calls``): as a stage idles between its calls, waiting
# on its peers or, emulated, sleeping out its slow-down. A call pays more after longer idles, up to about 0.2 s
# (MobileNetV2's whole forward at batch 3, one thread: 2.3 ms after 50 ms, 2.9 ms after 0.25 s), but priced as the
# whole model's for every stage, that figure put a served pipeline's small stages 1.12x-1.21x over their measured
# times, and 50 ms's fits both.
COLD_IDLE_S = 0.05
# Cold calls timed, each beside a hot one (``_cold_calls``): a pair's difference scattered from -5 to 11 ms for the
# whole MobileNetV2 at batch 4 on this project's VM, around 1 to 2.5.
COLD_PAIRS = 7


# --- the profiler ----------------------------------------------------------------------------------------


def profile_model(
    spec: ModelSpec,
    batch_sizes: Sequence[int],
    *,
    runner: Runner[Any] | None = None,
    repeats: int = 3,
    warmup: int = 1,
    device_fingerprint: str | None = None,
    progress: Progress | None = None,
    compute: torch.device | None = None,
) -> tuple[ModelProfile, ComputeProfile]:
    """Profile every unit of zoo model ``spec`` in training mode.

    Sizes (batch independent): a_l = bytes per sample of the tensor crossing the cut after unit l (exact),
    trainable weight bytes and buffer bytes of the unit (exact), forward FLOPs per sample, and activation
    bytes saved for backward as fixed + per_sample * b, fitted through batches 2 and 4 (distinct storages
    saved by autograd, parameters and buffers excluded; a tensor saved by two consecutive units counts in
    both, so a stage's sum is an upper bound).

    Times: for each batch size b of ``batch_sizes`` (sorted, duplicates dropped), unit l runs on the recorded
    output of unit l-1 at batch b. Forward = median seconds of ``repeats`` training forwards (autograd on)
    after ``warmup`` untimed ones, each followed by its backward; backward = median seconds of those
    torch.autograd.backward(out, grad_out) with a random grad_out, the input requiring grad; inference = median
    seconds of the forward in eval mode under torch.inference_mode. Each timed call goes through ``runner`` when
    given (for example DeviceProfile.run, whose sleeps then count): method "measured". Each batch size's units are
    then scaled to sum to the whole model run as one stage (``_chain_factors``), timed CHAIN_ROUNDS times at every
    batch size in rounds spread over the passes (``_chain_round``, their median), beside its two halves each run as
    a stage (the profile's ``chain``: how a stage's price depends on its extent), and what a call pays beyond its
    units when it starts after the device idled is measured once, at the smallest batch size (``_cold_calls``: the
    profile's ``cold_*_s``).

    ``compute`` is the torch device units are timed on (default the CPU); on an accelerator every timed call is
    synchronised and at least ACCELERATOR_WARMUP untimed runs come first. Sizes are always measured on the CPU.
    The ComputeProfile records ``compute`` (its ``compute`` field).

    ``device_fingerprint`` labels the ComputeProfile (default: host_fingerprint(compute); pass
    device_fingerprint(device, compute) when timing through an emulated device's runner). ``progress(fraction,
    message)`` is called after every unit of every pass. Raises BatchSizeError for a missing or invalid grid,
    ConfigError for a bad spec or repeats/warmup, UnitProfilingError when a unit fails to run.
    """
    grid = validate_batch_sizes(batch_sizes)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be an integer >= 1, not {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"warmup must be an integer >= 0, not {warmup!r}")
    started = time.perf_counter()
    model = build_model(spec).train()
    seq = layer_sequence(model)
    stages = [seq.build_stage(i, i + 1) for i in range(len(seq))]
    names = [u.name for u in seq.units]
    total_steps = len(stages) * (1 + len(grid))  # the size pass, then one timing pass per batch size
    done = 0

    def step(message: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done / total_steps, message)

    on = compute if compute is not None else torch.device("cpu")
    accelerated = on if is_accelerator(on) else None
    if accelerated is not None:
        warmup = max(warmup, ACCELERATOR_WARMUP)
    log.info("profiling %s on %s: %d units, batch sizes %s, %d repeats", spec.name, describe(on), len(stages), grid,
             repeats)
    sizes = size_pass(spec, stages, names, step)
    stages = [stage.to(on) for stage in stages]
    whole = seq.build_stage(0, len(seq)).to(on)  # every unit in one stage, as a worker builds its stage
    inputs = [example_input(spec, b).to(on) for b in grid]
    rows = [(whole, inputs), *_halves(spec.name, seq, inputs)]
    forward_s: list[list[float]] = [[] for _ in stages]
    backward_s: list[list[float]] = [[] for _ in stages]
    inference_s: list[list[float]] = [[] for _ in stages]
    gen = torch.Generator().manual_seed(0)  # on the CPU: the same gradients whatever device times them
    cold = (0.0, 0.0, 0.0)
    chain: list[list[list[Triple]]] = [[] for _ in grid]
    failed: set[int] = set()  # batch sizes whose units in a row could not run
    rounds_after = _round_points(len(grid), CHAIN_ROUNDS)
    for p, (b, x) in enumerate(zip(grid, inputs, strict=True)):
        for i, stage in enumerate(stages):
            try:
                x_in = _stage_input(x)
                fwd, bwd, x = _time_unit(stage, x_in, runner, repeats, warmup, gen, accelerated)
                inference_s[i].append(_inference_time(stage, x_in, runner, repeats, warmup, accelerated))
            except Exception as exc:
                message = f"unit {i} ({names[i]}) of {spec.name} failed at batch size {b}: {exc}"
                raise UnitProfilingError(message) from exc
            forward_s[i].append(fwd)
            backward_s[i].append(bwd)
            step(f"unit {i + 1}/{len(stages)} ({names[i]}) at batch size {b}")
        for _ in range(rounds_after[p]):
            _chain_round(spec.name, rows, grid, chain, failed, runner, max(warmup, CHAIN_WARMUP), gen, accelerated)
    if chain[0] and 0 not in failed:
        # Once, at the smallest batch size, where the run-to-run noise is smallest beside the cost measured, and only
        # where the units in a row fit.
        cold = _cold_calls(whole, inputs[0], runner, COLD_PAIRS, gen, accelerated)
    factors = []
    for j, runs in enumerate(chain):
        # A batch size whose units in a row did not fit keeps its units' own timings, unscaled, at every extent.
        factors.append(ChainFactors(whole=(1.0, 1.0, 1.0), half=(1.0, 1.0, 1.0)) if j in failed or not runs else
                       _chain_factors(runs, [forward_s, backward_s, inference_s], j))
        for table, factor in zip((forward_s, backward_s, inference_s), factors[j].whole, strict=True):
            for row in table:
                row[j] *= factor

    units = [
        UnitProfile(index=i, name=u.name, ops=u.ops, **sizes[i])
        for i, u in enumerate(seq.units)
    ]
    fingerprint = model_fingerprint(spec)
    model_profile = ModelProfile(model=spec, fingerprint=fingerprint,
                                 input_bytes_per_sample=_nbytes(example_input(spec, 1)), units=units)
    timings = ComputeProfile(model_fingerprint=fingerprint,
                             device_fingerprint=device_fingerprint or host_fingerprint(on),
                             batch_sizes=grid, forward_s=forward_s, backward_s=backward_s, inference_s=inference_s,
                             method="measured", compute=describe(on), cold_forward_s=cold[0],
                             cold_backward_s=cold[1], cold_inference_s=cold[2], chain=factors)
    log.info("profiled %s in %.1f s", spec.name, time.perf_counter() - started)
    return model_profile, timings


def _time_unit(stage: nn.Module, x: torch.Tensor, runner: Runner[Any] | None, repeats: int, warmup: int,
               gen: torch.Generator, accelerated: torch.device | None = None,
               idle_s: float = 0.0) -> tuple[float, float, torch.Tensor]:
    """Median forward and backward seconds of one unit on input ``x`` (on the unit's device; ``accelerated`` when
    that is an accelerator, to synchronise with), each timed call after the device idled ``idle_s`` seconds, and
    its output (detached). Each forward is followed by its
    backward, as a stage worker runs them, so the allocator reuses what the backward freed: forwards timed back to
    back, each dropping its graph unused, took 1.3x to 1.6x as long as a worker's on MobileNetV2 at batch 8 and 16
    on this project's VM, and not every time (the allocator's state decided)."""
    out = stage(x)
    recorded = out.detach()
    if not out.requires_grad:
        # Nothing to differentiate (no parameters and an integer input): backward costs nothing.
        return _median_time(lambda: stage(x), runner, repeats, warmup, accelerated, idle_s), 0.0, recorded
    grad_out = torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)
    del out
    held: list[torch.Tensor] = []
    forward, backward = [], []
    for r in range(warmup + repeats):
        # Warm-up runs skip the runner: on an emulated device its sleeps would only waste time.
        through, idle = (runner, idle_s) if r >= warmup else (None, 0.0)
        f = _timed(lambda: held.append(stage(x)), through, accelerated, idle)
        b = _timed(lambda: torch.autograd.backward(held.pop(), grad_out), through, accelerated, idle)
        _clear_grads(stage, x)
        if r >= warmup:
            forward.append(f)
            backward.append(b)
    return statistics.median(forward), statistics.median(backward), recorded


def _round_points(passes: int, rounds: int) -> list[int]:
    """How many rounds of the units in a row follow each of ``passes`` passes: ``rounds`` in all, spread evenly, the
    last after the last pass ([1, 1, 1, 1, 1] for 5 and 5; [2, 3] for 2 and 5; after passes 1, 3, 5, 7 and 9 for
    10 and 5)."""
    points = [0] * passes
    for r in range(rounds):
        points[max(0, math.ceil((r + 1) * passes / rounds) - 1)] += 1
    return points


def _halves(model: str, seq: LayerSequence,
            inputs: list[torch.Tensor]) -> list[tuple[nn.Module, list[torch.Tensor]]]:
    """The model's two halves (by units) as stages on the device ``inputs`` are on, each with its input at every
    batch size of ``inputs``: none for a model of one unit, or where the first half cannot run at every batch size
    (memory), so that a stage of the model is priced as the whole model is."""
    if len(seq) < 2:
        return []
    mid = len(seq) // 2
    on = inputs[0].device
    head = seq.build_stage(0, mid).to(on)
    try:
        with torch.no_grad():
            middle = [head(x).detach() for x in inputs]
    except (RuntimeError, MemoryError) as exc:
        log.warning("%s's first half could not run (%s): its stages are priced as the whole model", model,
                    str(exc)[:200])
        return []
    return [(head, inputs), (seq.build_stage(mid, len(seq)).to(on), middle)]


def _chain_round(model: str, rows: list[tuple[nn.Module, list[torch.Tensor]]], grid: list[int],
                 times: list[list[list[Triple]]], failed: set[int], runner: Runner[Any] | None, warmup: int,
                 gen: torch.Generator, accelerated: torch.device | None) -> None:
    """Time each stage of ``rows`` (the whole model, then its halves where it has two units or more; each with its
    input at every batch size of ``grid``) once at each batch size, after ``warmup`` untimed runs: forward and
    backward in turns (``_time_unit``), then the inference forward; the round's triples are appended to ``times`` at
    the batch size's index. A batch size whose run fails for memory is added to ``failed`` and not timed again:
    every unit ran alone, so the whole model's activations at once are what failed (a device whose memory a plan
    would split the model for)."""
    for j, b in enumerate(grid):
        if j in failed:
            continue
        try:
            measured = []
            for stage, inputs in rows:
                # Each after its own warm-up: timed right after the whole model, without one, MobileNetV2's halves
                # took 4-7% (training) and 5-10% (served) longer than with one, the caches in the state the whole
                # left them.
                x_in = _stage_input(inputs[j])
                fwd, bwd, _ = _time_unit(stage, x_in, runner, 1, warmup, gen, accelerated)
                measured.append((fwd, bwd, _inference_time(stage, x_in, runner, 1, warmup, accelerated)))
            times[j].append(measured)
        except (RuntimeError, MemoryError) as exc:
            log.warning("%s's units in a row could not run at batch size %d (%s): their timings are left as each "
                        "unit's alone", model, b, str(exc)[:200])
            failed.add(j)


def _chain_factors(runs: list[list[Triple]], tables: list[list[list[float]]], column: int) -> ChainFactors:
    """The forward, backward and inference forward of the units in a row over the sums of their units' timings at
    batch-size index ``column`` in ``tables`` (forward, backward, inference), each clipped to CHAIN_BOUNDS: of the
    whole model (the median over ``runs``, the rounds of ``_chain_round``, of each round's first triple) and of its
    halves (the median of the sum of the others; the whole's where there are none). A unit timed alone in a loop
    keeps its weights and activations in the caches; run in a row, as a stage runs its units, the units evict each
    other's (MobileNetV2 at batch 8, one thread: forward 1.12x, backward 1.09x, served forward 1.14x the sums of its
    units on this VM's CPU). Scaling every unit by the whole's factor keeps the units' proportions, where the cuts
    are chosen; the halves' tell a planner what a shorter stage costs."""
    low, high = CHAIN_BOUNDS

    def factor(measured: list[float], k: int) -> float:
        parts = sum(row[column] for row in tables[k])
        whole = statistics.median(measured)
        return 1.0 if parts <= 0 or whole <= 0 else min(high, max(low, whole / parts))

    def kinds(measured: Callable[[list[Triple], int], float]) -> Triple:
        return (factor([measured(run, 0) for run in runs], 0), factor([measured(run, 1) for run in runs], 1),
                factor([measured(run, 2) for run in runs], 2))

    whole = kinds(lambda run, k: run[0][k])
    half = kinds(lambda run, k: sum(t[k] for t in run[1:])) if len(runs[0]) > 1 else whole
    return ChainFactors(whole=whole, half=half)


def _cold_calls(chain: nn.Module, x: torch.Tensor, runner: Runner[Any] | None, pairs: int, gen: torch.Generator,
                accelerated: torch.device | None) -> tuple[float, float, float]:
    """Seconds a forward, backward and inference forward of ``chain`` on ``x`` take beyond the same call back to back
    when each starts after the device idled COLD_IDLE_S: the median over ``pairs`` of a cold call less the hot call
    timed just before it (at least 0). A stage's every call starts so, and pays this once whatever its units: on
    this project's 2-core VM 1 to 4 ms of CPU a call for the whole MobileNetV2, and an emulated device multiplies it
    by its slow-down. Timed in pairs because the host's speed drifts by more than the cost between two medians a
    second apart: so taken, the whole MobileNetV2's came out 0 to 13 ms on one idle VM within minutes."""
    x_in = _stage_input(x)
    forward, backward, inference = [], [], []
    for _ in range(pairs):
        hot_f, hot_b, _ = _time_unit(chain, x_in, runner, 1, 1, gen, accelerated)
        cold_f, cold_b, _ = _time_unit(chain, x_in, runner, 1, 0, gen, accelerated, COLD_IDLE_S)
        hot_i = _inference_time(chain, x_in, runner, 1, 1, accelerated)
        cold_i = _inference_time(chain, x_in, runner, 1, 0, accelerated, COLD_IDLE_S)
        forward.append(cold_f - hot_f)
        backward.append(cold_b - hot_b)
        inference.append(cold_i - hot_i)
    return max(0.0, statistics.median(forward)), max(0.0, statistics.median(backward)), max(
        0.0, statistics.median(inference))


def _inference_time(stage: nn.Module, x: torch.Tensor, runner: Runner[Any] | None, repeats: int, warmup: int,
                    accelerated: torch.device | None = None, idle_s: float = 0.0) -> float:
    """Median seconds of one unit's forward on ``x`` as a served stage runs it: eval mode, under inference_mode;
    each timed call after the device idled ``idle_s`` seconds."""
    stage.eval()
    try:
        with torch.inference_mode():
            return _median_time(lambda: stage(x), runner, repeats, warmup, accelerated, idle_s)
    finally:
        stage.train()


def size_pass(spec: ModelSpec, stages: list[nn.Module], names: list[str],
              step: Callable[[str], None] = lambda message: None) -> list[dict[str, int | float]]:
    """Per-unit sizes of ``stages`` (one per unit, in order; ``names`` theirs), keyed as UnitProfile's fields:
    output bytes per sample, weight and buffer bytes, forward FLOPs per sample and the saved-activation fit
    (fixed + per-sample bytes through batches 2 and 4). ``step(message)`` is called after every unit."""
    small, large = _SIZE_BATCHES
    x_small, x_large = example_input(spec, small), example_input(spec, large)
    sizes: list[dict[str, int | float]] = []
    for i, stage in enumerate(stages):
        try:
            a, b = _stage_input(x_small), _stage_input(x_large)
            out_small, saved_small = _saved_bytes(stage, a)
            out_large, saved_large = _saved_bytes(stage, b)
            flops = _forward_flops(stage, a)
        except Exception as exc:
            raise UnitProfilingError(f"unit {i} ({names[i]}) of {spec.name} failed to run: {exc}") from exc
        out_bytes = _per_sample(_nbytes(out_small), small, "the output", names[i])
        if _per_sample(_nbytes(out_large), large, "the output", names[i]) != out_bytes:
            raise UnitProfilingError(f"the output of unit {i} ({names[i]}) does not grow linearly with the batch")
        per_sample = max(0, (saved_large - saved_small) // (large - small))
        sizes.append({
            "output_bytes_per_sample": out_bytes,
            "weight_bytes": sum(_nbytes(p) for p in stage.parameters() if p.requires_grad),
            "buffer_bytes": sum(_nbytes(t) for t in stage.buffers()),
            "activation_bytes_per_sample": per_sample,
            "activation_bytes_fixed": saved_small - per_sample * small,
            "flops_per_sample": flops / small,
        })
        x_small, x_large = out_small.detach(), out_large.detach()
        step(f"sized unit {i + 1}/{len(stages)} ({names[i]})")
    return sizes


# --- calibration -----------------------------------------------------------------------------------------


# The calibration step's shape: a batch of 32 16x16 maps of 32 channels, a 3x3 convolution to 64, a Linear to 256.
_BATCH, _IN, _OUT, _SIDE, _KERNEL, _FEATURES = 32, 32, 64, 16, 3, 256
# Seconds of runner timings after which the calibration times the runner no more (it always times it twice).
RATIO_BUDGET_S = 4.0


def _calibration_workload() -> Callable[[], None]:
    """A fixed training step: 3x3 convolution + ReLU + Linear, forward and backward (1.41 GFLOP: tens of
    milliseconds on a laptop-class CPU)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(_IN, _OUT, _KERNEL, padding=1), nn.ReLU(), nn.Flatten(),
                            nn.Linear(_OUT * _SIDE * _SIDE, _FEATURES))
    x = torch.randn((_BATCH, _IN, _SIDE, _SIDE), generator=torch.Generator().manual_seed(0))

    def work() -> None:
        net(x).sum().backward()
        for p in net.parameters():
            p.grad = None

    return work


def measure_speed_ratio(runner: Runner[Any], *, repeats: int = 5, budget_s: float = RATIO_BUDGET_S) -> float:
    """How many times slower ``runner`` runs a fixed calibration workload than this process does natively.

    Interleaves ``repeats`` native and runner timings, each pair after an untimed warm run (the runner's sleep
    leaves caches cold) and in alternating order (the later of two runs in a row is the faster: 2.5% on this
    project's VM, which timed runners 4% fast when they always went second), and returns the fastest runner time
    over the fastest native time:
    the fastest run of each is the one least disturbed by other load on a shared host, where per-pair ratios
    scatter several-fold. Near 1 for a native runner; about the slow-down for an emulated device.
    The runner is timed no more once its timings add up to ``budget_s`` seconds (twice at least): on a device
    hundreds of times slower than the host each of its runs takes seconds, and five of them held a profile request
    up for most of a minute; the native timings, milliseconds each, all run. Raises ConfigError for repeats below
    1."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be an integer >= 1, not {repeats!r}")
    work = _calibration_workload()
    work()
    native: list[float] = []
    through: list[float] = []
    for i in range(repeats):
        work()
        runner_first = i % 2 == 1 and (len(through) < 2 or sum(through) < budget_s)
        if runner_first:
            through.append(_timed(work, runner))
            work()
        native.append(_timed(work, None))
        if not runner_first and (len(through) < 2 or sum(through) < budget_s):
            through.append(_timed(work, runner))
    ratio = min(through) / min(native)
    log.info("speed ratio %.3f (fastest of %d native runs, %.4f s, and of %d through the device, %.4f s)", ratio,
             len(native), min(native), len(through), min(through))
    return ratio


def calibrated_profile(native: ComputeProfile, ratio: float, device_fingerprint: str) -> ComputeProfile:
    """``native``'s times scaled by ``ratio`` (as returned by measure_speed_ratio), labelled with
    ``device_fingerprint``: method "calibrated", speed_ratio = native.speed_ratio * ratio (so ratio for a
    measured native profile). Raises ProfilerError for a ratio that is not a positive finite number."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not math.isfinite(ratio) or ratio <= 0:
        raise ProfilerError(f"speed ratio must be a positive finite number, not {ratio!r}")
    return native.scaled(ratio).model_copy(update={"device_fingerprint": device_fingerprint, "method": "calibrated",
                                                   "speed_ratio": native.speed_ratio * ratio})
