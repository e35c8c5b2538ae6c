"""A generic layer DAG and its linearisation into candidate cut points (spec 2.1), segments and their memory
and transfer sizes (spec 2.2).

A ``LayerGraph`` holds layers in any order; edges go from each input layer to its consumer. Sizes: output
element counts (numel, batch dimension excluded), parameter counts, bytes. Transfer sizes are in Mbit with
"mega" = 2**20, as in the reference code.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from edgeswarm.errors import ModelError

MemoryMode = Literal["reference", "bytes"]


@dataclass(frozen=True)
class Layer:
    """One vertex: ``name``, its ``inputs`` (names of producer layers), output element count (without the
    batch dimension) and trainable / non-trainable parameter counts."""

    name: str
    inputs: tuple[str, ...]
    output_numel: int
    trainable_params: int = 0
    nontrainable_params: int = 0
    kind: str = ""

    @property
    def params(self) -> int:
        return self.trainable_params + self.nontrainable_params


@dataclass(frozen=True)
class LayerGraph:
    """A single-source DAG of layers. ``consumers[name]`` counts the layers that read a layer's output
    (Keras's outbound nodes: a tensor read by two layers counts twice)."""

    layers: tuple[Layer, ...]
    by_name: dict[str, int] = field(init=False, repr=False, compare=False)
    succ: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name = {ly.name: i for i, ly in enumerate(self.layers)}
        if len(by_name) != len(self.layers):
            raise ModelError("layer names must be unique")
        succ: list[list[int]] = [[] for _ in self.layers]
        for j, ly in enumerate(self.layers):
            for src in ly.inputs:
                if src not in by_name:
                    raise ModelError(f"layer {ly.name} reads unknown layer {src}")
                succ[by_name[src]].append(j)
        object.__setattr__(self, "by_name", by_name)
        object.__setattr__(self, "succ", tuple(tuple(s) for s in succ))

    def consumers(self, i: int) -> int:
        """How many layers read layer i's output."""
        return len(self.succ[i])

    def index(self, name: str) -> int:
        return self.by_name[name]


def topological_order(g: LayerGraph) -> list[int]:
    """Kahn's order; ties by layer position, so it is deterministic. Raises ModelError on a cycle."""
    indeg = [len(ly.inputs) for ly in g.layers]
    ready = deque(i for i, d in enumerate(indeg) if d == 0)
    order: list[int] = []
    while ready:
        u = ready.popleft()
        order.append(u)
        for w in g.succ[u]:
            indeg[w] -= 1
            if indeg[w] == 0:
                ready.append(w)
    if len(order) != len(g.layers):
        raise ModelError("the layer graph has a cycle")
    return order


def source_and_sink(g: LayerGraph) -> tuple[int, int]:
    """The single input and single output layer; ModelError otherwise (add a virtual source/sink first)."""
    sources = [i for i, ly in enumerate(g.layers) if not ly.inputs]
    sinks = [i for i in range(len(g.layers)) if not g.succ[i]]
    if len(sources) != 1 or len(sinks) != 1:
        raise ModelError(f"the graph must have one input and one output layer, not {len(sources)} and {len(sinks)}")
    return sources[0], sinks[0]


def longest_path_depths(g: LayerGraph) -> list[int]:
    """LP(v): edges on the longest path from the source to v (spec 2.1), O(V+E)."""
    lp = [0] * len(g.layers)
    for u in topological_order(g):
        for w in g.succ[u]:
            lp[w] = max(lp[w], lp[u] + 1)
    return lp


def singletons(lp: Sequence[int]) -> list[int]:
    """Vertices alone at their LP level, by LP ascending."""
    count: dict[int, int] = {}
    for d in lp:
        count[d] = count.get(d, 0) + 1
    return sorted((v for v, d in enumerate(lp) if count[d] == 1), key=lambda v: lp[v])


def all_paths_through(g: LayerGraph, lp: Sequence[int], p: int, u: int) -> bool:
    """AP(p, u): every path from p passes through u before going deeper than LP(u).

    One BFS from p with u as a stop vertex: false iff a vertex deeper than u is reachable without passing u.
    """
    if p == u:
        return True
    seen = {p}
    queue = deque([p])
    while queue:
        v = queue.popleft()
        for w in g.succ[v]:
            if w == u or w in seen:
                continue
            if lp[w] > lp[u]:
                return False
            seen.add(w)
            queue.append(w)
    return True


def candidate_points(g: LayerGraph) -> list[int]:
    """The linearisation (spec 2.1 scan): layer indices p_0 = source .. p_m = sink."""
    src, _ = source_and_sink(g)
    lp = longest_path_depths(g)
    singles = singletons(lp)
    points: list[int] = []
    prev = src
    while singles:
        for i, u in enumerate(singles):
            if all_paths_through(g, lp, prev, u):
                points.append(u)
                prev = u
                singles = singles[i + 1:]
                break
        else:  # no remaining singleton passes: only possible for a graph without a single sink
            raise ModelError("linearisation found no further candidate point")
    return points


def segments(g: LayerGraph, points: Sequence[int]) -> list[list[int]]:
    """Segment k (k = 1..m) = the layers with LP in (LP(p_{k-1}), LP(p_k)]; returned 0-based (segment k at k-1)."""
    lp = longest_path_depths(g)
    bounds = [lp[p] for p in points]
    segs: list[list[int]] = [[] for _ in range(len(points) - 1)]
    for v, d in enumerate(lp):
        if d == 0:
            continue
        # The first k with bounds[k] >= d: levels rise strictly along the points.
        lo, hi = 1, len(bounds) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if bounds[mid] >= d:
                hi = mid
            else:
                lo = mid + 1
        segs[lo - 1].append(v)
    return segs


def layer_memory(layer: Layer, mode: MemoryMode = "reference", dtype_bytes: int = 4) -> int:
    """Bytes of one layer at batch size 1: activations (dtype bytes x numel) plus parameters, which the
    reference code adds as a raw *count* (``reference``) and ``bytes`` mode multiplies by the dtype size."""
    params = layer.params if mode == "reference" else layer.params * dtype_bytes
    return dtype_bytes * layer.output_numel + params


def segment_memories(g: LayerGraph, points: Sequence[int], mode: MemoryMode = "reference",
                     dtype_bytes: int = 4) -> list[int]:
    """M_1..M_m (bytes, spec 2.2)."""
    return [sum(layer_memory(g.layers[v], mode, dtype_bytes) for v in seg) for seg in segments(g, points)]


@dataclass(frozen=True)
class TransferModel:
    """How a cut's tensor is sized on the wire (spec 2.2). The defaults are the reference preset: 8-byte
    elements, ZFP ratio 1.44, one copy per consumer, Mbit = 2**20 bits."""

    element_bytes: float = 8.0
    compression_ratio: float = 1.44
    per_consumer: bool = True
    bits_per_mbit: float = float(2**20)

    def mbit(self, numel: int, consumers: int) -> float:
        """Mbit sent for a tensor of ``numel`` elements read by ``consumers`` layers (0 consumers: 0)."""
        copies = consumers if self.per_consumer else min(consumers, 1)
        return copies * numel * self.element_bytes / self.compression_ratio * 8.0 / self.bits_per_mbit


REFERENCE_TRANSFER = TransferModel()


def transfer_sizes(g: LayerGraph, points: Sequence[int], model: TransferModel = REFERENCE_TRANSFER) -> list[float]:
    """T(p_0..p_m) in Mbit; T(sink) = 0."""
    return [model.mbit(g.layers[p].output_numel, g.consumers(p)) for p in points]


@dataclass(frozen=True)
class Linearised:
    """A model as the partitioner sees it: point names, segment memories M_1..M_m (bytes) and T(p_0..p_m)."""

    names: tuple[str, ...]
    memories: tuple[int, ...]
    transfers: tuple[float, ...]

    @property
    def m(self) -> int:
        return len(self.memories)


def linearise(g: LayerGraph, mode: MemoryMode = "reference", transfer: TransferModel = REFERENCE_TRANSFER,
              dtype_bytes: int = 4) -> Linearised:
    """Candidate points, segment memories and transfer sizes of ``g`` in one go."""
    points = candidate_points(g)
    return Linearised(names=tuple(g.layers[p].name for p in points),
                      memories=tuple(segment_memories(g, points, mode, dtype_bytes)),
                      transfers=tuple(transfer_sizes(g, points, transfer)))
