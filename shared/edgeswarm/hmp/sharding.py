"""Which weights, and which part of each, rank ``r`` holds under an ``HmpShares`` split (spec section 2.3-2.4).

galaxy and megatron (tensor parallel): rank r holds the rows of ``q`` of its query heads and the rows of ``k``/``v``
of the KV heads they read (its heads are whole KV groups), the matching columns of ``o``, the rows of ``up`` (and
``gate``) of its MLP columns and the matching columns of ``down``; the biases of ``q``/``k``/``v``/``up`` are sliced
like their rows. The biases of the row-partitioned GEMMs (``o.bias``, ``down.bias``) are held whole and added once,
after the reduction (C-N4). Norms, embeddings, ``final_norm`` and ``lm_head`` (when not tied to ``embed.tokens``)
are replicated: embeddings so that layer 0 needs no AllGather, ``lm_head`` because the rank holding the last row
changes with the sequence length (a decode step's one row is on rank 0, a prefill's last row on rank D-1 when
s >= D).
sp and local: every weight, whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from edgeswarm.models.text.ops import Weights
from edgeswarm.models.text.reference import weight_shapes
from edgeswarm.models.text.slices import WeightSlice
from edgeswarm.planning.hmp.shares import HmpShares
from edgeswarm.values.text_model import TextModelConfig


def check_shares(cfg: TextModelConfig, shares: HmpShares) -> None:
    """Raise ValueError unless ``shares`` fits ``cfg``: heads and columns sum to the model's, head shares are whole
    KV groups (tensor-parallel modes)."""
    if shares.mode in ("galaxy", "megatron"):
        if sum(shares.heads) != cfg.heads:
            raise ValueError(f"head shares {shares.heads} sum to {sum(shares.heads)}, the model has {cfg.heads}")
        if sum(shares.columns) != cfg.ffn:
            raise ValueError(f"column shares {shares.columns} sum to {sum(shares.columns)}, the model has {cfg.ffn}")
        if any(a % cfg.group for a in shares.heads):
            raise ValueError(f"head shares {shares.heads} must be multiples of {cfg.group} (query heads per KV head)")
        if any(c % cfg.column_granule for c in shares.columns):
            raise ValueError(f"column shares {shares.columns} must be multiples of {cfg.column_granule} (the "
                             f"{cfg.quantization} weights' blocks)")


def rank_slices(cfg: TextModelConfig, shares: HmpShares, rank: int) -> list[WeightSlice]:
    """The weights rank ``rank`` holds and the part of each (see the module's docstring), in layout order."""
    check_shares(cfg, shares)
    if not 0 <= rank < len(shares.devices):
        raise ValueError(f"rank {rank} is not one of {len(shares.devices)}")
    names = list(weight_shapes(cfg))  # a tied lm_head is embed.tokens: the runtime holds it once
    if shares.mode in ("sp", "local"):
        return [WeightSlice(name=n) for n in names]
    hd = cfg.head_dim
    h0, h1 = shares.head_range(rank)
    qrows = (h0 * hd, h1 * hd)
    kvrows = (h0 // cfg.group * hd, h1 // cfg.group * hd)
    crows = shares.column_range(rank)
    out: list[WeightSlice] = []
    for n in names:
        part = n.split(".")
        if part[0] != "layers":
            out.append(WeightSlice(name=n))
            continue
        block = part[2]
        if block == "q":
            out.append(WeightSlice(name=n, rows=qrows))
        elif block in ("k", "v"):
            out.append(WeightSlice(name=n, rows=kvrows))
        elif block == "o":
            out.append(WeightSlice(name=n, columns=qrows) if part[3] == "weight" else WeightSlice(name=n))
        elif block in ("up", "gate"):
            out.append(WeightSlice(name=n, rows=crows))
        elif block == "down":
            out.append(WeightSlice(name=n, columns=crows) if part[3] == "weight" else WeightSlice(name=n))
        else:
            out.append(WeightSlice(name=n))
    return out


def shard_shapes(cfg: TextModelConfig, shares: HmpShares, rank: int) -> dict[str, tuple[int, ...]]:
    """Name and shape of every tensor rank ``rank`` holds."""
    full = weight_shapes(cfg)
    return {s.name: s.shape(full[s.name]) for s in rank_slices(cfg, shares, rank)}


def read_shard(cfg: TextModelConfig, shares: HmpShares, rank: int,
               read: Callable[[WeightSlice], torch.Tensor]) -> Weights:
    """Rank ``rank``'s shard from ``read(slice)``, which returns that part of one weight (a loader reads only it
    from a file); shapes are checked."""
    want = shard_shapes(cfg, shares, rank)
    out: Weights = {}
    for s in rank_slices(cfg, shares, rank):
        t = read(s)
        if tuple(t.shape) != want[s.name]:
            raise ValueError(f"{s.name}: read {tuple(t.shape)}, rank {rank} holds {want[s.name]}")
        out[s.name] = t.contiguous().clone() if s.rows is not None or s.columns is not None else t
    return out
