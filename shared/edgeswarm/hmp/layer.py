"""One rank's forward pass of a Transformer split by ``HmpShares``, for every mode, with the request's KV cache.

Rows. A pass over ``s`` tokens splits its rows evenly (``row_bounds``: the first ``s mod D`` ranks one more row;
a decode step of one token is rows 1, 0, 0, ...). Every rank is given the same token ids (they are tiny).

* ``galaxy`` (spec section 2): every rank embeds the whole sequence (replicated, so layer 0 needs no AllGather;
  pre-LN families also apply layer 0's input norm to all rows there, outside the layers), then per layer
  MHA on its heads -> ReduceScatter -> connective block on its rows -> AllGather -> MLP on its columns ->
  ReduceScatter -> connective block on its rows -> AllGather (not after the last layer). Pre-LN: the residual
  stream stays sharded by rows and a connective block is "residual add -> the next sub-block's norm" (section
  2.5; the last layer's is the final norm). With ``overlap`` each AllGather is tiled with the GEMM after it and
  each ReduceScatter with the GEMM before it (``tiles``); without, the platform's ring collectives run whole.
  Collective numbers within a pass: layer*4 + 0 (AllGather into QKV, layers >= 1), +1 (ReduceScatter after the
  output projection), +2 (AllGather into the MLP), +3 (ReduceScatter after the MLP).
* ``megatron``: the same heads and columns, an AllReduce after each TP block (numbers layer*4 + 1 and + 3), the
  connective blocks on every row on every rank.
* ``sp``: every weight on every rank, its rows only, keys and values AllGathered per layer (layer*4 + 0 and + 1),
  causal masks by absolute position.
* ``local``: one rank, everything (megatron's path with no collective).

Direct syncs (``direct_syncs``: a pass of fewer rows than ranks, such as every decode step). Splitting so few
rows gains nothing, and a ring collective of them is D - 1 sequential message hops that carry almost nothing, so
such a pass is message-bound. galaxy and megatron then run megatron's path: every rank holds all the pass's rows
(the connective blocks replicated) and the two per-layer syncs (numbers layer*4 + 1 and + 3) are direct
AllReduces (``runtime.collectives.direct_all_reduce``: one round of D - 1 parallel messages each, summed in rank
order so every rank's replicated rows hold the same bits): 2 message rounds per layer instead of 4 (D - 1) hops.
galaxy still answers with its row slice (``row_bounds``) of the result. sp keeps its K and V AllGathers (it shards
no weights, so there is nothing to reduce) but runs them direct (one round each, from the ranks with rows).
The KV cache is the same either way (each rank's heads, or sp's every head, for every position), so a prefill
on the ring and decode steps direct continue one another.

KV cache (decoders). galaxy and megatron: each rank caches the keys and values of its KV heads for every position
(the prefill fills it, each decode step adds the step's rows), which is exactly the single device's cache cut by
heads. sp: each rank caches every head's keys and values for every position, as gathered (D copies in all: sp
shards no weights either; its decode steps would otherwise AllGather the whole cache each step).

Output. Each rank returns ``RankOutput``: its rows of the final hidden states (galaxy, sp: its row slice;
megatron, local: all rows). The last row is on ``last_row_rank(mode, s, D)``, which ``next_logits`` answers on.

Logits (``answer_logits``). Galaxy and megatron on two or more devices (``HmpShares.splits_head``) split a decoder's
lm_head by vocabulary (``HmpShares.vocab_bounds``, in proportion to the ranks' MLP columns): each rank multiplies the
rows that want a token by its rows of the head, and one direct AllGather (collective number layers*4 + 1) puts the
logits together; the rank that answers a segment samples from them. Where a wanted row is on one rank only (galaxy's
prefill on the ring), a direct AllReduce of those rows first (number layers*4: each rank adds its own, zeros for the
others', so every rank gets them exactly). The head of a large vocabulary is the biggest single product of a pass's
answer (Llama 3.2's 128,256 x 2,048, more than a layer's weights), and the other ranks would otherwise wait while
one computes it. sp and one device compute it whole on the rank holding the row.

The ring is a factory ``ring(collective) -> (send, recv)`` (``runtime.collectives``' callables) for one pass;
numbers are unique within a pass, so each pass (prefill, every decode step) needs its own scope.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from edgeswarm.hmp.sharding import check_shares, rank_slices, read_shard, shard_shapes
from edgeswarm.hmp.tiles import CommThreads, ag_gemm, gemm_rs
from edgeswarm.hmp.trace import OUTSIDE, Recorder
from edgeswarm.models.text.ops import (
    HeadCache,
    Matrix,
    Weights,
    attention,
    cat_rows,
    embed,
    linear,
    mlp_inner,
    norm,
    positioned,
    torch_dtype,
)
from edgeswarm.models.text.slices import WeightSlice
from edgeswarm.planning.hmp.shares import HmpShares
from edgeswarm.runtime.collectives import (
    Bounds,
    Recv,
    Send,
    direct_all_gather,
    direct_all_reduce,
    even_bounds,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from edgeswarm.values.text_model import TextModelConfig

Ring = Callable[[int], tuple[Send, Recv]]
COLLECTIVES_PER_LAYER = 4


def row_bounds(s: int, parts: int) -> Bounds:
    """The rows [start, end) of each rank for a pass of ``s`` tokens (the first ``s mod parts`` one longer)."""
    return even_bounds(s, parts)


def direct_syncs(rows: int, parts: int) -> bool:
    """Whether a pass of ``rows`` tokens on ``parts`` ranks synchronises with direct collectives, every rank holding
    every row (galaxy, megatron; sp gathers direct), instead of ring collectives over row slices: when there are
    fewer rows than ranks (a decode step's one row; a prompt shorter than the ring), where a ring step carries at
    most one row and its message's fixed cost is all its time."""
    return parts > 1 and rows < parts


def last_row_rank(mode: str, s: int, parts: int) -> int:
    """The rank that answers for the last row of a pass of ``s`` rows (the owner of row s-1 by ``row_bounds``;
    megatron's ranks all hold it, and the same rank answers)."""
    for j, (a, b) in enumerate(row_bounds(s, parts)):
        if a <= s - 1 < b:
            return j
    return 0


class RankOutput(BaseModel):
    """Rows [``start``, ``start + hidden.shape[0]``) of the final hidden states of a pass of ``rows`` tokens (after
    the final norm for pre-LN families), held by rank ``rank``; ``last`` when this rank answers for row
    ``rows - 1``. A batched pass's segments end at rows ``ends`` (one segment: [rows]); ``answers`` lists the
    segments whose last row this rank answers for (``segment_logits``)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    rank: int
    start: int
    rows: int
    hidden: torch.Tensor
    last: bool
    ends: tuple[int, ...] = ()
    answers: tuple[int, ...] = ()
    every: torch.Tensor | None = None  # every row of the pass, where this rank holds them all (galaxy direct, megatron)


@dataclass(frozen=True)
class Segment:
    """Rows [``a``, ``b``) of a pass: one request's tokens at positions ``start`` .., continuing ``cache`` (None: an
    encoder's pass without one)."""

    cache: RequestCache | None
    start: int
    a: int
    b: int


class RequestCache:
    """One request's KV cache on one rank (one ``HeadCache`` per layer), the number of positions it covers and their
    token ids (what sampling's penalties count); ``free`` drops the tensors at once (the request ended or its client
    left)."""

    def __init__(self, layers: int) -> None:
        self.layers = [HeadCache() for _ in range(layers)]
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        """The positions it covers: one a token."""
        return len(self.tokens)

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)

    def free(self) -> None:
        self.layers = [HeadCache() for _ in self.layers]
        self.tokens = []

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions (drop those of a pass that failed part-way)."""
        for c in self.layers:
            if c.k is not None and c.v is not None:
                c.k, c.v = c.k[:, :length].clone(), c.v[:, :length].clone()
        self.tokens = self.tokens[:length]


class HmpRank:
    """Rank ``rank`` of ``shares`` computing ``cfg`` on torch device ``device``. ``weights``: its shard
    (``sharding.read_shard``) or the whole model's dict (cut here); moved to ``device`` in ``cfg``'s dtype.
    Holds two communication threads: ``close`` them. Not thread-safe: one pass at a time."""

    def __init__(self, cfg: TextModelConfig, shares: HmpShares, rank: int, weights: Weights,
                 device: torch.device | str = "cpu", *, spans: bool = True, slowdown: float = 1.0) -> None:
        check_shares(cfg, shares)
        if shares.mode == "local" and rank != 0:
            raise ValueError("a local run has only rank 0")
        self.cfg, self.shares, self.rank = cfg, shares, rank
        self.n = len(shares.devices)
        self.device = torch.device(device)
        self.dtype = torch_dtype(cfg)
        dev = self.device
        fence = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None
        self.recorder = Recorder(spans, fence, slowdown)
        self.io = CommThreads(self.recorder, f"hmp{rank}")
        want = shard_shapes(cfg, shares, rank)
        slices = {s.name: s for s in rank_slices(cfg, shares, rank)}
        w: Weights = {}
        for name, shape in want.items():
            if name not in weights:
                raise ValueError(f"rank {rank} needs weight {name}")
            t = weights[name]
            cut = tuple(t.shape) != shape
            if cut:
                t = slices[name].cut(t)
                if tuple(t.shape) != shape:
                    raise ValueError(f"{name}: got {tuple(weights[name].shape)}, rank {rank} holds {shape}")
            # a copy of a cut part, so that a row slice does not keep the whole weight's storage alive
            w[name] = t.to(self.device, self.dtype, copy=cut).contiguous()
        if cfg.decoder and cfg.tie_embeddings:
            w["lm_head.weight"] = w["embed.tokens"]  # one tensor under both names, as the reference holds it
        self.w = w
        self._fuse()

    @classmethod
    def from_reader(cls, cfg: TextModelConfig, shares: HmpShares, rank: int,
                    read: Callable[[WeightSlice], torch.Tensor], device: torch.device | str = "cpu",
                    *, spans: bool = True, slowdown: float = 1.0) -> HmpRank:
        """A rank whose shard ``read(slice)`` gives weight by weight (a loader reading only its part of a file)."""
        return cls(cfg, shares, rank, read_shard(cfg, shares, rank, read), device, spans=spans, slowdown=slowdown)

    def _fuse(self) -> None:
        """One GEMM for q, k, v and one for up and gate per layer (the tiles multiply each once)."""
        self.qkv: list[tuple[Matrix, torch.Tensor | None, int, int]] = []
        self.upgate: list[Matrix] = []
        for i in range(self.cfg.layers):
            p = f"layers.{i}."
            q, k, v = (self.w.pop(p + n + ".weight") for n in ("q", "k", "v"))
            bias = None
            if self.cfg.attention_biased:
                bias = torch.cat([self.w.pop(p + n + ".bias") for n in ("q", "k", "v")])
            self.qkv.append((cat_rows([q, k, v]), bias, q.shape[0], k.shape[0]))
            if self.cfg.gated:
                self.upgate.append(cat_rows([self.w.pop(p + "up.weight"), self.w.pop(p + "gate.weight")]))

    def new_cache(self) -> RequestCache:
        return RequestCache(self.cfg.layers)

    def weight_bytes(self) -> int:
        """Bytes of the weights this rank holds (a tied ``lm_head`` counted once)."""
        seen: set[int] = set()
        total = 0
        tensors = list(self.w.values()) + [t for wt, b, _, _ in self.qkv for t in (wt, b) if t is not None]
        for t in tensors + self.upgate:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.nbytes
        return total

    def close(self) -> None:
        self.io.close()

    # -- public pass -------------------------------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor | list[int], ring: Ring, *, cache: RequestCache | None = None,
                types: torch.Tensor | None = None,
                batch: Sequence[tuple[RequestCache, int]] | None = None) -> RankOutput:
        """One pass over ``tokens`` (the same ids on every rank), continuing ``cache`` when given (a prefill, then
        one decode step per token) and adding this pass's keys and values to it. ``batch`` (galaxy, megatron and
        local): the pass holds several requests' tokens one after another, (cache, token count) each: a decode
        step of every running request and a chunk of a new one's prompt in one pass, its GEMMs and collectives over
        all their rows, attention per request over its own cache."""
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1).to(self.device)
        s = int(ids.shape[0])
        segs = self._segments(s, cache, batch, types)
        self._check(ids, segs, types)
        if types is not None:
            types = types.to(self.device)
        try:
            with torch.inference_mode():
                # A batch of decode steps (a row a request) syncs as one step does: directly, every rank holding
                # every row; tiling its few rows over the ring would repeat each GEMM's weight reads per tile.
                stepping = len(segs) > 1 and all(g.b - g.a == 1 for g in segs)
                direct = self.shares.direct_syncs and (direct_syncs(s, self.n) or stepping)
                every = None
                if self.shares.mode == "galaxy" and direct:
                    _, every = self._megatron(ids, segs, ring, types, direct=True)
                    first, end = row_bounds(s, self.n)[self.rank]
                    hidden = every[first:end]
                elif self.shares.mode == "galaxy":
                    first, hidden = self._galaxy(ids, segs, ring, types)
                elif self.shares.mode == "sp":
                    first, hidden = self._sp(ids, segs[0].start, ring, segs[0].cache, types, direct=direct)
                else:
                    first, hidden = self._megatron(ids, segs, ring, types, direct=direct)
                    every = hidden
        except BaseException:
            for seg in segs:
                if seg.cache is not None:
                    seg.cache.truncate(seg.start)  # a failed pass leaves the cache as it found it: the request goes on
            raise
        finally:
            self.recorder.layer = OUTSIDE
        listed = ids.tolist()
        for seg in segs:
            if seg.cache is not None:
                seg.cache.tokens.extend(int(t) for t in listed[seg.a:seg.b])
        answering = last_row_rank(self.shares.mode, s, self.n)
        held = range(first, first + int(hidden.shape[0]))
        answers = tuple(k for k, seg in enumerate(segs) if (
            self.rank == answering if self.shares.mode == "megatron" else seg.b - 1 in held))
        return RankOutput(rank=self.rank, start=first, rows=s, hidden=hidden, last=self.rank == answering,
                          ends=tuple(seg.b for seg in segs), answers=answers, every=every)

    def _segments(self, s: int, cache: RequestCache | None, batch: Sequence[tuple[RequestCache, int]] | None,
                  types: torch.Tensor | None) -> list[Segment]:
        if batch is None:
            return [Segment(cache, cache.length if cache is not None else 0, 0, s)]
        if cache is not None or types is not None:
            raise ValueError("a batched pass takes its caches in the batch, and no token types")
        if self.shares.mode == "sp" and len(batch) > 1:
            raise ValueError("sequence-parallel passes hold one request: its ranks split the rows of one sequence")
        segs, a = [], 0
        for c, rows in batch:
            if rows < 1:
                raise ValueError("every request of a batched pass has at least one token")
            segs.append(Segment(c, c.length, a, a + rows))
            a += rows
        if a != s:
            raise ValueError(f"the batch's requests hold {a} tokens, the pass {s}")
        return segs

    def segment_logits(self, out: RankOutput, only: Sequence[int] | None = None) -> dict[int, torch.Tensor]:
        """Next-token logits [vocab] after each segment of a pass whose last row this rank answers for (``only``:
        those of them), by segment index (one product over all of them)."""
        wanted = [k for k in out.answers if only is None or k in only]
        if not wanted:
            return {}
        rows = [out.ends[k] - 1 - out.start for k in wanted]
        with torch.inference_mode(), self.recorder.phase("compute", "lm_head"):
            logits = linear(out.hidden[rows], self.w["lm_head.weight"])
        return {k: logits[j] for j, k in enumerate(wanted)}

    def answer_logits(self, out: RankOutput, asked: Sequence[int], ring: Ring) -> dict[int, torch.Tensor]:
        """Next-token logits [vocab] after each segment in ``asked`` that this rank answers for, by segment index.
        ``asked`` (the segments that want a token, in order) must be the same list on every rank: where the head is
        split (``HmpShares.splits_head``; see the module's docstring) every rank computes its vocabulary's share and
        takes part in the collectives, even one that answers none. Elsewhere ``segment_logits``."""
        if not (self.shares.splits_head and self.cfg.decoder):
            return self.segment_logits(out, [k for k in asked if k in out.answers])
        if not asked:
            return {}
        k = len(asked)
        last = [out.ends[j] - 1 for j in asked]
        base = self.cfg.layers * COLLECTIVES_PER_LAYER
        with torch.inference_mode():
            if out.every is not None:
                rows = out.every[last]
            else:
                mine = torch.zeros(k, self.cfg.hidden, dtype=out.hidden.dtype, device=self.device)
                for i, row in enumerate(last):
                    if out.start <= row < out.start + int(out.hidden.shape[0]):
                        mine[i] = out.hidden[row - out.start]
                send, recv = ring(base)
                with self.recorder.phase("sync", "allreduce rows direct"):
                    rows = direct_all_reduce(mine, self.rank, self.n, send, self._timed(recv)).view(k, -1)
            bounds = self.shares.vocab_bounds(self.cfg.vocab)
            a, b = bounds[self.rank]
            with self.recorder.phase("compute", "lm_head"):
                head = WeightSlice(name="lm_head.weight", rows=(a, b)).cut(self.w["lm_head.weight"])
                # Vocabulary-major ([b - a, k]), so that each rank's share is one contiguous run of the gathered
                # [vocab, k] tensor.
                part = linear(rows, head).T.contiguous()
            send, recv = ring(base + 1)
            with self.recorder.phase("sync", "allgather logits direct"):
                flat = direct_all_gather(part, self.rank, [(x * k, y * k) for x, y in bounds], send,
                                         self._timed(recv))
        logits = flat.view(self.cfg.vocab, k).T
        return {j: logits[i] for i, j in enumerate(asked) if j in out.answers}

    def next_logits(self, out: RankOutput) -> torch.Tensor | None:
        """Next-token logits [vocab] of the pass's last row, on the rank that answers for it; None elsewhere."""
        if not out.last:
            return None
        with torch.inference_mode(), self.recorder.phase("compute", "lm_head"):
            return linear(out.hidden[-1:], self.w["lm_head.weight"])[0]

    # -- helpers -----------------------------------------------------------------------------------------------

    def _check(self, ids: torch.Tensor, segs: list[Segment], types: torch.Tensor | None) -> None:
        cfg = self.cfg
        if ids.numel() == 0:
            raise ValueError("a pass needs at least one token")
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab:
            raise ValueError(f"token ids must be in [0, {cfg.vocab})")
        longest = max(seg.start + seg.b - seg.a for seg in segs)
        if longest > cfg.max_positions:
            raise ValueError(f"{longest} positions exceed the model's {cfg.max_positions}")
        if types is not None and (types.shape != ids.shape or int(types.min()) < 0
                                  or int(types.max()) >= max(cfg.type_vocab, 1)):
            raise ValueError("token types must match the tokens and be in the model's range")

    def _norm(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        with self.recorder.phase("compute", "norm"):
            self.recorder.count_norm(int(x.shape[0]))
            return norm(self.cfg, x, self.w, prefix)

    def _timed(self, recv: Recv) -> Recv:
        def timed(frm: int, step: int) -> torch.Tensor:
            with self.recorder.phase("wait", "wait slice"):
                return recv(frm, step).to(self.device)
        return timed

    def _qkv(self, i: int, t: torch.Tensor) -> torch.Tensor:
        wt, b, _, _ = self.qkv[i]
        return linear(t, wt, b)

    def _split_qkv(self, i: int, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _, _, nq, nkv = self.qkv[i]
        return qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:]

    def _inner(self, i: int, t: torch.Tensor) -> torch.Tensor:
        p = f"layers.{i}."
        if self.cfg.gated:
            both = linear(t, self.upgate[i])
            up, gate = both.chunk(2, dim=1)
            return F.silu(gate) * up
        return mlp_inner(self.cfg, t, self.w[p + "up.weight"], self.w.get(p + "up.bias"))

    def _down(self, i: int, t: torch.Tensor) -> torch.Tensor:
        return linear(t, self.w[f"layers.{i}.down.weight"])

    def _o(self, i: int, t: torch.Tensor) -> torch.Tensor:
        return linear(t, self.w[f"layers.{i}.o.weight"])

    def _bias(self, i: int, name: str) -> torch.Tensor | float:
        return self.w.get(f"layers.{i}.{name}.bias", 0.0)

    def _embed(self, ids: torch.Tensor, start: int, types: torch.Tensor | None) -> torch.Tensor:
        with self.recorder.phase("compute", "embed"):
            if "embed.norm.weight" in self.w:
                self.recorder.count_norm(int(ids.shape[0]))
            return embed(self.cfg, self.w, ids, start, types)

    def _embed_segments(self, ids: torch.Tensor, segs: list[Segment], types: torch.Tensor | None) -> torch.Tensor:
        """The embeddings of every segment's rows at its own positions."""
        if len(segs) == 1:
            return self._embed(ids, segs[0].start, types)
        return torch.cat([self._embed(ids[g.a:g.b], g.start, None) for g in segs])

    def _attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segs: list[Segment]) -> torch.Tensor:
        """Layer ``i``'s attention of every segment's rows over its own cache (extended with them)."""
        parts = [attention(self.cfg, q[g.a:g.b], k[g.a:g.b], v[g.a:g.b], g.start,
                           g.cache.layers[i] if g.cache is not None else None, self.w, f"layers.{i}.") for g in segs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # -- galaxy ------------------------------------------------------------------------------------------------

    def _ag_gemm(self, own: torch.Tensor, bounds: Bounds, gemm: Callable[[torch.Tensor], torch.Tensor],
                 ring: Ring, index: int, name: str) -> torch.Tensor:
        if self.n == 1:
            with self.recorder.phase("compute", name):
                return gemm(own)
        send, recv = ring(index)
        if self.shares.overlap:
            return ag_gemm(own, self.rank, bounds, gemm, send, recv, self.io, self.recorder, name=name)
        cols = own.shape[1]
        with self.recorder.phase("sync", "allgather"):
            full = ring_all_gather(own, self.rank, _scale(bounds, cols), send, self._timed(recv))
        with self.recorder.phase("compute", name):
            return gemm(full.view(-1, cols))

    def _gemm_rs(self, full: torch.Tensor, bounds: Bounds, gemm: Callable[[torch.Tensor], torch.Tensor],
                 ring: Ring, index: int, name: str) -> torch.Tensor:
        if self.n == 1:
            with self.recorder.phase("compute", name):
                return gemm(full)
        send, recv = ring(index)
        if self.shares.overlap:
            return gemm_rs(full, self.rank, bounds, gemm, send, recv, self.io, self.recorder, name=name)
        with self.recorder.phase("compute", name):
            out = gemm(full)
        cols = out.shape[1]
        with self.recorder.phase("sync", "reducescatter"):
            part = ring_reduce_scatter(out, self.rank, _scale(bounds, cols), send, self._timed(recv))
        return part.view(-1, cols)

    def _galaxy(self, ids: torch.Tensor, segs: list[Segment], ring: Ring,
                types: torch.Tensor | None) -> tuple[int, torch.Tensor]:
        cfg, rec = self.cfg, self.recorder
        s = int(ids.shape[0])
        bounds = row_bounds(s, self.n)
        a, b = bounds[self.rank]
        rec.layer = OUTSIDE
        x = self._embed_segments(ids, segs, types)
        resid = x[a:b]  # the residual stream, sharded by rows from here on
        own: torch.Tensor | None = None  # this rank's rows of the next TP block's input, to be AllGathered
        # layer 0's input is replicated (pre-LN: its norm too), so it starts without an AllGather
        first_in = self._norm(x, "layers.0.attn_norm") if cfg.pre_ln else x
        for i in range(cfg.layers):
            rec.layer = i
            base = i * COLLECTIVES_PER_LAYER
            gemm = functools.partial(self._qkv, i)
            if own is None:
                with rec.phase("compute", "qkv"):
                    qkv = gemm(first_in)
            else:
                qkv = self._ag_gemm(own, bounds, gemm, ring, base + 0, "qkv")
            q, k, v = self._split_qkv(i, qkv)
            with rec.phase("compute", "attention"):
                att = self._attend(i, q, k, v, segs)
            g = self._gemm_rs(att, bounds, lambda t, i=i: self._o(i, t), ring, base + 1, "o")
            with rec.phase("compute", "residual"):
                u = resid + g + self._bias(i, "o")  # o's bias once, on the owned rows, after the reduction
            if cfg.pre_ln:
                h_own = self._norm(u, f"layers.{i}.mlp_norm")
            else:
                u = h_own = self._norm(u, f"layers.{i}.attn_norm")
            inner = self._ag_gemm(h_own, bounds, lambda t, i=i: self._inner(i, t), ring, base + 2, "up")
            g2 = self._gemm_rs(inner, bounds, lambda t, i=i: self._down(i, t), ring, base + 3, "down")
            with rec.phase("compute", "residual"):
                out = u + g2 + self._bias(i, "down")
            if cfg.pre_ln:
                resid = out
                nxt = "final_norm" if i == cfg.layers - 1 else f"layers.{i + 1}.attn_norm"
                own = self._norm(out, nxt)
            else:
                resid = own = self._norm(out, f"layers.{i}.mlp_norm")
        assert own is not None
        return a, own

    # -- megatron and local ------------------------------------------------------------------------------------

    def _all_reduce(self, part: torch.Tensor, bounds: Bounds, ring: Ring, index: int, direct: bool) -> torch.Tensor:
        if self.n == 1:
            return part
        send, recv = ring(index)
        cols = part.shape[1]
        if direct:
            with self.recorder.phase("sync", "allreduce direct"):
                return direct_all_reduce(part, self.rank, self.n, send, self._timed(recv)).view(-1, cols)
        with self.recorder.phase("sync", "allreduce"):
            return ring_all_reduce(part, self.rank, _scale(bounds, cols), send, self._timed(recv)).view(-1, cols)

    def _megatron(self, ids: torch.Tensor, segs: list[Segment], ring: Ring, types: torch.Tensor | None, *,
                  direct: bool = False) -> tuple[int, torch.Tensor]:
        cfg, rec = self.cfg, self.recorder
        bounds = row_bounds(int(ids.shape[0]), self.n)
        rec.layer = OUTSIDE
        x = self._embed_segments(ids, segs, types)
        for i in range(cfg.layers):
            rec.layer = i
            base = i * COLLECTIVES_PER_LAYER
            hin = self._norm(x, f"layers.{i}.attn_norm") if cfg.pre_ln else x
            with rec.phase("compute", "qkv"):
                q, k, v = self._split_qkv(i, self._qkv(i, hin))
            with rec.phase("compute", "attention"):
                att = self._attend(i, q, k, v, segs)
            with rec.phase("compute", "o"):
                c = self._o(i, att)
            g = self._all_reduce(c, bounds, ring, base + 1, direct)
            with rec.phase("compute", "residual"):
                u = x + g + self._bias(i, "o")
            if not cfg.pre_ln:
                u = self._norm(u, f"layers.{i}.attn_norm")
            m = self._norm(u, f"layers.{i}.mlp_norm") if cfg.pre_ln else u
            with rec.phase("compute", "mlp"):
                f = self._down(i, self._inner(i, m))
            g2 = self._all_reduce(f, bounds, ring, base + 3, direct)
            with rec.phase("compute", "residual"):
                x = u + g2 + self._bias(i, "down")
            if not cfg.pre_ln:
                x = self._norm(x, f"layers.{i}.mlp_norm")
        rec.layer = OUTSIDE
        if cfg.pre_ln:
            x = self._norm(x, "final_norm")
        return 0, x

    # -- sequence parallel -------------------------------------------------------------------------------------

    def _sp(self, ids: torch.Tensor, start: int, ring: Ring, cache: RequestCache | None,
            types: torch.Tensor | None, *, direct: bool = False) -> tuple[int, torch.Tensor]:
        cfg, rec = self.cfg, self.recorder
        s = int(ids.shape[0])
        bounds = row_bounds(s, self.n)
        a, b = bounds[self.rank]
        hd = cfg.head_dim
        rec.layer = OUTSIDE
        x = self._embed(ids[a:b], start + a, None if types is None else types[a:b])
        for i in range(cfg.layers):
            rec.layer = i
            base = i * COLLECTIVES_PER_LAYER
            hin = self._norm(x, f"layers.{i}.attn_norm") if cfg.pre_ln else x
            with rec.phase("compute", "qkv"):
                q, k, v = self._split_qkv(i, self._qkv(i, hin))
                # Keys travel to the other ranks normalised and rotated at their own positions.
                qh, kr = positioned(cfg, q, k, start + a, self.w, f"layers.{i}.")
                k = kr.transpose(0, 1).reshape(b - a, cfg.n_kv * hd)
            keys = self._sp_gather(k, bounds, ring, base + 0, direct)
            values = self._sp_gather(v, bounds, ring, base + 1, direct)
            with rec.phase("compute", "attention"):
                kh = keys.view(s, cfg.n_kv, hd).transpose(0, 1)
                vh = values.view(s, cfg.n_kv, hd).transpose(0, 1)
                if cache is not None:
                    kh, vh = cache.layers[i].extend(kh, vh)
                att = _sp_attention(cfg, qh, kh, vh, start + a)
            with rec.phase("compute", "o"):
                o = self._o(i, att) + self._bias(i, "o")
            with rec.phase("compute", "residual"):
                u = x + o
            if not cfg.pre_ln:
                u = self._norm(u, f"layers.{i}.attn_norm")
            m = self._norm(u, f"layers.{i}.mlp_norm") if cfg.pre_ln else u
            with rec.phase("compute", "mlp"):
                f = self._down(i, self._inner(i, m)) + self._bias(i, "down")
            with rec.phase("compute", "residual"):
                x = u + f
            if not cfg.pre_ln:
                x = self._norm(x, f"layers.{i}.mlp_norm")
        rec.layer = OUTSIDE
        if cfg.pre_ln:
            x = self._norm(x, "final_norm")
        return a, x

    def _sp_gather(self, part: torch.Tensor, bounds: Bounds, ring: Ring, index: int, direct: bool) -> torch.Tensor:
        cols = part.shape[1]
        if self.n == 1:
            return part
        send, recv = ring(index)
        if direct:
            with self.recorder.phase("sync", "allgather kv direct"):
                return direct_all_gather(part, self.rank, _scale(bounds, cols), send,
                                         self._timed(recv)).view(-1, cols)
        with self.recorder.phase("sync", "allgather kv"):
            return ring_all_gather(part, self.rank, _scale(bounds, cols), send, self._timed(recv)).view(-1, cols)


def _scale(bounds: Bounds, cols: int) -> Bounds:
    """Row bounds as element bounds of the flattened [rows, cols] tensor."""
    return [(a * cols, b * cols) for a, b in bounds]


def _sp_attention(cfg: TextModelConfig, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                  first: int) -> torch.Tensor:
    """Attention of queries at absolute positions ``first`` .. (``qh`` [H, rows, hd]) over keys at positions 0 ..
    (``kh``, ``vh`` [KV, t, hd]), causal by absolute position for decoders; [rows, H*hd]."""
    rows, hd = qh.shape[1], qh.shape[2]
    if rows == 0:
        return qh.new_zeros((0, qh.shape[0] * hd))
    if cfg.group > 1:
        kh = kh.repeat_interleave(cfg.group, 0)
        vh = vh.repeat_interleave(cfg.group, 0)
    mask = None
    if cfg.causal:
        t = kh.shape[1]
        pos = torch.arange(first, first + rows, device=qh.device).unsqueeze(1)
        mask = torch.arange(t, device=qh.device).unsqueeze(0) <= pos
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=1.0 / math.sqrt(hd))
    return out.transpose(0, 1).reshape(rows, -1)
