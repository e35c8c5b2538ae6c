"""Sentence embeddings from an encoder's final hidden states, as a sentence-transformers model folder describes them
(``modules.json``, the pooling module's ``config.json``): mean, CLS or max pooling, then L2 normalisation when the
folder lists a Normalize module."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from edgeswarm.models.text.hf import ModelFolderError

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 1 << 16
PoolMode = Literal["mean", "cls", "max"]


class SentencePooling(BaseModel):
    """How token states [s, h] become one sentence embedding [h]."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: PoolMode = "mean"
    normalize: bool = False


def _json(path: Path) -> object:
    if not path.is_file() or path.stat().st_size > MAX_JSON_BYTES:
        raise ModelFolderError(f"{path} is missing or too large for a sentence-transformers module file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFolderError(f"{path} is not valid JSON ({exc})") from exc


def pooling_for(folder: Path | str) -> SentencePooling | None:
    """The pooling a sentence-transformers folder declares, or None when the folder is not one (no
    ``modules.json``). Raises ``ModelFolderError`` for a pooling this module does not implement."""
    folder = Path(folder)
    if not (folder / "modules.json").is_file():
        return None
    modules = _json(folder / "modules.json")
    if not isinstance(modules, list):
        raise ModelFolderError(f"{folder / 'modules.json'} is not a list of modules")
    mode: PoolMode | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        if kind.endswith(".Pooling"):
            sub = str(module.get("path", ""))
            if Path(sub).name != sub:
                raise ModelFolderError(f"{folder / 'modules.json'}: pooling path {sub!r} is not a folder name")
            cfg = _json(folder / sub / "config.json")
            if not isinstance(cfg, dict):
                raise ModelFolderError(f"{folder / sub / 'config.json'} is not a JSON object")
            chosen = [m for m, key in (("mean", "pooling_mode_mean_tokens"), ("cls", "pooling_mode_cls_token"),
                                       ("max", "pooling_mode_max_tokens")) if cfg.get(key)]
            others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in (
                "pooling_mode_mean_tokens", "pooling_mode_cls_token", "pooling_mode_max_tokens")]
            if len(chosen) != 1 or others:
                raise ModelFolderError(f"{folder / sub / 'config.json'}: only one of mean, CLS or max pooling is "
                                       f"supported, not {chosen + others}")
            mode = chosen[0]  # type: ignore[assignment]
        elif kind.endswith(".Normalize"):
            normalize = True
        elif not kind.endswith(".Transformer"):
            raise ModelFolderError(f"{folder / 'modules.json'}: module {kind!r} is not supported")
    if mode is None:
        raise ModelFolderError(f"{folder / 'modules.json'} lists no Pooling module")
    return SentencePooling(mode=mode, normalize=normalize)


def sentence_embedding(pooling: SentencePooling, hidden: torch.Tensor) -> torch.Tensor:
    """One sentence's embedding [h] from its final hidden states [s, h] (every row a real token: batch 1, no
    padding), computed in float32 and returned in ``hidden``'s dtype."""
    x = hidden.float()
    if pooling.mode == "mean":
        out = x.mean(0)
    elif pooling.mode == "cls":
        out = x[0]
    else:
        out = x.max(0).values
    if pooling.normalize:
        out = F.normalize(out, dim=0)
    return out.to(hidden.dtype)
