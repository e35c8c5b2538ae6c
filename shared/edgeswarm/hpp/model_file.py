"""Whole-model weight files: one standard safetensors file holding a zoo model's state dict.

What ``edgeswarm export`` writes and what a training job's ``init: {file: ...}`` reads: tensors named exactly as
the plain torch model's ``state_dict()`` keys, so ``model.load_state_dict(safetensors.torch.load_file(path))``
loads it, and Hugging Face tools read it like any safetensors file (its metadata says ``format: pt``). A file is
checked against the model it is meant for (``state_problems``: every missing, unexpected, mis-shaped or mis-typed
tensor) before it is used, and its size is capped before it is read.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgeswarm.errors import ConfigError
from edgeswarm.files import fsync_dir, sync_and_hash, temporary_beside
from edgeswarm.models.zoo import build_model, without_weights
from edgeswarm.values.profiles import ModelSpec

MAX_PROBLEMS_SHOWN = 50  # a file for another model would list every tensor; the count says the rest


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's dtype (torch's name without ``torch.``) and shape."""

    dtype: str
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


@dataclass
class ModelFile:
    """A whole-model weight file as read: its tensors by name, its safetensors metadata, its size in bytes and the
    SHA-256 of its bytes (hex)."""

    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)
    file_bytes: int = 0
    sha256: str = ""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def expected_state(model: ModelSpec) -> dict[str, TensorSpec]:
    """The state dict of the zoo ``model`` as names -> dtype and shape, computed without allocating a weight (the
    random number generators are left as they were). Raises ConfigError for a bad model spec."""
    with without_weights():
        state = build_model(model).state_dict()
    return {name: TensorSpec(_dtype_name(t.dtype), tuple(t.shape)) for name, t in state.items()}


def specs_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """Names -> dtype and shape of ``tensors``."""
    return {name: TensorSpec(_dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()}


def state_problems(found: Mapping[str, TensorSpec], model: ModelSpec) -> list[str]:
    """Every way ``found`` (a file's tensors) differs from the state dict of ``model``: tensors it lacks, tensors
    the model has no place for, and tensors of another shape or dtype. Empty when the file loads into the model
    with ``load_state_dict(strict=True)`` and trains as that model. Raises ConfigError for a bad model spec."""
    expected = expected_state(model)
    problems = [f"missing tensor {name!r} ({spec})" for name, spec in expected.items() if name not in found]
    problems += [f"unexpected tensor {name!r} ({spec}): {model.name} has no such parameter or buffer"
                 for name, spec in found.items() if name not in expected]
    for name, spec in found.items():
        want = expected.get(name)
        if want is None or want == spec:
            continue
        if want.shape != spec.shape:
            problems.append(f"tensor {name!r} has shape {list(spec.shape)}, {model.name} needs {list(want.shape)}")
        if want.dtype != spec.dtype:
            problems.append(f"tensor {name!r} is {spec.dtype}, {model.name} needs {want.dtype}")
    return problems


def describe_problems(problems: list[str]) -> str:
    """``problems`` as indented lines, the first MAX_PROBLEMS_SHOWN of them and how many more there are."""
    lines = [f"  {p}" for p in problems[:MAX_PROBLEMS_SHOWN]]
    if len(problems) > MAX_PROBLEMS_SHOWN:
        lines.append(f"  ... and {len(problems) - MAX_PROBLEMS_SHOWN} more")
    return "\n".join(lines)


def read_model_file(path: Path, *, max_bytes: int) -> ModelFile:
    """Read the safetensors file ``path`` (at most ``max_bytes`` bytes: checked before it is read). Raises
    ConfigError naming the file when it is missing, too large or not a safetensors file."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise ConfigError(f"{path} is {size} bytes, more than the {max_bytes} a checkpoint may hold "
                                  "(EDGESWARM_CHECKPOINT_MAX_BYTES)")
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read the weights file {path}: {exc.strerror or exc}") from None
    try:
        tensors = load(raw)
        with safe_open(path, framework="pt") as f:
            metadata = dict(f.metadata() or {})
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{path} is not a safetensors file ({exc}); export one with `edgeswarm export` or "
                          "`safetensors.torch.save_file(model.state_dict(), path)`") from None
    return ModelFile(tensors, metadata, len(raw), hashlib.sha256(raw).hexdigest())


def write_model_file(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> tuple[int, str]:
    """Write ``tensors`` with ``metadata`` as the safetensors file ``path``, atomically (a temporary file in the same
    folder, fsynced, renamed over ``path``); returns its size in bytes and SHA-256. Raises ConfigError when the
    folder cannot be written."""
    from safetensors.torch import save_file

    path = Path(path)
    try:
        with temporary_beside(path) as tmp:
            # contiguous() and clone() of tied tensors: safetensors refuses views and tensors that share memory.
            save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}, tmp,
                      metadata=dict(metadata))
            digest, size = sync_and_hash(tmp)
            os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None
    fsync_dir(path.parent)
    return size, digest
