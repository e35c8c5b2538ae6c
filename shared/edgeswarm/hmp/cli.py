"""What Galaxy's serving adds to the command line: ``edgeswarm infer`` for serve-hmp jobs (the kind's
``infer_cli``, its options ``infer_arguments``): token ids, text or an .npz of them in; each answer's tokens, timings
and per-layer split out. And ``edgeswarm plan --kind serve-hmp`` (``plan_cli``, its options ``plan_arguments``):
Galaxy's plan of a Transformer preset on a cluster, and with ``--compare`` Galaxy beside Megatron-TP, SP and Local
(predicted latency, memory, out-of-memory verdicts). The plan's block profiles come from ``--profiles FILE`` (a saved
HmpCluster JSON) or, for a cluster file or bundled name given with ``--cluster``, from each device class's speed and
budget (``planning.hmp.synthetic``): nothing is started."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.markup import escape
from rich.table import Table

from edgeswarm.bus import Bus
from edgeswarm.errors import ConfigError
from edgeswarm.hmp.client import Prompt, ask
from edgeswarm.hmp.spec import HmpSpec
from edgeswarm.messages.jobs import JobState
from edgeswarm.models.inputs import as_input_dtype, read_npz
from edgeswarm.models.text.hf import ModelFolderError, source_config
from edgeswarm.models.text.pooling import SentencePooling, pooling_for, sentence_embedding
from edgeswarm.planning.hmp.plan import compare, plan_hmp
from edgeswarm.planning.hmp.synthetic import synthetic_cluster
from edgeswarm.planning.hmp.types import HmpCluster, HmpComparison, HmpOptions, HmpPlan
from edgeswarm.values.chat import ChatMessage
from edgeswarm.values.sampling import Sampling
from edgeswarm.values.text_model import PRESETS, TextModelConfig
from edgeswarm.workloads import parse_spec_text
from edgeswarm.workloads.commands import CommandTools

DEFAULT_COUNT = 8  # prompts generated when no input is given (the help of --count says so)


def add_infer_arguments(p: argparse.ArgumentParser) -> None:
    """The ``serve-hmp`` options of ``edgeswarm infer`` (its kind's ``infer_arguments``; the job, the inputs
    ``--npz`` and ``--count``, ``--window``, ``--timeout``, ``--show``, ``--out`` and ``--json`` are shared): two
    more input sources, each taking the place of ``--npz`` and ``--count`` (``run_infer`` refuses both at once), and
    the tokens to generate."""
    source = p.add_mutually_exclusive_group()
    source.add_argument("--text", action="append", default=None, metavar="TEXT",
                        help="a text model with a tokenizer: one request of TEXT (repeatable)")
    source.add_argument("--tokens", action="append", default=None, metavar="IDS",
                        help="a text model: one request of these comma-separated token ids (repeatable)")
    source.add_argument("--chat", action="append", default=None, metavar="TEXT",
                        help="a chat model (its folder has a chat template): one request of a user turn TEXT "
                             "(repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="a text decoder: tokens to generate per request (default: the job's max_new_tokens)")
    p.add_argument("--temperature", type=float, default=None,
                   help="a text decoder: sample at this temperature (default: greedy)")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: keep the k most likely tokens")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: keep the smallest set of mass p")
    p.add_argument("--seed", type=int, default=0, help="with --temperature: the draws' seed (same seed, same text)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="a text decoder with a tokenizer: end the answer before TEXT (repeatable)")


def _check_infer_arguments(args: argparse.Namespace) -> None:
    """Refuse two input sources at once (--text or --tokens with --npz or --count: the shared ones are declared
    apart from this kind's, so argparse cannot) and a negative --max-new-tokens."""
    own = "--text" if args.text else "--tokens" if args.tokens else "--chat" if args.chat else None
    shared = "--npz" if args.npz is not None else "--count" if args.count is not None else None
    if own and shared:
        raise ConfigError(f"{own} and {shared} are two sources of inputs: give one")
    if (args.max_new_tokens or 0) < 0:
        raise ConfigError("--max-new-tokens must be at least 0")
    sampling(args)  # its ranges, said before anything is sent


def sampling(args: argparse.Namespace) -> Sampling | None:
    """The sampling --temperature, --top-k, --top-p and --seed ask for (None: greedy). Raises ConfigError naming the
    option out of range."""
    if args.temperature is None:
        return None
    try:
        return Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValidationError as exc:
        option = "--" + str(exc.errors()[0]["loc"][0]).replace("_", "-")
        raise ConfigError(f"{option}: {exc.errors()[0]['msg']}") from None


def _prompts(args: argparse.Namespace, state: JobState) -> list[Prompt]:
    """The prompts ``edgeswarm infer`` sends: --text, --chat, --tokens, the rows of --npz, or --count generated
    ones."""
    import torch

    if args.text:
        return list(args.text)
    if args.chat:
        return [[ChatMessage(role="user", content=text)] for text in args.chat]
    if args.tokens:
        try:
            return [[int(t) for t in line.split(",") if t.strip()] for line in args.tokens]
        except ValueError:
            raise ConfigError("--tokens takes comma-separated integers, e.g. --tokens 15496,11,995") from None
    spec = parse_spec_text(state.spec, source=f"the spec of job {state.job_id}")
    assert isinstance(spec, HmpSpec)
    if args.npz is not None:
        ids = as_input_dtype(read_npz(args.npz), torch.int64, args.npz)
        return [row.reshape(-1).tolist() for row in ids.reshape(ids.shape[0], -1)]
    vocab = source_config(spec.model).vocab
    g = torch.Generator().manual_seed(0)
    count = DEFAULT_COUNT if args.count is None else args.count
    return [torch.randint(0, vocab, (spec.seq_len,), generator=g).tolist() for _ in range(count)]


def _pooling(state: JobState) -> tuple[SentencePooling | None, str]:
    """The sentence pooling of the job's model folder (sentence-transformers' ``modules.json``), or None and why
    not: a preset, no pooling declared, or a folder this machine cannot read."""
    spec = parse_spec_text(state.spec, source=f"the spec of job {state.job_id}")
    assert isinstance(spec, HmpSpec)
    if spec.model.path is None:
        return None, ""
    try:
        pooling = pooling_for(spec.model.path)
    except (ModelFolderError, OSError) as exc:
        return None, f"no sentence embeddings: {exc}"
    if pooling is None and not Path(spec.model.path).is_dir():
        return None, f"no sentence embeddings: the model folder {spec.model.path} is not on this machine"
    return pooling, ""


def run_infer(args: argparse.Namespace, bus: Bus, state: JobState, tools: CommandTools) -> int:
    """``edgeswarm infer`` for a serve-hmp job: print each answer (generated tokens and text, or the hidden states'
    shape and, for a sentence-transformers folder, the sentence embedding its pooling makes of them), its latency,
    time to first token and per output token, and the per-layer time split."""
    _check_infer_arguments(args)
    prompts = _prompts(args, state)
    started = time.monotonic()
    answers = ask(bus, args.job, prompts, max_new_tokens=args.max_new_tokens, window=args.window,
                  timeout_s=args.timeout, sampling=sampling(args), stop=args.stop)
    wall = time.monotonic() - started
    good = [a for a in answers if a.reply is not None]
    pooling, why_not = _pooling(state) if any(a.hidden is not None for a in good) else (None, "")
    if why_not:
        tools.err_console.print(why_not)
    embeddings = {a.index: sentence_embedding(pooling, a.hidden) for a in good
                  if pooling is not None and a.hidden is not None}
    for a in answers[:max(0, args.show)] if args.show else []:
        if a.reply is None:
            continue
        r = a.reply
        what = (f"{len(r.prompt_tokens)} prompt tokens -> {r.tokens}" + (f" {escape(repr(r.text))}" if r.text else "")
                if r.tokens or a.hidden is None else f"hidden states {list(a.hidden.shape)}")
        if a.index in embeddings:
            e = embeddings[a.index]
            what += (f", sentence embedding [{e.numel()}] ({pooling.mode} pooling"  # type: ignore[union-attr]
                     f"{', normalised' if pooling.normalize else ''}): "  # type: ignore[union-attr]
                     f"{', '.join(f'{v:.4f}' for v in e[:4].tolist())}, ...")
        timing = f"{r.latency_s * 1000:.1f} ms, TTFT {r.ttft_s * 1000:.1f} ms"
        if r.tpot_s is not None:
            timing += f", TPOT {r.tpot_s * 1000:.1f} ms"
        tools.console.print(f"request {a.index}: {what}; {timing}" + (" (recomputed after a device was lost)"
                                                                if r.recomputed else ""))
        if r.split is not None:
            tools.console.print(f"  per layer: compute {r.split.compute_ms:.2f} ms, sync {r.split.sync_ms:.2f} ms, "
                                f"waiting {r.split.waiting_ms:.2f} ms")
    for a in answers:
        if a.reply is None:
            tools.err_console.print(f"request {a.index}: {a.reason}: {escape(a.error or '')}")
    if good:
        latencies = sorted(a.latency_s for a in good)
        tools.console.print(f"{len(good)}/{len(answers)} requests answered in {wall:.2f} s; latency median "
                            f"{statistics.median(latencies) * 1000:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "answered": len(good), "requests": len(answers), "wall_s": wall,
            "results": [{"index": a.index, "latency_s": a.latency_s, "reason": a.reason, "error": a.error,
                         "reply": a.reply.model_dump(mode="json") if a.reply is not None else None,
                         "hidden_shape": list(a.hidden.shape) if a.hidden is not None else None,
                         "embedding": embeddings[a.index].tolist() if a.index in embeddings else None}
                        for a in answers]}, indent=1))
    if args.out and good:
        import numpy as np

        hidden = [a.hidden.numpy() for a in good if a.hidden is not None]
        if hidden:
            np.savez(args.out, **{f"y{a.index}": a.hidden.numpy() for a in good if a.hidden is not None},
                     **{f"e{i}": e.numpy() for i, e in embeddings.items()})
        else:
            np.savez(args.out, **{f"y{a.index}": np.array(a.reply.tokens) for a in good if a.reply is not None})
        tools.console.print(f"outputs written to {args.out}")
    return 0 if len(good) == len(answers) else 1


# --- edgeswarm plan --kind serve-hmp -----------------------------------------------------------------------

DEFAULT_SEQ_LEN = 284  # the paper's mean QNLI length (spec 5.1)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The ``serve-hmp`` options of ``edgeswarm plan`` (its kind's ``plan_arguments``; ``--exclude``, ``--json`` and
    the sources are shared)."""
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="serve-hmp: sequence length planned for")
    p.add_argument("--hmp-mode", choices=("galaxy", "megatron", "sp", "local", "auto"), default="galaxy",
                   help="serve-hmp: the parallelism (auto: the fastest predicted that fits, or one on fewer "
                        "devices within 5%% of it)")
    p.add_argument("--compare", action="store_true", help="serve-hmp: Galaxy beside Megatron-TP, SP and Local")
    p.add_argument("--no-overlap", action="store_true", help="serve-hmp: no tiled comm/compute overlap")
    p.add_argument("--shift", choices=("paper", "water"), default="paper",
                   help="serve-hmp: Algorithm 1's memory shifts as the paper has them, or water-filling")
    p.add_argument("--paper", action="store_true",
                   help="serve-hmp: count only the weights against the budgets (the paper's memory model)")
    p.add_argument("--no-prune", action="store_true", help="serve-hmp: use every device even when one does not pay")
    p.add_argument("--max-tokens", type=int, default=0, help="serve-hmp: tokens a request's KV cache must hold")
    p.add_argument("--decode-cache", type=int, default=0,
                   help="serve-hmp: cache length of the per-token prediction (default: the sequence length)")
    p.add_argument("--new-tokens", type=int, default=0,
                   help="serve-hmp: tokens a request generates; plans are compared on the prefill and these")


def _model(name: str, overrides: dict[str, Any]) -> TextModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"no Transformer preset {name!r}; serve-hmp plans one of: {', '.join(PRESETS)}")
    try:
        return TextModelConfig.model_validate({**PRESETS[name].model_dump(), **overrides})
    except ValidationError as exc:
        raise ConfigError(f"bad config for {name}: {exc}") from None


def plan_input(args: argparse.Namespace) -> HmpCluster:
    """The planner input the command line names: a saved HmpCluster (``--profiles``) or a cluster file's
    devices priced from their classes (``--cluster``)."""
    from edgeswarm.devices.cluster import load_cluster
    from edgeswarm.values.profiles import parse_config

    if args.profiles:
        try:
            return HmpCluster.model_validate_json(Path(args.profiles).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{args.profiles} is not a serve-hmp cluster profile: {exc}") from None
    if not args.cluster:
        raise ConfigError("serve-hmp plans from --cluster FILE|NAME (device classes) or --profiles FILE "
                          "(measured block profiles), not from --hub")
    cfg = _model(args.model, parse_config(args.config))
    if not 1 <= args.seq_len <= cfg.max_positions:
        raise ConfigError(f"--seq-len must be 1..{cfg.max_positions} for {args.model}, not {args.seq_len}")
    return synthetic_cluster(load_cluster(args.cluster), cfg, args.seq_len, args.model)


def hmp_options(args: argparse.Namespace) -> HmpOptions:
    try:
        return HmpOptions(mode=args.hmp_mode, exclude=[x.strip() for x in args.exclude.split(",") if x.strip()],
                          overlap=not args.no_overlap, shift=args.shift, paper=args.paper, prune=not args.no_prune,
                          max_tokens=args.max_tokens, decode_cache=args.decode_cache, new_tokens=args.new_tokens)
    except ValidationError as exc:
        raise ConfigError(f"bad serve-hmp options: {exc}") from None


def run_plan(args: argparse.Namespace, cluster: object, tools: CommandTools) -> int:
    """Print the serve-hmp plan (``--json``: as JSON) or, with ``--compare``, every parallelism's verdict (its kind's
    ``plan_cli``). ``cluster`` is None: serve-hmp reads its own profiles (``plan_input``)."""
    hmp = plan_input(args)
    if getattr(args, "save_profiles", None):
        path = Path(args.save_profiles) / f"{hmp.model_name or 'model'}-hmp-{hmp.seq_len}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(hmp.model_dump_json(indent=2))
        tools.err_console.print(f"serve-hmp cluster profile written to {path}")
    options = hmp_options(args)
    if args.compare:
        comparison = compare(hmp, options)
        if args.json:
            tools.console.out(comparison.model_dump_json(indent=2), highlight=False)
        else:
            print_comparison(comparison, hmp, tools)
        return 0
    plan = plan_hmp(hmp, options)
    if args.json:
        tools.console.out(plan.model_dump_json(indent=2), highlight=False)
    else:
        print_plan(plan, hmp, tools)
    return 0


def print_plan(plan: HmpPlan, cluster: HmpCluster, tools: CommandTools) -> None:
    """One row per device (heads, columns, rows, capacity, memory), then the predicted latency split."""
    cfg = cluster.model
    tools.console.print(f"[bold]{plan.model_name or cfg.family}[/bold]: serve-hmp {plan.mode}, {cfg.layers} layers, "
                        f"{cfg.heads} heads, f={cfg.ffn}, s={plan.seq_len}, {cfg.dtype}; {len(plan.shares.devices)} of "
                        f"{len(cluster.devices)} devices" + (f" (left out: {', '.join(plan.left_out)})"
                                                       if plan.left_out else ""))
    table = Table(title=f"serve-hmp {plan.mode} plan, epoch {plan.epoch}")
    for col in ("rank", "device", "heads", "MLP columns", "rows", "capacity (1/s)", "memory used / budget"):
        table.add_column(col)
    for i, node in enumerate(plan.shares.devices):
        a, b = plan.shares.head_range(i), plan.shares.column_range(i)
        table.add_row(str(i), node, f"{plan.shares.heads[i]} [{a[0]}, {a[1]})",
                      f"{plan.shares.columns[i]} [{b[0]}, {b[1]})", str(plan.rows[i]), f"{plan.capacity[i]:.3g}",
                      f"{plan.memory_bytes[i] / 2**20:.0f}/{plan.memory_budget_bytes[i] / 2**20:.0f} MiB")
    tools.console.print(table)
    m, c = plan.model, plan.comm
    tools.console.print(f"predicted [bold]{m.total_s:.3f} s[/bold] per forward pass: compute {m.compute_s:.3f} s, "
                        f"communication {m.comm_s:.3f} s of which {m.exposed_s:.3f} s not hidden "
                        f"({'overlapped' if plan.shares.overlap else 'not overlapped'}, shifts {plan.shift})")
    tools.console.print(f"per layer and device: {c.messages} messages, {c.bytes / 1e6:.2f} MB, {c.broker_hops} broker "
                        f"hops; one ring step {c.tau_s * 1e3:.2f} ms ({c.message_s * 1e3:.2f} ms per message)")
    if plan.decode is not None:
        d = plan.decode
        tools.console.print(f"generation: {d.per_token_s * 1e3:.1f} ms per token with a cache of {d.cache_tokens}, "
                            f"network {d.network_share:.0%}")


def print_comparison(c: HmpComparison, cluster: HmpCluster, tools: CommandTools) -> None:
    """Galaxy, Megatron-TP, SP and Local side by side: latency split, memory, and why one does not fit."""
    table = Table(title=f"{cluster.model_name or cluster.model.family} at s={cluster.seq_len} on "
                        f"{len(cluster.devices)} devices (same latency model)")
    for col in ("parallelism", "devices", "heads", "latency (s)", "compute (s)", "exposed comm (s)",
                "msgs/layer", "max memory / budget", "Galaxy speed-up", "ms/token (net)"):
        table.add_column(col, justify="left" if col in ("parallelism", "heads") else "right")
    galaxy = c.of("galaxy").plan
    names = {"galaxy": "Galaxy", "megatron": "Megatron-TP", "sp": "SP", "local": "Local"}
    for v in c.verdicts:
        if v.plan is None:
            verdict = "Fail" if v.mode == "galaxy" else "OOM" if "GB" in v.reason else "no plan"
            table.add_row(names[v.mode], "-", "-", verdict, "-", "-", "-", "-", "-", "-")
            continue
        p = v.plan
        worst = max(range(len(p.memory_bytes)), key=lambda i: p.memory_bytes[i] / max(1, p.memory_budget_bytes[i]))
        speedup = f"{p.model.total_s / galaxy.model.total_s:.2f}x" if galaxy is not None else "-"
        dec = f"{p.decode.per_token_s * 1e3:.1f} ({p.decode.network_share:.0%})" if p.decode else "-"
        table.add_row(names[v.mode], str(len(p.shares.devices)),
                      "/".join(map(str, p.shares.heads)) if v.mode in ("galaxy", "megatron") else "all",
                      f"{p.model.total_s:.3f}", f"{p.model.compute_s:.3f}", f"{p.model.exposed_s:.3f}",
                      str(p.comm.messages),
                      f"{p.memory_bytes[worst] / 2**20:.0f}/{p.memory_budget_bytes[worst] / 2**20:.0f} MiB",
                      speedup, dec)
    tools.console.print(table)
    for v in c.verdicts:
        if v.plan is None:
            tools.console.print(f"{names[v.mode]}: {v.reason}")
