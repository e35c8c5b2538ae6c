"""GGUF files written with ggml's own writer (the ``gguf`` package) from weights in our canonical layout, as
llama.cpp's converter writes them (a Llama's q and k rows reordered within each head, Llama 3's rotary scaling as
``rope_freqs``), and the same weights read back through ``gguf``'s own reader and dequantization: the reference a
GGUF model served here must equal (tests only)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgeswarm.models.text.ops import Weights, inverse_frequencies
from edgeswarm.models.text.reference import weight_shapes
from edgeswarm.values.text_model import TextModelConfig

LAYER = {"q.weight": "attn_q.weight", "k.weight": "attn_k.weight", "v.weight": "attn_v.weight",
         "o.weight": "attn_output.weight", "q.bias": "attn_q.bias", "k.bias": "attn_k.bias", "v.bias": "attn_v.bias",
         "q_norm.weight": "attn_q_norm.weight", "k_norm.weight": "attn_k_norm.weight",
         "attn_norm.weight": "attn_norm.weight", "mlp_norm.weight": "ffn_norm.weight", "up.weight": "ffn_up.weight",
         "gate.weight": "ffn_gate.weight", "down.weight": "ffn_down.weight"}
GLOBAL = {"embed.tokens": "token_embd.weight", "final_norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
MATRICES = {"q", "k", "v", "o", "up", "gate", "down"}


def stored_name(name: str) -> str:
    part = name.split(".")
    return f"blk.{part[1]}.{LAYER['.'.join(part[2:])]}" if part[0] == "layers" else GLOBAL[name]


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of a Llama's q or k rows (its ``LlamaModel.permute``)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _kind_of(name: str, matrices: str, embed: str) -> str:
    part = name.split(".")
    if part[0] == "layers" and part[2] in MATRICES and part[3] == "weight":
        return matrices
    if name in ("embed.tokens", "lm_head.weight"):
        return embed
    return "F32"


def vocabulary(tokenizer_file: Path, pre: str, *, eos: str, add_bos: bool = False, bos: str | None = None,
               eot: str | None = None, template: str | None = None) -> Callable[[Any], None]:
    """What writes an HF ``tokenizer.json``'s byte-level BPE into a GGUF writer's metadata as llama.cpp's converter
    does: the tokens by id, their types (an added special token CONTROL, another added one USER_DEFINED), the merges
    as "a b", the split (``pre``), the special ids by their texts and the chat template."""
    data = json.loads(tokenizer_file.read_text())
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    added = {t["content"]: t for t in data["added_tokens"]}
    for text, t in added.items():
        vocab[text] = t["id"]
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    types = [(3 if added[t]["special"] else 4) if t in added else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]

    def add(w: Any) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_eos_token_id(vocab[eos])
        w.add_add_bos_token(add_bos)
        if bos is not None:
            w.add_bos_token_id(vocab[bos])
        if eot is not None:
            w.add_eot_token_id(vocab[eot])
        if template is not None:
            w.add_chat_template(template)
    return add


def write_gguf(path: Path, cfg: TextModelConfig, weights: Weights, arch: str = "llama", matrices: str = "Q8_0",
               embed: str = "Q8_0", metadata: Callable[[Any], None] | None = None) -> Path:
    """``weights`` (``cfg``'s canonical layout, float32) written to ``path`` as llama.cpp would write the model:
    the layers' matrices in ggml type ``matrices``, the token embedding (and an untied head) in ``embed``, the
    rest F32; ``metadata`` adds more (a ``vocabulary``)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    if metadata is not None:
        metadata(w)
    w.add_block_count(cfg.layers)
    w.add_context_length(cfg.max_positions)
    w.add_embedding_length(cfg.hidden)
    w.add_feed_forward_length(cfg.ffn)
    w.add_head_count(cfg.heads)
    w.add_head_count_kv(cfg.n_kv)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab)
    if cfg.rope_scaling is not None:
        plain = cfg.model_copy(update={"rope_scaling": None})
        factors = inverse_frequencies(plain, cfg.head_dim, torch.device("cpu")) / inverse_frequencies(
            cfg, cfg.head_dim, torch.device("cpu"))
        w.add_tensor("rope_freqs.weight", factors.numpy().astype(np.float32))
    for name, t in weights.items():
        if name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        a = t.float().numpy()
        part = name.split(".")
        if arch == "llama" and part[0] == "layers" and part[2] in ("q", "k"):
            a = permute(a, cfg.heads if part[2] == "q" else cfg.n_kv)
        kind = _kind_of(name, matrices, embed)
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            w.add_tensor(stored_name(name), a.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(stored_name(name), a.astype(np.float16))
        else:
            w.add_tensor(stored_name(name), gguf.quants.quantize(a.astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def read_dequantized(path: Path, cfg: TextModelConfig, arch: str = "llama") -> Weights:
    """Every canonical weight of the file, dequantized by ``gguf.quants`` and put back in transformers' row order:
    the weights the served model holds, as ggml computes them."""
    import gguf

    reader = gguf.GGUFReader(str(path), "r")
    stored = {t.name: t for t in reader.tensors}
    out: Weights = {}
    for name in weight_shapes(cfg):
        t = stored[stored_name(name)]
        a = gguf.quants.dequantize(np.array(t.data), t.tensor_type).astype(np.float32)
        part = name.split(".")
        if arch == "llama" and part[0] == "layers" and part[2] in ("q", "k"):
            a = unpermute(a, cfg.heads if part[2] == "q" else cfg.n_kv)
        out[name] = torch.from_numpy(np.ascontiguousarray(a))
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed.tokens"]
    return out
