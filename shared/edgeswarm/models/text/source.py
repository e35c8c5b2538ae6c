"""Where a Transformer comes from: a preset's shape with random weights, or a Hugging Face style folder."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgeswarm.errors import ConfigError
from edgeswarm.models.text.config import MAX_LAYERS, PRESETS, DType, TextModelConfig

MAX_PATH_CHARS = 1024


class TextModelSource(BaseModel):
    """A model by ``preset`` (random weights drawn from ``seed``, the same on every node) or by ``path``, a folder
    every node can read at that path (config.json, safetensors, tokenizer.json). ``layers`` keeps only the first
    layers (the paper's scaling runs use one); ``dtype`` overrides the weights' and activations' dtype."""

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

    def config(self) -> TextModelConfig:
        """The model's shape with this source's overrides. Raises ConfigError when the folder cannot be read."""
        if self.preset is not None:
            base = PRESETS[self.preset]
        else:
            from edgeswarm.models.text.hf import read_config

            try:
                base = read_config(Path(str(self.path)))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"model folder {self.path}: {exc}") from None
        update: dict[str, object] = {}
        if self.layers is not None:
            if self.layers > base.layers:
                raise ConfigError(f"model {self.name} has {base.layers} layers, not {self.layers}")
            update["layers"] = self.layers
        if self.dtype is not None:
            update["dtype"] = self.dtype
        return base.model_copy(update=update) if update else base
