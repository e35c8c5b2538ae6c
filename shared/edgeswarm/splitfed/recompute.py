"""The Memory Reducer at run time: a chain of units trained with per-segment recomputation (spec 6.3).

A device-side part (the U-split's front, or its tail) is a chain of units of the model's layer sequence. Each unit
runs as its own autograd "island": its input is a detached leaf, so the graph of one unit can be kept, freed or
rebuilt without touching its neighbours, and backward hands the input gradient of one island to the next.

Checkpoints and segments (SuperNeurons, spec 6.3): outputs of **expensive** units (conv, linear, matmul, attention,
recurrent cells) are always kept; a **segment** is a maximal run of cheap units (activation, pooling, norm, ...),
and the tensor entering it is its checkpoint. Per segment the plan names a strategy:

- ``none``: the segment's units keep their graphs from the forward pass (plain training).
- ``speed`` (speed-centric): forward runs the segment without a graph; when backward reaches it, units s_1..s_{k-1}
  are recomputed once from the checkpoint and kept until the segment's backward is done: k-1 extra layer forwards.
- ``memory`` (memory-centric): for each s_t in reverse order, s_1..s_{t-1} are recomputed from the checkpoint
  without a graph, used and freed: k(k-1)/2 extra layer forwards.

"Extra layer forwards" counts what the paper counts: forwards run to rebuild a freed output, i.e. the input of the
layer whose backward runs. A layer's backward itself is a vector-Jacobian product over its input; autograd gets it
by running that one layer again with a graph where it was not kept (``vjp_forwards``: s_k's per speed-centric
segment, every unit's per memory-centric one), which a layer-level backward kernel would not need. Cost-aware
planning (Algorithm 3) is a choice of ``speed`` or ``memory`` per segment: the pure planner decides, this runtime
executes.

Recomputation replays the random number generators from the segment's forward (dropout gives the same mask) and
leaves buffers as the forward left them (a BatchNorm's running statistics are updated once per iteration, not once
per recomputation).

Memory is measured, not modelled: every tensor the runtime keeps for backward (the tensors autograd saves, which a
``saved_tensors_hooks`` pair hands to the ledger instead of to the graph, and checkpoints; an island's input and
output are reached through stand-ins that save nothing, so they live only where something saves them, as in one
whole-model graph) is held in an ``ActivationLedger``, which sums the distinct storages it holds, parameters and
buffers excluded, with the tensors in flight (the output just computed, gradients) after every unit's forward and
every unit's backward, and keeps the peak. Bytes are bytes of tensor storage on the compute device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Literal

import torch
from torch import fx, nn

from edgeswarm.errors import ConfigError, EdgeswarmError

Strategy = Literal["none", "speed", "memory"]
STRATEGIES: tuple[str, ...] = ("none", "speed", "memory")

# Operation names (module types lower-cased, function names) that make a unit expensive: its output is a checkpoint.
_EXPENSIVE_TOKENS = ("conv", "linear", "matmul", "bmm", "addmm", "einsum", "attention", "lstm", "gru", "rnn",
                     "embedding")


class RecomputeError(EdgeswarmError):
    """A chain was driven out of order (a backward without its forward) or given a plan that does not fit it."""


def op_names(stage: nn.Module) -> list[str]:
    """The operations a unit's stage module runs, in graph order: module types lower-cased for module calls,
    function or method names otherwise. A module that is not an fx graph is described by its own type and its
    submodules' types."""
    if isinstance(stage, fx.GraphModule):
        names = []
        for node in stage.graph.nodes:
            if node.op == "call_module":
                names.append(type(stage.get_submodule(str(node.target))).__name__.lower())
            elif node.op == "call_function":
                names.append(getattr(node.target, "__name__", str(node.target)).lower())
            elif node.op == "call_method":
                names.append(str(node.target).lower())
        return names
    return [type(m).__name__.lower() for m in stage.modules()]


def is_expensive(ops: Iterable[str]) -> bool:
    """Whether a unit running ``ops`` (operation names, see ``op_names``) is expensive: it contains a convolution,
    a linear layer, a matrix product, attention or a recurrent cell, so its output is kept as a checkpoint."""
    return any(token in op for op in ops for token in _EXPENSIVE_TOKENS)


@dataclass(frozen=True)
class Segment:
    """Units [start, end) of a chain (indices into the chain): a maximal run of cheap units."""

    start: int
    end: int

    @property
    def size(self) -> int:
        """k, the number of units in the segment."""
        return self.end - self.start


def find_segments(expensive: Sequence[bool]) -> list[Segment]:
    """The recomputation segments of a chain whose units are ``expensive`` or not: the maximal runs of cheap units,
    in order. The tensor entering a segment (an expensive unit's output, or the chain's input) is its checkpoint."""
    out: list[Segment] = []
    start: int | None = None
    for i, costly in enumerate(expensive):
        if costly and start is not None:
            out.append(Segment(start, i))
            start = None
        elif not costly and start is None:
            start = i
    if start is not None:
        out.append(Segment(start, len(expensive)))
    return out


def extra_forwards(strategy: Strategy, k: int) -> int:
    """Extra layer forwards that ``strategy`` spends on a segment of ``k`` units per iteration: 0, k-1 (speed) or
    k(k-1)/2 (memory)."""
    if strategy == "speed":
        return max(0, k - 1)
    if strategy == "memory":
        return k * (k - 1) // 2
    return 0


class ActivationLedger:
    """The activation tensors a training runtime holds, by holder, and the peak of their distinct storages' bytes.

    ``exclude`` modules' parameters and buffers are weights, not activations: storages they own are never counted.
    ``sample`` adds the tensors passed to it (transients a caller holds only in local variables) for that sample."""

    def __init__(self, exclude: Iterable[nn.Module] = ()) -> None:
        self._held: dict[object, list[torch.Tensor]] = {}
        self._excluded: set[int] = set()
        self.peak_bytes = 0
        self.exclude(exclude)

    def exclude(self, modules: Iterable[nn.Module]) -> None:
        """Never count the storages of ``modules``' parameters and buffers (or their gradients' storages)."""
        for module in modules:
            for t in chain(module.parameters(), module.buffers()):
                self._excluded.add(t.untyped_storage().data_ptr())

    def hold(self, key: object, *tensors: torch.Tensor | None) -> None:
        """Hold ``tensors`` under ``key`` (added to what the key already holds)."""
        self._held.setdefault(key, []).extend(t for t in tensors if t is not None)

    def release(self, key: object) -> None:
        """Drop every tensor held under ``key`` (a missing key is fine)."""
        self._held.pop(key, None)

    def get(self, key: object) -> list[torch.Tensor]:
        """The tensors held under ``key``."""
        return self._held[key]

    def clear(self) -> None:
        """Drop everything held; the peak stays."""
        self._held.clear()

    def live_bytes(self, *transient: torch.Tensor | None) -> int:
        """Bytes of the distinct storages held now, plus those of ``transient`` tensors, weights excluded."""
        seen: dict[int, int] = {}
        for t in chain(chain.from_iterable(self._held.values()), (t for t in transient if t is not None)):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._excluded and ptr not in seen:
                seen[ptr] = storage.nbytes()
        return sum(seen.values())

    def sample(self, *transient: torch.Tensor | None) -> int:
        """Measure the live bytes now (with ``transient``), raise the peak if it is higher, and return them."""
        now = self.live_bytes(*transient)
        self.peak_bytes = max(self.peak_bytes, now)
        return now


@dataclass
class RecomputeStats:
    """What one iteration's recomputation cost: extra layer forwards per segment (in the chain's segment order),
    and the layer re-forwards autograd needed for the backward of units whose graphs were freed."""

    extra_forwards: list[int] = field(default_factory=list)
    vjp_forwards: int = 0


class _RngState:
    """The generator states a recomputation must replay: the CPU's, and the CUDA device's when computing there."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device if device.type == "cuda" else None
        self.cpu = torch.get_rng_state()
        self.gpu = torch.cuda.get_rng_state(self.cuda) if self.cuda is not None else None

    @contextmanager
    def replay(self) -> Iterator[None]:
        devices = [self.cuda] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None and self.gpu is not None:
                torch.cuda.set_rng_state(self.gpu, self.cuda)
            yield


@contextmanager
def _buffers_kept(units: Sequence[nn.Module]) -> Iterator[None]:
    # A recomputed BatchNorm in training mode would update its running statistics again: put them back after.
    saved = [(b, b.detach().clone()) for u in units for b in u.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


class _Sink:
    """Where a gradient is handed between islands."""

    __slots__ = ("grad",)

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None


class _Enter(torch.autograd.Function):
    """The identity into an island: its backward hands the input's gradient to a sink. It saves nothing, so the
    input's storage stays alive only if the unit itself saves it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor, sink: _Sink) -> torch.Tensor:
        ctx.sink = sink
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.sink.grad = grad
        return None, None, None


class _Exit(torch.autograd.Function):
    """A scalar stand-in for an island's output: backward feeds the output the gradient set on a sink. It saves
    nothing, so the output's storage stays alive only if something that needs it holds it."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, sink: _Sink) -> torch.Tensor:
        ctx.sink = sink
        return y.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        grad, ctx.sink.grad = ctx.sink.grad, None
        return grad, None


class _Island:
    """One unit's graph: the stand-in root to call backward on, and the sinks of its input and output gradients."""

    __slots__ = ("entry", "exit", "root")

    def __init__(self) -> None:
        self.entry: _Sink | None = None
        self.exit = _Sink()
        self.root: torch.Tensor | None = None


class UnitChain:
    """Trains a chain of unit modules with per-segment recomputation, measuring the activation bytes it holds.

    ``units`` run in order (each a stage of one unit, or any module taking and returning one tensor). ``plan``
    gives a strategy per segment of ``segments`` (default: ``find_segments`` over ``is_expensive`` of each unit's
    ``op_names``); None means no recomputation. ``ledger`` is shared when several chains make up one device's
    memory. ``input_grad``: whether ``backward`` must return the gradient of the chain's input (a received
    activation), or may skip it (the model's input data).

    One iteration is ``forward(x)`` then ``backward(grad_of_output)``; calling them out of order raises
    RecomputeError. Raises ConfigError for a plan of the wrong length or an unknown strategy.
    """

    def __init__(self, units: Sequence[nn.Module], plan: Sequence[str] | None = None, *,
                 segments: Sequence[Segment] | None = None, ledger: ActivationLedger | None = None,
                 input_grad: bool = True, name: str = "chain") -> None:
        self.units = list(units)
        if not self.units:
            raise ConfigError(f"{name}: a unit chain needs at least one unit")
        self.name = name
        self.segments = list(segments) if segments is not None else find_segments(
            [is_expensive(op_names(u)) for u in self.units])
        self.ledger = ledger if ledger is not None else ActivationLedger()
        self.ledger.exclude(self.units)
        self.input_grad = input_grad
        self.set_plan(plan)
        self._rng: dict[int, _RngState] = {}
        self._forwarded = False
        self._islands: dict[object, _Island] = {}
        # Makes the island entries' outputs require grad, so the input gradient reaches their sinks.
        self._anchor = torch.zeros((), requires_grad=True)

    # --- islands -----------------------------------------------------------------------------------------

    def set_plan(self, plan: Sequence[str] | None) -> None:
        """Use ``plan`` (one strategy per segment; None: no recomputation) from the next iteration on: the memory
        reducer re-plans when the device's budget changes. Raises ConfigError for a plan of another length or an
        unknown strategy."""
        strategies = list(plan) if plan is not None else ["none"] * len(self.segments)
        if len(strategies) != len(self.segments):
            raise ConfigError(f"{self.name}: the plan names {len(strategies)} strategies for {len(self.segments)} "
                              "segments")
        bad = [s for s in strategies if s not in STRATEGIES]
        if bad:
            raise ConfigError(f"{self.name}: unknown recomputation strategy {bad[0]!r}; use one of "
                              f"{', '.join(STRATEGIES)}")
        self.plan: list[str] = strategies
        self.stats = RecomputeStats(extra_forwards=[0] * len(self.segments))
        # unit index -> (segment index, segment) for units of segments that recompute
        self._recomputed: dict[int, tuple[int, Segment]] = {
            i: (n, seg) for n, (seg, s) in enumerate(zip(self.segments, self.plan, strict=True)) if s != "none"
            for i in range(seg.start, seg.end)}

    def _key(self, kind: str, index: int) -> tuple[str, str, int]:
        return (self.name, kind, index)

    def _island(self, index: int, x: torch.Tensor, needs_grad: bool, key: object) -> torch.Tensor:
        """Run unit ``index`` on ``x`` with a graph of its own whose saved tensors the ledger holds under ``key``;
        returns the unit's output. Nothing else of the island keeps a storage alive: its input and output are
        reached through stand-ins (``_Enter``, ``_Exit``) that save nothing, as in one whole-model graph."""
        inp = x.detach()
        island = _Island()
        if needs_grad and inp.is_floating_point():
            island.entry = _Sink()
            inp = _Enter.apply(inp, self._anchor, island.entry)
        self.ledger.hold(key)  # the key exists from here on, even if the unit saves nothing
        store = self.ledger.get(key)

        def pack(t: torch.Tensor) -> int:
            store.append(t)
            return len(store) - 1

        def unpack(slot: int) -> torch.Tensor:
            return store[slot]

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = self.units[index](inp)
            if out.requires_grad:
                island.root = _Exit.apply(out, island.exit)
        self._islands[key] = island
        return out

    def _island_backward(self, key: object, grad: torch.Tensor) -> torch.Tensor | None:
        island = self._islands.pop(key)
        if island.root is not None:
            island.exit.grad = grad
            island.root.backward()
        g_in = island.entry.grad if island.entry is not None else None
        self.ledger.sample(grad, g_in)
        self.ledger.release(key)
        return g_in

    # --- forward -----------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One training forward over the chain; returns its output (detached: what crosses the wire). The chain
        keeps what its backward needs until ``backward``."""
        self._drop_iteration()
        self.stats = RecomputeStats(extra_forwards=[0] * len(self.segments))
        for i in range(len(self.units)):
            entry = self._recomputed.get(i)
            if entry is None:
                x = self._island(i, x, self.input_grad or i > 0, self._key("unit", i))
            else:
                n, seg = entry
                if i == seg.start:
                    # The checkpoint: the tensor entering the segment, held until the segment's backward.
                    self.ledger.hold(self._key("checkpoint", n), x.detach())
                    self._rng[n] = _RngState(x.device)
                with torch.no_grad():
                    x = self.units[i](x)
            self.ledger.sample(x)
        self._forwarded = True
        return x.detach()

    # --- backward ----------------------------------------------------------------------------------------

    def backward(self, grad: torch.Tensor) -> torch.Tensor | None:
        """Backpropagate ``grad`` (the loss gradient of the chain's output), accumulating the units' parameter
        gradients; returns the gradient of the chain's input, or None when ``input_grad`` is false. Frees what the
        forward kept. Raises RecomputeError without a forward since the last backward."""
        if not self._forwarded:
            raise RecomputeError(f"{self.name}: backward without a forward")
        self._forwarded = False
        g: torch.Tensor | None = grad
        i = len(self.units) - 1
        while i >= 0:
            assert g is not None
            entry = self._recomputed.get(i)
            if entry is None:
                g = self._island_backward(self._key("unit", i), g)
                i -= 1
                continue
            n, seg = entry
            if self.plan[n] == "speed":
                g = self._speed_backward(n, seg, g)
            else:
                g = self._memory_backward(n, seg, g)
            self.ledger.release(self._key("checkpoint", n))
            self._rng.pop(n, None)
            i = seg.start - 1
        return g if self.input_grad else None

    def _needs_grad(self, index: int) -> bool:
        return self.input_grad or index > 0

    def _speed_backward(self, n: int, seg: Segment, g: torch.Tensor) -> torch.Tensor | None:
        """Recompute s_1..s_{k-1} once from the checkpoint, keep them through the segment's backward."""
        x = self.ledger.get(self._key("checkpoint", n))[0]
        keys = []
        with self._rng[n].replay(), _buffers_kept(self.units[seg.start:seg.end]):
            for i in range(seg.start, seg.end):
                key = self._key("recomputed", i)
                x = self._island(i, x, self._needs_grad(i), key)
                keys.append(key)
                if i < seg.end - 1:
                    self.stats.extra_forwards[n] += 1
                else:
                    self.stats.vjp_forwards += 1
                self.ledger.sample(g)
        out: torch.Tensor | None = g
        for key in reversed(keys):
            assert out is not None
            out = self._island_backward(key, out)
        return out

    def _memory_backward(self, n: int, seg: Segment, g: torch.Tensor) -> torch.Tensor | None:
        """For each s_t in reverse order, recompute s_1..s_{t-1} from the checkpoint without a graph, then s_t's
        backward; nothing of the segment outlives the step."""
        checkpoint = self.ledger.get(self._key("checkpoint", n))[0]
        out: torch.Tensor | None = g
        for t in range(seg.end - 1, seg.start - 1, -1):
            assert out is not None
            key = self._key("recomputed", t)
            with self._rng[n].replay(), _buffers_kept(self.units[seg.start:seg.end]):
                x = checkpoint
                with torch.no_grad():
                    for i in range(seg.start, t):
                        x = self.units[i](x)
                        self.stats.extra_forwards[n] += 1
                        self.ledger.sample(x, out)
                self._island(t, x, self._needs_grad(t), key)
                self.stats.vjp_forwards += 1
            del x
            self.ledger.sample(out)
            out = self._island_backward(key, out)
        return out

    def _drop_iteration(self) -> None:
        for i in range(len(self.units)):
            self.ledger.release(self._key("unit", i))
            self.ledger.release(self._key("recomputed", i))
        for n in range(len(self.segments)):
            self.ledger.release(self._key("checkpoint", n))
        self._islands.clear()
        self._rng.clear()

    def reset(self) -> None:
        """Forget an iteration that will not be completed (its kept activations are freed)."""
        self._drop_iteration()
        self._forwarded = False

    def held_bytes(self) -> int:
        """Activation bytes the chain's ledger holds now."""
        return self.ledger.live_bytes()
