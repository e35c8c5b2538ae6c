"""A Transformer language model's shape (``TextModelConfig``), its presets and its weight layout, and where a model
comes from (``TextModelSource``: a preset, or a Hugging Face style folder): value types that job specs, messages,
planners and runtimes share.

Weight layout (the one every loader writes and every runtime reads; ``nn.Linear`` convention, weight [out, in]),
``hd`` = ``head_dim``, ``H`` = ``heads``, ``K`` = ``kv_heads``, ``h`` = ``hidden``, ``f`` = ``ffn``:

=============================  ======================  =====================================================
name                           shape                   present
=============================  ======================  =====================================================
``embed.tokens``               [vocab, h]              always
``embed.positions``            [max_positions+off, h]  learned positions (bert, gpt2, opt; ``off`` =
                                                       ``position_offset``, OPT's 2)
``embed.types``                [type_vocab, h]         bert
``embed.norm.weight|bias``     [h]                     bert (LayerNorm after the embedding sum)
``layers.{i}.q.weight|bias``   [H*hd, h] | [H*hd]      always (bias when ``bias`` or ``qkv_bias``)
``layers.{i}.k.weight|bias``   [K*hd, h] | [K*hd]      always (likewise)
``layers.{i}.v.weight|bias``   [K*hd, h] | [K*hd]      always (likewise)
``layers.{i}.q_norm.weight``   [hd]                    ``qk_norm`` (Qwen3: RMSNorm of each query head)
``layers.{i}.k_norm.weight``   [hd]                    ``qk_norm`` (of each key head)
``layers.{i}.o.weight|bias``   [h, H*hd] | [h]         always (bias when ``bias``)
``layers.{i}.attn_norm.*``     [h]                     always: pre-LN: before attention; post-LN (bert): after
                                                       the attention's residual add (``.bias`` not for RMSNorm)
``layers.{i}.mlp_norm.*``      [h]                     likewise around the MLP
``layers.{i}.up.weight|bias``  [f, h] | [f]            always
``layers.{i}.gate.weight``     [f, h]                  llama (SwiGLU: down(silu(gate(x)) * up(x)))
``layers.{i}.down.weight|bias`` [h, f] | [h]           always
``final_norm.weight|bias``     [h]                     pre-LN families (gpt2 ``ln_f``, opt, llama ``norm``)
``lm_head.weight``             [vocab, h]              decoders (the same tensor as ``embed.tokens`` when tied)
=============================  ======================  =====================================================

Head ``j`` of a layer is rows [j*hd, (j+1)*hd) of ``q``; query head ``j`` reads KV head ``j // (H // K)``. ``hd`` is
``hidden / heads`` unless ``head_size`` says otherwise (Qwen3: 128 at hidden 1024 and 16 heads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Family = Literal["bert", "gpt2", "opt", "llama"]
Activation = Literal["gelu", "gelu_tanh", "relu", "silu"]
DType = Literal["float32", "bfloat16", "float16"]

MAX_LAYERS = 256
MAX_WIDTH = 65536
MAX_VOCAB = 1 << 20
MAX_POSITIONS = 1 << 17

# ggml's quantized blocks a GGUF file holds and the runtime keeps as they are (``models.text.quantized``): a block
# is BLOCK consecutive weights of a row in BLOCK_BYTES[kind] bytes (a float16 scale and the quants).
QuantType = Literal["q8_0", "q4_0"]
BLOCK = 32
BLOCK_BYTES: dict[str, int] = {"q8_0": 34, "q4_0": 18}
MATRICES = ("q", "k", "v", "o", "up", "gate", "down")  # a layer's weights that ``quantization`` applies to


class RopeScaling(BaseModel):
    """Llama 3's rotary scaling (``rope_type: llama3``): the frequencies whose wavelength is longer than
    ``original_max_positions / low_freq_factor`` are divided by ``factor``, those shorter than ``original_max_positions
    / high_freq_factor`` kept, and those between blended smoothly, so a model trained on ``original_max_positions``
    reads longer contexts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["llama3"] = "llama3"
    factor: float = Field(gt=0, le=1e4)
    low_freq_factor: float = Field(gt=0, le=1e4)
    high_freq_factor: float = Field(gt=0, le=1e4)
    original_max_positions: int = Field(ge=1, le=MAX_POSITIONS)

    @model_validator(mode="after")
    def _ordered(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"high_freq_factor {self.high_freq_factor} must exceed low_freq_factor "
                             f"{self.low_freq_factor}")
        return self


class TextModelConfig(BaseModel):
    """One Transformer's shape. ``family`` fixes the block structure: bert is post-LN, bidirectional, with token
    types; gpt2 and opt are pre-LN causal decoders with learned positions (opt: ReLU, positions offset by 2);
    llama is a pre-LN causal decoder with RMSNorm, SwiGLU, rotary positions and grouped-query attention
    (``kv_heads`` < ``heads``); Mistral, SmolLM2 and Qwen2/2.5/3 are llama with ``qkv_bias`` (Qwen2: biases on q, k
    and v only), ``qk_norm`` (Qwen3: each query and key head RMS-normalised before the rotation) and ``head_size``
    (a head dimension other than ``hidden / heads``); ``rope_scaling`` is Llama 3's. ``dtype`` is what weights and
    activations are held in."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    family: Family
    layers: int = Field(ge=1, le=MAX_LAYERS)
    hidden: int = Field(ge=1, le=MAX_WIDTH)
    heads: int = Field(ge=1, le=MAX_WIDTH)
    kv_heads: int = Field(default=0, ge=0, le=MAX_WIDTH)  # 0: as many as ``heads``
    ffn: int = Field(ge=1, le=4 * MAX_WIDTH)
    vocab: int = Field(ge=2, le=MAX_VOCAB)
    max_positions: int = Field(default=512, ge=1, le=MAX_POSITIONS)
    type_vocab: int = Field(default=2, ge=0, le=16)
    norm_eps: float = Field(default=1e-5, gt=0, le=1e-1)
    activation: Activation = "gelu"
    bias: bool = True
    position_offset: int = Field(default=0, ge=0, le=16)
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = True
    dtype: DType = "float32"
    head_size: int = Field(default=0, ge=0, le=MAX_WIDTH)  # 0: hidden / heads
    qkv_bias: bool = False
    qk_norm: bool = False
    # The layers' matrices (q, k, v, o, up, gate, down) and the token embedding (with a tied head) held in ggml's
    # quantized blocks (a GGUF file's); None: in ``dtype``. An untied head is in ``head_quantization``.
    quantization: QuantType | None = None
    embed_quantization: QuantType | None = None
    head_quantization: QuantType | None = None
    # A GGUF Llama 3's rotary scaling as stored there: each frequency's divisor (``rope_freqs``, head_dim / 2 of
    # them), in place of ``rope_scaling``'s parameters.
    rope_factors: tuple[float, ...] | None = Field(default=None, max_length=MAX_WIDTH // 2)

    @model_validator(mode="after")
    def _consistent(self) -> TextModelConfig:
        if not self.head_size and self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if (self.qk_norm or self.rope_scaling is not None) and self.family != "llama":
            raise ValueError("qk_norm and rope_scaling belong to the llama family")
        if self.heads % self.n_kv:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.family == "llama" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head dimension, not {self.head_dim}")
        if self.rope_factors is not None and (self.family != "llama" or len(self.rope_factors) != self.head_dim // 2
                                              or self.rope_scaling is not None):
            raise ValueError(f"rope_factors are a llama model's head_dim / 2 = {self.head_dim // 2} divisors, "
                             "given instead of rope_scaling")
        if self.quantization is not None and (self.head_dim % BLOCK or self.ffn % BLOCK or self.hidden % BLOCK):
            # A rank's columns of o (whole heads) and of down (its MLP columns) must be whole blocks.
            raise ValueError(f"a {self.quantization} model's hidden size, head dimension and MLP width must be "
                             f"multiples of its {BLOCK}-weight blocks ({self.hidden}, {self.head_dim}, {self.ffn})")
        return self

    @property
    def n_kv(self) -> int:
        """KV heads (``kv_heads``, or ``heads`` when 0)."""
        return self.kv_heads or self.heads

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.n_kv

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def attention_biased(self) -> bool:
        """Whether q, k and v have biases."""
        return self.bias or self.qkv_bias

    @property
    def pre_ln(self) -> bool:
        return self.family != "bert"

    @property
    def causal(self) -> bool:
        return self.family != "bert"

    @property
    def rms_norm(self) -> bool:
        return self.family == "llama"

    @property
    def gated(self) -> bool:
        return self.family == "llama"

    @property
    def rotary(self) -> bool:
        return self.family == "llama"

    @property
    def decoder(self) -> bool:
        return self.family != "bert"

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def column_granule(self) -> int:
        """The MLP columns a tensor-parallel share is a multiple of: a quantization block when the matrices are
        quantized (a rank's columns of ``down`` are whole blocks), else 1."""
        return BLOCK if self.quantization is not None else 1

    def matrix_bytes(self, kind: QuantType | None) -> float:
        """Bytes a matrix weight of ``kind`` takes (None: ``dtype``'s)."""
        return self.dtype_bytes if kind is None else BLOCK_BYTES[kind] / BLOCK

    def tensor_bytes(self, name: str, numel: int) -> float:
        """Bytes weight ``name`` (canonical: "layers.3.q.weight", "embed.tokens") of ``numel`` elements takes as
        held: a layer's matrix in ``quantization``, the embedding in ``embed_quantization``, an untied head in
        ``head_quantization``, everything else in ``dtype``."""
        part = name.split(".")
        if part[0] == "layers" and len(part) == 4 and part[3] == "weight" and part[2] in MATRICES:
            kind = self.quantization
        elif name == "embed.tokens":
            kind = self.embed_quantization
        elif name == "lm_head.weight":
            kind = self.embed_quantization if self.tie_embeddings else self.head_quantization
        else:
            kind = None
        return numel * self.matrix_bytes(kind)

    def attention_bytes(self) -> float:
        """Bytes of one attention block as held (M_att): its matrices in ``quantization``, the rest in ``dtype``."""
        h, hd = self.hidden, self.head_dim
        matrices = (self.heads + 2 * self.n_kv) * hd * h + h * self.heads * hd
        return self.attention_params() * self.dtype_bytes + matrices * (
            self.matrix_bytes(self.quantization) - self.dtype_bytes)

    def mlp_bytes(self) -> float:
        """Bytes of one MLP block as held (M_mlp)."""
        matrices = (3 if self.gated else 2) * self.hidden * self.ffn
        return self.mlp_params() * self.dtype_bytes + matrices * (
            self.matrix_bytes(self.quantization) - self.dtype_bytes)

    def attention_params(self) -> int:
        """Parameters of one attention block (projections and their biases), the paper's M_att in elements."""
        h, hd = self.hidden, self.head_dim
        q = self.heads * hd * h + (self.heads * hd if self.attention_biased else 0)
        kv = 2 * (self.n_kv * hd * h + (self.n_kv * hd if self.attention_biased else 0))
        o = h * self.heads * hd + (h if self.bias else 0)
        return q + kv + o + (2 * hd if self.qk_norm else 0)

    def mlp_params(self) -> int:
        """Parameters of one MLP block (M_mlp in elements)."""
        h, f = self.hidden, self.ffn
        mats = (3 if self.gated else 2) * h * f
        return mats + ((f + h) if self.bias else 0)


def _bert(layers: int, hidden: int, heads: int, **kw: object) -> TextModelConfig:
    return TextModelConfig(family="bert", layers=layers, hidden=hidden, heads=heads, ffn=4 * hidden, vocab=30522,
                           norm_eps=1e-12, activation="gelu", tie_embeddings=False, **kw)  # type: ignore[arg-type]


def _gpt2(layers: int, hidden: int, heads: int, **kw: object) -> TextModelConfig:
    return TextModelConfig(family="gpt2", layers=layers, hidden=hidden, heads=heads, ffn=4 * hidden, vocab=50257,
                           max_positions=1024, activation="gelu_tanh", type_vocab=0, **kw)  # type: ignore[arg-type]


def _opt(layers: int, hidden: int, heads: int, **kw: object) -> TextModelConfig:
    return TextModelConfig(family="opt", layers=layers, hidden=hidden, heads=heads, ffn=4 * hidden, vocab=50272,
                           max_positions=2048, position_offset=2, activation="relu", type_vocab=0,
                           **kw)  # type: ignore[arg-type]


def _llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, **kw: object) -> TextModelConfig:
    return TextModelConfig(family="llama", layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                           vocab=32000, max_positions=4096, activation="silu", bias=False, type_vocab=0,
                           norm_eps=1e-5, tie_embeddings=False, **kw)  # type: ignore[arg-type]


# Test sizes run in milliseconds; the paper's shapes (Table IV) hold random weights unless a model folder is given.
PRESETS: dict[str, TextModelConfig] = {
    "bert-tiny": _bert(2, 64, 4).model_copy(update={"vocab": 512, "max_positions": 128}),
    "gpt2-tiny": _gpt2(2, 64, 4).model_copy(update={"vocab": 512, "max_positions": 128}),
    "opt-tiny": _opt(2, 64, 4).model_copy(update={"vocab": 512, "max_positions": 128}),
    "llama-tiny": _llama(2, 64, 8, 2, 176).model_copy(update={"vocab": 512, "max_positions": 128}),
    "distilbert": _bert(6, 768, 12),
    "bert-large": _bert(24, 1024, 16),
    "gpt2-large": _gpt2(36, 1280, 20),
    "opt-1.3b": _opt(24, 2048, 32),
    "opt-2.7b": _opt(32, 2560, 32),
    "qwen2-tiny": _llama(2, 64, 8, 2, 176).model_copy(update={"vocab": 512, "max_positions": 128, "qkv_bias": True,
                                                              "tie_embeddings": True}),
    "qwen3-tiny": _llama(2, 64, 4, 2, 176).model_copy(update={"vocab": 512, "max_positions": 128, "head_size": 24,
                                                              "qk_norm": True, "tie_embeddings": True}),
    "llama-3.2-1b": _llama(16, 2048, 32, 8, 8192).model_copy(update={
        "vocab": 128256, "rope_theta": 500000.0, "tie_embeddings": True, "max_positions": 131072,
        "rope_scaling": RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_positions=8192)}),
    "qwen2.5-0.5b": _llama(24, 896, 14, 2, 4864).model_copy(update={
        "vocab": 151936, "rope_theta": 1000000.0, "tie_embeddings": True, "qkv_bias": True, "norm_eps": 1e-6,
        "max_positions": 32768}),
    "qwen3-0.6b": _llama(28, 1024, 16, 8, 3072).model_copy(update={
        "vocab": 151936, "rope_theta": 1000000.0, "tie_embeddings": True, "head_size": 128, "qk_norm": True,
        "norm_eps": 1e-6, "max_positions": 40960}),
    "smollm2-135m": _llama(30, 576, 9, 3, 1536).model_copy(update={
        "vocab": 49152, "rope_theta": 100000.0, "tie_embeddings": True, "max_positions": 8192}),
}






MAX_PATH_CHARS = 1024


class TextModelSource(BaseModel):
    """A model by ``preset`` (random weights drawn from ``seed``, the same on every node) or by ``path``, a folder
    (config.json, safetensors, tokenizer.json) or a GGUF file every node can read at that path. ``layers`` keeps only
    the first layers (the paper's scaling runs use one); ``dtype`` overrides the weights' and activations' dtype."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    preset: str | None = Field(default=None, max_length=64)
    path: str | None = Field(default=None, max_length=MAX_PATH_CHARS)
    layers: int | None = Field(default=None, ge=1, le=MAX_LAYERS)
    dtype: DType | None = None
    seed: int = Field(default=0, ge=0, le=(1 << 31) - 1)

    @model_validator(mode="after")
    def _one_source(self) -> TextModelSource:
        if (self.preset is None) == (self.path is None):
            raise ValueError("name the model by exactly one of preset (one of "
                             f"{', '.join(PRESETS)}) or path (a model folder)")
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; the presets are {', '.join(PRESETS)}")
        return self

    @property
    def name(self) -> str:
        """A short name for listings: the preset, or the folder's name."""
        return self.preset if self.preset is not None else Path(str(self.path)).name
