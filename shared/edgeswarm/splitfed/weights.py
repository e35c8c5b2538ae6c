"""A model's state as one flat float32 vector, the form weights take on the wire between the coordinator, the MECs
and the devices: every entry of the named part, in the model's state-dict order, back to back.

Both ends build the same zoo model, so the names, shapes and order are known to each; a vector of another length
is refused before anything is read from it. Integer buffers (BatchNorm's ``num_batches_tracked``) travel as floats,
exact below 2^24."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from edgeswarm.errors import EdgeswarmError


class WeightsError(EdgeswarmError):
    """A flat weight vector does not fit the part it is said to hold."""


@dataclass(frozen=True)
class Layout:
    """The entries of a (part of a) model's state dict: names in state-dict order, their shapes and dtypes."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def numel(self) -> int:
        """Values in the flat vector."""
        total = 0
        for shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def subset(self, names: Iterable[str]) -> Layout:
        """The layout of the entries in ``names``, kept in this layout's order."""
        wanted = set(names)
        keep = [i for i, n in enumerate(self.names) if n in wanted]
        return Layout(tuple(self.names[i] for i in keep), tuple(self.shapes[i] for i in keep),
                      tuple(self.dtypes[i] for i in keep))


def layout_of(state: Mapping[str, torch.Tensor]) -> Layout:
    """The layout of ``state`` (a state dict), in its order."""
    return Layout(tuple(state), tuple(tuple(t.shape) for t in state.values()), tuple(t.dtype for t in state.values()))


def flatten(state: Mapping[str, torch.Tensor], layout: Layout, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``state``'s entries named by ``layout`` as one vector of ``dtype`` (float32; float64 for sums that must stay
    exact) on the host (``state`` may hold more). Raises WeightsError naming an entry that is missing or of another
    shape."""
    parts = []
    for name, shape in zip(layout.names, layout.shapes, strict=True):
        value = state.get(name)
        if value is None or tuple(value.shape) != shape:
            raise WeightsError(f"entry {name}: expected shape {list(shape)}, got "
                               f"{'nothing' if value is None else list(value.shape)}")
        parts.append(value.detach().reshape(-1).to("cpu", dtype))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def unflatten(flat: torch.Tensor, layout: Layout, device: torch.device | None = None,
              dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The state entries of ``layout`` read from ``flat`` (a 1-D float vector), on ``device``, in their own dtypes
    (or, for floating entries, ``dtype`` when given: a float64 sum stays float64).
    Raises WeightsError when ``flat`` is not a vector of exactly ``layout.numel`` values, or holds NaN or infinite
    values (an update that would poison the model)."""
    if flat.dim() != 1 or flat.numel() != layout.numel:
        raise WeightsError(f"a weight vector of shape {list(flat.shape)} does not hold the {len(layout.names)} "
                           f"entries of {layout.numel} values it is sent for")
    if not bool(torch.isfinite(flat).all()):
        raise WeightsError("the weight vector holds NaN or infinite values")
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape, entry_dtype in zip(layout.names, layout.shapes, layout.dtypes, strict=True):
        n = 1
        for d in shape:
            n *= d
        value = flat[offset:offset + n].reshape(shape)
        target = dtype if dtype is not None and entry_dtype.is_floating_point else entry_dtype
        out[name] = (value.round() if not entry_dtype.is_floating_point else value).to(device=device, dtype=target)
        offset += n
    return out
