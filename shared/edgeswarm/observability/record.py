"""What programs measure, written into a service's Metrics under the internal names the catalogue maps.

One function per event, so a program never spells an internal name and the catalogue's sources stay the only
place that knows them. Times are seconds. Labels: ``job`` a job name, ``kind`` a job kind, ``reason`` a short
name from a closed list (never a caller's text).
"""

from __future__ import annotations

from functools import lru_cache

from edgeswarm.metrics import Metrics
from edgeswarm.observability import catalogue as c


@lru_cache(maxsize=256)
def _buckets(name: str) -> tuple[float, ...]:
    return c.buckets_for(name)


def observe(metrics: Metrics, name: str, value: float) -> None:
    """Observe ``value`` in histogram ``name`` of ``metrics``, with the buckets the catalogue gives that name."""
    metrics.observe(name, value, _buckets(name))


def request_answered(metrics: Metrics, job: str, duration_s: float) -> None:
    """A serving request of ``job`` answered ``duration_s`` after it arrived."""
    observe(metrics, c.REQUEST_DURATION + job, duration_s)
    metrics.count(f"{c.REQUESTS}answered.{job}")


def request_refused(metrics: Metrics, job: str, reason: str) -> None:
    """A serving request of ``job`` (a job this coordinator runs) refused with InferError ``reason``."""
    metrics.count(f"{c.REQUESTS}{reason}.{job}")


def request_dispatched(metrics: Metrics, job: str, queued_s: float) -> None:
    """A request of ``job`` left the queue for the devices after waiting ``queued_s``."""
    observe(metrics, c.REQUEST_QUEUE + job, queued_s)


def first_token(metrics: Metrics, job: str, ttft_s: float, prompt_tokens: int) -> None:
    """A generation request of ``job`` (``prompt_tokens`` long) had its first token ``ttft_s`` after it arrived."""
    observe(metrics, c.TTFT + job, ttft_s)
    metrics.count(c.PROMPT_TOKENS + job, prompt_tokens)


def next_token(metrics: Metrics, job: str, seconds: float) -> None:
    """One decode pass of ``job`` produced the next token in ``seconds``."""
    observe(metrics, c.ITL + job, seconds)


def tokens_generated(metrics: Metrics, job: str, tokens: int) -> None:
    """An answered request of ``job`` carried ``tokens`` generated tokens (none: an encoder's, nothing counted)."""
    if tokens > 0:
        metrics.count(c.GENERATION_TOKENS + job, tokens)


def round_done(metrics: Metrics, kind: str, job: str, round_s: float, samples: int) -> None:
    """A training round of ``job`` (of ``kind``) took ``round_s`` over ``samples`` samples."""
    observe(metrics, f"{c.ROUND_DURATION}{kind}.{job}", round_s)
    metrics.count(f"{c.ROUNDS}{kind}.{job}")
    metrics.count(f"{c.SAMPLES}{kind}.{job}", samples)


def recovered(metrics: Metrics, job: str, device_lost: bool) -> None:
    """``job`` runs again on a new plan after a disruption (``device_lost``: a device was confirmed gone)."""
    metrics.count(f"{c.RECOVERIES}{'device_lost' if device_lost else 'disrupted'}.{job}")


def replayed(metrics: Metrics, job: str, units: int) -> None:
    """``units`` of ``job``'s work (items, requests, rounds) were sent again after a recovery."""
    if units > 0:
        metrics.count(c.REPLAYED + job, units)
