"""What Galaxy's serving adds to the command line: ``edgeswarm infer`` for serve-hmp jobs (the kind's
``infer_cli``): token ids, text or an .npz of them in; each answer's tokens, timings and per-layer split out."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rich.markup import escape

from edgeswarm.bus import Bus
from edgeswarm.errors import ConfigError
from edgeswarm.hmp.client import ask
from edgeswarm.hmp.spec import HmpSpec
from edgeswarm.messages.jobs import JobState
from edgeswarm.models.inputs import as_input_dtype, read_npz
from edgeswarm.models.text.hf import ModelFolderError, source_config
from edgeswarm.models.text.pooling import SentencePooling, pooling_for, sentence_embedding
from edgeswarm.workloads import parse_spec_text
from edgeswarm.workloads.commands import CommandTools


def _prompts(args: argparse.Namespace, state: JobState) -> list[list[int] | str]:
    """The prompts ``edgeswarm infer`` sends: --text, --tokens, the rows of --npz, or --count generated ones."""
    import torch

    if args.text:
        return list(args.text)
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
    return [torch.randint(0, vocab, (spec.seq_len,), generator=g).tolist() for _ in range(args.count)]


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
    prompts = _prompts(args, state)
    started = time.monotonic()
    answers = ask(bus, args.job, prompts, max_new_tokens=args.max_new_tokens, window=args.window,
                  timeout_s=args.timeout)
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
