"""Choosing the next token (``models.text.sampling``): greedy is the argmax, sampling follows the distribution its
parameters describe, the same seed gives the same tokens, and a model split over ranks samples exactly what one
device samples."""

from __future__ import annotations

import math

import pytest
import torch

from edgeswarm.models.text import reference
from edgeswarm.models.text.sampling import next_token, penalised
from edgeswarm.values.sampling import Sampling
from edgeswarm.values.text_model import PRESETS
from hmp_driver import generate, shares_for

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, 2.5, -2.0])


def frequencies(params: Sampling, draws: int = 4000) -> torch.Tensor:
    """How often each token is chosen at ``draws`` positions (each position its own draw)."""
    counts = torch.zeros(LOGITS.shape[0])
    for position in range(draws):
        counts[next_token(LOGITS, [], params, position)] += 1
    return counts / draws


def test_greedy_and_degenerate_filters_take_the_argmax() -> None:
    best = int(LOGITS.argmax())
    assert next_token(LOGITS, [], None, 0) == best
    assert next_token(LOGITS, [], Sampling(), 0) == best
    for params in (Sampling(temperature=1.0, top_k=1), Sampling(temperature=1.0, top_p=0.01),
                   Sampling(temperature=1.0, min_p=0.99), Sampling(temperature=1e-4)):
        assert {next_token(LOGITS, [], params, p) for p in range(50)} == {best}, params


def test_sampling_follows_the_softmax_at_its_temperature() -> None:
    for temperature in (1.0, 2.0):
        want = torch.softmax(LOGITS / temperature, 0)
        got = frequencies(Sampling(temperature=temperature, seed=3))
        # 4000 draws: a frequency's standard error is at most 0.008
        assert (got - want).abs().max() < 0.035, (temperature, got, want)


def test_top_k_top_p_and_min_p_keep_only_their_candidates() -> None:
    ranked = torch.argsort(-LOGITS).tolist()  # 5, 6, 0, 1, 2, 3, 4, 7
    got = frequencies(Sampling(temperature=1.0, top_k=3, seed=1), 2000)
    assert set(torch.nonzero(got).flatten().tolist()) == set(ranked[:3])
    probs = torch.softmax(LOGITS, 0)[ranked]
    mass = torch.cumsum(probs, 0)
    need = int((mass < 0.8).sum()) + 1  # the smallest prefix reaching 0.8
    got = frequencies(Sampling(temperature=1.0, top_p=0.8, seed=1), 2000)
    assert set(torch.nonzero(got).flatten().tolist()) == set(ranked[:need])
    got = frequencies(Sampling(temperature=1.0, min_p=0.5, seed=1), 2000)
    kept = [t for t in ranked if torch.softmax(LOGITS, 0)[t] >= 0.5 * torch.softmax(LOGITS, 0).max()]
    assert set(torch.nonzero(got).flatten().tolist()) == set(kept)
    # within what they keep, the kept tokens' relative odds stay the softmax's
    pair = frequencies(Sampling(temperature=1.0, top_k=2, seed=2))
    assert pair[5] / pair[6] == pytest.approx(math.exp(0.5), rel=0.15)


def test_penalties_lower_the_tokens_already_seen() -> None:
    seen = [5, 5, 5, 0]
    rep = penalised(LOGITS, seen, Sampling(repetition_penalty=2.0))
    assert rep[5] == pytest.approx(1.5) and rep[0] == pytest.approx(1.0) and rep[6] == LOGITS[6]
    negative = penalised(torch.tensor([-1.0, 1.0]), [0], Sampling(repetition_penalty=2.0))
    assert negative[0] == pytest.approx(-2.0)  # a negative logit is multiplied: the token gets less likely too
    pres = penalised(LOGITS, seen, Sampling(presence_penalty=1.0, frequency_penalty=0.5))
    assert pres[5] == pytest.approx(3.0 - 1.0 - 1.5) and pres[0] == pytest.approx(2.0 - 1.0 - 0.5)
    assert next_token(LOGITS, seen, Sampling(repetition_penalty=3.0), 0) == 6  # greedy, after the penalty


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others() -> None:
    params = Sampling(temperature=1.5, seed=11)
    first = [next_token(LOGITS, [], params, p) for p in range(64)]
    assert first == [next_token(LOGITS, [], params, p) for p in range(64)]
    other = [next_token(LOGITS, [], params.model_copy(update={"seed": 12}), p) for p in range(64)]
    assert other != first


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny", "qwen3-tiny"])
def test_a_split_model_samples_what_one_device_samples(name: str) -> None:
    cfg = PRESETS[name]
    w = reference.init_weights(cfg, 5)
    prompt = [3, 141, 59, 26, 5, 35]
    params = Sampling(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.2,
                      presence_penalty=0.3, seed=2024)
    want = reference.generate(cfg, w, prompt, 12, sampling=params)
    got, _, _ = generate(cfg, shares_for(cfg, "galaxy", 3, "uneven"), w, prompt, 12, sampling=params)
    assert got == want
    assert want != reference.generate(cfg, w, prompt, 12)  # it did sample: not the greedy tokens
    again, _, _ = generate(cfg, shares_for(cfg, "sp", 2), w, prompt, 12, sampling=params)
    assert again == want
