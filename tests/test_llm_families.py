"""The language models edge users run, each equal to ``transformers`` on a tiny random configuration made here:
Llama 3.x (its ``llama3`` rotary scaling), Qwen2/2.5 (q, k and v biases, tied embeddings), Qwen3 (each query and key
head RMS-normalised, a head dimension other than hidden / heads), Mistral and SmolLM2 (Llama with tied embeddings and
nine heads in three KV groups). Whole (logits within 2e-5 in fp32, greedy tokens equal) and split over three ranks in
every mode (galaxy unevenly, with grouped-query attention whose KV heads do not divide the ranks: heads move in whole
KV groups)."""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from edgeswarm.models.text import reference
from edgeswarm.models.text.hf import load_config
from edgeswarm.values.text_model import PRESETS, TextModelConfig
from helpers import load_model
from hmp_driver import generate, run_pass, shares_for

FAMILIES = ["llama3", "qwen2", "qwen3", "mistral", "smollm2"]
PROMPT = [5, 17, 42, 8, 63, 21, 9, 77, 3, 50, 31]


@pytest.fixture(scope="module")
def transformers() -> ModuleType:
    import transformers as t  # one import for the module: it takes seconds

    t.logging.set_verbosity_error()
    return t


def _config(t: ModuleType, family: str) -> tuple[Any, type]:
    common: dict[str, Any] = dict(vocab_size=96, num_hidden_layers=2, intermediate_size=112,
                                  max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
    if family == "llama3":
        # The original context of 64 puts one of head_dim 8's four frequencies in the band the scaling blends.
        return t.LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                             rope_theta=10000.0, rope_scaling={
                                 "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                             **common), t.LlamaForCausalLM
    if family == "qwen2":
        return t.Qwen2Config(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
                             **common), t.Qwen2ForCausalLM
    if family == "qwen3":
        return t.Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                             tie_word_embeddings=True, **common), t.Qwen3ForCausalLM
    if family == "mistral":
        return t.MistralConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, sliding_window=None,
                               tie_word_embeddings=False, **common), t.MistralForCausalLM
    # SmolLM2-135M's shape in small: nine query heads in three KV groups, tied embeddings
    return t.LlamaConfig(hidden_size=72, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                         rope_theta=100000.0, **common), t.LlamaForCausalLM


def _saved(t: ModuleType, family: str, folder: Path, seed: int = 0) -> torch.nn.Module:
    """A tiny random model of ``family`` saved in ``folder``, every parameter random (the libraries initialise biases
    to 0 and norms to 1, which would hide a wrong mapping of either)."""
    cfg, cls = _config(t, family)
    torch.manual_seed(seed)
    model = cls(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise if p.dim() == 1 else 0.15 * noise)
    model.eval()
    model.save_pretrained(str(folder))
    return model


def test_each_family_translates_to_its_shape(transformers: ModuleType, tmp_path: Path) -> None:
    shapes = {}
    for family in FAMILIES:
        _saved(transformers, family, tmp_path / family)
        shapes[family] = load_config(tmp_path / family)
    llama3 = shapes["llama3"].rope_scaling
    assert llama3 is not None and (llama3.factor, llama3.original_max_positions) == (8.0, 64)
    assert shapes["qwen2"].qkv_bias and shapes["qwen2"].tie_embeddings and not shapes["qwen2"].bias
    assert shapes["qwen3"].qk_norm and shapes["qwen3"].head_dim == 24 and shapes["qwen3"].hidden == 64
    assert (shapes["smollm2"].heads, shapes["smollm2"].n_kv, shapes["smollm2"].tie_embeddings) == (9, 3, True)
    assert all(c.family == "llama" and c.dtype == "float32" for c in shapes.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_greedy_tokens_equal_transformers(transformers: ModuleType, tmp_path: Path, family: str) -> None:
    model = _saved(transformers, family, tmp_path)
    cfg, w = load_model(tmp_path)
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        expected = model(ids[None]).logits[0]
        ours = reference.logits(w, reference.forward(cfg, w, ids))
    assert torch.allclose(ours, expected, atol=2e-5, rtol=1e-5), (ours - expected).abs().max()
    new = 20
    with torch.inference_mode():
        theirs = model.generate(ids[None], attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                                max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    theirs_new = theirs[0, len(PROMPT):].tolist()
    assert reference.generate(cfg, w, PROMPT, new) == theirs_new
    assert len(set(theirs_new)) > 1  # not a degenerate model repeating one token


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["galaxy", "megatron", "sp", "local"])
def test_split_in_every_mode_equals_one_device(transformers: ModuleType, tmp_path: Path, family: str,
                                               mode: str) -> None:
    _saved(transformers, family, tmp_path)
    cfg, w = load_model(tmp_path)
    ids = torch.tensor(PROMPT)
    want = reference.forward(cfg, w, ids)
    n = 1 if mode == "local" else 3
    shares = shares_for(cfg, mode, n, "uneven" if mode == "galaxy" else "equal")
    if mode == "galaxy":  # whole KV groups, unevenly: a rank with none, KV heads that 3 does not divide
        assert 0 in shares.heads and all(h % cfg.group == 0 for h in shares.heads), shares.heads
    outs, _, ranks = run_pass(cfg, shares, w, ids)
    got = torch.zeros_like(want)
    for o in outs:
        got[o.start:o.start + o.hidden.shape[0]] = o.hidden
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * math.sqrt(cfg.layers) * want.abs().max().item(), err
    answering = [o for o in outs if o.last]
    logits = ranks[answering[0].rank].next_logits(answering[0])
    assert logits is not None
    torch.testing.assert_close(logits, reference.logits(w, want[-1:])[0], rtol=1e-4, atol=1e-4)
    tokens, _, _ = generate(cfg, shares, w, PROMPT, 8)
    assert tokens == reference.generate(cfg, w, PROMPT, 8)


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b", "smollm2-135m"])
def test_the_published_shapes_are_presets_with_their_parameter_counts(name: str) -> None:
    """The presets' shapes hold the published models' parameter counts (random weights unless a folder is given)."""
    published = {"llama-3.2-1b": 1.236e9, "qwen2.5-0.5b": 0.494e9, "qwen3-0.6b": 0.596e9, "smollm2-135m": 0.1345e9}
    cfg: TextModelConfig = PRESETS[name]
    params = cfg.layers * (cfg.attention_params() + cfg.mlp_params() + 2 * cfg.hidden) + cfg.vocab * cfg.hidden
    assert params == pytest.approx(published[name], rel=0.005)
