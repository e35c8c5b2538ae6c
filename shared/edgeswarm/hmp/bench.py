"""The benchmark Galaxy's serving adds to the command line, ``edgeswarm bench hmp``: its arguments, checks, tables and
the goals' lines (the measurements live in ``hmp.bench_hmp``, imported when it runs)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from edgeswarm.errors import ConfigError
from edgeswarm.profiling.host_load import busy_cell
from edgeswarm.profiling.verdict import verdict, verdict_lines
from edgeswarm.workloads.commands import Bench, CommandTools

if TYPE_CHECKING:
    from edgeswarm.hmp.bench_hmp import HmpBenchConfig, HmpReport
    from edgeswarm.hmp.bench_llm import LlmReport


class HmpBench(Bench):
    name = "hmp"
    help = ("Galaxy's tensor-parallel serving against Megatron-TP, SP and Local on emulated Galaxy environments: "
            "speedups, bandwidth sweep, scaling, overlap, generation")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--sections", default="envs,overlap,trace",
                       help="comma-separated: envs, bandwidth, scaling, overlap, generation, trace (default: about 15 "
                       "minutes on a 2-core VM; each further section 5 to 20)")
        p.add_argument("--envs", default="a,f", help="Galaxy environments (a-f) at 125 Mbps")
        p.add_argument("--models", default="distilbert,gpt2-large", help="comma-separated Transformer presets")
        p.add_argument("--modes", default="galaxy,megatron,sp,local", help="comma-separated modes")
        p.add_argument("--layers", type=int, default=1, help="layers kept of each model (the paper's shapes)")
        p.add_argument("--seq-len", type=int, default=284, help="prompt tokens per request (the paper's 284)")
        p.add_argument("--requests", type=int, default=3, help="measured requests per run, after one warm-up")
        p.add_argument("--bandwidths", default="125,250,500,1000", help="the sweep's bandwidths, Mbps")
        p.add_argument("--bandwidth-env", default="b", help="the sweep's environment")
        p.add_argument("--bandwidth-model", default="distilbert", help="the sweep's model")
        p.add_argument("--scaling-model", default="gpt2-large", help="the scaling runs' model (one layer)")
        p.add_argument("--scaling-devices", type=int, default=4, help="scaling: 1 to this many Nano-M")
        p.add_argument("--scaling-seq-len", type=int, default=384, help="strong scaling's tokens")
        p.add_argument("--weak-tokens", type=int, default=96, help="weak scaling's tokens per device")
        p.add_argument("--overlap-env", default="a", help="the environment of overlap on against off")
        p.add_argument("--generation-envs", default="c,b,f",
                       help="generation's environments at 1000 Mbps (c: 4 Nano-M, b: 3, f: Nano-L, -M, -S)")
        p.add_argument("--generation-model", default="gpt2-large", help="the generation runs' model")
        p.add_argument("--generation-layers", type=int, default=2, help="the generation runs' layers")
        p.add_argument("--generation-prompt", type=int, default=32, help="the generation runs' prompt tokens")
        p.add_argument("--generation-tokens", type=int, default=8, help="tokens generated per request")
        p.add_argument("--trace", default="out/hmp-trace.json", help="where the Chrome trace goes")
        p.add_argument("--json", default=None, metavar="PATH", help="also write every run as JSON")
        p.add_argument("--netns", action="store_true", help="every cluster in network namespaces, its links shaped by "
                       "the kernel (root; docs/netns.md)")

    def run(self, args: argparse.Namespace, tools: CommandTools) -> int:
        """Galaxy against Megatron-TP, SP and Local measured on emulated Galaxy environments: tables, the goals'
        lines, and every run as JSON with --json."""
        from edgeswarm.hmp.bench_hmp import run_hmp_bench

        config = hmp_config(args)
        trace = Path(args.trace) if args.trace else None
        if trace is not None:
            trace.parent.mkdir(parents=True, exist_ok=True)
        report = run_hmp_bench(config, tools.cluster, trace_path=trace,
                               json_path=Path(args.json) if args.json else None, log=tools.log)
        for table in hmp_tables(report):
            tools.console.print(table)
        for line in hmp_lines(report):
            tools.console.print(line, highlight=False)
        return 0 if all(r.error is None or r.error.startswith("failed") for r in report.runs) else 1


def _split_list(text: str, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ConfigError(f"{what}: give at least one, comma-separated")
    return items


def hmp_config(args: argparse.Namespace) -> HmpBenchConfig:
    """The benchmark's configuration from ``edgeswarm bench hmp``'s arguments. Raises ConfigError."""
    from pydantic import ValidationError

    from edgeswarm.hmp.bench_hmp import ENVS, MODES, SECTIONS, HmpBenchConfig
    from edgeswarm.values.text_model import PRESETS

    sections = _split_list(args.sections, "--sections")
    envs = _split_list(args.envs.lower(), "--envs")
    generation_envs = _split_list(args.generation_envs.lower(), "--generation-envs")
    models = _split_list(args.models, "--models")
    modes = _split_list(args.modes, "--modes")
    bad = ([f"section {s}" for s in sections if s not in SECTIONS]
           + [f"env {e}" for e in envs + generation_envs + [args.bandwidth_env, args.overlap_env]
              if e not in ENVS]
           + [f"mode {m}" for m in modes if m not in MODES]
           + [f"model {m}" for m in models + [args.bandwidth_model, args.scaling_model, args.generation_model]
              if m not in PRESETS])
    if bad:
        raise ConfigError(f"unknown {', '.join(bad)} (envs a-f; modes {', '.join(MODES)}; models: the presets "
                          f"{', '.join(PRESETS)})")
    try:
        bandwidths = [float(b) for b in _split_list(args.bandwidths, "--bandwidths")]
    except ValueError:
        raise ConfigError(f"--bandwidths: {args.bandwidths!r} is not a list of numbers (Mbps)") from None
    if any(b <= 0 for b in bandwidths) or args.requests < 1 or args.layers < 1 or args.seq_len < 1 \
            or not 1 <= args.scaling_devices <= 4 or args.weak_tokens < 1 or args.generation_tokens < 2:
        raise ConfigError("bandwidths, --requests, --layers, --seq-len and --weak-tokens must be positive, "
                          "--scaling-devices 1 to 4 and --generation-tokens at least 2")
    try:
        return HmpBenchConfig(sections=sections, envs=envs, models=models, modes=modes, layers=args.layers,
                              seq_len=args.seq_len, requests=args.requests, bandwidths=bandwidths,
                              bandwidth_env=args.bandwidth_env, bandwidth_model=args.bandwidth_model,
                              scaling_model=args.scaling_model, scaling_devices=args.scaling_devices,
                              scaling_seq_len=args.scaling_seq_len, weak_tokens=args.weak_tokens,
                              overlap_env=args.overlap_env, generation_envs=generation_envs,
                              generation_model=args.generation_model,
                              generation_layers=args.generation_layers, generation_prompt=args.generation_prompt,
                              generation_tokens=args.generation_tokens, netns=args.netns)
    except ValidationError as exc:
        raise ConfigError(f"bad bench hmp options: {exc}") from None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def layer_flops(model: str, seq_len: int) -> float:
    """Multiply-adds times two of one layer of ``model`` over ``seq_len`` tokens (the GEMMs and attention)."""
    from edgeswarm.values.text_model import PRESETS

    cfg = PRESETS[model]
    return 2.0 * seq_len * (cfg.attention_params() + cfg.mlp_params()) + 4.0 * seq_len * seq_len * cfg.hidden


def hmp_tables(report: HmpReport) -> list[Table]:
    """The report's tables: the environments, the bandwidth sweep, scaling, overlap and generation."""
    from edgeswarm.hmp.bench_hmp import galaxy_of, speedups

    runs = report.runs
    tables: list[Table] = []
    ups, ups_all = speedups(runs), speedups(runs, all_devices=True)
    verdicts = {(v.env, v.model, v.mode): v for v in report.verdicts}
    for section, title in (("envs", "Galaxy environments at 125 Mbps"), ("bandwidth", "bandwidth sweep")):
        rows = [r for r in runs if r.section == section]
        if not rows:
            continue
        c = report.config
        t = Table(title=f"{title}: {c.layers} layer(s) of each model, {c.seq_len} tokens, prefill, median of "
                        f"{c.requests} requests on the coordinator; speedup = mode's latency / Galaxy's")
        for col in ("env", "Mbps", "model", "mode", "devices", "heads", "predicted ms", "measured ms",
                    "meas / pred", "meas / refitted", "layer: compute / sync / wait ms", "Galaxy speedup",
                    "host busy", "full model (planner)"):
            t.add_column(col, justify="left" if col in ("env", "model", "mode", "devices", "heads",
                                                          "full model (planner)") else "right")
        for r in rows:
            v = verdicts.get((r.env, r.model, r.mode))
            full = "-" if v is None or section != "envs" else ("fits" if v.fits else "OOM" if "memory" in v.reason
                                                                 or "budget" in v.reason or "holds" in v.reason
                                                                 else "infeasible")
            if r.error:
                t.add_row(r.env.upper(), f"{r.bandwidth_mbps:g}", r.model, r.mode, "-", "-", "-",
                          escape(r.error[:60]), "-", "-", "-", "-", "-", full)
                continue
            up = ups.get((r.section, r.env, r.bandwidth_mbps, r.model), {}).get(r.mode)
            up_all = ups_all.get((r.section, r.env, r.bandwidth_mbps, r.model), {}).get(r.mode)
            label = r.mode + ("" if r.mode != "galaxy" else " (all devices)" if not r.prune else " (planned)")
            t.add_row(r.env.upper(), f"{r.bandwidth_mbps:g}", r.model, label, str(len(r.devices)),
                      "/".join(map(str, r.heads)), _ms(r.predicted_s), _ms(r.latency_s), _x(r.ratio),
                      _x(r.refitted_ratio), f"{r.compute_ms or 0:.0f} / {r.sync_ms or 0:.0f} / {r.waiting_ms or 0:.0f}",
                      "" if r.mode == "galaxy" else _x(up) if up == up_all else f"{_x(up)} ({_x(up_all)} all)",
                      busy_cell(r.host_busy), full)
        tables.append(t)
    strong = {len(r.devices): r for r in runs if r.section == "strong" and r.latency_s}
    weak = {len(r.devices): r for r in runs if r.section == "weak" and r.latency_s}
    if strong or weak:
        t = Table(title="scaling: one layer on 1-4 Nano-M at 1000 Mbps (Galaxy, no devices left out; 1: Local)")
        for col in ("devices", "strong: tokens", "latency ms", "vs Local", "efficiency", "weak: tokens",
                    "latency ms", "GFLOP/s", "efficiency"):
            t.add_column(col, justify="right")
        for n in sorted(set(strong) | set(weak)):
            s, w = strong.get(n), weak.get(n)
            vs = strong[1].latency_s / s.latency_s if s and 1 in strong and s.latency_s else None
            gf = layer_flops(w.model, w.seq_len) / w.latency_s / 1e9 if w and w.latency_s else None
            gf1 = (layer_flops(weak[1].model, weak[1].seq_len) / weak[1].latency_s / 1e9 if 1 in weak
                   and weak[1].latency_s else None)
            t.add_row(str(n), str(s.seq_len) if s else "-", _ms(s.latency_s if s else None), _x(vs),
                      f"{vs / n:.0%}" if vs else "-", str(w.seq_len) if w else "-", _ms(w.latency_s if w else None),
                      f"{gf:.2f}" if gf else "-", f"{gf / gf1 / n:.0%}" if gf and gf1 else "-")
        tables.append(t)
    off = [r for r in runs if r.section == "overlap" and r.latency_s]
    if off:
        t = Table(title="overlap: Galaxy allowed to tile communication with its GEMMs (where its planner predicts "
                        "the tiles faster), against never")
        for col in ("env", "model", "overlap on ms", "overlap off ms", "saved ms", "on: wait ms", "off: wait ms",
                    "predicted on / off ms"):
            t.add_column(col, justify="left" if col in ("env", "model") else "right")
        for r in off:
            on = galaxy_of(runs, "envs", r.env, r.bandwidth_mbps, r.model, all_devices=True)
            if on is None or on.latency_s is None or r.latency_s is None:
                continue
            t.add_row(r.env.upper(), r.model, _ms(on.latency_s) + ("" if on.tiled else " (untiled)"),
                      _ms(r.latency_s), _ms(r.latency_s - on.latency_s),
                      f"{on.waiting_ms or 0:.0f}", f"{r.waiting_ms or 0:.0f}",
                      f"{_ms(on.predicted_s)} / {_ms(r.predicted_s)}")
        tables.append(t)
    gen = [r for r in runs if r.section == "generation"]
    if gen:
        passes = {(r.env, r.mode): r for r in runs if r.section == "token-pass"}
        t = Table(title="generation at 1000 Mbps: greedy tokens from the sharded KV cache; network share = sync + "
                        "waiting over the slowest rank's time in a one-token pass")
        for col in ("env", "devices", "model", "mode", "TTFT ms", "TPOT ms", "predicted TPOT ms",
                    "Galaxy's speedup", "network share", "predicted share"):
            t.add_column(col, justify="left" if col in ("env", "model", "mode") else "right")
        for r in gen:
            if r.error:
                t.add_row(r.env.upper(), "-", r.model, r.mode, escape(r.error[:60]), *["-"] * 5)
                continue
            galaxy = next((x for x in gen if x.env == r.env and x.mode == "galaxy" and x.tpot_s), None)
            p = passes.get((r.env, r.mode))
            vs = r.tpot_s / galaxy.tpot_s if galaxy and galaxy.tpot_s and r.tpot_s and r.mode != "galaxy" else None
            t.add_row(r.env.upper(), str(len(r.devices)), f"{r.model} x{r.layers}", r.mode, _ms(r.ttft_s),
                      _ms(r.tpot_s), _ms(r.predicted_tpot_s), _x(vs),
                      f"{p.network_share:.0%}" if p and p.network_share is not None else "-",
                      f"{r.predicted_network_share:.0%}" if r.predicted_network_share is not None else "-")
        tables.append(t)
    return tables


def hmp_lines(report: HmpReport) -> list[str]:
    """The goals checked, one line each, and where the trace is."""
    from edgeswarm.hmp.bench_hmp import speedups

    lines = []
    homo = {"a", "b", "c"}
    every = speedups(report.runs, all_devices=True)
    for (section, env, bw, model), cell in speedups(report.runs).items():
        if section != "envs":
            continue
        goal = 1.46 if env in homo else 2.5
        for what, c in (("as planned", cell), ("on every device", every.get((section, env, bw, model), {}))):
            if what != "as planned" and (c == cell or all(v is None for v in c.values())):
                continue
            mlm = c.get("megatron")
            worst = min((v for v in c.values() if v is not None), default=None)
            lines.append(f"Env {env.upper()} {model}, Galaxy {what}: {_x(mlm)} over Megatron-TP (goal >= {goal}x: "
                         f"{'met' if mlm and mlm >= goal else 'missed'}); against the fastest baseline "
                         f"{_x(worst)} ({'never slower' if worst is None or worst >= 1.0 else 'SLOWER'})")
    cells = [c for r in report.runs if r.section in ("envs", "bandwidth") and (c := r.cell()) is not None]
    lines += verdict_lines(verdict(cells), "latency cells")
    if report.trace:
        lines.append(f"Chrome trace of one Galaxy pass: {report.trace} ({report.trace_overlaps} communication spans "
                     "overlap a GEMM span); open it in https://ui.perfetto.dev")
    return lines




class LlmBench(Bench):
    name = "llm"
    help = ("a GGUF language model (random weights of a published shape, Q8_0 or Q4_0) split over emulated devices: "
            "decode time per token and its network share; and against llama.cpp on the same file")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default="llama-3.2-1b", help="a llama-family preset (its shape; random weights)")
        p.add_argument("--quant", default="Q8_0", choices=("Q8_0", "Q4_0"), help="the matrices' ggml type")
        p.add_argument("--layers", type=int, default=None, help="keep only the first layers (default: all)")
        p.add_argument("--sections", default="split,batch,llamacpp", help="comma-separated: split, batch, llamacpp")
        p.add_argument("--streams", type=int, default=8, help="batch: streams decoding together, against one")
        p.add_argument("--bandwidth", type=float, default=1000.0, help="the split runs' links, Mbps")
        p.add_argument("--decode", type=int, default=8, help="generated tokens timed per run")
        p.add_argument("--positions", type=int, default=256, help="teacher-forced positions against llama.cpp")
        p.add_argument("--out", default="out/llm", help="where the GGUF file (kept) and llama.cpp's build go")
        p.add_argument("--llama-python", default=None, metavar="PYTHON",
                       help="a Python that imports llama_cpp (default: built from source under --out on first use)")
        p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")

    def run(self, args: argparse.Namespace, tools: CommandTools) -> int:
        """The sections asked for: tables and the goals' lines."""
        from pydantic import ValidationError

        from edgeswarm.hmp.bench_llm import LlmBenchConfig, run_llm_bench

        sections = _split_list(args.sections, "--sections")
        unknown = sorted(set(sections) - {"split", "batch", "llamacpp"})
        if unknown:
            raise ConfigError(f"--sections: unknown {', '.join(unknown)} (split, batch, llamacpp)")
        if args.decode < 1 or args.positions < 2 or args.bandwidth <= 0 or not 1 <= args.streams <= 64:
            raise ConfigError("--decode and --bandwidth must be positive, --positions at least 2, --streams 1 to 64")
        try:
            config = LlmBenchConfig(preset=args.model, kind=args.quant, layers=args.layers,
                                    sections=tuple(sections), bandwidth_mbps=args.bandwidth, decode=args.decode,
                                    streams=args.streams,
                                    positions=args.positions, out=Path(args.out),
                                    llama_python=Path(args.llama_python) if args.llama_python else None)
        except ValidationError as exc:
            raise ConfigError(f"bad bench llm options: {exc}") from None
        report = run_llm_bench(config, tools.log, Path(args.json) if args.json else None)
        t = Table(title=f"{config.preset} {config.kind} split over emulated devices ({config.bandwidth_mbps:g} "
                        f"Mbps links; {report.file_bytes / 2**20:.0f} MiB file)")
        for column in ("devices", "heads", "MLP columns", "decode ms/token", "network share",
                       "weight MiB per rank (its share)"):
            t.add_column(column)
        for r in report.split:
            t.add_row(f"{r.label}: {', '.join(r.devices)}", " ".join(map(str, r.heads)),
                      " ".join(map(str, r.columns)), f"{r.token_s * 1000:.0f}", f"{r.network_share:.0%}",
                      " ".join(f"{w / 2**20:.0f} ({s / 2**20:.0f})" for w, s in zip(r.weight_bytes, r.share_bytes,
                                                                                 strict=True)))
        if report.split:
            tools.console.print(t)
        batch = report.batch
        if batch is not None:
            b = Table(title=f"continuous batching on {batch.label}: total decode tokens/s")
            for column in ("1 stream", f"{batch.streams} streams together", "ratio"):
                b.add_column(column)
            b.add_row(f"{batch.one_tps:.2f}", f"{batch.many_tps:.2f}", _x(batch.ratio))
            tools.console.print(b)
        peer = report.peer
        if peer is not None:
            p = Table(title="one device, the same file: ours and llama.cpp")
            for column in ("", "prefill tokens/s", "decode tokens/s"):
                p.add_column(column)
            p.add_row("edgeswarm", f"{peer.ours_prefill_tps:.1f}", f"{peer.ours_decode_tps:.2f}")
            if peer.llama_prefill_tps is not None and peer.llama_decode_tps is not None:
                p.add_row("llama.cpp", f"{peer.llama_prefill_tps:.1f}", f"{peer.llama_decode_tps:.2f}")
                p.add_row("ours / llama.cpp", _x(peer.ours_prefill_tps / peer.llama_prefill_tps),
                          _x(peer.ours_decode_tps / peer.llama_decode_tps))
            tools.console.print(p)
        for line in llm_lines(report):
            tools.console.print(line, highlight=False)
        return 0 if peer is None or peer.error is None else 1


def llm_lines(report: LlmReport) -> list[str]:
    """The goals checked, one line each."""
    lines = []
    for r in report.split:
        held = max(abs(w / s - 1.0) for w, s in zip(r.weight_bytes, r.share_bytes, strict=True))
        lines.append(f"{r.label}: network {r.network_share:.0%} of a token's time (goal <= 31%: "
                     f"{'met' if r.network_share <= 0.31 else 'missed'}); each rank's weights within {held:.1%} of "
                     f"its share of the quantized file (goal 5%: {'met' if held <= 0.05 else 'missed'})")
    if report.batch is not None:
        b = report.batch
        lines.append(f"{b.streams} streams together on {b.label}: {_x(b.ratio)} one stream's total tokens/s (goal "
                     f">= 4x: {'met' if b.ratio >= 4 else 'missed'})")
    peer = report.peer
    if peer is not None and peer.error is not None:
        lines.append(f"llama.cpp not measured: {escape(peer.error)}")
    elif peer is not None and peer.cosine_min is not None and peer.agreement is not None:
        lines.append(f"against llama.cpp over {report.config.positions} teacher-forced positions: logits cosine min "
                     f"{peer.cosine_min:.5f} (goal >= 0.999: {'met' if peer.cosine_min >= 0.999 else 'missed'}), "
                     f"next-token agreement {peer.agreement:.1%} (goal >= 98%: "
                     f"{'met' if peer.agreement >= 0.98 else 'missed'})")
    return lines
