"""Choosing the next token from a decoder's logits: greedy, or sampled with temperature, top-k, top-p and min-p,
after repetition, presence and frequency penalties over the tokens so far (``values.sampling.Sampling``).

Sampling is reproducible and needs no generator state carried between steps: the uniform number a step draws comes
from a generator seeded by the request's ``seed`` and the position of the token it chooses, and the token is found by
inverting the cumulative distribution of the candidates in a fixed order (most likely first, ties by id). So the same
request gives the same tokens twice, whichever rank samples, after a device loss rebuilt its cache, and on one
device (``reference.generate``): logits that agree to float rounding choose the same token but for a uniform number
landing within that rounding of a boundary between two candidates.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from edgeswarm.values.sampling import Sampling

GREEDY = Sampling()


def penalised(logits: torch.Tensor, seen: Sequence[int], params: Sampling) -> torch.Tensor:
    """``logits`` [vocab] (float32) after the penalties for the tokens in ``seen``; a new tensor."""
    out = logits.float().clone()
    if not seen or (params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
                    and params.frequency_penalty == 0.0):
        return out
    counts = Counter(t for t in seen if 0 <= t < out.shape[0])
    ids = torch.tensor(sorted(counts), dtype=torch.long)
    if params.repetition_penalty != 1.0:
        chosen = out[ids]
        out[ids] = torch.where(chosen > 0, chosen / params.repetition_penalty, chosen * params.repetition_penalty)
    if params.presence_penalty or params.frequency_penalty:
        times = torch.tensor([counts[int(i)] for i in ids], dtype=torch.float32)
        out[ids] -= params.presence_penalty + params.frequency_penalty * times
    return out


def next_token(logits: torch.Tensor, seen: Sequence[int], params: Sampling | None, position: int) -> int:
    """The token chosen at sequence position ``position`` (the index it will have) from ``logits`` [vocab], after
    ``seen`` (the prompt's and the generated tokens); greedy when ``params`` is None or its temperature 0."""
    params = params or GREEDY
    scores = penalised(logits, seen, params)
    if params.greedy:
        return int(scores.argmax())
    order = torch.argsort(-scores.double(), stable=True)  # most likely first, ties by id: the same on every host
    ranked = scores.double()[order] / params.temperature
    if params.top_k:
        ranked, order = ranked[:params.top_k], order[:params.top_k]
    probs = torch.softmax(ranked, 0)
    keep = probs.numel()
    if params.top_p < 1.0:
        # the smallest prefix whose mass reaches top_p (the token that crosses it included)
        keep = min(keep, int(torch.searchsorted(torch.cumsum(probs, 0), params.top_p)) + 1)
    if params.min_p > 0.0:
        keep = min(keep, max(1, int((probs >= params.min_p * probs[0]).sum())))
    probs = probs[:keep] / probs[:keep].sum()
    draw = torch.Generator().manual_seed((params.seed * 1_000_003 + position) % (1 << 63))
    u = float(torch.rand(1, generator=draw, dtype=torch.float64))
    index = min(int(torch.searchsorted(torch.cumsum(probs, 0), u, right=True)), keep - 1)
    return int(order[index])
