"""The whole model on one device: the forward pass every sharded run must equal, and generation (greedy or sampled).

Weights follow ``config``'s layout; ``init_weights`` makes random ones of any preset's shape (deterministic per
seed), ``models.text.hf`` loads published ones.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from edgeswarm.models.text.ops import HeadCache, Weights, attention, embed, linear, mlp_inner, norm, torch_dtype
from edgeswarm.models.text.sampling import next_token
from edgeswarm.values.sampling import Sampling
from edgeswarm.values.text_model import TextModelConfig


def weight_shapes(cfg: TextModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's name and shape (``config``'s layout), ``lm_head.weight`` only when not tied."""
    h, f, hd = cfg.hidden, cfg.ffn, cfg.head_dim
    qd, kvd = cfg.heads * hd, cfg.n_kv * hd
    shapes: dict[str, tuple[int, ...]] = {"embed.tokens": (cfg.vocab, h)}
    if not cfg.rotary:
        shapes["embed.positions"] = (cfg.max_positions + cfg.position_offset, h)
    if cfg.family == "bert":
        if cfg.type_vocab:
            shapes["embed.types"] = (cfg.type_vocab, h)
        shapes["embed.norm.weight"] = (h,)
        shapes["embed.norm.bias"] = (h,)
    for i in range(cfg.layers):
        p = f"layers.{i}."
        for name, out, inp in (("q", qd, h), ("k", kvd, h), ("v", kvd, h), ("o", h, qd), ("up", f, h),
                               ("down", h, f)):
            shapes[p + name + ".weight"] = (out, inp)
            if cfg.bias or (cfg.qkv_bias and name in ("q", "k", "v")):
                shapes[p + name + ".bias"] = (out,)
        if cfg.qk_norm:
            shapes[p + "q_norm.weight"] = (hd,)
            shapes[p + "k_norm.weight"] = (hd,)
        if cfg.gated:
            shapes[p + "gate.weight"] = (f, h)
        for n in ("attn_norm", "mlp_norm"):
            shapes[p + n + ".weight"] = (h,)
            if not cfg.rms_norm:
                shapes[p + n + ".bias"] = (h,)
    if cfg.pre_ln:
        shapes["final_norm.weight"] = (h,)
        if not cfg.rms_norm:
            shapes["final_norm.bias"] = (h,)
    if cfg.decoder and not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab, h)
    return shapes


def init_weights(cfg: TextModelConfig, seed: int = 0, *, names: set[str] | None = None) -> Weights:
    """Random weights of ``cfg``'s shapes in its dtype, the same for a seed on every machine (drawn per tensor from
    a generator seeded by the seed and the tensor's name, so a worker can make only ``names``). Norm weights are
    near 1, biases small and matrices scaled by their fan-in, so activations stay in range through many layers."""
    out: Weights = {}
    for name, shape in weight_shapes(cfg).items():
        if names is not None and name not in names:
            continue
        g = torch.Generator().manual_seed((seed * 1_000_003 + _stable_hash(name)) % (1 << 63))
        if "norm" in name and name.endswith(".weight"):
            t = torch.ones(shape) + 0.05 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=g)
        elif len(shape) == 2 and name.startswith("layers."):
            t = torch.randn(shape, generator=g) / shape[1] ** 0.5  # unit-variance outputs for unit-variance inputs
        else:
            t = 0.5 * torch.randn(shape, generator=g)
        out[name] = t.to(torch_dtype(cfg))
    if cfg.decoder and cfg.tie_embeddings and (names is None or "lm_head.weight" in names):
        out["lm_head.weight"] = out.get("embed.tokens", init_weights(cfg, seed, names={"embed.tokens"})[
            "embed.tokens"])
    return out


def _stable_hash(text: str) -> int:
    h = 1469598103934665603
    for b in text.encode():
        h = ((h ^ b) * 1099511628211) % (1 << 64)
    return h


class ModelCache:
    """A request's KV cache on one device: one ``HeadCache`` per layer."""

    def __init__(self, layers: int) -> None:
        self.layers = [HeadCache() for _ in range(layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)


def layer(cfg: TextModelConfig, w: Weights, i: int, x: torch.Tensor, start: int,
          cache: HeadCache | None = None) -> torch.Tensor:
    """Layer ``i`` on the whole sequence ``x`` [s, h] (positions ``start`` ..)."""
    p = f"layers.{i}."

    def lin(t: torch.Tensor, name: str) -> torch.Tensor:
        return linear(t, w[p + name + ".weight"], w.get(p + name + ".bias"))

    a = norm(cfg, x, w, p + "attn_norm") if cfg.pre_ln else x
    att = attention(cfg, lin(a, "q"), lin(a, "k"), lin(a, "v"), start, cache, w, p)
    u = x + lin(att, "o")
    if not cfg.pre_ln:
        u = norm(cfg, u, w, p + "attn_norm")
    m = norm(cfg, u, w, p + "mlp_norm") if cfg.pre_ln else u
    inner = mlp_inner(cfg, m, w[p + "up.weight"], w.get(p + "up.bias"), w.get(p + "gate.weight"))
    out = u + lin(inner, "down")
    return out if cfg.pre_ln else norm(cfg, out, w, p + "mlp_norm")


def forward(cfg: TextModelConfig, w: Weights, tokens: torch.Tensor, *, cache: ModelCache | None = None,
            types: torch.Tensor | None = None) -> torch.Tensor:
    """Final hidden states [s, h] of ``tokens`` [s] (after the final norm for pre-LN families). With ``cache``, the
    tokens continue the cached sequence and their keys and values are added to it."""
    start = cache.length if cache is not None else 0
    x = embed(cfg, w, tokens, start, types)
    for i in range(cfg.layers):
        x = layer(cfg, w, i, x, start, cache.layers[i] if cache is not None else None)
    return norm(cfg, x, w, "final_norm") if cfg.pre_ln else x


def logits(w: Weights, hidden: torch.Tensor) -> torch.Tensor:
    """Next-token logits [rows, vocab] of final hidden states."""
    return linear(hidden, w["lm_head.weight"])


def generate(cfg: TextModelConfig, w: Weights, prompt: list[int], new_tokens: int,
             stop: int | Collection[int] | None = None, sampling: Sampling | None = None) -> list[int]:
    """Decoding with a KV cache: the ``new_tokens`` tokens after ``prompt`` (fewer when a ``stop`` token comes),
    greedy or as ``sampling`` says (``sampling.next_token``: what every sharded run must equal)."""
    stops = {stop} if isinstance(stop, int) else set(stop or ())
    cache = ModelCache(cfg.layers)
    out: list[int] = []
    with torch.inference_mode():
        hidden = forward(cfg, w, torch.tensor(prompt), cache=cache)
        for _ in range(new_tokens):
            token = next_token(logits(w, hidden[-1:])[0], prompt + out, sampling, len(prompt) + len(out))
            out.append(token)
            if token in stops or len(out) == new_tokens:
                break
            hidden = forward(cfg, w, torch.tensor([token]), cache=cache)
    return out
