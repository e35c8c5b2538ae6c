"""A caller's side of a serve-hmp job: send token ids or text, get generated tokens (or hidden states) back.

Any MQTT client can do the same from the wire format alone: an ``edgeswarm.hmp.request`` frame on the coordinator's
data topic (its tensor: int64 token ids, or empty with ``text``), with ``reply_to`` and a correlation id, answered
on that reply topic with an ``edgeswarm.hmp.reply`` (or ``edgeswarm.infer.error``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgeswarm.bus import Bus, Expectation
from edgeswarm.messages.hmp import HmpReply, HmpRequest
from edgeswarm.messages.liveness import RequestRejected
from edgeswarm.messages.serving import InferError
from edgeswarm.values.chat import ChatMessage
from edgeswarm.values.sampling import Sampling
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


Prompt = list[int] | str | list[ChatMessage]


def _send(bus: Bus, job_id: str, prompt: Prompt, max_new_tokens: int | None, coordinator: str,
          sampling: Sampling | None, stop: list[str]) -> Expectation:
    import torch

    exp = bus.expect()
    chat = [m for m in prompt if isinstance(m, ChatMessage)] if isinstance(prompt, list) else []
    body = HmpRequest(job_id=job_id, request_id=new_id(), text=prompt if isinstance(prompt, str) else None,
                      messages=chat or None, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop)
    if isinstance(prompt, str) or chat:
        tensor = torch.empty(0, dtype=torch.int64)
    else:
        tensor = torch.tensor(prompt, dtype=torch.int64)
    bus.send_tensor(coordinator, "coordinator", body, tensor, expectation=exp)
    return exp


def ask(bus: Bus, job_id: str, prompts: Sequence[Prompt], *, max_new_tokens: int | None = None, window: int = 4,
        timeout_s: float = 120.0, coordinator: str = COORDINATOR_NODE, sampling: Sampling | None = None,
        stop: list[str] | None = None) -> list[Answer]:
    """Send every prompt (token ids, text for a model with a tokenizer, or a conversation for one with a chat
    template) to serve-hmp job ``job_id``, at most ``window`` unanswered at once, and return the answers in prompt
    order; a request not answered within ``timeout_s`` seconds is an answer with reason ``timeout``.
    ``max_new_tokens``: what a decoder generates (None: the job's default); ``sampling``: how (None: greedily);
    ``stop``: strings that end the generated text."""
    answers: dict[int, Answer] = {}
    pending: list[tuple[int, Expectation, float]] = []
    todo = list(enumerate(prompts))
    while todo or pending:
        while todo and len(pending) < window:
            index, prompt = todo.pop(0)
            pending.append((index, _send(bus, job_id, prompt, max_new_tokens, coordinator, sampling, stop or []),
                            time.monotonic()))
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
