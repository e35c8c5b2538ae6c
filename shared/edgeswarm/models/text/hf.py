"""Published weights from a local Hugging Face style model folder (``config.json`` + safetensors), in ``config``'s
layout, read lazily so a shard reads only its rows or columns; nothing is downloaded.

Families: ``bert`` (BERT, MiniLM and other ``BertModel`` checkpoints), ``distilbert`` (read as the bert family
without token types), ``gpt2``, ``opt`` (pre-LN ones) and ``llama`` (Llama 2 and 3.x with Llama 3's rotary scaling,
SmolLM2, ``mistral``, ``qwen2`` (Qwen2 and 2.5) and ``qwen3``, all read as the llama family). A folder holds
``model.safetensors`` or a sharded set named by ``model.safetensors.index.json``.

The translation to the canonical layout is per tensor: a canonical tensor is a stored tensor, transposed for
GPT-2's ``Conv1D`` (weights stored [in, out]), and for GPT-2's fused ``c_attn`` a block of its rows (q, k, v one
after another). ``ModelFolder.get_slice`` reads rows or columns of the canonical tensor by reading the matching
slice of the stored one, so a device holding heads j..k reads only their bytes from disk.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict
from safetensors import SafetensorError, safe_open

from edgeswarm.errors import ConfigError
from edgeswarm.models.text.errors import (
    MissingModelFileError,
    MissingWeightError,
    ModelFolderError,
    UnsupportedModelError,
    WeightShapeError,
)
from edgeswarm.models.text.ops import Weights, torch_dtype
from edgeswarm.models.text.reference import weight_shapes
from edgeswarm.models.text.slices import WeightSlice
from edgeswarm.values.text_model import (
    MAX_POSITIONS,
    PRESETS,
    DType,
    RopeScaling,
    TextModelConfig,
    TextModelSource,
)

if TYPE_CHECKING:
    from edgeswarm.models.text.gguf_file import GgufModel

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_CONFIG_BYTES = 1 << 20  # a config.json or index larger than this is not one
SUPPORTED = ("bert", "distilbert", "gpt2", "opt", "llama", "mistral", "qwen2", "qwen3")


class _Source(BaseModel):
    """Where a canonical tensor lives: stored tensor ``key`` (transposed first when ``transpose``), rows
    [offset, offset + length) of it (``length`` 0: all)."""

    model_config = ConfigDict(frozen=True)

    key: str
    transpose: bool = False
    offset: int = 0
    length: int = 0


# ---------------------------------------------------------------------------------------------------------------
# config.json -> TextModelConfig


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise MissingModelFileError(f"{path} is missing: a model folder needs its {what}")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ModelFolderError(f"{path} is {path.stat().st_size} bytes, more than a {what} can be")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFolderError(f"{path} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelFolderError(f"{path} holds a {type(data).__name__}, not a JSON object")
    return data


def _need(raw: dict[str, Any], path: Path, *keys: str) -> Any:
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    raise ModelFolderError(f"{path} has no {' or '.join(repr(k) for k in keys)}, which a "
                           f"{raw.get('model_type')} model needs")


def _activation(name: object, path: Path) -> str:
    table = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
             "relu": "relu", "silu": "silu", "swish": "silu"}
    if not isinstance(name, str) or name not in table:
        raise UnsupportedModelError(f"{path}: activation {name!r} is not supported (one of {sorted(table)})")
    return table[name]


def _stored_dtype(raw: dict[str, Any]) -> DType:
    stored = raw.get("torch_dtype") or raw.get("dtype")
    return stored if stored in ("float32", "bfloat16", "float16") else "float32"


def _rope(raw: dict[str, Any], path: Path) -> tuple[float, RopeScaling | None]:
    """The rotary base and scaling of a config.json: transformers 5 writes them in ``rope_parameters``, older files
    in ``rope_theta`` and ``rope_scaling``."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    scaling = raw.get("rope_scaling") if isinstance(raw.get("rope_scaling"), dict) else {}
    both = {**scaling, **params}
    kind = both.get("rope_type") or both.get("type") or "default"
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise UnsupportedModelError(f"{path}: rotary scaling {kind!r} is not supported, only plain rotary positions "
                                    "(rope_type 'default') and Llama 3's ('llama3')")
    try:
        return theta, RopeScaling(factor=both["factor"], low_freq_factor=both["low_freq_factor"],
                                  high_freq_factor=both["high_freq_factor"],
                                  original_max_positions=both["original_max_position_embeddings"])
    except (KeyError, ValueError) as exc:
        raise ModelFolderError(f"{path}: Llama 3 rotary scaling needs factor, low_freq_factor, high_freq_factor and "
                               f"original_max_position_embeddings: {exc}") from exc


def config_from_hf(raw: dict[str, Any], path: Path | str = CONFIG_FILE, dtype: DType | None = None) -> TextModelConfig:
    """The ``TextModelConfig`` of a parsed ``config.json`` (``path`` only names it in errors). ``dtype``: what
    weights and activations are held in; None: the dtype the folder says it stores (``torch_dtype``/``dtype``),
    float32 when it says none. Raises ``UnsupportedModelError`` for a model type or variant without a translation
    and ``ModelFolderError`` for a missing or inconsistent field."""
    path = Path(path)
    kind = raw.get("model_type")
    out_dtype = dtype or _stored_dtype(raw)
    if kind == "bert":
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModelError(f"{path}: position_embedding_type {raw['position_embedding_type']!r} is "
                                        "not supported, only 'absolute'")
        if raw.get("is_decoder"):
            raise UnsupportedModelError(f"{path}: a BERT decoder (is_decoder true) is not supported, only encoders")
        fields: dict[str, Any] = dict(
            family="bert", layers=_need(raw, path, "num_hidden_layers"), hidden=_need(raw, path, "hidden_size"),
            heads=_need(raw, path, "num_attention_heads"), ffn=_need(raw, path, "intermediate_size"),
            vocab=_need(raw, path, "vocab_size"), max_positions=raw.get("max_position_embeddings", 512),
            type_vocab=raw.get("type_vocab_size", 2), norm_eps=raw.get("layer_norm_eps", 1e-12),
            activation=_activation(raw.get("hidden_act", "gelu"), path), tie_embeddings=False)
    elif kind == "distilbert":
        if raw.get("sinusoidal_pos_embds"):
            log.debug("%s: sinusoidal positions are read from the stored position table", path)
        fields = dict(
            family="bert", layers=_need(raw, path, "n_layers"), hidden=_need(raw, path, "dim"),
            heads=_need(raw, path, "n_heads"), ffn=_need(raw, path, "hidden_dim"), vocab=_need(raw, path, "vocab_size"),
            max_positions=raw.get("max_position_embeddings", 512), type_vocab=0, norm_eps=1e-12,
            activation=_activation(raw.get("activation", "gelu"), path), tie_embeddings=False)
    elif kind == "gpt2":
        if raw.get("scale_attn_by_inverse_layer_idx"):
            raise UnsupportedModelError(f"{path}: scale_attn_by_inverse_layer_idx is not supported")
        if raw.get("scale_attn_weights") is False:
            raise UnsupportedModelError(f"{path}: scale_attn_weights false is not supported")
        hidden = _need(raw, path, "n_embd", "hidden_size")
        fields = dict(
            family="gpt2", layers=_need(raw, path, "n_layer", "num_hidden_layers"), hidden=hidden,
            heads=_need(raw, path, "n_head", "num_attention_heads"), ffn=raw.get("n_inner") or 4 * hidden,
            vocab=_need(raw, path, "vocab_size"), max_positions=_need(raw, path, "n_positions",
                                                                      "max_position_embeddings"),
            type_vocab=0, norm_eps=raw.get("layer_norm_epsilon", 1e-5),
            activation=_activation(raw.get("activation_function", "gelu_new"), path),
            tie_embeddings=raw.get("tie_word_embeddings", True))
    elif kind == "opt":
        if not raw.get("do_layer_norm_before", True):
            raise UnsupportedModelError(f"{path}: this OPT normalises after each block (do_layer_norm_before false, "
                                        "as OPT-350m does); only pre-LN OPT models are supported")
        hidden = _need(raw, path, "hidden_size")
        if raw.get("word_embed_proj_dim", hidden) != hidden:
            raise UnsupportedModelError(f"{path}: word_embed_proj_dim {raw['word_embed_proj_dim']} differs from "
                                        f"hidden_size {hidden} (projected embeddings are not supported)")
        if raw.get("_remove_final_layer_norm") or raw.get("layer_norm_elementwise_affine") is False:
            raise UnsupportedModelError(f"{path}: OPT without a final or affine layer norm is not supported")
        fields = dict(
            family="opt", layers=_need(raw, path, "num_hidden_layers"), hidden=hidden,
            heads=_need(raw, path, "num_attention_heads"), ffn=_need(raw, path, "ffn_dim"),
            vocab=_need(raw, path, "vocab_size"), max_positions=raw.get("max_position_embeddings", 2048),
            position_offset=2, type_vocab=0, norm_eps=1e-5,
            activation=_activation(raw.get("activation_function", "relu"), path), bias=raw.get("enable_bias", True),
            tie_embeddings=raw.get("tie_word_embeddings", True))
    elif kind in ("llama", "mistral", "qwen2", "qwen3"):
        hidden = _need(raw, path, "hidden_size")
        heads = _need(raw, path, "num_attention_heads")
        head_dim = raw.get("head_dim")  # when given, Qwen3's is not hidden / heads
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            # Qwen2's q, k and v biases are its architecture's, not this flag's (which would add o's too).
            raise UnsupportedModelError(f"{path}: attention_bias or mlp_bias in a {kind} model is not supported")
        positions = raw.get("max_position_embeddings", 4096)
        window = raw.get("sliding_window") if kind == "mistral" or raw.get("use_sliding_window") else None
        if window:
            # Within the window sliding-window attention is full attention, so cap the sequence there.
            positions = min(positions, int(window))
        theta, scaling = _rope(raw, path)
        fields = dict(
            family="llama", layers=_need(raw, path, "num_hidden_layers"), hidden=hidden, heads=heads,
            kv_heads=raw.get("num_key_value_heads") or heads, ffn=_need(raw, path, "intermediate_size"),
            vocab=_need(raw, path, "vocab_size"), max_positions=min(positions, MAX_POSITIONS), type_vocab=0,
            norm_eps=raw.get("rms_norm_eps", 1e-6), activation=_activation(raw.get("hidden_act", "silu"), path),
            bias=False, rope_theta=theta, rope_scaling=scaling, tie_embeddings=raw.get("tie_word_embeddings", False),
            head_size=head_dim if head_dim and (head_dim != hidden // heads or hidden % heads) else 0,
            qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3")
    else:
        raise UnsupportedModelError(f"{path}: model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
    if fields["activation"] == "silu" and fields["family"] != "llama":
        raise UnsupportedModelError(f"{path}: activation silu outside a Llama-style model is not supported")
    if fields["family"] == "llama" and fields["activation"] != "silu":
        raise UnsupportedModelError(f"{path}: a Llama-style MLP must use silu, not {fields['activation']}")
    try:
        return TextModelConfig(dtype=out_dtype, **fields)
    except ValueError as exc:
        raise ModelFolderError(f"{path} describes a model this runtime cannot hold: {exc}") from exc


def load_config(folder: Path | str, dtype: DType | None = None) -> TextModelConfig:
    """The ``TextModelConfig`` of the model folder's ``config.json`` (see ``config_from_hf`` for ``dtype``), or of
    a GGUF file's metadata (``gguf_file``)."""
    folder = Path(folder)
    if is_gguf(folder):
        from edgeswarm.models.text.gguf_file import load_gguf_config

        return load_gguf_config(folder, dtype)
    if not folder.is_dir():
        raise MissingModelFileError(f"model folder {folder} does not exist")
    return config_from_hf(_read_json(folder / CONFIG_FILE, CONFIG_FILE), folder / CONFIG_FILE, dtype)




# ---------------------------------------------------------------------------------------------------------------
# stored names -> canonical names


def _layer_sources(family: str, raw: dict[str, Any], cfg: TextModelConfig, i: int) -> dict[str, _Source]:
    s = _Source
    if family == "bert":
        p = f"encoder.layer.{i}."
        pairs = {"q": "attention.self.query", "k": "attention.self.key", "v": "attention.self.value",
                 "o": "attention.output.dense", "attn_norm": "attention.output.LayerNorm",
                 "up": "intermediate.dense", "down": "output.dense", "mlp_norm": "output.LayerNorm"}
    elif family == "distilbert":
        p = f"transformer.layer.{i}."
        pairs = {"q": "attention.q_lin", "k": "attention.k_lin", "v": "attention.v_lin", "o": "attention.out_lin",
                 "attn_norm": "sa_layer_norm", "up": "ffn.lin1", "down": "ffn.lin2", "mlp_norm": "output_layer_norm"}
    elif family == "gpt2":
        p, h = f"h.{i}.", cfg.hidden
        out: dict[str, _Source] = {}
        for j, name in enumerate(("q", "k", "v")):
            out[f"{name}.weight"] = s(key=p + "attn.c_attn.weight", transpose=True, offset=j * h, length=h)
            out[f"{name}.bias"] = s(key=p + "attn.c_attn.bias", offset=j * h, length=h)
        for name, stored in (("o", "attn.c_proj"), ("up", "mlp.c_fc"), ("down", "mlp.c_proj")):
            out[f"{name}.weight"] = s(key=p + stored + ".weight", transpose=True)
            out[f"{name}.bias"] = s(key=p + stored + ".bias")
        for name, stored in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[f"{name}.weight"] = s(key=p + stored + ".weight")
            out[f"{name}.bias"] = s(key=p + stored + ".bias")
        return out
    elif family == "opt":
        p = f"layers.{i}."
        pairs = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                 "o": "self_attn.out_proj", "attn_norm": "self_attn_layer_norm", "up": "fc1", "down": "fc2",
                 "mlp_norm": "final_layer_norm"}
    else:
        p = f"layers.{i}."
        pairs = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                 "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
                 "up": "mlp.up_proj", "gate": "mlp.gate_proj", "down": "mlp.down_proj",
                 "mlp_norm": "post_attention_layernorm"}
    return {f"{name}.{part}": s(key=f"{p}{stored}.{part}") for name, stored in pairs.items()
            for part in ("weight", "bias")}


def _global_sources(family: str) -> dict[str, _Source]:
    s = _Source
    if family in ("bert", "distilbert"):
        return {"embed.tokens": s(key="embeddings.word_embeddings.weight"),
                "embed.positions": s(key="embeddings.position_embeddings.weight"),
                "embed.types": s(key="embeddings.token_type_embeddings.weight"),
                "embed.norm.weight": s(key="embeddings.LayerNorm.weight"),
                "embed.norm.bias": s(key="embeddings.LayerNorm.bias")}
    if family == "gpt2":
        return {"embed.tokens": s(key="wte.weight"), "embed.positions": s(key="wpe.weight"),
                "final_norm.weight": s(key="ln_f.weight"), "final_norm.bias": s(key="ln_f.bias")}
    if family == "opt":
        return {"embed.tokens": s(key="embed_tokens.weight"), "embed.positions": s(key="embed_positions.weight"),
                "final_norm.weight": s(key="final_layer_norm.weight"),
                "final_norm.bias": s(key="final_layer_norm.bias")}
    return {"embed.tokens": s(key="embed_tokens.weight"), "final_norm.weight": s(key="norm.weight")}


# The prefixes a model class puts before the base model's names (BertModel: none; BertForMaskedLM: "bert.").
_PREFIXES = {"bert": ("", "bert."), "distilbert": ("", "distilbert."), "gpt2": ("", "transformer."),
             "opt": ("model.decoder.", "decoder.", ""), "llama": ("model.", ""), "mistral": ("model.", ""),
             "qwen2": ("model.", ""), "qwen3": ("model.", "")}
# Names older checkpoints use for the same tensor.
_LEGACY_SUFFIXES = (("LayerNorm.weight", "LayerNorm.gamma"), ("LayerNorm.bias", "LayerNorm.beta"))


class ModelFolder:
    """A model folder opened for reading: its ``config`` and lazy access to every canonical weight (``names``).

    Nothing is read from disk until asked: ``get`` reads a whole tensor, ``get_slice`` rows or columns of it,
    ``load`` a set of them. Shapes are checked against ``config`` when the folder is opened (from the files'
    headers), so a mismatched checkpoint fails before any weight is read. Use as a context manager or ``close()``.
    ``lm_head.weight`` is present for decoders; when tied it is ``embed.tokens``'s storage. ``device``: where the
    tensors read land (the compute device from ``devices.compute``; None: host memory). ``layers``: keep only the
    first layers (``config.layers`` becomes it; the others are neither checked nor offered)."""

    def __init__(self, folder: Path | str, dtype: DType | None = None,
                 device: torch.device | str | None = None, layers: int | None = None) -> None:
        self.folder = Path(folder)
        self.device = torch.device(device) if device is not None else None
        self.config = load_config(self.folder, dtype)
        if layers is not None:
            if not 1 <= layers <= self.config.layers:
                raise ModelFolderError(f"{self.folder} holds {self.config.layers} layers; cannot keep {layers}")
            self.config = self.config.model_copy(update={"layers": layers})
        raw = _read_json(self.folder / CONFIG_FILE, CONFIG_FILE)
        self.model_type: str = raw["model_type"]
        self._dtype = torch_dtype(self.config)
        self._files, self._shapes = self._read_headers()
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()  # handles are opened on first use, possibly from several threads
        self._sources = self._resolve(raw)
        self._check_shapes()

    # -- files ----------------------------------------------------------------------------------------------------

    def _read_headers(self) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
        """Stored name -> its file and stored name -> its shape, from the headers of the single file or of every
        file the index names."""
        index, single = self.folder / INDEX_FILE, self.folder / SINGLE_FILE
        if index.is_file():
            weight_map = _read_json(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelFolderError(f"{index} has no weight_map")
            files = sorted({str(v) for v in weight_map.values()})
        elif single.is_file():
            files = [SINGLE_FILE]
        else:
            found = sorted(p.name for p in self.folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".h5"))
            hint = (f"; it holds {', '.join(found)}: convert them to safetensors (safetensors' own conversion or "
                    "transformers' save_pretrained(..., safe_serialization=True))") if found else ""
            raise MissingModelFileError(f"{self.folder} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
        out: dict[str, str] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for name in files:
            path = self.folder / name
            if Path(name).name != name or not path.is_file():
                raise MissingModelFileError(f"{path} is missing (named by {INDEX_FILE})")
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        out[key] = name
                        shapes[key] = tuple(f.get_slice(key).get_shape())
            except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
                raise ModelFolderError(f"{path} is not a readable safetensors file ({exc})") from exc
        return out, shapes

    def _handle(self, file: str) -> Any:
        with self._lock:
            if file not in self._handles:
                self._handles[file] = safe_open(str(self.folder / file), framework="pt")
            return self._handles[file]

    def close(self) -> None:
        """Releases the open files (their memory maps); a later read opens them again."""
        with self._lock:
            self._handles.clear()

    def __enter__(self) -> ModelFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- names ----------------------------------------------------------------------------------------------------

    def _find(self, key: str, prefix: str) -> str | None:
        for candidate in (prefix + key, *(prefix + key[: -len(new)] + old for new, old in _LEGACY_SUFFIXES
                                          if key.endswith(new))):
            if candidate in self._files:
                return candidate
        return None

    def _resolve(self, raw: dict[str, Any]) -> dict[str, _Source]:
        kind, cfg = self.model_type, self.config
        sources = _global_sources(kind)
        for i in range(cfg.layers):
            sources.update({f"layers.{i}.{k}": v for k, v in _layer_sources(kind, raw, cfg, i).items()})
        probe = sources["embed.tokens"].key
        prefix = next((p for p in _PREFIXES[kind] if p + probe in self._files), None)
        if prefix is None:
            raise MissingWeightError(f"{self.folder}: no token embedding "
                                     f"({' or '.join(p + probe for p in _PREFIXES[kind])}) in the safetensors files; "
                                     f"is this folder's model_type {kind!r} right?")
        wanted = [n for n in weight_shapes(cfg) if n != "lm_head.weight"]  # the head is resolved below
        out: dict[str, _Source] = {}
        for name in wanted:
            src = sources.get(name)
            if src is None:
                raise MissingWeightError(f"no stored name for {name} in a {kind} model")  # a bug, not a file problem
            key = self._find(src.key, prefix)
            if key is None:
                raise MissingWeightError(f"{self.folder}: tensor {prefix + src.key} (our {name}) is not in the "
                                         "safetensors files; the checkpoint is incomplete or not a "
                                         f"{kind} model as config.json says")
            out[name] = src.model_copy(update={"key": key})
        if cfg.decoder and cfg.tie_embeddings:
            # Tied: the head is the embedding, whether or not the file also stores a copy (transformers ties too).
            out["lm_head.weight"] = out["embed.tokens"]
        elif cfg.decoder:
            if "lm_head.weight" not in self._files:
                raise MissingWeightError(f"{self.folder}: lm_head.weight is not in the safetensors files and "
                                         "config.json says the embeddings are not tied (tie_word_embeddings false)")
            out["lm_head.weight"] = _Source(key="lm_head.weight")
        return out

    def _check_shapes(self) -> None:
        wanted = weight_shapes(self.config)
        if self.config.decoder:
            wanted["lm_head.weight"] = (self.config.vocab, self.config.hidden)
        for name, shape in wanted.items():
            got = self._canonical_shape(self._sources[name])
            if got != shape:
                src = self._sources[name]
                raise WeightShapeError(
                    f"{self.folder / self._files[src.key]}: tensor {src.key} (our {name}) has shape "
                    f"{list(self._shapes[src.key])}, but config.json implies {list(shape)}"
                    + (" after transposing" if src.transpose else "")
                    + ("" if not src.length else f" as rows {src.offset}..{src.offset + src.length} of it")
                    + "; the weights do not belong to this config.json")

    def _canonical_shape(self, src: _Source) -> tuple[int, ...]:
        stored = self._shapes[src.key]
        shape = tuple(reversed(stored)) if src.transpose else stored
        if src.length and shape:
            if shape[0] < src.offset + src.length:
                return (-1, *shape[1:])
            shape = (src.length, *shape[1:])
        return shape

    @property
    def names(self) -> list[str]:
        """Every canonical weight this folder provides (``weight_shapes`` plus ``lm_head.weight`` for decoders)."""
        return list(self._sources)

    def shape(self, name: str) -> tuple[int, ...]:
        """The canonical shape of ``name`` (no read)."""
        return self._canonical_shape(self._source(name))

    def nbytes(self, name: str) -> int:
        """The bytes ``name`` takes in the config's dtype."""
        return math.prod(self.shape(name)) * self.config.dtype_bytes

    def _source(self, name: str) -> _Source:
        if name not in self._sources:
            raise MissingWeightError(f"{name!r} is not a weight of this {self.model_type} model "
                                     f"({len(self._sources)} names, e.g. {', '.join(self.names[:3])})")
        return self._sources[name]

    # -- reads ----------------------------------------------------------------------------------------------------

    def get(self, name: str) -> torch.Tensor:
        """The whole canonical tensor ``name`` in the config's dtype."""
        return self.get_slice(name, None, 0, 0)

    def get_slice(self, name: str, dim: int | None, start: int, stop: int) -> torch.Tensor:
        """Rows (``dim`` 0) or columns (``dim`` 1) [``start``, ``stop``) of the canonical tensor ``name`` in the
        config's dtype, reading only those bytes where the stored layout allows (a stored [in, out] tensor's column
        range is a strided read of the file's rows). ``dim`` None: the whole tensor. Raises ``IndexError`` for a
        range outside the tensor."""
        src = self._source(name)
        shape = self._canonical_shape(src)
        if dim is not None:
            if dim not in (0, 1) or dim >= len(shape):
                raise IndexError(f"{name} has {len(shape)} dimension(s); cannot slice dimension {dim}")
            if not 0 <= start <= stop <= shape[dim]:
                raise IndexError(f"[{start}, {stop}) is outside dimension {dim} of {name} (size {shape[dim]})")
        # Canonical index ranges per dimension, then moved to the stored tensor's dimensions.
        ranges = [(0, n) for n in shape]
        if dim is not None:
            ranges[dim] = (start, stop)
        if src.length:
            ranges[0] = (ranges[0][0] + src.offset, ranges[0][1] + src.offset)
        if src.transpose:
            ranges.reverse()
        part = self._handle(self._files[src.key]).get_slice(src.key)
        index = tuple(slice(a, b) for a, b in ranges)
        t = part[index] if index else part[:]
        if src.transpose:
            t = t.t()
        t = t.to(self._dtype).contiguous()
        return t if self.device is None else t.to(self.device)

    def load(self, names: Iterable[str] | None = None) -> Weights:
        """The canonical weights ``names`` (all of ``self.names`` when None), each read once; a tied ``lm_head``
        shares ``embed.tokens``'s tensor when both are asked for."""
        wanted = list(self.names if names is None else dict.fromkeys(names))
        out: Weights = {}
        for name in wanted:
            src = self._source(name)
            tied = next((other for other in out if self._sources[other] == src), None)
            out[name] = out[tied] if tied is not None else self.get(name)
        return out

    def read_slice(self, part: WeightSlice) -> torch.Tensor:
        """The rows and/or columns of one canonical tensor that ``part`` names, reading only those bytes (rows, or
        columns; both: the rows read, then cut)."""
        if part.rows is not None:
            return part.model_copy(update={"rows": None}).cut(self.get_slice(part.name, 0, *part.rows))
        if part.columns is not None:
            return self.get_slice(part.name, 1, *part.columns)
        return self.get(part.name)

    def __call__(self, names: Iterable[str]) -> Weights:
        """``load(names)``, so a folder serves where a ``names -> weights`` callable is expected."""
        return self.load(names)


def open_model(folder: Path | str, dtype: DType | None = None, device: torch.device | str | None = None,
               layers: int | None = None) -> ModelFolder | GgufModel:
    """The model folder, or GGUF file (``gguf_file.GgufModel``), opened for lazy reads (config, names, shapes
    checked; no weight read yet); the arguments as ``ModelFolder``'s."""
    if is_gguf(folder):
        from edgeswarm.models.text.gguf_file import GgufModel

        return GgufModel(folder, dtype, device, layers)
    return ModelFolder(folder, dtype, device, layers)


def is_gguf(path: Path | str) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix), not a model folder."""
    return Path(path).suffix.lower() == ".gguf"


def source_config(source: TextModelSource) -> TextModelConfig:
    """The shape of the model ``source`` names (a preset, or the config.json of its folder) with its overrides.
    Raises ConfigError when the folder cannot be read or the source asks for more layers than the model has."""
    if source.preset is not None:
        base = PRESETS[source.preset]
    else:
        try:
            base = load_config(Path(str(source.path)))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model folder {source.path}: {exc}") from None
    update: dict[str, object] = {}
    if source.layers is not None:
        if source.layers > base.layers:
            raise ConfigError(f"model {source.name} has {base.layers} layers, not {source.layers}")
        update["layers"] = source.layers
    if source.dtype is not None:
        update["dtype"] = source.dtype
    return base.model_copy(update=update) if update else base
