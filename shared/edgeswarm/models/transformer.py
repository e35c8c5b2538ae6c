"""Transformers in plain torch: a BERT-style encoder classifier and a GPT-2-style causal language model.

Inputs are int64 token ids of shape (batch, seq_len) with seq_len fixed by the config (no padding mask).
No dropout, so that a pipeline-trained model matches single-process training exactly. Attention uses
F.scaled_dot_product_attention (causal through ``is_causal``), which keeps every forward fx traceable.
GPT-2's output head is not tied to the token embedding: tied weights would sit in two pipeline stages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgeswarm.models.cnn import Config


class SelfAttention(nn.Module):
    """Multi-head self-attention: one fused QKV projection, scaled dot-product attention, output projection."""

    def __init__(self, hidden: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.causal = causal
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (B, S, 3H) -> (3, B, heads, S, head_dim) with constant sizes only, so no shape value is traced.
        qkv = self.qkv(x).unflatten(-1, (3, self.heads, self.head_dim)).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(out.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """Position-wise MLP: Linear, GELU, Linear."""

    def __init__(self, hidden: int, inner: int, approximate: str = "none") -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, inner)
        self.act = nn.GELU(approximate=approximate)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TokenEmbedding(nn.Module):
    """Token plus learned absolute position embeddings for sequences of exactly ``seq_len`` tokens."""

    def __init__(self, vocab: int, hidden: int, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq_len, hidden)
        self.register_buffer("position_ids", torch.arange(seq_len), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(self.position_ids)


def init_transformer(module: nn.Module) -> None:
    """BERT/GPT-2 initialisation: N(0, 0.02) weights for Linear and Embedding, zero biases, unit LayerNorm."""
    for m in module.modules():
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


# --- BERT ------------------------------------------------------------------------------------------------


class EncoderLayer(nn.Module):
    """BERT encoder layer (post-LayerNorm): x = LN(x + attn(x)); x = LN(x + ffn(x))."""

    def __init__(self, hidden: int, heads: int, inner: int) -> None:
        super().__init__()
        self.attn = SelfAttention(hidden, heads, causal=False)
        self.ln1 = nn.LayerNorm(hidden, eps=1e-12)
        self.ffn = FeedForward(hidden, inner)
        self.ln2 = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.ffn(x))


class BertClassifier(nn.Module):
    """BERT-style encoder: embeddings + LayerNorm, ``layers`` encoder layers, tanh pooler on the first token,
    and a Linear classifier."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        hidden, heads = int(cfg["hidden"]), int(cfg["heads"])
        self.embed = TokenEmbedding(int(cfg["vocab_size"]), hidden, int(cfg["seq_len"]))
        self.embed_ln = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.Sequential(
            *(EncoderLayer(hidden, heads, int(cfg["intermediate_size"])) for _ in range(int(cfg["layers"])))
        )
        self.pooler = nn.Linear(hidden, hidden)
        self.pooler_act = nn.Tanh()
        self.classifier = nn.Linear(hidden, int(cfg["num_classes"]))
        init_transformer(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.embed_ln(self.embed(ids)))
        return self.classifier(self.pooler_act(self.pooler(x[:, 0])))


# --- GPT-2 -----------------------------------------------------------------------------------------------


class DecoderBlock(nn.Module):
    """GPT-2 block (pre-LayerNorm): x = x + attn(LN(x)); x = x + mlp(LN(x)), causal attention."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads, causal=True)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = FeedForward(hidden, 4 * hidden, approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    """GPT-2-style language model: embeddings, ``n_layer`` decoder blocks, final LayerNorm, Linear LM head.
    Returns logits of shape (batch, seq_len, vocab_size)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        hidden = int(cfg["n_embd"])
        self.embed = TokenEmbedding(int(cfg["vocab_size"]), hidden, int(cfg["seq_len"]))
        self.blocks = nn.Sequential(*(DecoderBlock(hidden, int(cfg["n_head"])) for _ in range(int(cfg["n_layer"]))))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, int(cfg["vocab_size"]), bias=False)
        init_transformer(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(self.blocks(self.embed(ids))))
