"""A model in one GGUF file (llama.cpp's format), read with ggml's own reader (the ``gguf`` package): its shape
from the file's metadata, its weights memory-mapped, each read only where asked.

Architectures: ``llama`` (Llama 2 and 3.x, Mistral, SmolLM2: llama.cpp writes them all as llama), ``qwen2`` (and
2.5) and ``qwen3``. Tensors in F32, F16 and BF16 are read as tensors; Q8_0 and Q4_0 matrices stay in their blocks
(``quantized.QuantizedMatrix``): a row range reads those rows' blocks, a column range on block boundaries those bytes
of each row. Other ggml types (the K-quants) are dequantized as they are read, by ``gguf.quants``, and held in the
model's dtype, which ``TextModelConfig`` does not count: a warning says so.

llama.cpp's converter reorders a Llama's q and k rows within each head (its rotation pairs dimensions 2i and 2i+1,
transformers' i and i + head_dim/2); reading undoes it, so the canonical layout is transformers' for every source.
Llama 3's rotary scaling is in the file as ``rope_freqs.weight``, each frequency's divisor: the config's
``rope_factors``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgeswarm.models.text.errors import (
    MissingModelFileError,
    MissingWeightError,
    ModelFolderError,
    UnsupportedModelError,
    WeightShapeError,
)
from edgeswarm.models.text.ops import Matrix, Weights, torch_dtype
from edgeswarm.models.text.quantized import QuantizedMatrix
from edgeswarm.models.text.reference import weight_shapes
from edgeswarm.models.text.slices import WeightSlice
from edgeswarm.values.text_model import MAX_POSITIONS, DType, QuantType, TextModelConfig

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "qwen3")
_KEPT: dict[str, QuantType] = {"Q8_0": "q8_0", "Q4_0": "q4_0"}  # ggml type name -> the blocks kept as they are
_DENSE = ("F32", "F16", "BF16")
# canonical layer weight -> GGUF's name within blk.N
_LAYER = {"q.weight": "attn_q.weight", "k.weight": "attn_k.weight", "v.weight": "attn_v.weight",
          "o.weight": "attn_output.weight", "q.bias": "attn_q.bias", "k.bias": "attn_k.bias", "v.bias": "attn_v.bias",
          "q_norm.weight": "attn_q_norm.weight", "k_norm.weight": "attn_k_norm.weight",
          "attn_norm.weight": "attn_norm.weight", "mlp_norm.weight": "ffn_norm.weight",
          "up.weight": "ffn_up.weight", "gate.weight": "ffn_gate.weight", "down.weight": "ffn_down.weight"}
_GLOBAL = {"embed.tokens": "token_embd.weight", "final_norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def stored_name(name: str) -> str:
    """GGUF's name of canonical weight ``name`` ("layers.3.q.weight" -> "blk.3.attn_q.weight")."""
    part = name.split(".")
    return f"blk.{part[1]}.{_LAYER['.'.join(part[2:])]}" if part[0] == "layers" else _GLOBAL[name]


def open_reader(path: Path) -> Any:
    """ggml's reader of GGUF file ``path`` (memory-mapped). Raises MissingModelFileError or ModelFolderError."""
    import gguf

    if not path.is_file():
        raise MissingModelFileError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(str(path), "r")
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise ModelFolderError(f"{path} is not a readable GGUF file ({exc})") from exc


def metadata(reader: Any, keep: Callable[[str], bool], path: Path | None = None) -> dict[str, Any]:
    """The file's metadata values whose keys ``keep`` accepts. A value the reader cannot decode is left out, or with
    ``path`` (the file, for the message) raises ModelFolderError."""
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if not keep(name):
            continue
        try:
            out[name] = field.contents()
        except (ValueError, UnicodeDecodeError, IndexError) as exc:
            if path is not None:
                raise ModelFolderError(f"{path}: metadata {name} cannot be read ({exc})") from exc
    return out


def _shape_keys(name: str) -> bool:
    return not name.startswith("tokenizer.ggml.") or name == "tokenizer.ggml.model"  # the vocabulary: the tokenizer's


def _type_name(tensor: Any) -> str:
    return str(tensor.tensor_type.name)


def config_from_gguf(reader: Any, path: Path, dtype: DType | None = None) -> TextModelConfig:
    """The ``TextModelConfig`` of an open GGUF file (``path`` only names it in errors). ``dtype``: what activations
    (and dense weights) are held in; None: the file's matrices' own half precision when they all are F16 or BF16,
    else float32. Raises UnsupportedModelError or ModelFolderError saying what is missing or not supported."""
    meta = metadata(reader, _shape_keys)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                                    f"{', '.join(ARCHITECTURES)}")
    if meta.get(f"{arch}.expert_count"):
        raise UnsupportedModelError(f"{path}: a mixture-of-experts model is not supported")
    tensors = {t.name: t for t in reader.tensors}

    def need(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ModelFolderError(f"{path} has no {arch}.{key}, which a {arch} model needs")
        return value

    if "token_embd.weight" not in tensors:
        raise MissingWeightError(f"{path}: no token_embd.weight; is this a {arch} model?")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModelError(f"{path}: rotary scaling {scaling!r} is not supported, only plain rotary "
                                    "positions and Llama 3's (rope_freqs)")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or 0)
    factors = tensors.get("rope_freqs.weight")
    matrix_types = {_type_name(t) for n, t in tensors.items()
                    if n.startswith("blk.") and n.split(".")[2].removeprefix("attn_").removeprefix("ffn_") in
                    ("q", "k", "v", "output", "up", "gate", "down") and n.endswith(".weight")}
    kept = [_KEPT[t] for t in matrix_types if t in _KEPT]
    if dtype is None:
        dtype = "float16" if matrix_types == {"F16"} else "bfloat16" if matrix_types == {"BF16"} else "float32"
    converted = sorted(t for t in matrix_types if t not in _KEPT and t not in _DENSE)
    if converted:
        log.warning("%s: %s matrices are dequantized as they are read and held in %s (only %s stay quantized); "
                    "the plan's memory figures count them quantized", path, ", ".join(converted), dtype,
                    " and ".join(_KEPT))
    embed_type = _type_name(tensors["token_embd.weight"])
    head = tensors.get("output.weight")
    vocab = int(meta.get(f"{arch}.vocab_size") or tensors["token_embd.weight"].shape[1])
    try:
        return TextModelConfig(
            family="llama", layers=int(need("block_count")), hidden=hidden, heads=heads,
            kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads), ffn=int(need("feed_forward_length")),
            vocab=vocab, max_positions=min(int(meta.get(f"{arch}.context_length") or 4096), MAX_POSITIONS),
            type_vocab=0, norm_eps=float(need("attention.layer_norm_rms_epsilon")), activation="silu", bias=False,
            rope_theta=float(meta.get(f"{arch}.rope.freq_base") or 10000.0),
            rope_factors=tuple(float(x) for x in np.asarray(factors.data).reshape(-1)) if factors is not None else None,
            tie_embeddings=head is None, dtype=dtype,
            head_size=head_dim if head_dim and (head_dim != hidden // heads or hidden % heads) else 0,
            qkv_bias="blk.0.attn_q.bias" in tensors, qk_norm="blk.0.attn_q_norm.weight" in tensors,
            quantization=max(kept, key=kept.count) if kept else None, embed_quantization=_KEPT.get(embed_type),
            head_quantization=_KEPT.get(_type_name(head)) if head is not None else None)
    except ValueError as exc:
        raise ModelFolderError(f"{path} describes a model this runtime cannot hold: {exc}") from exc


def load_gguf_config(path: Path | str, dtype: DType | None = None) -> TextModelConfig:
    """The ``TextModelConfig`` of GGUF file ``path`` (see ``config_from_gguf``)."""
    path = Path(path)
    return config_from_gguf(open_reader(path), path, dtype)


def _unpermute_rows(heads: int, head_dim: int) -> torch.Tensor:
    """For each canonical (transformers) row of ``heads`` heads, the row llama.cpp stored it in: canonical row
    h*hd + t*hd/2 + i is stored at h*hd + 2i + t."""
    half = head_dim // 2
    t = torch.arange(2).view(1, 2, 1)
    i = torch.arange(half).view(1, 1, half)
    h = torch.arange(heads).view(heads, 1, 1)
    return (h * head_dim + 2 * i + t).reshape(-1)


class GgufModel:
    """A GGUF file opened for reading, with ``ModelFolder``'s interface: ``config``, ``names``, ``shape``, ``nbytes``,
    ``get``, ``read_slice``, ``load`` (the weights as ``Matrix``: quantized ones stay so). ``device``: where what is
    read lands; ``layers``: keep only the first layers."""

    def __init__(self, path: Path | str, dtype: DType | None = None,
                 device: torch.device | str | None = None, layers: int | None = None) -> None:
        self.path = Path(path)
        self.device = torch.device(device) if device is not None else None
        self._reader = open_reader(self.path)
        self.config = config_from_gguf(self._reader, self.path, dtype)
        if layers is not None:
            if not 1 <= layers <= self.config.layers:
                raise ModelFolderError(f"{self.path} holds {self.config.layers} layers; cannot keep {layers}")
            self.config = self.config.model_copy(update={"layers": layers})
        self.architecture = str(self._reader.fields["general.architecture"].contents())  # checked by the config
        self._dtype = torch_dtype(self.config)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._sources = self._resolve()
        self._check_shapes()

    def _resolve(self) -> dict[str, str]:
        cfg = self.config
        out: dict[str, str] = {}
        for name in weight_shapes(cfg):
            stored = stored_name(name)
            if stored not in self._tensors:
                raise MissingWeightError(f"{self.path}: tensor {stored} (our {name}) is not in the file")
            out[name] = stored
        if cfg.decoder:
            out["lm_head.weight"] = out["embed.tokens"] if cfg.tie_embeddings else stored_name("lm_head.weight")
        return out

    def _check_shapes(self) -> None:
        wanted = weight_shapes(self.config)
        wanted["lm_head.weight"] = (self.config.vocab, self.config.hidden)
        for name, stored in self._sources.items():
            got = self.shape(name)
            if got != wanted[name]:
                raise WeightShapeError(f"{self.path}: tensor {stored} (our {name}) has shape {list(got)}, but the "
                                       f"file's metadata implies {list(wanted[name])}")

    @property
    def names(self) -> list[str]:
        return list(self._sources)

    def _tensor(self, name: str) -> Any:
        if name not in self._sources:
            raise MissingWeightError(f"{name!r} is not a weight of this {self.architecture} model")
        return self._tensors[self._sources[name]]

    def shape(self, name: str) -> tuple[int, ...]:
        """The canonical shape of ``name`` (ggml lists a tensor's dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self._tensor(name).shape.tolist()))

    def kind(self, name: str) -> str:
        """ggml's type of the stored tensor (F32, Q8_0, ...)."""
        return _type_name(self._tensor(name))

    def nbytes(self, name: str) -> int:
        """The bytes ``name`` takes as held: its quantized blocks, or its elements in the config's dtype."""
        tensor = self._tensor(name)
        if self.kind(name) in _KEPT:
            return int(tensor.n_bytes)
        return math.prod(self.shape(name)) * self.config.dtype_bytes

    def stored_bytes(self) -> dict[str, int]:
        """Every tensor the file stores, by its GGUF name: its bytes in the file."""
        return {name: int(t.n_bytes) for name, t in self._tensors.items()}

    def _permuted(self, name: str) -> bool:
        """Whether llama.cpp reordered the rows of ``name`` within each head (a Llama's q and k)."""
        part = name.split(".")
        return self.architecture == "llama" and part[0] == "layers" and part[2] in ("q", "k")

    def read_slice(self, part: WeightSlice) -> Matrix:
        """The rows and/or columns of one canonical weight that ``part`` names, reading only their bytes (a quantized
        matrix's column range must lie on its blocks)."""
        tensor = self._tensor(part.name)
        shape = self.shape(part.name)
        kind = self.kind(part.name)
        rows = part.rows or (0, shape[0])
        index: torch.Tensor | None = None
        if self._permuted(part.name):
            hd = self.config.head_dim
            if rows[0] % hd or rows[1] % hd:
                raise ValueError(f"{part.name}: rows {rows} are not whole heads of {hd}")
            index = _unpermute_rows((rows[1] - rows[0]) // hd, hd)
        if len(shape) == 1:  # a norm or a bias: small, and a BF16 one's data is its bytes
            t = self._dense(torch.from_numpy(np.array(tensor.data)), kind)[rows[0]:rows[1]]
            return t[index.to(t.device)] if index is not None else t
        raw = torch.from_numpy(np.array(tensor.data[rows[0]:rows[1]]))  # a copy of those rows' bytes only
        if index is not None:
            raw = raw[index]
        if kind in _KEPT:
            out = QuantizedMatrix(raw, _KEPT[kind], shape[1], self._dtype)
            if part.columns is not None:
                out = out.column_range(*part.columns)
            return out if self.device is None else out.to(self.device)
        t = self._dense(raw, kind)
        if part.columns is not None:
            t = t[:, part.columns[0]:part.columns[1]].contiguous()
        return t

    def _dense(self, raw: torch.Tensor, kind: str) -> torch.Tensor:
        """A stored tensor's elements (``raw``: as the reader holds them) in the config's dtype."""
        if kind == "BF16":
            t = raw.contiguous().view(torch.int16).view(torch.bfloat16)
        elif kind in ("F32", "F16"):
            t = raw
        else:
            import gguf

            t = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[kind]))
        t = t.to(self._dtype).contiguous()
        return t if self.device is None else t.to(self.device)

    def get(self, name: str) -> Matrix:
        """The whole canonical weight ``name``."""
        return self.read_slice(WeightSlice(name=name))

    def load(self, names: Iterable[str] | None = None) -> Weights:
        """The canonical weights ``names`` (all when None); a tied head shares the embedding's matrix."""
        wanted = list(self.names if names is None else dict.fromkeys(names))
        out: Weights = {}
        for name in wanted:
            tied = next((other for other in out if self._sources[other] == self._sources[name]), None)
            out[name] = out[tied] if tied is not None else self.get(name)
        return out

    def close(self) -> None:
        """Nothing to release early: the memory map goes with the object."""

    def __enter__(self) -> GgufModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, names: Iterable[str]) -> Weights:
        return self.load(names)
