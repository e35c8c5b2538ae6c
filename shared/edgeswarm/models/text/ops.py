"""The building blocks of a Transformer layer, on whole weights or on a shard of them.

Batch 1: activations are [s, h] (rows are sequence positions). Every function takes the weights it needs as
tensors, so the single-device forward pass (``reference``) and the tensor-parallel runtime run the same code, the
latter on its heads' rows of ``q``/``k``/``v`` and its columns of the MLP.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from edgeswarm.models.text.quantized import QuantizedMatrix
from edgeswarm.values.text_model import TextModelConfig

# A weight: a tensor, or a matrix still in a GGUF file's quantized blocks (``quantized``: ``linear`` and
# ``embedding`` take either).
Matrix = torch.Tensor | QuantizedMatrix
Weights = dict[str, Matrix]


def torch_dtype(cfg: TextModelConfig) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]


def linear(x: torch.Tensor, w: Matrix, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w^T + b`` for a dense or a quantized ``w`` [out, in]."""
    return w.linear(x, b) if isinstance(w, QuantizedMatrix) else F.linear(x, w, b)


def embedding(ids: torch.Tensor, w: Matrix) -> torch.Tensor:
    """The rows of ``w`` that ``ids`` name (a quantized table dequantizes only those)."""
    return w.embedding(ids) if isinstance(w, QuantizedMatrix) else F.embedding(ids, w)


def cat_rows(parts: list[Matrix]) -> Matrix:
    """The rows of ``parts`` one after another, as one matrix: quantized when they all are of one kind, else dense
    (a quantized part dequantized: a file mixing formats within q, k and v)."""
    if all(isinstance(p, QuantizedMatrix) for p in parts):
        try:
            return QuantizedMatrix.cat([p for p in parts if isinstance(p, QuantizedMatrix)])
        except ValueError:
            pass
    dtype = next((p.dtype for p in parts if isinstance(p, torch.Tensor)), parts[0].dtype)
    return torch.cat([p.dequantize().to(dtype) if isinstance(p, QuantizedMatrix) else p for p in parts])


def embed(cfg: TextModelConfig, w: Weights, tokens: torch.Tensor, start: int = 0,
          types: torch.Tensor | None = None) -> torch.Tensor:
    """Embeddings [s, h] of token ids ``tokens`` [s] at positions ``start`` .. ``start + s - 1``."""
    x = embedding(tokens, w["embed.tokens"])
    if "embed.positions" in w:
        at = torch.arange(start, start + tokens.shape[0], device=tokens.device) + cfg.position_offset
        x = x + F.embedding(at, w["embed.positions"])
    if "embed.types" in w:
        kinds = types if types is not None else torch.zeros_like(tokens)
        x = x + F.embedding(kinds, w["embed.types"])
    if "embed.norm.weight" in w:
        x = norm(cfg, x, w, "embed.norm")
    return x


def norm(cfg: TextModelConfig, x: torch.Tensor, w: Weights, prefix: str) -> torch.Tensor:
    """LayerNorm (or RMSNorm for llama) of the rows of ``x`` with the weights under ``prefix``."""
    if cfg.rms_norm:
        return rms_norm(cfg, x, w[f"{prefix}.weight"])
    return F.layer_norm(x, (x.shape[-1],), w[f"{prefix}.weight"], w.get(f"{prefix}.bias"), cfg.norm_eps)


def rms_norm(cfg: TextModelConfig, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (computed in float32, as the published models do)."""
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + cfg.norm_eps)).to(x.dtype) * weight


def activation(cfg: TextModelConfig, x: torch.Tensor) -> torch.Tensor:
    if cfg.activation == "gelu":
        return F.gelu(x)
    if cfg.activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if cfg.activation == "relu":
        return F.relu(x)
    return F.silu(x)


def mlp_inner(cfg: TextModelConfig, x: torch.Tensor, up_w: Matrix, up_b: torch.Tensor | None,
              gate_w: Matrix | None = None) -> torch.Tensor:
    """The MLP's intermediate activations [s, columns] for the columns whose rows of ``up`` (and ``gate``) are
    given: act(x up^T + b), or for SwiGLU silu(x gate^T) * (x up^T)."""
    up = linear(x, up_w, up_b)
    if cfg.gated:
        assert gate_w is not None
        return F.silu(linear(x, gate_w)) * up
    return activation(cfg, up)


def inverse_frequencies(cfg: TextModelConfig, hd: int, device: torch.device) -> torch.Tensor:
    """The rotation's frequency of each pair of a head's dimensions [hd / 2] (radians per position), with Llama 3's
    scaling when the model has it (``RopeScaling``)."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    if cfg.rope_factors is not None:
        return inv / torch.tensor(cfg.rope_factors, device=device, dtype=torch.float32)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv
    wavelength = 2 * math.pi / inv
    long = scaling.original_max_positions / scaling.low_freq_factor  # longer wavelengths: divided by the factor
    short = scaling.original_max_positions / scaling.high_freq_factor  # shorter ones: kept
    blend = ((scaling.original_max_positions / wavelength - scaling.low_freq_factor)
             / (scaling.high_freq_factor - scaling.low_freq_factor))
    between = (1 - blend) * inv / scaling.factor + blend * inv
    return torch.where(wavelength > long, inv / scaling.factor, torch.where(wavelength < short, inv, between))


def rotary(cfg: TextModelConfig, x: torch.Tensor, start: int) -> torch.Tensor:
    """Rotary positions on ``x`` [heads, s, hd] at positions ``start`` .. (the half-split convention of Llama's
    published weights)."""
    hd = x.shape[-1]
    inv = inverse_frequencies(cfg, hd, x.device)
    pos = torch.arange(start, start + x.shape[-2], device=x.device, dtype=torch.float32)
    angles = torch.outer(pos, inv)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)
    first, second = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-second, first], -1) * sin


class HeadCache:
    """The keys and values of the KV heads one worker holds, for one layer: [kv, t, hd] each, grown per step."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else int(self.k.shape[1])

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], 1)
        self.v = v if self.v is None else torch.cat([self.v, v], 1)
        return self.k, self.v

    def nbytes(self) -> int:
        return 0 if self.k is None or self.v is None else 2 * self.k.numel() * self.k.element_size()


def positioned(cfg: TextModelConfig, q: torch.Tensor, k: torch.Tensor, start: int, w: Weights, prefix: str
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``q`` [s, a*hd] and keys ``k`` [s, b*hd] as heads [a, s, hd] and [b, s, hd], each head RMS-normalised
    first when the model has per-head norms (``qk_norm``: ``{prefix}q_norm.weight`` in ``w``), then rotated to
    positions ``start`` .. when it has rotary positions."""
    s, hd = q.shape[0], cfg.head_dim
    qh = q.view(s, q.shape[1] // hd, hd).transpose(0, 1)  # the head counts given: a rank may hold no rows
    kh = k.view(s, k.shape[1] // hd, hd).transpose(0, 1)
    if cfg.qk_norm:
        qh = rms_norm(cfg, qh, w[prefix + "q_norm.weight"])
        kh = rms_norm(cfg, kh, w[prefix + "k_norm.weight"])
    if cfg.rotary:
        qh, kh = rotary(cfg, qh, start), rotary(cfg, kh, start)
    return qh, kh


def attention(cfg: TextModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
              cache: HeadCache | None = None, w: Weights | None = None, prefix: str = "") -> torch.Tensor:
    """Self-attention [s, heads*hd] of the query heads in ``q`` [s, a*hd] over the KV heads in ``k``, ``v``
    [s, a/group*hd] (whole groups: query head j reads KV head j // group), for positions ``start`` .. Keys and
    values of earlier positions come from ``cache``, which is extended with these. ``w`` holds the layer's per-head
    norms under ``prefix`` (``positioned``) for a model that has them."""
    s, hd = q.shape[0], cfg.head_dim
    if q.shape[1] == 0:
        return q
    qh, kh = positioned(cfg, q, k, start, w or {}, prefix)
    vh = v.view(s, -1, hd).transpose(0, 1)
    if cache is not None:
        kh, vh = cache.extend(kh, vh)
    if cfg.group > 1:
        kh = kh.repeat_interleave(cfg.group, 0)
        vh = vh.repeat_interleave(cfg.group, 0)
    t = kh.shape[1]
    mask = None
    if cfg.causal and s > 1:
        # Query i sits at position start + i and sees keys 0 .. start + i.
        mask = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=1.0 / math.sqrt(hd))
    return out.transpose(0, 1).reshape(s, -1)
