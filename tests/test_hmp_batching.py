"""Continuous batching in the tensor-parallel runtime: one pass holds a decode step of every running request and a
chunk of a new request's prompt, its GEMMs and collectives over all their rows, attention per request over its own
KV cache. Requests join the batch (their prompt in chunks) and leave it (at their length) between passes; every
request's tokens are what it generates alone on one device, greedy or sampled with its seed, in every mode that
batches (galaxy split unevenly, megatron, local), for learned and rotary positions."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from edgeswarm.hmp.compute import request_kv_bytes
from edgeswarm.hmp.layer import HmpRank, RequestCache
from edgeswarm.hmp.loopback import Loopback
from edgeswarm.models.text import reference
from edgeswarm.models.text.sampling import next_token
from edgeswarm.values.sampling import Sampling
from edgeswarm.values.text_model import PRESETS
from hmp_driver import in_threads, shares_for

CHUNK = 3  # prompt tokens a pass takes of a joining request


@dataclass
class Stream:
    prompt: list[int]
    new: int
    sampling: Sampling | None
    fed: int = 0  # tokens of prompt + generated already in the caches
    out: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    def next_rows(self) -> list[int]:
        """What this request puts in the next pass: a chunk of its prompt, or its last token (one decode step)."""
        if self.fed < len(self.prompt):
            return self.prompt[self.fed:self.fed + CHUNK]
        return self.out[-1:]


def _serve(preset: str, mode: str, streams: list[Stream], joins: dict[int, list[Stream]]) -> int:
    """Run ``streams`` (and those of ``joins``, which join before pass k) batched to their lengths on 3 ranks (1
    for local); returns how many passes it took."""
    cfg = PRESETS[preset]
    weights = reference.init_weights(cfg, 3)
    n = 1 if mode == "local" else 3
    shares = shares_for(cfg, mode, n, "uneven" if mode == "galaxy" else "equal")
    ranks = [HmpRank(cfg, shares, r, weights) for r in range(n)]
    caches: dict[int, list[RequestCache]] = {}
    loop = Loopback(n)
    running: list[Stream] = []
    passes = 0
    try:
        while running or joins or not passes:
            running += joins.pop(passes, [])
            if passes == 0:
                running += streams
            active = [s for s in running if len(s.out) < s.new]
            if not active:
                if joins:
                    passes += 1
                    continue
                break
            for s in active:
                caches.setdefault(id(s), [rank.new_cache() for rank in ranks])
            rows = [s.next_rows() for s in active]
            ids = [t for r in rows for t in r]

            def body(r: int, rows: list[list[int]] = rows, ids: list[int] = ids, active: list[Stream] = active,
                     scope: int = passes) -> dict[int, int]:
                out = ranks[r].forward(ids, loop.ring(r, scope), batch=[
                    (caches[id(s)][r], len(rw)) for s, rw in zip(active, rows, strict=True)])
                chosen = {}
                for k, logits in ranks[r].segment_logits(out).items():
                    s = active[k]
                    if s.fed + len(rows[k]) >= len(s.prompt):  # its prompt is in: the next token is due
                        cache = caches[id(s)][r]
                        chosen[k] = next_token(logits, cache.tokens, s.sampling, cache.length)
                return chosen

            answered = in_threads(n, body)
            merged: dict[int, int] = {}
            for chosen in answered:
                assert not set(merged) & set(chosen), "one rank answers each request"  # type: ignore[arg-type]
                merged.update(chosen)  # type: ignore[arg-type]
            for k, s in enumerate(active):
                s.fed += len(rows[k])
                if k in merged:
                    s.out.append(merged[k])
                else:
                    assert s.fed < len(s.prompt), "a request whose prompt is in got no token"
            running = [s for s in running if len(s.out) < s.new]
            passes += 1
    finally:
        for rank in ranks:
            rank.close()
        loop.close()
    return passes


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("mode", ["galaxy", "megatron", "local"])
def test_batched_requests_generate_what_each_generates_alone(preset: str, mode: str) -> None:
    cfg = PRESETS[preset]
    weights = reference.init_weights(cfg, 3)
    g = torch.Generator().manual_seed(5)

    def prompt(length: int) -> list[int]:
        return torch.randint(0, cfg.vocab, (length,), generator=g).tolist()

    streams = [Stream(prompt(7), 6, None), Stream(prompt(2), 9, Sampling(temperature=0.9, top_k=20, seed=4)),
               Stream(prompt(11), 4, Sampling(temperature=1.2, top_p=0.8, seed=9))]
    late = [Stream(prompt(8), 5, Sampling(temperature=0.7, seed=1)), Stream(prompt(1), 3, None)]
    passes = _serve(preset, mode, streams, {3: late[:1], 6: late[1:]})
    for s in streams + late:
        assert s.out == reference.generate(cfg, weights, s.prompt, s.new, sampling=s.sampling), s
    # Batched: far fewer passes than one request after another (each: its prompt's chunks, then a pass a token).
    alone = sum(-(-len(s.prompt) // CHUNK) + s.new - 1 for s in streams + late)
    assert passes < alone * 0.6, (passes, alone)


def test_a_pass_refuses_batches_that_do_not_add_up() -> None:
    cfg = PRESETS["llama-tiny"]
    rank = HmpRank(cfg, shares_for(cfg, "local", 1), 0, reference.init_weights(cfg, 3))
    loop = Loopback(1)
    try:
        a, b = rank.new_cache(), rank.new_cache()
        with pytest.raises(ValueError, match="hold 3 tokens, the pass 4"):
            rank.forward([1, 2, 3, 4], loop.ring(0, 0), batch=[(a, 1), (b, 2)])
        with pytest.raises(ValueError, match="at least one token"):
            rank.forward([1, 2], loop.ring(0, 1), batch=[(a, 2), (b, 0)])
        assert a.length == b.length == 0
    finally:
        rank.close()
        loop.close()
    sp = HmpRank(cfg, shares_for(cfg, "sp", 1), 0, reference.init_weights(cfg, 3))
    try:
        with pytest.raises(ValueError, match="sequence-parallel passes hold one request"):
            sp.forward([1, 2], Loopback(1).ring(0, 0), batch=[(sp.new_cache(), 1), (sp.new_cache(), 1)])
    finally:
        sp.close()


@pytest.mark.parametrize("mode", ["galaxy", "megatron", "sp"])
def test_a_requests_kv_cache_holds_what_its_admission_reserves(mode: str) -> None:
    """What a rank reserves for a request's KV cache in the node's ledger (``request_kv_bytes``) is what the cache
    holds at that many positions, on every rank (uneven galaxy: one holding no heads)."""
    cfg = PRESETS["llama-tiny"]
    shares = shares_for(cfg, mode, 3, "uneven" if mode == "galaxy" else "equal")
    ranks = [HmpRank(cfg, shares, r, reference.init_weights(cfg, 3)) for r in range(3)]
    loop = Loopback(3)
    caches = [rank.new_cache() for rank in ranks]
    try:
        in_threads(3, lambda r: ranks[r].forward(list(range(1, 12)), loop.ring(r, 0), batch=[(caches[r], 11)]))
        for r, cache in enumerate(caches):
            assert cache.length == 11
            assert cache.nbytes() == request_kv_bytes(cfg, shares, r, 11), (r, cache.nbytes())
        assert sum(c.nbytes() for c in caches) > 0
    finally:
        for rank in ranks:
            rank.close()
        loop.close()
