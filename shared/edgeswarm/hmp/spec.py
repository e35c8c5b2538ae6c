"""What a user submits to serve a Transformer split across devices: ``kind: serve-hmp`` and these fields."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.messages.hmp import MAX_BATCH, MAX_NEW_TOKENS, LayerSplit
from edgeswarm.planning.hmp.shares import MAX_SHARDS, Mode
from edgeswarm.values.text_model import TextModelSource
from edgeswarm.wire.schema import NAME_PATTERN, Name

PREFILL = "prefill"  # the span a shard records over a whole pass from token 0 ("decode" over the others)


class HmpPlannerSpec(BaseModel):
    """How the planner may split the job: devices it must leave out, whether it may leave out devices that do not
    pay for their communication (``prune``), and how an over-budget device's share moves (``paper``: in proportion
    to the receivers' speed, as Algorithm 1;
    ``water``: water-filling, never past a receiver's free memory)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    exclude: list[Name] = Field(default_factory=list, max_length=MAX_SHARDS)
    prune: bool = True
    shift: Literal["paper", "water"] = "paper"


class HmpSpec(BaseModel):
    """A tensor-parallel serving job. ``mode`` is Galaxy's hybrid parallelism (``galaxy``) or a baseline on the same
    runtime (``megatron``: equal tensor parallelism with AllReduce; ``sp``: sequence parallelism, every device holds
    every weight; ``local``: one device), or ``auto`` (the default): whichever of them the planner predicts fastest on
    the cluster, so a job is never planned slower than a baseline it could run (or one on fewer devices predicted within
    5% of it); ``overlap`` lets Galaxy tile its collectives with its GEMMs where the planner predicts the tiles faster
    (false: never). ``seq_len`` is the prompt length it is profiled and planned for; ``max_tokens`` bounds a request's
    prompt and generated tokens together, ``max_new_tokens`` is a decoder's default number of generated tokens. A
    decoder's requests decode together, up to ``max_batch`` of them (each pass holds a step of every one; the plan
    leaves room for that many KV caches, and each device reserves a request's as it joins), a joining request's prompt
    going in ``prefill_chunk`` tokens a pass beside them (0: whole), so running streams never wait longer than one
    chunk; with none decoding, a prompt goes in passes of up to ``seq_len`` tokens. At most ``queue`` requests wait;
    beyond, or when a request's KV cache does not fit a device's memory and none of the job's is running to free some, a
    request is answered ``busy``. The ring's slices go at ``qos`` (0: a slice not there within ``deadline_s`` seconds is
    asked for again once; a request whose pass fails is run again once). A decode step (one row) synchronises with
    ``direct`` collectives, one round of messages from every device to every other, or ``ring`` ones, one hop after
    another: direct wins where each message's latency is its cost (separate devices), ring where the devices share the
    cores that move the messages (an emulated cluster on one host)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["serve-hmp"]
    name: str = Field(pattern=NAME_PATTERN)
    model: TextModelSource
    mode: Literal["auto"] | Mode = "auto"
    overlap: bool = True
    seq_len: int = Field(default=128, ge=1, le=1 << 16)
    max_tokens: int = Field(default=512, ge=1, le=1 << 17)
    max_new_tokens: int = Field(default=16, ge=0, le=MAX_NEW_TOKENS)
    queue: int = Field(default=64, ge=1, le=4096)
    max_batch: int = Field(default=8, ge=1, le=MAX_BATCH)
    prefill_chunk: int = Field(default=128, ge=0, le=1 << 16)
    qos: Literal[0, 1] = 0
    deadline_s: float = Field(default=5.0, gt=0, le=600)
    decode_syncs: Literal["direct", "ring"] = "direct"
    planner: HmpPlannerSpec = HmpPlannerSpec()


class HmpProgress(BaseModel):
    """How a tensor-parallel serving job serves: requests ``answered`` and refused (``errors``), ``recomputed``
    requests (a device was lost during them: their KV cache was rebuilt on the survivors), requests ``queued``,
    ``tokens`` generated. Latencies are over the recent requests, in seconds: ``latency`` from arrival to answer,
    ``ttft`` to the first token, ``tpot`` per further token; ``tokens_per_s`` a stream's generated tokens per second
    of decoding; ``passes`` run and the most requests one held (``peak_batch``). ``split`` is the measured per-layer
    time split of the latest prefill (slowest device), beside the plan's predictions and ``refitted_latency_s``: the
    running plan's prefill priced on each device's arithmetic as measured so far (the closed loop's fit)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    kind: Literal["serve-hmp"] = "serve-hmp"
    answered: int = Field(default=0, ge=0)
    errors: int = Field(default=0, ge=0)
    recomputed: int = Field(default=0, ge=0)
    queued: int = Field(default=0, ge=0)
    tokens: int = Field(default=0, ge=0)
    reconfigurations: int = Field(default=0, ge=0)
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    ttft_p50_s: float | None = None
    tpot_p50_s: float | None = None
    tokens_per_s: float | None = None
    split: LayerSplit | None = None
    predicted_latency_s: float | None = None
    predicted_tpot_s: float | None = None
    refitted_latency_s: float | None = None
    passes: int = Field(default=0, ge=0)
    peak_batch: int = Field(default=0, ge=0)
