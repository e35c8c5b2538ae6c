"""A model's layer sequence: the units between consecutive candidate partition points, and runnable stages.

The model is traced with torch.fx. Its graph is a DAG whose source is the input placeholder and whose sink is
the output node; nodes that do not depend on the input (parameter reads, constants, position ids and whatever
is computed from them alone) are not vertices: each stage recomputes the ones its nodes use.

Candidate partition points follow the partition-placement spec, section 2.1: longest-path depth LP from the
source, singleton levels, and the all-paths check AP(prev, u) done as one BFS with ``u`` as a stop vertex.
Unit k holds the vertices with LP in (LP(p_k), LP(p_{k+1})], so a residual block is one unit while every
op of a plain chain is a unit of its own. Exactly one tensor, the output of the unit's last point, crosses
each cut; this is checked when the sequence is built.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from torch import fx, nn

from edgeswarm.errors import ModelTraceError, StageRangeError

log = logging.getLogger(__name__)

_COMPUTE_OPS = ("call_module", "call_function", "call_method")


@dataclass(frozen=True)
class Unit:
    """One element of the layer sequence.

    ``name`` is readable (the module path the unit's nodes share, made unique with the output node's name
    where two units share a path); ``ops`` summarises the distinct operations in order ("conv2d,batchnorm2d");
    ``nodes`` are the fx node names computed in the unit; ``modules`` the module paths it calls; ``output``
    the fx node whose value leaves the unit.
    """

    index: int
    name: str
    ops: str
    nodes: tuple[str, ...]
    modules: tuple[str, ...]
    output: str


def longest_path_depths(source: fx.Node, vertices: set[fx.Node], order: Iterable[fx.Node]) -> dict[fx.Node, int]:
    """LP(v): edges on the longest path from ``source`` to each vertex, relaxing users in topological ``order``."""
    depth = {v: 0 for v in vertices}
    for v in order:
        if v not in vertices:
            continue
        for user in v.users:
            if user in vertices and depth[user] < depth[v] + 1:
                depth[user] = depth[v] + 1
    depth[source] = 0
    return depth


def all_paths_pass(prev: fx.Node, u: fx.Node, depth: dict[fx.Node, int]) -> bool:
    """AP(prev, u): True iff no vertex deeper than ``u`` is reachable from ``prev`` without passing through ``u``.

    One BFS with ``u`` as a stop vertex: O(V+E)."""
    if prev is u:
        return True
    limit = depth[u]
    seen = {prev}
    queue = deque([prev])
    while queue:
        v = queue.popleft()
        for w in v.users:
            if w is u or w in seen or w not in depth:
                continue
            if depth[w] > limit:
                return False
            seen.add(w)
            queue.append(w)
    return True


def candidate_points(source: fx.Node, depth: dict[fx.Node, int]) -> list[fx.Node]:
    """The candidate partition points in scan order, starting with ``source`` and ending with the sink."""
    levels: dict[int, list[fx.Node]] = {}
    for v, d in depth.items():
        levels.setdefault(d, []).append(v)
    singles = [nodes[0] for d, nodes in sorted(levels.items()) if len(nodes) == 1]
    points: list[fx.Node] = []
    prev = source
    i = 0
    while i < len(singles):
        # Singletons that fail AP are bypassed by a skip connection; they are dropped for good.
        while i < len(singles) and not all_paths_pass(prev, singles[i], depth):
            i += 1
        if i == len(singles):
            break
        prev = singles[i]
        points.append(prev)
        i += 1
    return points


def _module_path(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    key, value = next(reversed(stack.items()))
    return str(value[0]) if isinstance(value, tuple) else str(key)


def _op_name(node: fx.Node, root: nn.Module) -> str:
    if node.op == "call_module":
        return type(root.get_submodule(str(node.target))).__name__.lower()
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return str(node.target)


def _common_path(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common: list[str] = []
    for column in zip(*parts, strict=False):
        if any(c != column[0] for c in column):
            break
        common.append(column[0])
    # zip stops at the shortest path, which is itself the common prefix when all agree so far.
    return ".".join(common)


class LayerSequence:
    """The units of one traced model and a way to build a runnable stage for any contiguous range of them.

    Stages share parameters, buffers and submodules with the model (no copies): weights loaded into the model
    in place (``load_state_dict``) show up in every stage, and training a stage trains the model.
    """

    def __init__(self, traced: fx.GraphModule, source: fx.Node, groups: list[list[fx.Node]],
                 outputs: list[fx.Node], non_persistent: frozenset[str] = frozenset()) -> None:
        self._traced = traced
        self._non_persistent = non_persistent  # qualified names of the model's non-persistent buffers
        self._source = source
        self._groups = groups
        self._outputs = outputs  # the candidate point closing each unit: the one value leaving it
        self._node_unit: dict[fx.Node, int] = {n: i for i, g in enumerate(groups) for n in g}
        self.units: list[Unit] = self._describe()

    def __len__(self) -> int:
        return len(self.units)

    def _describe(self) -> list[Unit]:
        raw: list[tuple[str, Unit]] = []
        for i, group in enumerate(self._groups):
            compute = [n for n in group if n.op in _COMPUTE_OPS]
            modules = tuple(str(n.target) for n in compute if n.op == "call_module")
            paths = [_module_path(n) for n in compute]
            if len(compute) == 1 and compute[0].op != "call_module" and paths[0]:
                name = f"{paths[0]}:{compute[0].name}"
            else:
                name = _common_path(paths) or (
                    compute[0].name if len(compute) == 1 else f"{compute[0].name}..{compute[-1].name}")
            ops = ",".join(dict.fromkeys(_op_name(n, self._traced) for n in compute))
            unit = Unit(index=i, name=name, ops=ops, nodes=tuple(n.name for n in group), modules=modules,
                        output=self._outputs[i].name)
            raw.append((name, unit))
        counts: dict[str, int] = {}
        for name, _ in raw:
            counts[name] = counts.get(name, 0) + 1
        return [
            u if counts[name] == 1 else Unit(index=u.index, name=f"{name}:{u.output}", ops=u.ops, nodes=u.nodes,
                                             modules=u.modules, output=u.output)
            for name, u in raw
        ]

    def build_stage(self, start: int, end: int) -> fx.GraphModule:
        """A GraphModule computing units [start, end): it takes the one tensor crossing the cut before ``start``
        (for start 0, the model's input) and returns the tensor leaving unit ``end - 1``. Its parameters and buffers
        keep the model's qualified names and its buffers the model's persistence, so its state dict is the part of
        the model's state dict that those units use.

        Raises StageRangeError unless 0 <= start < end <= len(self)."""
        count = len(self.units)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (start, end)) or not 0 <= start < end <= count:
            raise StageRangeError(f"stage range [{start!r}, {end!r}) is invalid: need integers with "
                                  f"0 <= start < end <= {count} (the number of units)")
        inside = {n for g in self._groups[start:end] for n in g}
        entry = self._source if start == 0 else self._outputs[start - 1]
        needed = self._constants_for(inside)
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {entry: graph.placeholder(entry.name)}
        for node in self._traced.graph.nodes:
            if node in inside or node in needed:
                env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(env[self._outputs[end - 1]])
        stage = fx.GraphModule(self._traced, graph, class_name=f"Stage_{start}_{end}")
        # fx registers every tensor a graph reads as a persistent buffer, so a non-persistent one (GPT-2's and
        # BERT's position ids) would enter the stage's state dict, and with it checkpoints that the model's own
        # load_state_dict(strict=True) then refuses. Registering it again keeps the model's persistence.
        for name, buffer in list(stage.named_buffers(remove_duplicate=False)):
            if name in self._non_persistent:
                owner, _, field = name.rpartition(".")
                stage.get_submodule(owner).register_buffer(field, buffer, persistent=False)
        return stage

    def _constants_for(self, inside: set[fx.Node]) -> set[fx.Node]:
        """The input-independent nodes that the nodes in ``inside`` use, directly or through each other."""
        needed: set[fx.Node] = set()
        stack = [a for n in inside for a in n.all_input_nodes if a not in self._node_unit and a is not self._source]
        while stack:
            node = stack.pop()
            if node not in needed:
                needed.add(node)
                stack.extend(node.all_input_nodes)
        return needed


def layer_sequence(model: nn.Module) -> LayerSequence:
    """Trace ``model`` with torch.fx and split it at its candidate partition points.

    Raises ModelTraceError when the model cannot be traced, has other than one input and one tensor output,
    has an output that does not depend on its input, or (which the rule excludes) a cut crossed by more than
    one value."""
    name = type(model).__name__
    try:
        traced = fx.symbolic_trace(model)
    except Exception as exc:  # fx raises many kinds (TraceError, TypeError, ...): all mean "not traceable"
        raise ModelTraceError(f"torch.fx cannot trace {name}: {exc}. Its forward must not branch on tensor "
                              "values or shapes.") from exc
    graph = traced.graph
    graph.eliminate_dead_code()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise ModelTraceError(f"{name} takes {len(placeholders)} inputs; a layer sequence needs exactly one")
    source = placeholders[0]
    sink = next(n for n in graph.nodes if n.op == "output")
    if not isinstance(sink.args[0], fx.Node):
        raise ModelTraceError(f"{name} returns {type(sink.args[0]).__name__}; a layer sequence needs one tensor "
                              "output")

    vertices = {source}
    queue = deque([source])
    while queue:
        for user in queue.popleft().users:
            if user not in vertices:
                vertices.add(user)
                queue.append(user)
    if sink not in vertices or sink.args[0] is source:
        raise ModelTraceError(f"the output of {name} does not depend on its input through any layer")

    depth = longest_path_depths(source, vertices, graph.nodes)
    points = candidate_points(source, depth)
    if not points or points[-1] is not sink:
        raise ModelTraceError(f"internal error: the candidate scan of {name} did not end at the output")
    # Points other than the source and the sink close units; the sink's own segment holds only the output node.
    closing = [p for p in points if p is not source and p is not sink]
    bounds = [depth[p] for p in closing]
    groups: list[list[fx.Node]] = [[] for _ in closing]
    for node in graph.nodes:
        if node in vertices and node is not source and node is not sink:
            groups[bisect_left(bounds, depth[node])].append(node)
    _check_single_crossing(name, source, sink, groups, closing)
    non_persistent = frozenset(dict(model.named_buffers(remove_duplicate=False))) - frozenset(
        model.state_dict(keep_vars=True))
    seq = LayerSequence(traced, source, groups, closing, non_persistent)
    log.debug("layer sequence of %s: %d units from %d graph vertices", name, len(seq), len(vertices))
    return seq


def _check_single_crossing(name: str, source: fx.Node, sink: fx.Node, groups: list[list[fx.Node]],
                           outputs: list[fx.Node]) -> None:
    """Every cut between units k-1 and k must be crossed by exactly one value: the output of unit k-1."""
    count = len(groups)
    unit = {n: i for i, g in enumerate(groups) for n in g}
    unit[source] = -1
    unit[sink] = count
    # Difference array: a value made in unit i and last used in unit j crosses the cuts i+1..j.
    delta = [0] * (count + 2)
    for node, i in unit.items():
        last_use = max((unit[u] for u in node.users if u in unit), default=i)
        if last_use > i:
            delta[i + 1] += 1
            delta[last_use + 1] -= 1
    crossing = [0] * (count + 1)  # crossing[k]: values made before unit k and used from unit k on
    running = 0
    for k in range(count + 1):
        running += delta[k]
        crossing[k] = running
    # The one crossing value must be the closing point itself (it is used after the cut).
    bad = [k for k in range(1, count)
           if crossing[k] != 1 or not any(unit.get(u, -1) >= k for u in outputs[k - 1].users)]
    if bad:
        k = bad[0]
        raise ModelTraceError(f"{crossing[k]} values cross the cut before unit {k} of {name} "
                              f"(after node {outputs[k - 1].name}); a stage boundary must carry exactly one tensor")
