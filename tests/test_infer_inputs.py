"""`edgeswarm infer`'s inputs from a file: converted to the model's input dtype when no value changes, refused with
what to do otherwise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from edgeswarm.errors import ConfigError
from edgeswarm.models.inputs import as_input_dtype, read_npz


def test_numpy_defaults_become_the_models_dtype(tmp_path: Path) -> None:
    np.savez(tmp_path / "f.npz", x=np.linspace(0, 1, 12).reshape(3, 4))  # float64
    got = as_input_dtype(read_npz(str(tmp_path / "f.npz")), torch.float32, "f.npz")
    assert got.dtype == torch.float32 and torch.allclose(got.double(), torch.linspace(0, 1, 12).double().view(3, 4),
                                                         atol=1e-7)
    np.savez(tmp_path / "ids.npz", x=np.array([[15496.0, 11.0, 995.0]]))  # token ids saved as floats
    ids = as_input_dtype(read_npz(str(tmp_path / "ids.npz")), torch.int64, "ids.npz")
    assert ids.dtype == torch.int64 and ids.tolist() == [[15496, 11, 995]]
    assert as_input_dtype(torch.tensor([1, 2], dtype=torch.int32), torch.int64, "x").dtype == torch.int64


def test_a_conversion_that_would_change_values_is_refused_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="int64 inputs; float64 values would change"):
        as_input_dtype(torch.tensor([1.5], dtype=torch.float64), torch.int64, "x.npz")
    with pytest.raises(ConfigError, match="would change"):
        as_input_dtype(torch.tensor([2.0 ** 40]), torch.int32, "x.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match="cannot read inputs"):
        read_npz(str(tmp_path / "bad.npz"))
    np.savez(tmp_path / "two.npz", a=np.zeros(2), b=np.zeros(2))
    with pytest.raises(ConfigError, match="name the inputs x"):
        read_npz(str(tmp_path / "two.npz"))


def test_integers_a_float_cannot_hold_exactly_are_refused() -> None:
    # An int64 of 2^40 + 1 became float32 2^40 and was answered: the float32 mantissa holds integers to 2^24 only.
    with pytest.raises(ConfigError, match="float32 inputs; int64 values would change"):
        as_input_dtype(torch.tensor([[1, 2 ** 40 + 1]], dtype=torch.int64), torch.float32, "x.npz")
    with pytest.raises(ConfigError, match="would change"):
        as_input_dtype(torch.tensor([2 ** 24 + 1], dtype=torch.int32), torch.float32, "x.npz")
    with pytest.raises(ConfigError, match="would change"):
        as_input_dtype(torch.tensor([257], dtype=torch.int64), torch.bfloat16, "x.npz")
    with pytest.raises(ConfigError, match="would change"):  # int64's top rounds to 2^63, outside int64
        as_input_dtype(torch.tensor([2 ** 63 - 1], dtype=torch.int64), torch.float64, "x.npz")
    # What a float holds exactly still goes through: pixels saved as uint8, large but representable integers.
    pixels = torch.arange(256, dtype=torch.uint8).view(16, 16)
    assert torch.equal(as_input_dtype(pixels, torch.float32, "x.npz"), pixels.float())
    big = torch.tensor([-(2 ** 24), 2 ** 24, 2 ** 40], dtype=torch.int64)
    assert as_input_dtype(big, torch.float32, "x.npz").tolist() == [-(2.0 ** 24), 2.0 ** 24, 2.0 ** 40]
    assert as_input_dtype(torch.tensor([True, False]), torch.float32, "x.npz").tolist() == [1.0, 0.0]
    assert as_input_dtype(torch.zeros(0, 3, dtype=torch.int64), torch.float32, "x.npz").shape == (0, 3)
