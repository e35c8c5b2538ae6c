"""A model written as one GGUF file the way llama.cpp's converter writes it, with ggml's own writer and block
formats (the ``gguf`` package): the shape as metadata, a Llama's q and k rows in llama.cpp's order, Llama 3's
rotary scaling as ``rope_freqs``, the layers' matrices and the embedding in the ggml types asked for, the rest F32.
For benchmarks and tests of random-weight models of the published shapes; real models come converted already.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgeswarm.models.text.gguf_file import stored_name
from edgeswarm.models.text.ops import inverse_frequencies
from edgeswarm.models.text.reference import weight_shapes
from edgeswarm.values.text_model import MATRICES, TextModelConfig


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a Llama's q or k rows within each head (its rotation pairs dimensions 2i and 2i+1)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _kind_of(name: str, matrices: str, embed: str) -> str:
    part = name.split(".")
    if part[0] == "layers" and part[2] in MATRICES and part[3] == "weight":
        return matrices
    return embed if name in ("embed.tokens", "lm_head.weight") else "F32"


def filler_vocabulary(vocab: int) -> Callable[[Any], None]:
    """Metadata of a byte-level BPE vocabulary of ``vocab`` tokens for a file of random weights, which llama.cpp
    will not load without one: the 256 bytes, then every pair of them and pairs with a third (each with its merge);
    id 0 begins and id 1 ends a sequence."""
    from gguf.vocab import bytes_to_unicode  # type: ignore[import-untyped]

    alphabet = list(bytes_to_unicode().values())
    tokens, merges = alphabet[:vocab], []
    for first in alphabet:
        for second in alphabet:
            tokens.append(first + second)
            merges.append(f"{first} {second}")
    pairs = tokens[len(alphabet):]
    for pair in pairs:
        if len(tokens) >= vocab:
            break
        for third in alphabet:
            tokens.append(pair + third)
            merges.append(f"{pair} {third}")
    tokens, merges = tokens[:vocab], merges[:max(0, vocab - len(alphabet))]

    def add(w: Any) -> None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([1] * vocab)
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
    return add


def write_gguf(path: Path, cfg: TextModelConfig, weight: Callable[[str], torch.Tensor], *, arch: str = "llama",
               matrices: str = "Q8_0", embed: str = "Q8_0", metadata: Callable[[Any], None] | None = None) -> Path:
    """The model of shape ``cfg`` (a llama-family config) whose weights ``weight(name)`` gives one at a time
    (canonical names and layout) written to ``path``: the layers' matrices in ggml type ``matrices``, the token
    embedding (and an untied head) in ``embed``, the rest F32; ``metadata(writer)`` adds more (a vocabulary).
    Tensors are spooled to a temporary file as they are made, so a large model never sits in memory whole."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch, use_temp_file=True)
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
        cpu = torch.device("cpu")  # the factors go into the file (numpy), not into a computation
        plain = cfg.model_copy(update={"rope_scaling": None})
        factors = inverse_frequencies(plain, cfg.head_dim, cpu) / inverse_frequencies(cfg, cfg.head_dim, cpu)
        w.add_tensor("rope_freqs.weight", factors.numpy().astype(np.float32))
    for name in weight_shapes(cfg):
        a = weight(name).float().numpy()
        part = name.split(".")
        if arch == "llama" and part[0] == "layers" and part[2] in ("q", "k"):
            a = permute(a, cfg.heads if part[2] == "q" else cfg.n_kv)
        kind = _kind_of(name, matrices, embed)
        if kind == "F32":
            w.add_tensor(stored_name(name), a.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(stored_name(name), a.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(stored_name(name), gguf.quants.quantize(a.astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
