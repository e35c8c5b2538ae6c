"""Messages of the serve-hmp workload (Galaxy): deploying a model split by heads, columns and rows, its passes, and
requests for it.

The coordinator assigns each device of an HmpPlan its shard (ShardAssign, answered ShardReady or StageFailed) and
releases it when the job ends (ShardRelease). A request runs as passes: its prompt (in one pass or in chunks), then
one pass per generated token; a decoder's passes batch the running requests (each pass holds a decode step of every
one and a chunk of a joining one's prompt). Each pass starts with a ShardPass frame (the pass's token ids) from the
coordinator to every device of the ring; the devices exchange CollectiveTensor slices among themselves, and each
answers the coordinator with a ShardResult frame (its rows of the final hidden states, or, from the devices holding
a request's last row, the request's next token). Before a request's first pass on a plan, ShardAdmit has every
device reserve its KV cache in the node's memory ledger (answered ShardAdmitted, naming the requests that did not
fit); ShardFree drops a request's KV cache and gives its memory back.

Anyone allowed to send the coordinator tensors asks with an HmpRequest frame on the coordinator's data topic (token
ids as an int64 tensor [tokens], or ``text`` for a model with a tokenizer), with ``reply_to`` and a correlation id in
its envelope; the answer is an HmpReply (its tensor: the final hidden states [tokens, hidden] of an encoder) or an
InferError on that reply topic.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.messages.collectives import MAX_SCOPE
from edgeswarm.planning.hmp.shares import HmpShares
from edgeswarm.planning.hmp.types import BlockProfile
from edgeswarm.values.chat import MAX_MESSAGES, ChatMessage
from edgeswarm.values.limits import MAX_DEVICES, MAX_EPOCH
from edgeswarm.values.sampling import Sampling
from edgeswarm.values.text_model import TextModelSource
from edgeswarm.wire.schema import MIB, Message, Name, schema

MAX_TEXT_CHARS = 16384
MAX_NEW_TOKENS = 4096
MAX_BATCH = 64  # requests one pass holds
MAX_REQUESTS_FREED = 64
MAX_STOPS = 8  # stop strings a request names
MAX_STOP_CHARS = 256


class PassSplit(BaseModel):
    """Where one device's time went in one pass, in seconds summed over the layers: ``compute`` (its own
    arithmetic), ``sync`` (inside collectives, sending and adding), ``waiting`` (for a peer's slice)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    compute_s: float = Field(default=0.0, ge=0)
    sync_s: float = Field(default=0.0, ge=0)
    waiting_s: float = Field(default=0.0, ge=0)


@schema("edgeswarm.hmp.profile", 1)
class ShardProfileRequest(Message):
    """Request to a tensor-shard-worker: time one layer's attention, MLP and connective blocks of ``model`` at
    ``seq_len`` tokens on this device (several head, column and row counts; spec 1.1). Answered ShardProfileReply,
    or StageFailed."""

    model: TextModelSource
    seq_len: int = Field(ge=1, le=1 << 16)


@schema("edgeswarm.hmp.profile_reply", 1)
class ShardProfileReply(Message):
    """The device's block latencies and memory budget (``planning.hmp.types.BlockProfile``)."""

    MAX_BYTES = 1 * MIB

    profile: BlockProfile


@schema("edgeswarm.hmp.assign", 1)
class ShardAssign(Message):
    """Request to a tensor-shard-worker: hold rank ``rank``'s shard of ``model`` under ``shares`` for serving job
    ``job_id`` at plan ``epoch``; passes come from ``coordinator``. ``max_tokens`` bounds a request's sequence
    (prompt and generated tokens: the KV cache it may hold); ``qos`` and ``deadline_s`` are the ring's (a step's
    slice that has not come within ``deadline_s`` is asked for again once at QoS 0); ``max_batch`` bounds the
    requests one pass holds. Answered ShardReady, or StageFailed (``memory`` when the shard and one request's KV
    cache do not fit the device's budget). A newer assignment of the job replaces the old one."""

    MAX_BYTES = 1 * MIB

    job_id: Name
    epoch: int = Field(ge=0, le=MAX_EPOCH)
    rank: int = Field(ge=0, lt=MAX_DEVICES)
    model: TextModelSource
    shares: HmpShares
    coordinator: Name
    max_tokens: int = Field(ge=1, le=1 << 17)
    qos: Literal[0, 1] = 0
    deadline_s: float = Field(default=5.0, gt=0, le=600)
    max_batch: int = Field(default=1, ge=1, le=MAX_BATCH)  # requests decoding at once


@schema("edgeswarm.hmp.ready", 1)
class ShardReady(Message):
    """Rank ``rank`` of ``job_id`` at ``epoch`` holds its shard: ``parameters`` weights, ``memory_bytes`` reserved
    in the node's memory ledger (weights and one pass's activations; each request's KV cache is reserved apart, by
    ShardAdmit), ``load_s`` seconds to make or read them."""

    job_id: Name
    epoch: int = Field(ge=0)
    rank: int = Field(ge=0)
    parameters: int = Field(ge=0)
    memory_bytes: int = Field(ge=0)
    load_s: float = Field(ge=0)


@schema("edgeswarm.hmp.release", 1)
class ShardRelease(Message):
    """Command to a tensor-shard-worker, not answered: drop serving job ``job_id``'s shard."""

    job_id: Name


class KvRequest(BaseModel):
    """A request whose KV cache a shard reserves: request number ``request``, up to ``tokens`` positions (its prompt
    and the tokens it may generate)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request: int = Field(ge=0, le=MAX_SCOPE)
    tokens: int = Field(ge=1, le=1 << 17)


class KvRefusal(BaseModel):
    """A request whose KV cache did not fit, and why (the ledger's account of who holds the memory)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request: int = Field(ge=0, le=MAX_SCOPE)
    detail: str = Field(max_length=2048)


@schema("edgeswarm.hmp.admit", 1)
class ShardAdmit(Message):
    """Request to a tensor-shard-worker: reserve the KV cache of each of ``requests`` of ``job_id`` at ``epoch`` in
    the node's memory ledger, before their first pass (a pass that starts a cache the shard has not reserved is
    dropped). Answered ShardAdmitted, or StageFailed (``not_assigned``: no shard of that job and epoch here)."""

    job_id: Name
    epoch: int = Field(ge=0, le=MAX_EPOCH)
    requests: list[KvRequest] = Field(min_length=1, max_length=MAX_BATCH)


@schema("edgeswarm.hmp.admitted", 1)
class ShardAdmitted(Message):
    """Rank ``rank`` reserved the KV caches of the admitted requests, all but ``refused``'s (they did not fit
    beside what the node's ledger holds)."""

    job_id: Name
    epoch: int = Field(ge=0, le=MAX_EPOCH)
    rank: int = Field(ge=0, lt=MAX_DEVICES)
    refused: list[KvRefusal] = Field(default_factory=list, max_length=MAX_BATCH)


@schema("edgeswarm.hmp.free", 1)
class ShardFree(Message):
    """Command, not answered: drop the KV caches of ``requests`` (their passes are over) of ``job_id`` and give
    their memory back."""

    job_id: Name
    epoch: int = Field(ge=0, le=MAX_EPOCH)
    requests: list[int] = Field(max_length=MAX_REQUESTS_FREED)


class PassSegment(BaseModel):
    """One request's part of a pass: the next ``tokens`` of the pass's token ids, at positions ``start`` .. of
    request number ``request`` (the KV cache they extend; 0 .. starts the cache ShardAdmit reserved). With
    ``answer``, the rank holding its last row chooses the request's next token as ``sampling`` says (None: greedy),
    over the request's tokens it has seen (every rank keeps them with the cache); without (a chunk of a prompt not
    yet all in), none."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request: int = Field(ge=0, le=MAX_SCOPE)
    start: int = Field(ge=0, le=1 << 17)
    tokens: int = Field(ge=1, le=1 << 17)
    sampling: Sampling | None = None
    answer: bool = True


@schema("edgeswarm.hmp.pass", 2)
class ShardPass(Message):
    """Frames of one pass of ``job_id`` at ``epoch`` for every rank: its tensor is the pass's token ids (int64
    [tokens]), the ``segments``' one after another (an encoder's pass: one). ``pass_id`` numbers the job's passes
    (the ring's exchange scope)."""

    job_id: Name
    epoch: int = Field(ge=0, le=MAX_EPOCH)
    pass_id: int = Field(ge=0, le=MAX_SCOPE)
    segments: list[PassSegment] = Field(min_length=1, max_length=MAX_BATCH)


@schema("edgeswarm.hmp.result", 2)
class ShardResult(Message):
    """Frames of rank ``rank``'s answer to pass ``pass_id``: its tensor holds its rows [row_start, row_start + rows)
    of the final hidden states (an encoder), or nothing (an empty tensor: a decoder). ``tokens``: a decoder's next
    token of each segment of the pass whose last row this rank holds, -1 for the others (empty from a rank that
    answers none). ``split`` says where the rank's time went."""

    job_id: Name
    epoch: int = Field(ge=0, le=MAX_EPOCH)
    pass_id: int = Field(ge=0, le=MAX_SCOPE)
    rank: int = Field(ge=0, lt=MAX_DEVICES)
    row_start: int = Field(default=0, ge=0)
    tokens: list[int] = Field(default_factory=list, max_length=MAX_BATCH)
    split: PassSplit = PassSplit()
    cache_bytes: int = Field(default=0, ge=0)


@schema("edgeswarm.hmp.request", 1)
class HmpRequest(Message):
    """Frames of a request to serving job ``job_id``: token ids (its tensor, int64 [tokens]), ``text`` (for a
    model with a tokenizer; its tensor is then empty) or ``messages``, a conversation (for a model whose folder has
    a chat template: the prompt is the template's, with the assistant's turn opened). A decoder generates up to
    ``max_new_tokens`` tokens (None: the job's default; 0: the prefill alone), greedily or as ``sampling`` says, and
    stops early at the model's end of sequence (a chat model's end of turn) or once its text holds one of ``stop``
    (the answer's text ends before it); an encoder answers its final hidden states. ``request_id`` is the caller's,
    echoed."""

    job_id: Name
    request_id: str = Field(default="", max_length=64)
    text: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    max_new_tokens: int | None = Field(default=None, ge=0, le=MAX_NEW_TOKENS)
    sampling: Sampling | None = None
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] = Field(default_factory=list,
                                                                                        max_length=MAX_STOPS)
    stream: bool = False


@schema("edgeswarm.hmp.delta", 1)
class HmpDelta(Message):
    """While a request with ``stream`` is generated: its next tokens (``first`` is the index of the first among the
    generated ones) and the text they add from character ``offset`` of the answer's text on (held back while it may
    be the start of a stop string or ends in half a character; the HmpReply that ends the stream has the whole
    text), on the request's reply topic. Replies travel at QoS 0: a caller that sees a gap in ``offset`` takes the
    rest from the HmpReply."""

    job_id: Name
    request_id: str = Field(default="", max_length=64)
    first: int = Field(ge=0, le=MAX_NEW_TOKENS)
    tokens: list[int] = Field(max_length=MAX_NEW_TOKENS)
    offset: int = Field(default=0, ge=0, le=4 * MAX_TEXT_CHARS)
    text: str = Field(default="", max_length=4 * MAX_TEXT_CHARS)


@schema("edgeswarm.hmp.cancel", 1)
class HmpCancel(Message):
    """Frames (an empty tensor) from a caller: stop its request ``request_id`` (queued or being generated; answered
    InferError ``cancelled``). A request is only cancelled by the node and service that sent it."""

    job_id: Name
    request_id: str = Field(min_length=1, max_length=64)


class LayerSplit(BaseModel):
    """A request's time per layer on its slowest device, in milliseconds: compute, sync and waiting (the device
    whose sum is the largest)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    compute_ms: float = Field(ge=0)
    sync_ms: float = Field(ge=0)
    waiting_ms: float = Field(ge=0)


@schema("edgeswarm.hmp.reply", 1)
class HmpReply(Message):
    """The answer to ``request_id``: the prompt's ``prompt_tokens`` token ids and the generated ``tokens`` (with
    ``text``, their decoding, for a model with a tokenizer); an encoder's tensor is its final hidden states
    [tokens, hidden] (float32). ``latency_s`` runs from the request's arrival at the coordinator to this answer;
    ``ttft_s`` to its first token (the prefill), ``tpot_s`` is the mean time per further token. ``split`` is the
    per-layer time split of the prefill, ``epoch`` the plan epoch that finished it; ``recomputed`` says a device
    was lost during it and the request's cache was rebuilt on the survivors."""

    MAX_BYTES = 1 * MIB

    job_id: Name
    request_id: str = Field(default="", max_length=64)
    prompt_tokens: list[int] = Field(default_factory=list, max_length=1 << 17)
    tokens: list[int] = Field(default_factory=list, max_length=MAX_NEW_TOKENS)
    text: str = Field(default="", max_length=4 * MAX_TEXT_CHARS)
    latency_s: float = Field(ge=0)
    ttft_s: float = Field(ge=0)
    tpot_s: float | None = Field(default=None, ge=0)
    split: LayerSplit | None = None
    epoch: int = Field(ge=0)
    recomputed: bool = False
    finish: Literal["stop", "length"] = "stop"  # ended at its end of sequence or a stop string, or at its length
