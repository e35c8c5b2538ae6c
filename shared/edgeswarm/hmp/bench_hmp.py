"""What ``edgeswarm bench hmp`` measures (its command is ``hmp.bench``): Galaxy's tensor-parallel serving against
Megatron-TP, SP and Local, measured on the tensor-shard-workers of emulated Galaxy environments (spec section 5,
acceptance checks C-L1 to C-L7).

Every figure comes from serve-hmp jobs on a local cluster (started by the command line's ``StartCluster``): the
cluster file's devices (Nano-L, -M, -S: the compute of each phase stretched by its class's slow-down) and its links
shaped in the bus at the bandwidth of the run. On one cluster the modes run one job after the other, each with a
warm-up request and then ``requests`` prefill-only requests (a decoder's ``max_new_tokens`` 0), one at a time; a job
whose planning fails is recorded with its reason (OOM, infeasible). For each run the report keeps the median latency
on the coordinator (arrival to answer), the plan's prediction, and the per-layer time split of the slowest rank
(compute, sync, waiting). Sections: the environments (Env A-F at 125 Mbps), a bandwidth sweep on one environment,
strong and weak scaling of one layer on 1-4 Nano-M at 1000 Mbps, overlap on against off, and generation (time per
output token and the network's share of it) against equal-split TP. The paper's shapes are kept, with few layers
(``layers``), as the paper's scaling runs load one: the planner's full-model memory verdicts are reported beside
them.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from edgeswarm.bus import Bus
from edgeswarm.devices.cluster import ClusterSpec, NetworkDefaults, load_cluster
from edgeswarm.errors import EdgeswarmError
from edgeswarm.hmp.client import ask
from edgeswarm.hmp.spec import HmpProgress
from edgeswarm.planning.hmp.plan import prefill_s
from edgeswarm.planning.hmp.types import HmpPlan
from edgeswarm.profiling.host_load import HostLoad, busy_text
from edgeswarm.profiling.verdict import Cell
from edgeswarm.values.text_model import PRESETS
from edgeswarm.workloads.client import JobFollower, cancel_job, submit_job

if TYPE_CHECKING:
    from edgeswarm.workloads.commands import StartCluster

MODES = ("galaxy", "megatron", "sp", "local")
ENVS = ("a", "b", "c", "d", "e", "f")
SECTIONS = ("envs", "bandwidth", "scaling", "overlap", "generation", "trace")
LATENCY_MS = 0.5  # the Galaxy cluster files' one-way link latency
DEADLINE_S = 60.0  # a slice's re-request deadline: far above an emulated Nano's slowest phase
Log = Callable[[str], None]


class HmpRun(BaseModel):
    """One serve-hmp job measured: where (``section``, ``env``, ``bandwidth_mbps``), what (``model`` with ``layers``
    layers at ``seq_len`` tokens, ``mode``, ``overlap``: tiling allowed), the plan (devices, heads, columns, whether it
    ``tiled``, predicted seconds per request and per layer), and the measurements in seconds (medians over
    ``requests``): ``latency_s`` on the coordinator, the per-layer split of the slowest rank in milliseconds (the
    embeddings and head are in it, spread over the layers), and for generation the time to first token and per output
    token; ``host_busy``, the fraction of the host's core time busy over the measured requests
    (``profiling.host_load``).
    ``error``: why the job did not serve (its planning's reason: OOM, infeasible) or why requests failed."""

    section: str
    env: str
    bandwidth_mbps: float
    model: str
    layers: int
    seq_len: int
    mode: str
    overlap: bool = True
    prune: bool = True
    devices: list[str] = []
    heads: list[int] = []
    columns: list[int] = []
    tiled: bool = False
    left_out: list[str] = []
    predicted_s: float | None = None
    predicted_layer_s: float | None = None
    predicted_compute_s: float | None = None
    predicted_comm_s: float | None = None
    predicted_exposed_s: float | None = None
    tau_s: float | None = None
    message_s: float | None = None
    link_mbps: float | None = None
    predicted_tpot_s: float | None = None
    predicted_network_share: float | None = None
    refitted_s: float | None = None
    latency_s: float | None = None
    latencies_s: list[float] = []
    compute_ms: float | None = None
    sync_ms: float | None = None
    waiting_ms: float | None = None
    new_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    requests: int = 0
    answers: list[list[int]] = []  # the tokens each measured request generated
    host_busy: float | None = None
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        """Measured over predicted latency (the prefill; its logits only where a request generates a token)."""
        if self.latency_s is None or not self.predicted_s:
            return None
        return self.latency_s / self.predicted_s

    @property
    def refitted_ratio(self) -> float | None:
        """Measured over the closed loop's refitted latency (the plan priced on each rank's measured arithmetic)."""
        if self.latency_s is None or not self.refitted_s:
            return None
        return self.latency_s / self.refitted_s

    def cell(self) -> Cell | None:
        """This run as a cell of the benchmark's verdict (``profiling.verdict``); None when it did not serve."""
        if self.ratio is None:
            return None
        return Cell(name=f"Env {self.env.upper()} {self.bandwidth_mbps:g} Mbps {self.model} {self.mode} on "
                         f"{len(self.devices)}", ratio=self.ratio, refitted_ratio=self.refitted_ratio,
                    host_busy=self.host_busy)

    @property
    def layer_ratio(self) -> float | None:
        """The measured per-layer time of the slowest rank (compute + sync + waiting) over the predicted one."""
        if self.compute_ms is None or not self.predicted_layer_s:
            return None
        return (self.compute_ms + (self.sync_ms or 0) + (self.waiting_ms or 0)) / 1000 / self.predicted_layer_s

    @property
    def network_share(self) -> float | None:
        """(sync + waiting) over the per-layer total of the slowest rank."""
        if self.compute_ms is None:
            return None
        total = self.compute_ms + (self.sync_ms or 0) + (self.waiting_ms or 0)
        return ((self.sync_ms or 0) + (self.waiting_ms or 0)) / total if total > 0 else None


class Verdict(BaseModel):
    """The planner's verdict on the full model (every layer, paper memory model) on an environment's device
    classes: ``mode`` fits (its predicted seconds) or not (``reason``)."""

    env: str
    model: str
    mode: str
    fits: bool
    predicted_s: float | None = None
    reason: str = ""


def cluster_at(env: str, bandwidth_mbps: float, devices: int | None = None) -> ClusterSpec:
    """Galaxy's Env ``env`` (a-f) with every link at ``bandwidth_mbps``, optionally only its first ``devices``."""
    base = load_cluster(f"galaxy-env-{env}-125mbps")
    kept = base.devices[:devices] if devices else base.devices
    return ClusterSpec(name=f"{base.name.rsplit('-', 1)[0]}-{bandwidth_mbps:g}mbps",
                       description=base.description, devices=kept,
                       network=NetworkDefaults(bandwidth_mbps=bandwidth_mbps, latency_ms=LATENCY_MS))


def prompts_of(model: str, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids of ``model``'s vocabulary (latency depends only on the
    length: spec 5.1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    vocab = PRESETS[model].vocab
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(count)]


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _link_mbps(plan: HmpPlan, hidden: int, dtype_bytes: int) -> float | None:
    """The ring's bandwidth the plan priced its steps at (Mbps), from tau = message + latency + payload / bandwidth
    (one step carries the largest row slice); None for one device."""
    devices = len(plan.shares.devices)
    rows = -(-plan.seq_len // devices) if devices > 1 else 0
    left = plan.comm.tau_s - plan.comm.message_s - LATENCY_MS / 1000
    if rows <= 0 or left <= 0:
        return None
    return rows * hidden * dtype_bytes * 8 / left / 1e6


def _progress_after(follower: JobFollower, answered: int, wait_s: float = 3.0) -> HmpProgress | None:
    """The job's progress once it counts ``answered`` requests (it is published every second or so); the latest
    within ``wait_s`` seconds otherwise, None when it has none."""
    deadline = time.monotonic() + wait_s
    while True:
        state = follower.state
        progress = state.progress if state is not None and isinstance(state.progress, HmpProgress) else None
        if (progress is not None and progress.answered >= answered) or time.monotonic() >= deadline:
            return progress
        time.sleep(0.1)


def serve_and_measure(bus: Bus, *, section: str, env: str, bandwidth_mbps: float, model: str, layers: int,
                      seq_len: int, mode: str, overlap: bool = True, prune: bool = True, exclude: tuple[str, ...] = (),
                      requests: int = 3, new_tokens: int = 0, log: Log = lambda _m: None) -> HmpRun:
    """Submit one serve-hmp job, wait until it serves (or fails: its reason is the run's error), send a warm-up
    and then ``requests`` prompts of ``seq_len`` tokens one at a time (``new_tokens`` generated each), cancel it,
    and return the run. ``exclude``: devices the plan must leave out."""
    row = HmpRun(section=section, env=env, bandwidth_mbps=bandwidth_mbps, model=model, layers=layers,
                 seq_len=seq_len, mode=mode, overlap=overlap, prune=prune, new_tokens=new_tokens)
    name = f"bench-hmp-{mode}-{uuid.uuid4().hex[:6]}"
    spec = {"kind": "serve-hmp", "name": name, "model": {"preset": model, "layers": layers, "seed": 0},
            "mode": mode, "overlap": overlap, "seq_len": seq_len, "max_tokens": seq_len + new_tokens + 1,
            "max_new_tokens": new_tokens, "deadline_s": DEADLINE_S,
            "planner": {"prune": prune, "exclude": list(exclude)}}
    follower = JobFollower(bus, name)
    submit_job(bus, json.dumps(spec), submission=follower.submission)
    try:
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline and (follower.state is None or follower.state.status not in (
                "running", "failed", "cancelled")):
            time.sleep(0.2)
        state = follower.state
        if state is None or state.status != "running" or not isinstance(state.plan, HmpPlan):
            detail = f"{state.status}: {state.detail}" if state is not None else "no job state"
            return row.model_copy(update={"error": detail})
        plan = state.plan
        row = row.model_copy(update={
            "devices": plan.shares.devices, "heads": plan.shares.heads, "columns": plan.shares.columns,
            "tiled": plan.shares.overlap, "left_out": plan.left_out,
            "predicted_s": prefill_s(plan, new_tokens), "predicted_layer_s": plan.layer.total_s,
            "predicted_compute_s": plan.layer.compute_s, "predicted_comm_s": plan.layer.comm_s,
            "predicted_exposed_s": plan.layer.exposed_s,
            "tau_s": plan.comm.tau_s, "message_s": plan.comm.message_s,
            "link_mbps": _link_mbps(plan, PRESETS[model].hidden, PRESETS[model].dtype_bytes),
            "predicted_tpot_s": plan.decode.per_token_s if plan.decode is not None else None,
            "predicted_network_share": plan.decode.network_share if plan.decode is not None else None})
        prompts = prompts_of(model, requests + 1, seq_len, seed=len(section))
        timeout = max(120.0, 20 * plan.model.total_s * max(1, new_tokens))
        answers = ask(bus, name, prompts[:1], max_new_tokens=new_tokens, window=1, timeout_s=timeout)  # warm-up
        with HostLoad() as host:
            answers += ask(bus, name, prompts[1:], max_new_tokens=new_tokens, window=1, timeout_s=timeout)
        failed = [a for a in answers if a.reply is None]
        if failed:
            return row.model_copy(update={"error": f"{len(failed)} requests failed: {failed[0].reason}: "
                                                   f"{failed[0].error}"})
        measured = [a.reply for a in answers[1:] if a.reply is not None]
        splits = [r.split for r in measured if r.split is not None]
        progress = _progress_after(follower, len(answers))
        row = row.model_copy(update={
            "refitted_s": progress.refitted_latency_s if progress is not None else None,
            "requests": len(measured), "latencies_s": [r.latency_s for r in measured],
            "answers": [r.tokens for r in measured],
            "latency_s": _median([r.latency_s for r in measured]),
            "compute_ms": _median([s.compute_ms for s in splits]), "sync_ms": _median([s.sync_ms for s in splits]),
            "waiting_ms": _median([s.waiting_ms for s in splits]),
            "ttft_s": _median([r.ttft_s for r in measured]),
            "tpot_s": _median([r.tpot_s for r in measured if r.tpot_s is not None]), "host_busy": host.busy})
        # Beside the prefill's prediction, the time to the first token where a request generates more.
        first, what = (row.ttft_s, "first token") if new_tokens and row.ttft_s else (row.latency_s, "request")
        log(f"{section}: env {env.upper()} {bandwidth_mbps:g} Mbps {model} x{layers} s={seq_len} {mode}"
            f"{'' if overlap else ' (no overlap)'} on {len(row.devices)}: {what} {first * 1000:.0f} ms measured, "
            f"{(row.predicted_s or 0) * 1000:.0f} ms predicted; per layer compute {row.compute_ms or 0:.0f}, sync "
            f"{row.sync_ms or 0:.0f}, waiting {row.waiting_ms or 0:.0f} ms"
            + (f"; TPOT {row.tpot_s * 1000:.0f} ms measured, {(row.predicted_tpot_s or 0) * 1000:.0f} ms predicted"
               if row.tpot_s else "") + f"; {busy_text(row.host_busy)}")
        return row
    finally:
        try:
            cancel_job(bus, name)
            follower.wait(60)
        except EdgeswarmError:
            pass  # it had already ended (a job whose planning failed): its reason is the run's error


def full_model_verdicts(env: str, model: str, seq_len: int) -> list[Verdict]:
    """The planner's verdict per mode on the whole ``model`` (every layer) on Env ``env``'s device classes with
    the paper's memory model in float16, as its Table I footprints (spec C-M2): which modes run out of memory."""
    from edgeswarm.planning.hmp.plan import compare
    from edgeswarm.planning.hmp.synthetic import synthetic_cluster
    from edgeswarm.planning.hmp.types import HmpOptions

    cfg = PRESETS[model].model_copy(update={"dtype": "float16"})
    cluster = synthetic_cluster(cluster_at(env, 125), cfg, seq_len, model)
    comparison = compare(cluster, HmpOptions(paper=True))
    return [Verdict(env=env, model=model, mode=v.mode, fits=v.plan is not None,
                    predicted_s=v.plan.model.total_s if v.plan is not None else None, reason=v.reason)
            for v in comparison.verdicts]


class HmpBenchConfig(BaseModel):
    """What ``run_hmp_bench`` runs: ``sections`` of envs, bandwidth, scaling, overlap, generation, trace."""

    sections: list[str] = ["envs", "overlap", "trace"]
    envs: list[str] = ["a", "f"]
    models: list[str] = ["distilbert", "gpt2-large"]
    layers: int = 1
    seq_len: int = 284
    requests: int = 3
    modes: list[str] = list(MODES)
    bandwidth_env: str = "b"
    bandwidth_model: str = "distilbert"
    bandwidths: list[float] = [125, 250, 500, 1000]
    scaling_model: str = "gpt2-large"
    scaling_devices: int = 4
    scaling_seq_len: int = 384
    weak_tokens: int = 96
    overlap_env: str = "a"
    generation_envs: list[str] = ["c", "b", "f"]
    generation_model: str = "gpt2-large"
    generation_layers: int = 2
    generation_prompt: int = 32
    generation_tokens: int = 8
    netns: bool = False  # every cluster in network namespaces, its links shaped by the kernel


class HmpReport(BaseModel):
    """Every run, the full-model verdicts, and where the trace went."""

    config: HmpBenchConfig
    runs: list[HmpRun] = []
    verdicts: list[Verdict] = []
    trace: str | None = None
    trace_overlaps: int | None = None


def _on_cluster(report: HmpReport, spec: ClusterSpec, env: str, bandwidth: float, jobs: list[dict[str, object]],
                save: Callable[[], None], log: Log, cluster: StartCluster) -> None:
    log(f"starting {spec.name} ({len(spec.devices)} devices)")
    try:
        # Every mode served on the plan its profiles give (no closed-loop re-plan), the loop's refitted latency beside.
        with cluster(spec, extra_env={"EDGESWARM_REBALANCE": "false"}) as (_running, bus):
            for job in jobs:
                try:
                    run = serve_and_measure(bus, env=env, bandwidth_mbps=bandwidth, log=log, **job)  # type: ignore
                except EdgeswarmError as exc:
                    run = HmpRun(env=env, bandwidth_mbps=bandwidth, error=str(exc), **job)  # type: ignore[arg-type]
                if run.error:
                    log(f"{run.section}: env {env.upper()} {run.model} {run.mode}: {run.error[:200]}")
                report.runs.append(run)
                save()
                if run.mode == "galaxy" and run.prune and run.left_out and not run.error:
                    # The planner left devices out on its prediction: the paper's Galaxy, on every device, beside it.
                    every = {**job, "prune": False}
                    report.runs.append(serve_and_measure(bus, env=env, bandwidth_mbps=bandwidth, log=log,
                                                         **every))  # type: ignore[arg-type]
                    save()
    except EdgeswarmError as exc:
        log(f"{spec.name}: {exc}")
        for job in jobs:
            report.runs.append(HmpRun(env=env, bandwidth_mbps=bandwidth, error=str(exc), **job))  # type: ignore
        save()


def run_hmp_bench(config: HmpBenchConfig, cluster: StartCluster, *, trace_path: Path | None = None,
                  json_path: Path | None = None, log: Log = lambda _m: None) -> HmpReport:
    """Run ``config``'s sections, each cluster started with ``cluster``; the report is written to ``json_path`` after
    every run (a long run interrupted keeps what it measured)."""
    report = HmpReport(config=config)
    c = config
    if c.netns:
        cluster = partial(cluster, netns=True)

    def save() -> None:
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(report_json(report), indent=1))

    def job(section: str, model: str, layers: int, seq_len: int, mode: str, **extra: object) -> dict[str, object]:
        return {"section": section, "model": model, "layers": layers, "seq_len": seq_len, "mode": mode,
                "requests": c.requests, **extra}

    overlap_jobs = [job("overlap", m, c.layers, c.seq_len, "galaxy", overlap=False, prune=False) for m in c.models]
    if "envs" in c.sections:
        for env in c.envs:
            for model in c.models:
                report.verdicts += full_model_verdicts(env, model, c.seq_len)
            jobs = [job("envs", m, c.layers, c.seq_len, mode) for m in c.models for mode in c.modes]
            if "overlap" in c.sections and env == c.overlap_env:
                jobs += overlap_jobs  # against the envs section's Galaxy runs on the same cluster
            _on_cluster(report, cluster_at(env, 125), env, 125, jobs, save, log, cluster)
    if "overlap" in c.sections and ("envs" not in c.sections or c.overlap_env not in c.envs):
        jobs = [job("envs", m, c.layers, c.seq_len, "galaxy") for m in c.models] + overlap_jobs
        _on_cluster(report, cluster_at(c.overlap_env, 125), c.overlap_env, 125, jobs, save, log, cluster)
    if "bandwidth" in c.sections:
        for bw in c.bandwidths:
            jobs = [job("bandwidth", c.bandwidth_model, c.layers, c.seq_len, mode) for mode in c.modes
                    if mode != "local" or bw == c.bandwidths[0]]  # Local does not use the network
            _on_cluster(report, cluster_at(c.bandwidth_env, bw), c.bandwidth_env, bw, jobs, save, log, cluster)
    if "scaling" in c.sections:
        # A cluster of n Nano-M at 1000 Mbps for each n (planner.exclude cannot narrow one cluster: the
        # coordinator removes the excluded devices before planning and the planner then refuses to exclude them).
        for n in range(1, c.scaling_devices + 1):
            mode = "local" if n == 1 else "galaxy"
            jobs = [job("strong", c.scaling_model, 1, c.scaling_seq_len, mode, prune=False),
                    job("weak", c.scaling_model, 1, c.weak_tokens * n, mode, prune=False)]
            _on_cluster(report, cluster_at("c", 1000, n), "c", 1000, jobs, save, log, cluster)
    if "generation" in c.sections:
        for env in c.generation_envs:
            jobs = [job("generation", c.generation_model, c.generation_layers, c.generation_prompt, mode,
                        new_tokens=c.generation_tokens, prune=False) for mode in ("galaxy", "megatron")]
            # one-token passes: a decoding step's per-layer split without the KV cache's attention
            jobs += [job("token-pass", c.generation_model, c.generation_layers, 1, mode, prune=False)
                     for mode in ("galaxy", "megatron")]
            _on_cluster(report, cluster_at(env, 1000), env, 1000, jobs, save, log, cluster)
    if "trace" in c.sections and trace_path is not None:
        from edgeswarm.hmp.bench_trace import loopback_trace

        report.trace_overlaps = loopback_trace(trace_path, model=c.scaling_model, seq_len=c.seq_len,
                                               bandwidth_mbps=125, devices=3)
        report.trace = str(trace_path)
        log(f"trace: {trace_path} ({report.trace_overlaps} comm spans overlap a GEMM span)")
    save()
    return report


def report_json(report: HmpReport) -> dict[str, object]:
    """The report as JSON, each run with its derived ratios."""
    out = report.model_dump(mode="json")
    out["runs"] = [r.model_dump(mode="json") | {"ratio": r.ratio, "layer_ratio": r.layer_ratio,
                                                "network_share": r.network_share} for r in report.runs]
    return out


def galaxy_of(runs: list[HmpRun], section: str, env: str, bandwidth: float, model: str,
              all_devices: bool = False) -> HmpRun | None:
    """Galaxy's run in that cell (overlap on): as planned (devices left out where the plan predicts they do not
    pay), or with ``all_devices`` the run on every device (the planned one where it left none out)."""
    same = [r for r in runs if (r.section, r.env, r.bandwidth_mbps, r.model, r.mode) == (
        section, env, bandwidth, model, "galaxy") and r.overlap]
    planned = next((r for r in same if r.prune), None)
    if not all_devices:
        return planned or next(iter(same), None)
    every = next((r for r in same if not r.prune), None)
    return every or (planned if planned is not None and not planned.left_out else None)


def speedups(runs: list[HmpRun], all_devices: bool = False) -> dict[tuple[str, str, float, str],
                                                                      dict[str, float | None]]:
    """Per (section, env, bandwidth, model): Galaxy's speedup over each baseline measured in the same section
    (baseline latency over Galaxy's; None where either did not serve); ``all_devices``: see ``galaxy_of``."""
    out: dict[tuple[str, str, float, str], dict[str, float | None]] = {}
    keys = {(r.section, r.env, r.bandwidth_mbps, r.model) for r in runs if r.mode == "galaxy" and r.overlap}
    for key in sorted(keys):
        same = [r for r in runs if (r.section, r.env, r.bandwidth_mbps, r.model) == key and r.overlap]
        galaxy = galaxy_of(runs, *key, all_devices=all_devices)
        local = [r for r in runs if (r.section, r.env, r.model, r.mode) == (key[0], key[1], key[3], "local")]
        cell: dict[str, float | None] = {}
        for mode in ("megatron", "sp", "local"):
            base = next((r for r in same if r.mode == mode), None) or (local[0] if mode == "local" and local
                                                                        else None)
            cell[mode] = (base.latency_s / galaxy.latency_s if base is not None and galaxy is not None
                          and base.latency_s and galaxy.latency_s else None)
        out[key] = cell
    return out
