"""What each device computes in every layer of a tensor-parallel run: the one type the planner writes and the
runtime reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgeswarm.wire.schema import Name

Mode = Literal["galaxy", "megatron", "sp", "local"]
MAX_SHARDS = 64


class HmpShares(BaseModel):
    """The split of every layer over ``devices`` (ring order: rank i sends to rank i + 1).

    ``mode``:
    * ``galaxy``: rank i holds ``heads[i]`` query heads (a contiguous range in rank order; a multiple of the model's
      query heads per KV head, so KV heads are sharded whole) and ``columns[i]`` MLP columns; the connective blocks
      (residual, norm) run on an equal split of the rows; ReduceScatter after and AllGather before each TP block.
    * ``megatron``: the same head and column shares (the planner gives equal ones), an AllReduce after each block,
      the connective blocks on every row on every rank.
    * ``sp``: every rank holds every weight and an equal split of the rows; keys and values are AllGathered.
    * ``local``: one device computes everything.
    ``overlap``: ReduceScatter and AllGather are tiled with the GEMMs beside them (galaxy only).
    ``direct_syncs``: a pass of fewer rows than devices (every decode step) synchronises with direct collectives
    (one round of D-1 messages per device) rather than ring ones (D-1 hops each): faster where a message's latency
    is its cost, slower where the devices share the cores that move the messages (an emulated cluster)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Mode = "galaxy"
    devices: list[Name] = Field(min_length=1, max_length=MAX_SHARDS)
    heads: list[int] = Field(max_length=MAX_SHARDS)
    columns: list[int] = Field(max_length=MAX_SHARDS)
    overlap: bool = True
    direct_syncs: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> HmpShares:
        n = len(self.devices)
        if len(set(self.devices)) != n:
            raise ValueError(f"a device appears twice in {self.devices}")
        if len(self.heads) != n or len(self.columns) != n:
            raise ValueError(f"{n} devices need {n} head and column shares, not {len(self.heads)} and "
                             f"{len(self.columns)}")
        if any(v < 0 for v in self.heads + self.columns):
            raise ValueError("shares cannot be negative")
        if self.mode == "local" and n != 1:
            raise ValueError("a local run has one device")
        return self

    def head_range(self, rank: int) -> tuple[int, int]:
        """Query heads [start, end) of ``rank``."""
        start = sum(self.heads[:rank])
        return start, start + self.heads[rank]

    def column_range(self, rank: int) -> tuple[int, int]:
        """MLP columns [start, end) of ``rank``."""
        start = sum(self.columns[:rank])
        return start, start + self.columns[rank]

    @property
    def splits_head(self) -> bool:
        """Whether a decoder's passes split the lm_head by vocabulary over the ranks and gather the logits
        (``vocab_bounds``; ``hmp.layer``), instead of the rank that answers computing all of them while the others
        wait: galaxy and megatron on two or more devices, with ``direct_syncs`` (the gather is a direct
        collective)."""
        return splits_head(self.mode, len(self.devices), self.direct_syncs)

    def vocab_bounds(self, vocab: int) -> list[tuple[int, int]]:
        """The lm_head rows [start, end) each rank computes when the head is split (``splits_head``; see
        ``vocab_bounds``, the function)."""
        return vocab_bounds(self.columns, vocab)


def splits_head(mode: str, devices: int, direct_syncs: bool) -> bool:
    """``HmpShares.splits_head`` for a plan of ``mode`` over ``devices`` devices (what the planner prices before it
    has the shares)."""
    return mode in ("galaxy", "megatron") and devices > 1 and direct_syncs


def vocab_bounds(columns: Sequence[int], vocab: int) -> list[tuple[int, int]]:
    """Each rank's rows [start, end) of a ``vocab``-row lm_head split over the ranks with ``columns`` MLP columns:
    shares in proportion to the columns (the planner's measure of the ranks' speed, so the head takes each rank about
    as long as its layers do), even when no rank has any."""
    total, n = sum(columns), len(columns)
    bounds, start, held = [], 0, 0
    for c in columns:
        held += c if total else 1
        end = vocab * held // (total or n)
        bounds.append((start, end))
        start = end
    return bounds
