"""``edgeswarm profile``: profile a model on this machine, as a given device class, with no broker.

It runs the same core as the profiler service (edgeswarm.profiling.device) through the same profile
cache, and writes a ClusterProfile with this one device (no links) that ``edgeswarm plan`` can read.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from edgeswarm.cli.console import console, err_console
from edgeswarm.devices.emulation import DeviceProfile
from edgeswarm.errors import ConfigError
from edgeswarm.planning.hpp.memory import memory_breakdown
from edgeswarm.profiling.cache import ProfileCache
from edgeswarm.profiling.device import DeviceProfileResult, run_device_profile
from edgeswarm.settings import Settings
from edgeswarm.values.profiles import ClusterProfile, ComputeProfile, DeviceProfileEntry, ModelSpec, parse_config
from edgeswarm.workloads.commands import report_file

DEFAULT_BATCH_SIZES = "1,2,4,8,16,32"


def add_profile_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register the ``profile`` subcommand on ``sub``."""
    p = sub.add_parser("profile", help="profile a model on this machine as a device class (no broker needed)")
    p.add_argument("--model", required=True, help="a zoo model: mlp, lenet5, resnet18, mobilenetv2, ...")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="a model config value, e.g. num_classes=10 or width=0.5 (repeatable)")
    p.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES,
                   help=f"comma-separated, ascending (default {DEFAULT_BATCH_SIZES})")
    p.add_argument("--method", choices=["calibrated", "measured"], default="calibrated",
                   help="calibrated: time the host once and scale by the device's measured speed; "
                   "measured: time every unit on the device")
    p.add_argument("--device-class", default="native", help="run as this device class (default native)")
    p.add_argument("--no-cache", action="store_true", help="measure even if the profile cache has the figures")
    p.add_argument("--out", type=report_file, default=None,
                   help="write the profile (a ClusterProfile, JSON) to this file")
    p.add_argument("--json", action="store_true", help="print the profile as JSON instead of a table")


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,2,4"`` as [1, 2, 4]; ConfigError for anything that is not comma-separated integers."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"--batch-sizes {text!r} is not a comma-separated list of integers") from None


def run_profile(args: argparse.Namespace) -> int:
    from edgeswarm.devices.compute import resolve_compute, with_accelerator_budget

    settings = Settings(device_class=args.device_class)
    device = DeviceProfile.from_settings(settings)
    compute = resolve_compute(settings.compute, device)  # EDGESWARM_COMPUTE, as the profiler service does
    device = with_accelerator_budget(device, compute, settings.memory_budget_bytes is not None)
    spec = ModelSpec(name=args.model, config=parse_config(args.config))
    cache = None if args.no_cache else ProfileCache(settings.profile_dir)
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=err_console,
                  transient=True, disable=not err_console.is_terminal) as bar:
        task = bar.add_task(f"profiling {spec.name}", total=1.0)

        def progress(fraction: float, message: str) -> None:
            bar.update(task, completed=fraction, description=message[:80])

        result = run_device_profile(spec, device, parse_batch_sizes(args.batch_sizes), cache=cache,
                                    method=args.method, node=settings.node_id, progress=progress,
                                    compute=compute)
    profile = ClusterProfile(model=result.model,
                             devices=[DeviceProfileEntry(device=result.device, compute=result.compute)])
    text = profile.model_dump_json(indent=2)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        print(text)
    else:
        console.print(profile_table(result))
        console.print(summary_line(result))
        console.print(memory_line(result))
        if args.out:
            console.print(f"written to {args.out}")
    return 0


def profile_table(result: DeviceProfileResult) -> Table:
    """One row per unit: sizes, FLOPs and forward / backward milliseconds at each batch size."""
    compute = result.compute
    table = Table(title=f"{result.model.model.name} on {result.device.device_class} ({compute.method}"
                        f"{', from the cache' if result.cache_hit else ''}): forward / backward ms")
    for col in ("#", "unit", "ops", "a_l B/sample", "w_l B", "FLOPs/sample"):
        table.add_column(col, justify="left" if col in ("unit", "ops") else "right")
    for b in compute.batch_sizes:
        table.add_column(f"b={b}", justify="right")
    for unit, fwd, bwd in zip(result.model.units, compute.forward_s, compute.backward_s, strict=True):
        times = [f"{f * 1e3:.3g} / {b * 1e3:.3g}" for f, b in zip(fwd, bwd, strict=True)]
        table.add_row(str(unit.index), unit.name, unit.ops, f"{unit.output_bytes_per_sample:,}",
                      f"{unit.weight_bytes:,}", f"{unit.flops_per_sample:,.0f}", *times)
    return table


def summary_line(result: DeviceProfileResult) -> str:
    """Totals: units, weights, FLOPs, the whole model's step time at the largest batch, FLOP/s, what a cold call
    pays, budget."""
    model, compute, device = result.model, result.compute, result.device
    b = compute.batch_sizes[-1]
    fwd = sum(row[-1] for row in compute.forward_s)
    bwd = sum(row[-1] for row in compute.backward_s)
    served = "" if compute.inference_s is None else (
        f" (served, without autograd: forward {sum(row[-1] for row in compute.inference_s) * 1e3:.2f} ms)")
    weights = sum(u.weight_bytes for u in model.units)
    flops = sum(u.flops_per_sample for u in model.units)
    ratio = f", speed ratio {compute.speed_ratio:.2f}" if compute.method == "calibrated" else ""
    return (f"{model.model.name}: {len(model.units)} units, {weights / 1e6:.2f} MB of weights, "
            f"{flops / 1e6:.2f} MFLOPs per sample forward; at batch {b}: forward {fwd * 1e3:.2f} ms + backward "
            f"{bwd * 1e3:.2f} ms = {device.compute_flops / 1e9:.2f} GFLOP/s training{served} on {device.node} as "
            f"{device.device_class} (computing on {compute.compute}){ratio}; a call after the device idled pays "
            f"{compute.cold_forward_s * 1e3:.2f} ms more (forward), {compute.cold_backward_s * 1e3:.2f} ms "
            f"(backward), {compute.cold_inference_s * 1e3:.2f} ms (served);{_chain_phrase(compute)} "
            f"memory budget {device.memory_budget_bytes / 2**30:.1f} GiB")


def _chain_phrase(compute: ComputeProfile) -> str:
    if compute.chain is None:
        return ""
    last = compute.chain[-1]
    return (f" its units in a row take {last.whole[0]:.2f}x / {last.whole[1]:.2f}x their times alone (forward / "
            f"backward), each half of the model {last.half[0]:.2f}x / {last.half[1]:.2f}x (shorter stages are "
            "priced nearer their units alone);")


def memory_line(result: DeviceProfileResult) -> str:
    """Eq. 3 for the whole model on one device at the largest batch, by kind and for each optimizer."""
    model, b = result.model, result.compute.batch_sizes[-1]
    parts = {opt: memory_breakdown(model, 0, len(model.units), b, 1, opt) for opt in ("sgd", "momentum", "adam")}
    m = parts["sgd"]
    mib = 2**20
    return (f"memory (Eq. 3, whole model, batch {b}, K=1): weights {m.weights_bytes / mib:.1f} + gradients "
            f"{m.gradients_bytes / mib:.1f} + buffers {m.buffers_bytes / mib:.1f} + activations "
            f"{m.activations_bytes / mib:.1f} MiB, plus optimizer state 0 / "
            f"{parts['momentum'].optimizer_bytes / mib:.1f} / {parts['adam'].optimizer_bytes / mib:.1f} MiB "
            f"= {m.total_bytes / mib:.1f} / {parts['momentum'].total_bytes / mib:.1f} / "
            f"{parts['adam'].total_bytes / mib:.1f} MiB with SGD / momentum / Adam")
