"""A caller's side of a serve-hmp job: send token ids or text, get generated tokens (or hidden states) back.

Any MQTT client can do the same from the wire format alone: an ``edgeswarm.hmp.request`` frame on the coordinator's
data topic (its tensor: int64 token ids, or empty with ``text``), with ``reply_to`` and a correlation id, answered
on that reply topic with an ``edgeswarm.hmp.reply`` (or ``edgeswarm.infer.error``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgeswarm.bus import Bus, Expectation, Inbound, ReplyStream
from edgeswarm.errors import EdgeswarmError
from edgeswarm.messages.hmp import HmpCancel, HmpDelta, HmpReply, HmpRequest
from edgeswarm.messages.liveness import RequestRejected
from edgeswarm.messages.serving import InferError
from edgeswarm.values.chat import ChatMessage
from edgeswarm.values.sampling import Sampling
from edgeswarm.wire.schema import new_id

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

COORDINATOR_NODE = "hub"
POLL_S = 0.25  # how often a stream that was given ``alive`` asks it while it waits


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
          sampling: Sampling | None, stop: list[str], expectation: Expectation | None = None,
          request_id: str | None = None) -> Expectation:
    import torch

    exp = expectation or bus.expect()
    chat = [m for m in prompt if isinstance(m, ChatMessage)] if isinstance(prompt, list) else []
    body = HmpRequest(job_id=job_id, request_id=request_id or new_id(),
                      text=prompt if isinstance(prompt, str) else None, messages=chat or None,
                      max_new_tokens=max_new_tokens, sampling=sampling, stop=stop,
                      stream=isinstance(exp, ReplyStream))
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
        answer = _answer(job_id, reply, latency, timeout_s)
        answer.index = index
        answers[index] = answer
    return [answers[k] for k in sorted(answers)]


def _answer(job_id: str, reply: Inbound | None, latency: float, timeout_s: float) -> Answer:
    body = reply.body if reply is not None else None
    if isinstance(body, HmpReply):
        hidden = reply.tensor.to_torch() if reply is not None and reply.tensor is not None else None
        return Answer(0, latency, body, hidden)
    if isinstance(body, (InferError, RequestRejected)):
        return Answer(0, latency, reason=body.reason, error=body.detail)
    return Answer(0, latency, reason="timeout", error=f"no answer from job {job_id} within {timeout_s:.0f} s")


def stream(bus: Bus, job_id: str, prompt: Prompt, *, request_id: str, max_new_tokens: int | None = None,
           sampling: Sampling | None = None, stop: list[str] | None = None, timeout_s: float = 120.0,
           coordinator: str = COORDINATOR_NODE, alive: Callable[[], bool] | None = None
           ) -> Generator[HmpDelta | Answer, None, None]:
    """Ask serve-hmp job ``job_id`` as ``ask`` does, one prompt, its answer streamed: each HmpDelta as its tokens are
    generated, then the Answer (the whole reply, or why there is none; reason ``timeout`` when the coordinator said
    nothing for ``timeout_s`` seconds). ``request_id`` names it for ``cancel``. While it waits it asks ``alive``
    every POLL_S seconds; when that says the caller went away, or the caller stops iterating before the answer, the
    request is cancelled on the coordinator."""
    replies = bus.expect_stream()
    sent = time.monotonic()
    answered = False
    try:
        _send(bus, job_id, prompt, max_new_tokens, coordinator, sampling, stop or [], replies, request_id)
        heard = checked = sent
        while True:
            reply = replies.next(POLL_S if alive is not None else timeout_s)
            now = time.monotonic()
            if alive is not None and now - checked >= POLL_S:  # asked while tokens flow too, not only in pauses
                checked = now
                if not alive():
                    answered = True  # nobody to answer: stop the work
                    cancel(bus, job_id, request_id, coordinator)
                    yield Answer(0, now - sent, reason="cancelled", error="the caller went away")
                    return
            if reply is None and now - heard < timeout_s and replies.refusal is None:
                continue
            heard = now
            if reply is not None and isinstance(reply.body, HmpDelta):
                yield reply.body
                continue
            answered = True
            yield _answer(job_id, reply, now - sent, timeout_s)
            return
    finally:
        replies.close()
        if not answered:
            try:
                cancel(bus, job_id, request_id, coordinator)
            except EdgeswarmError as exc:
                log.debug("could not cancel request %s: %s", request_id, exc)


def cancel(bus: Bus, job_id: str, request_id: str, coordinator: str = COORDINATOR_NODE) -> None:
    """Tell serve-hmp job ``job_id`` to stop this caller's request ``request_id`` (answered ``cancelled``)."""
    import torch

    bus.send_tensor(coordinator, "coordinator", HmpCancel(job_id=job_id, request_id=request_id),
                    torch.empty(0, dtype=torch.int64))
