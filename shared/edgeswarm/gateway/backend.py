"""What the gateway asks of a job kind that serves language models (``Workload.text_models``), in the gateway's own
terms: the models it serves now, and a request's answer as it is generated."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Protocol

from edgeswarm.values.chat import ChatMessage
from edgeswarm.values.sampling import Sampling

Prompt = str | list[int] | list[ChatMessage]


@dataclass(frozen=True)
class TextDelta:
    """Text an answer adds as it is generated, from character ``offset`` of its text on (a caller that sees a gap
    takes the rest from ``TextDone``)."""

    offset: int
    text: str


@dataclass(frozen=True)
class TextDone:
    """A whole answer: its text, why it ended (``stop`` or ``length``) and its token counts."""

    text: str
    finish: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class TextFailed:
    """No answer: ``reason`` (an InferError reason, ``timeout`` or ``cancelled``) and what to do."""

    reason: str
    detail: str


TextEvent = TextDelta | TextDone | TextFailed


class TextModels(Protocol):
    """One kind's language models, made by its ``text_models`` hook from the gateway's bus."""

    def models(self) -> list[tuple[str, float]]:
        """The models served now: (name, when its job was submitted, epoch seconds)."""

    def generate(self, model: str, prompt: Prompt, *, request_id: str, new_tokens: int | None, sampling: Sampling,
                 stop: list[str], alive: Callable[[], bool]) -> Generator[TextEvent, None, None]:
        """Ask the job serving ``model``: its deltas, then one TextDone or TextFailed. Asks ``alive`` while it waits
        and cancels the request when it says the client went away, or when the caller closes the generator first."""
