"""A serving job's inputs read from a user's file: an .npz of samples, in the model's input dtype when that loses
nothing (``edgeswarm infer --npz``, for every serving kind)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgeswarm.errors import ConfigError

if TYPE_CHECKING:
    import torch


def read_npz(path: str) -> torch.Tensor:
    """Array ``x`` of the .npz file ``path`` (or its only array), [samples, ...]. Raises ConfigError saying what is
    wrong with the file."""
    import numpy as np
    import torch

    try:
        with np.load(path, allow_pickle=False) as data:
            key = "x" if "x" in data.files else data.files[0] if len(data.files) == 1 else None
            if key is None:
                raise ConfigError(f"{path} holds {', '.join(data.files)}: name the inputs x")
            samples = torch.from_numpy(np.ascontiguousarray(data[key]))
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot read inputs from {path}: {exc}") from None
    if samples.dim() < 1 or samples.shape[0] == 0:
        raise ConfigError(f"{path}: x must be [samples, ...] with at least one sample")
    return samples

def _exact_as(integers: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every value of ``integers`` (an integer or bool tensor) is exactly a value of the float ``dtype``."""
    import torch

    # Every float16/bfloat16/float32 value is a float64, and one rounded from an integer is integral: back to int64
    # it compares exactly, once it is inside int64's range (2^63 itself, where int64's top rounds to, is not).
    if integers.numel() == 0:
        return True
    wide = integers.to(dtype).to(torch.float64)
    if not bool(torch.isfinite(wide).all()) or float(wide.abs().max()) >= 2.0 ** 63:
        return False
    return torch.equal(wide.to(torch.int64), integers.to(torch.int64))

def as_input_dtype(samples: torch.Tensor, dtype: torch.dtype, source: str) -> torch.Tensor:
    """``samples`` in the model's input ``dtype`` when that loses nothing a user cares about: any float to the
    model's float (NumPy's float64 default to float32, say), integers to a float that holds each of them exactly,
    integers to a wider or equal integer, and integral values of any dtype to an integer type that holds them (token
    ids saved as floats). Raises ConfigError when it would change values (an int64 of 2^40 + 1 to float32, say)."""
    import torch

    if samples.dtype == dtype:
        return samples
    if dtype.is_floating_point and samples.dtype.is_floating_point:
        return samples.to(dtype)
    if dtype.is_floating_point and not samples.dtype.is_complex and _exact_as(samples, dtype):
        return samples.to(dtype)
    if not dtype.is_floating_point and not dtype.is_complex and samples.dtype != torch.bool:
        info = torch.iinfo(dtype)
        converted = samples.to(torch.float64)
        if bool((converted == converted.round()).all()) and (samples.numel() == 0 or (
                float(converted.min()) >= info.min and float(converted.max()) <= info.max)):
            return samples.to(dtype)
    raise ConfigError(f"{source}: the model takes {str(dtype).removeprefix('torch.')} inputs; "
                      f"{str(samples.dtype).removeprefix('torch.')} values would change on the way (save them as "
                      f"{str(dtype).removeprefix('torch.')})")
