"""For GGUF files written by ``models.text.gguf_writer``: an HF ``tokenizer.json`` as a file's vocabulary, and the
weights read back through ``gguf``'s own reader and dequantization, un-permuted here (independently of the runtime's
reader): the reference a GGUF model served here must equal (tests only)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgeswarm.models.text.gguf_file import stored_name
from edgeswarm.models.text.ops import Weights
from edgeswarm.models.text.reference import weight_shapes
from edgeswarm.values.text_model import TextModelConfig


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' order of a Llama's q or k rows from llama.cpp's (the inverse of its converter's
    ``LlamaModel.permute``: rows [head, 2, hd/2] were written as [head, hd/2, 2])."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


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
