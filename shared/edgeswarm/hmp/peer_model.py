"""The peer ``bench peers`` sets beside Galaxy: the same Transformer as a plain torch module, split by torch's own
tensor parallelism (``torch.distributed.tensor.parallel``), as a user would write it.

``PlainDecoder`` holds a model's weights (``models.text``'s layout) in ``nn.Linear`` modules and computes exactly
``models.text.reference``'s forward (its attention, norms and positions are the same functions). ``tensor_parallel``
applies Megatron's plan to it as torchtitan does, a function over the plain model: the q, k, v, gate and up
projections column-wise, o and down row-wise (an AllReduce after each), every split even, as torch splits them; the
head column-wise too (each rank a slice of the vocabulary, the logits gathered whole on every rank). ``emulate``
makes each rank compute as an emulated device class: every piece of its own arithmetic (each linear layer's local
product, the head's, attention, the norms) stretched by the class's slow-down as a tensor-shard-worker's phases are
(``DeviceProfile.run``), the collectives between them not.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from edgeswarm.errors import EdgeswarmError
from edgeswarm.models.text.ops import HeadCache, Weights, activation, attention, embed, norm

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from edgeswarm.devices.emulation import DeviceProfile
    from edgeswarm.values.text_model import TextModelConfig

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
_COLUMNWISE = ("q", "k", "v", "gate", "up")  # their outputs split; o and down take those shards and AllReduce


class UnevenSplitError(EdgeswarmError):
    """torch's tensor parallelism splits every layer evenly: the model's heads or columns do not divide."""


def _run(fn: Callable[[], Any]) -> Any:
    return fn()


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` [out, in] and ``bias`` (not copied)."""
    m = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    m.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        m.bias = nn.Parameter(bias, requires_grad=False)
    return m


class PlainLayer(nn.Module):
    """Layer ``i`` of ``cfg`` with ``w``'s weights: its projections as ``nn.Linear`` modules (torch's tensor
    parallelism splits those), its norms' weights as they are."""

    def __init__(self, cfg: TextModelConfig, w: Weights, i: int) -> None:
        super().__init__()
        self.cfg, self.prefix = cfg, f"layers.{i}."
        self.small = {n: t for n, t in w.items() if n.startswith(self.prefix) and n.split(".")[2] not in LINEARS}
        self.compute: Callable[[Callable[[], Any]], Any] = _run
        for name in LINEARS:
            weight = w.get(f"{self.prefix}{name}.weight")
            setattr(self, name, None if weight is None else _linear(weight, w.get(f"{self.prefix}{name}.bias")))

    def forward(self, x: torch.Tensor, start: int, cache: HeadCache) -> torch.Tensor:
        cfg, p, w, run = self.cfg, self.prefix, self.small, self.compute
        a = run(lambda: norm(cfg, x, w, p + "attn_norm")) if cfg.pre_ln else x
        q, k, v = self.q(a), self.k(a), self.v(a)
        att = run(lambda: attention(cfg, q, k, v, start, cache, w, p))
        u = x + self.o(att)
        if not cfg.pre_ln:
            u = run(lambda: norm(cfg, u, w, p + "attn_norm"))
        m = run(lambda: norm(cfg, u, w, p + "mlp_norm")) if cfg.pre_ln else u
        up = self.up(m)
        if self.gate is not None:
            gate = self.gate(m)
            inner = run(lambda: torch.nn.functional.silu(gate) * up)
        else:
            inner = run(lambda: activation(cfg, up))
        out = u + self.down(inner)
        return out if cfg.pre_ln else run(lambda: norm(cfg, out, w, p + "mlp_norm"))


class PlainDecoder(nn.Module):
    """``cfg``'s whole model with ``w``'s weights; ``forward`` continues ``caches`` (one ``HeadCache`` a layer) with
    ``tokens`` [s] and returns the final hidden states [s, hidden]; ``logits`` the next-token logits of rows."""

    def __init__(self, cfg: TextModelConfig, w: Weights) -> None:
        super().__init__()
        self.cfg = cfg
        self.outer = {n: t for n, t in w.items() if not n.startswith("layers.") and n != "lm_head.weight"}
        self.layers = nn.ModuleList(PlainLayer(cfg, w, i) for i in range(cfg.layers))
        self.head = _linear(w["lm_head.weight"], None) if "lm_head.weight" in w else None
        self.compute: Callable[[Callable[[], Any]], Any] = _run

    def new_caches(self) -> list[HeadCache]:
        return [HeadCache() for _ in range(self.cfg.layers)]

    def forward(self, tokens: torch.Tensor, caches: list[HeadCache]) -> torch.Tensor:
        cfg, w, run = self.cfg, self.outer, self.compute
        start = caches[0].length if caches else 0
        x = run(lambda: embed(cfg, w, tokens, start))
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, start, cache)
        return run(lambda: norm(cfg, x, w, "final_norm")) if cfg.pre_ln else x

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            raise ValueError(f"a {self.cfg.family} encoder has no head")
        return self.head(rows)


def tensor_parallel(model: PlainDecoder, mesh: DeviceMesh) -> None:
    """Split every layer of ``model`` over ``mesh`` (1-D) as torch's tensor parallelism does: column-wise q, k, v,
    gate and up, row-wise o and down, even shares; the head column-wise, its logits gathered whole on every rank.
    The embeddings and norms stay whole on every rank. Raises UnevenSplitError when the heads, KV heads or MLP
    columns do not divide by the mesh's size."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    n, cfg = mesh.size(), model.cfg
    for what, count in (("KV heads", cfg.n_kv), ("attention heads", cfg.heads), ("MLP columns", cfg.ffn)):
        if count % n:
            raise UnevenSplitError(f"torch's tensor parallelism splits each layer evenly: {count} {what} of "
                                   f"{cfg.layers}-layer {cfg.family} do not divide over {n} devices")
    for layer in model.layers:
        assert isinstance(layer, PlainLayer)
        plan = {name: ColwiseParallel() if name in _COLUMNWISE else RowwiseParallel()
                for name in LINEARS if getattr(layer, name) is not None}
        parallelize_module(layer, mesh, plan)  # type: ignore[arg-type]
    if model.head is not None:
        parallelize_module(model.head, mesh, ColwiseParallel(output_layouts=Replicate()))


def emulate(model: PlainDecoder, device: DeviceProfile) -> None:
    """Make ``model`` compute as ``device``: each piece of its own arithmetic (a linear layer's local product, after
    torch's input redistribution and before its output's, and the attention, norms, embeddings and head) stretched
    by the device's slow-down (``DeviceProfile.run``); the collectives between them are not."""
    model.compute = device.run
    linears = [model.head]
    for layer in model.layers:
        assert isinstance(layer, PlainLayer)
        layer.compute = device.run
        linears += [getattr(layer, name) for name in LINEARS]
    for m in linears:
        if m is not None:
            # Called between the hooks torch's parallel style put on the module (they redistribute its input and
            # output): the local product alone.
            m.forward = partial(_timed, device, m.forward)


def _timed(device: DeviceProfile, forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return device.run(lambda: forward(x))
