"""Runs every rank of a tensor-parallel model in its own thread over the in-memory ring (tests only)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from edgeswarm.hmp.layer import HmpRank, RankOutput, RequestCache
from edgeswarm.hmp.loopback import Loopback
from edgeswarm.models.text.ops import Weights
from edgeswarm.models.text.sampling import next_token
from edgeswarm.planning.hmp.shares import HmpShares
from edgeswarm.values.sampling import Sampling
from edgeswarm.values.text_model import TextModelConfig


def shares_for(cfg: TextModelConfig, mode: str, n: int, kind: str = "equal", overlap: bool = True) -> HmpShares:
    """Head and column shares over ``n`` ranks: ``equal`` (as even as whole KV groups allow) or ``uneven`` (rank 1
    gets no heads and no columns when n > 1; the others unequal parts)."""
    groups, g = cfg.n_kv, cfg.group
    if kind == "equal" or n == 1:
        gw, cw = [1.0] * n, [1.0] * n
    else:
        gw = [float(r + 1) for r in range(n)]
        gw[1] = 0.0
        cw = [float(2 * r + 1) for r in range(n)]
        cw[1] = 0.0
    heads = [a * g for a in _split(groups, gw)]
    columns = _split(cfg.ffn, cw)
    return HmpShares(mode=mode, devices=[f"dev{r}" for r in range(n)], heads=heads, columns=columns,  # type: ignore
                     overlap=overlap)


def _split(total: int, weights: list[float]) -> list[int]:
    out = [int(total * w / sum(weights)) for w in weights]
    best = max(range(len(weights)), key=lambda j: weights[j])
    out[best] += total - sum(out)
    return out


def in_threads(n: int, body: Callable[[int], object]) -> list[object]:
    """``body(rank)`` for every rank in its own thread; re-raises the first error."""
    results: list[object] = [None] * n
    errors: list[BaseException] = []

    def go(r: int) -> None:
        try:
            results[r] = body(r)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(r,), name=f"rank-{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    return results


def run_pass(cfg: TextModelConfig, shares: HmpShares, weights: Weights, tokens: torch.Tensor,
             loop: Loopback | None = None,
             types: torch.Tensor | None = None) -> tuple[list[RankOutput], Loopback, list[HmpRank]]:
    """One forward pass on every rank: each rank's output, the transport and the (closed) ranks."""
    n = len(shares.devices)
    loop = loop or Loopback(n)
    ranks = [HmpRank(cfg, shares, r, weights) for r in range(n)]
    try:
        outs = in_threads(n, lambda r: ranks[r].forward(tokens, loop.ring(r, 0), types=types))
    finally:
        for rank in ranks:
            rank.close()
        loop.close()
    return outs, loop, ranks  # type: ignore[return-value]


def generate(cfg: TextModelConfig, shares: HmpShares, weights: Weights, prompt: list[int],
             new_tokens: int, loop: Loopback | None = None, sampling: Sampling | None = None
             ) -> tuple[list[int], list[RequestCache], list[int]]:
    """Generation on every rank with each rank's sharded KV cache (the prefill on scope 0, decode step k on scope k
    of ``loop``), greedy or as ``sampling`` says (the rank holding the last row chooses, as a worker does): the
    tokens, the caches and the cache bytes each rank held at the end (before it was freed)."""
    n = len(shares.devices)
    loop = loop or Loopback(n)
    ranks = [HmpRank(cfg, shares, r, weights) for r in range(n)]
    caches = [rank.new_cache() for rank in ranks]
    produced: list[int] = []
    answered: list[int] = []
    barrier = threading.Barrier(n, timeout=30)
    held = [0] * n

    def body(r: int) -> None:
        ids = list(prompt)
        step = 0
        while True:
            ring = loop.ring(r, step)
            out = ranks[r].forward(ids, ring, cache=caches[r])
            # As a worker asks: every rank takes part where the pass splits the head by vocabulary.
            for logits in ranks[r].answer_logits(out, [0], ring).values():
                produced.append(next_token(logits, caches[r].tokens, sampling, caches[r].length))
                answered.append(r)
            barrier.wait()
            token = produced[-1]
            done = len(produced) >= new_tokens
            barrier.wait()
            if done:
                held[r] = caches[r].nbytes()
                return
            ids = [token]
            step += 1

    try:
        in_threads(n, body)
    finally:
        for rank in ranks:
            rank.close()
        loop.close()
    assert len(answered) == len(produced), "exactly one rank answers each step"
    return produced, caches, held
