"""A caller's side of a serve-hmp job: send token ids or text, get generated tokens (or hidden states), and
``edgeswarm infer`` for such jobs.

Any MQTT client can do the same from the wire format alone: an ``edgeswarm.hmp.request`` frame on the coordinator's
data topic (its tensor: int64 token ids, or empty with ``text``), with ``reply_to`` and a correlation id, answered
on that reply topic with an ``edgeswarm.hmp.reply`` (or ``edgeswarm.infer.error``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from edgeswarm.bus import Bus, Expectation
from edgeswarm.errors import ConfigError
from edgeswarm.messages.hmp import HmpReply, HmpRequest
from edgeswarm.messages.jobs import JobState
from edgeswarm.messages.liveness import RequestRejected
from edgeswarm.messages.serving import InferError
from edgeswarm.wire.schema import new_id

if TYPE_CHECKING:
    import torch

COORDINATOR_NODE = "hub"


@dataclass
class Answer:
    """One request's answer (``reply``, with ``hidden`` states for an encoder) or why there is none (``reason``,
    ``error``); ``latency_s`` is the caller's round trip."""

    index: int
    latency_s: float
    reply: HmpReply | None = None
    hidden: torch.Tensor | None = None
    reason: str | None = None
    error: str | None = None


def _send(bus: Bus, job_id: str, prompt: list[int] | str, max_new_tokens: int | None,
          coordinator: str) -> Expectation:
    import torch

    exp = bus.expect()
    if isinstance(prompt, str):
        body = HmpRequest(job_id=job_id, request_id=new_id(), text=prompt, max_new_tokens=max_new_tokens)
        tensor = torch.empty(0, dtype=torch.int64)
    else:
        body = HmpRequest(job_id=job_id, request_id=new_id(), max_new_tokens=max_new_tokens)
        tensor = torch.tensor(prompt, dtype=torch.int64)
    bus.send_tensor(coordinator, "coordinator", body, tensor, expectation=exp)
    return exp


def ask(bus: Bus, job_id: str, prompts: list[list[int] | str], *, max_new_tokens: int | None = None, window: int = 4,
        timeout_s: float = 120.0, coordinator: str = COORDINATOR_NODE) -> list[Answer]:
    """Send every prompt (token ids, or text for a model with a tokenizer) to serve-hmp job ``job_id``, at most
    ``window`` unanswered at once, and return the answers in prompt order; a request not answered within
    ``timeout_s`` seconds is an answer with reason ``timeout``. ``max_new_tokens``: what a decoder generates (None:
    the job's default)."""
    answers: dict[int, Answer] = {}
    pending: list[tuple[int, Expectation, float]] = []
    todo = list(enumerate(prompts))
    while todo or pending:
        while todo and len(pending) < window:
            index, prompt = todo.pop(0)
            pending.append((index, _send(bus, job_id, prompt, max_new_tokens, coordinator), time.monotonic()))
        index, exp, sent = pending.pop(0)
        reply = exp.wait(max(0.0, timeout_s - (time.monotonic() - sent)))
        latency = time.monotonic() - sent
        body = reply.body if reply is not None else None
        if isinstance(body, HmpReply):
            hidden = reply.tensor.to_torch() if reply is not None and reply.tensor is not None else None
            answers[index] = Answer(index, latency, body, hidden)
        elif isinstance(body, (InferError, RequestRejected)):
            answers[index] = Answer(index, latency, reason=body.reason, error=body.detail)
        else:
            answers[index] = Answer(index, latency, reason="timeout",
                                    error=f"no answer from job {job_id} within {timeout_s:.0f} s")
    return [answers[k] for k in sorted(answers)]


def _prompts(args: argparse.Namespace, state: JobState) -> list[list[int] | str]:
    """The prompts ``edgeswarm infer`` sends: --text, --tokens, the rows of --npz, or --count generated ones."""
    import torch

    from edgeswarm.cli.serve import as_input_dtype, read_npz
    from edgeswarm.hmp.spec import HmpSpec
    from edgeswarm.workloads import parse_spec_text

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
    vocab = spec.model.config().vocab
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (spec.seq_len,), generator=g).tolist() for _ in range(args.count)]


def run_infer(args: argparse.Namespace, bus: Bus, state: JobState) -> int:
    """``edgeswarm infer`` for a serve-hmp job: print each answer (generated tokens and text, or the hidden states'
    shape), its latency, time to first token and per output token, and the per-layer time split."""
    from edgeswarm.cli.console import console, err_console

    prompts = _prompts(args, state)
    started = time.monotonic()
    answers = ask(bus, args.job, prompts, max_new_tokens=args.max_new_tokens, window=args.window,
                  timeout_s=args.timeout)
    wall = time.monotonic() - started
    good = [a for a in answers if a.reply is not None]
    for a in answers[:max(0, args.show)] if args.show else []:
        if a.reply is None:
            continue
        r = a.reply
        what = (f"{len(r.prompt_tokens)} prompt tokens -> {r.tokens}" + (f" {escape(repr(r.text))}" if r.text else "")
                if r.tokens or a.hidden is None else f"hidden states {list(a.hidden.shape)}")
        timing = f"{r.latency_s * 1000:.1f} ms, TTFT {r.ttft_s * 1000:.1f} ms"
        if r.tpot_s is not None:
            timing += f", TPOT {r.tpot_s * 1000:.1f} ms"
        console.print(f"request {a.index}: {what}; {timing}" + (" (recomputed after a device was lost)"
                                                                if r.recomputed else ""))
        if r.split is not None:
            console.print(f"  per layer: compute {r.split.compute_ms:.2f} ms, sync {r.split.sync_ms:.2f} ms, "
                          f"waiting {r.split.waiting_ms:.2f} ms")
    for a in answers:
        if a.reply is None:
            err_console.print(f"request {a.index}: {a.reason}: {escape(a.error or '')}")
    if good:
        latencies = sorted(a.latency_s for a in good)
        console.print(f"{len(good)}/{len(answers)} requests answered in {wall:.2f} s; latency median "
                      f"{statistics.median(latencies) * 1000:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "answered": len(good), "requests": len(answers), "wall_s": wall,
            "results": [{"index": a.index, "latency_s": a.latency_s, "reason": a.reason, "error": a.error,
                         "reply": a.reply.model_dump(mode="json") if a.reply is not None else None,
                         "hidden_shape": list(a.hidden.shape) if a.hidden is not None else None}
                        for a in answers]}, indent=1))
    if args.out and good:
        import numpy as np

        hidden = [a.hidden.numpy() for a in good if a.hidden is not None]
        if hidden:
            np.savez(args.out, **{f"y{a.index}": a.hidden.numpy() for a in good if a.hidden is not None})
        else:
            np.savez(args.out, **{f"y{a.index}": np.array(a.reply.tokens) for a in good if a.reply is not None})
        console.print(f"outputs written to {args.out}")
    return 0 if len(good) == len(answers) else 1
