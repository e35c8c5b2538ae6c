"""Profile one model on the device this process runs as, through the profile cache.

Two methods (``ComputeProfile.method``):

- ``measured``: every unit's forward and backward pass is timed through ``device.run``, so an emulated
  device's slow-down is in every figure, as a real device's speed would be.
- ``calibrated`` (default, much faster on slow devices): the host is timed natively once (cached
  under the host's fingerprint and shared by every emulated device on it), then scaled by the
  device's speed ratio, measured with ``measure_speed_ratio(device.run)``.

Units are timed on the device's compute device (``compute``: CUDA on a real board with one), which is part of
the fingerprints the cache is keyed by, so a profile measured on the CPU is never reused for CUDA or the other
way round; the profile records it (``ComputeProfile.compute``). The memory budget reported is the device's, which
on CUDA is the accelerator's (``edgeswarm.devices.compute.with_accelerator_budget``).

Nothing here reads the emulation settings (the slow-down factor): the device is only ever *run*
(DESIGN.md principle 7). torch is imported on first use, so importing this module is cheap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from edgeswarm.devices.emulation import DeviceProfile
from edgeswarm.errors import ConfigError, ProfileRequestError
from edgeswarm.profiling.cache import ProfileCache
from edgeswarm.values.limits import MAX_BATCH_GRID, MAX_BATCH_SIZE
from edgeswarm.values.profiles import ComputeProfile, DeviceInfo, ModelProfile, ModelSpec

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Method = Literal["calibrated", "measured"]
# progress(fraction in [0, 1], what is being done)
Progress = Callable[[float, str], None]


@dataclass(frozen=True)
class DeviceProfileResult:
    """What ``run_device_profile`` produced; ``cache_hit`` means nothing was measured."""

    model: ModelProfile
    compute: ComputeProfile
    device: DeviceInfo
    cache_hit: bool


def check_batch_sizes(batch_sizes: Sequence[int]) -> list[int]:
    """``batch_sizes`` if ascending, distinct, in 1..4096 and at most 64 of them; else ProfileRequestError."""
    sizes = list(batch_sizes)
    if not sizes or len(sizes) > MAX_BATCH_GRID:
        raise ProfileRequestError(f"give between 1 and {MAX_BATCH_GRID} batch sizes, not {len(sizes)}")
    if any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_BATCH_SIZE for b in sizes):
        raise ProfileRequestError(f"batch sizes must be integers from 1 to {MAX_BATCH_SIZE}: {sizes}")
    if sizes != sorted(set(sizes)):
        raise ProfileRequestError(f"batch sizes must be ascending and distinct: {sizes}")
    return sizes


def check_model(spec: ModelSpec) -> str:
    """The model's fingerprint; ProfileRequestError for an unknown model or a config it rejects."""
    from edgeswarm.models import zoo

    if spec.name not in zoo.MODEL_NAMES:
        raise ProfileRequestError(f"unknown model {spec.name!r}; available: {', '.join(sorted(zoo.MODEL_NAMES))}")
    try:
        return str(zoo.model_fingerprint(spec))
    except ProfileRequestError:
        raise
    except (ConfigError, ValueError, TypeError, KeyError) as exc:
        raise ProfileRequestError(f"model {spec.name!r} does not accept config {spec.config}: {exc}") from exc


def compute_flops(model: ModelProfile, compute: ComputeProfile) -> float:
    """Training speed in FLOP/s: 3 x forward FLOPs per sample x b over the summed forward + backward
    seconds of every unit at the largest profiled batch size b (backward counted as 2 x forward)."""
    b = compute.batch_sizes[-1]
    seconds = sum(row[-1] for row in compute.forward_s) + sum(row[-1] for row in compute.backward_s)
    flops = 3.0 * sum(u.flops_per_sample for u in model.units) * b
    return flops / seconds if seconds > 0 else 0.0


def run_device_profile(spec: ModelSpec, device: DeviceProfile, batch_sizes: Sequence[int], *,
                       cache: ProfileCache | None, method: Method = "calibrated", node: str = "local",
                       progress: Progress | None = None, repeats: int = 3, warmup: int = 1,
                       ratio_repeats: int = 5, compute: torch.device | None = None) -> DeviceProfileResult:
    """Profile ``spec`` on ``device`` (named ``node`` in the result) at ``batch_sizes``, its units timed on
    ``compute`` (the torch device it computes on; default the CPU).

    Cached figures are used when the cache has them for this model, device and method at every
    requested batch size; whatever is measured is stored. ``repeats`` and ``warmup`` are the timed and
    untimed runs per unit and batch size; ``ratio_repeats`` the runs of the speed-ratio benchmark.
    Raises ProfileRequestError for an unknown model, a bad config or bad batch sizes; whatever
    ``progress`` raises aborts the profiling (a way to cancel it).
    """
    from edgeswarm.profiling import compute as timing

    sizes = check_batch_sizes(batch_sizes)
    if method not in ("calibrated", "measured"):
        raise ProfileRequestError(f"method must be 'calibrated' or 'measured', not {method!r}")
    mfp = check_model(spec)
    report = progress or (lambda _f, _m: None)
    # Emulated devices compute on one thread (DeviceProfile.compute_threads), so they are timed on one too.
    with timing.torch_threads(device.compute_threads):
        return _profile(spec, mfp, device, sizes, cache=cache, method=method, node=node, report=report,
                        repeats=repeats, warmup=warmup, ratio_repeats=ratio_repeats, compute=compute)


def _profile(spec: ModelSpec, mfp: str, device: DeviceProfile, sizes: list[int], *, cache: ProfileCache | None,
             method: Method, node: str, report: Progress, repeats: int, warmup: int,
             ratio_repeats: int, compute: torch.device | None) -> DeviceProfileResult:
    from edgeswarm.profiling import compute as timing

    dfp = timing.device_fingerprint(device, compute)

    model = cache.model(mfp) if cache else None
    cached = cache.compute(mfp, dfp, method, sizes) if cache else None
    if model is not None and cached is not None:
        report(1.0, f"{spec.name} on {device.device_class}: cached ({method})")
        return DeviceProfileResult(model, cached, _device_info(node, device, dfp, model, cached), True)

    if method == "measured":
        report(0.0, f"timing every unit of {spec.name} on {device.device_class}")
        model, timings = timing.profile_model(spec, sizes, runner=device.run, repeats=repeats, warmup=warmup,
                                              device_fingerprint=dfp, progress=_scaled(report, 0.0, 1.0),
                                              compute=compute)
    else:
        hfp = timing.host_fingerprint(compute)
        native = cache.compute(mfp, hfp, "measured", sizes) if cache else None
        if model is None or native is None:
            report(0.0, f"timing every unit of {spec.name} natively (once per host)")
            model, native = timing.profile_model(spec, sizes, repeats=repeats, warmup=warmup,
                                                 device_fingerprint=hfp, progress=_scaled(report, 0.0, 0.8),
                                                 compute=compute)
            _store(cache, model, native)
        report(0.8, f"measuring the speed of {device.device_class} against the host")
        # On the CPU, where an emulated slow-down acts (an accelerator's device is never emulated: about 1).
        ratio = timing.measure_speed_ratio(device.run, repeats=ratio_repeats)
        timings = timing.calibrated_profile(native, ratio, dfp)
        log.info("%s on %s: speed ratio %.2f against the host", spec.name, device.device_class, ratio)
    _store(cache, model, timings)
    report(1.0, f"{spec.name} on {device.device_class}: profiled ({method})")
    return DeviceProfileResult(model, timings, _device_info(node, device, dfp, model, timings), False)


def _device_info(node: str, device: DeviceProfile, fingerprint: str, model: ModelProfile,
                 compute: ComputeProfile) -> DeviceInfo:
    return DeviceInfo(node=node, device_class=device.device_class, fingerprint=fingerprint,
                      memory_budget_bytes=device.memory_budget_bytes, compute_flops=compute_flops(model, compute))


def _store(cache: ProfileCache | None, model: ModelProfile, compute: ComputeProfile) -> None:
    if cache is None:
        return
    try:
        cache.put_model(model)
        cache.put_compute(compute)
    except OSError as exc:
        log.warning("could not write the profile cache in %s (%s); the profile is used but not kept",
                    cache.directory, exc)


def _scaled(report: Progress, start: float, end: float) -> Callable[..., None]:
    """A progress callback for the timing core that maps its [0, 1] onto [start, end]."""

    def forward(fraction: float, message: str = "") -> None:
        report(start + (end - start) * min(1.0, max(0.0, float(fraction))), message)

    return forward
