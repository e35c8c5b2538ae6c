"""One device's share of one HPP round, written once: the strict 1F1B order, the routing, the group sum.

Every device runs its stage's strict 1F1B order with K_p warm-up forwards: a forward takes its input from the
data (first stage) or the activation rows the devices of the previous group route to it (spec 6.1), and sends its
output's rows on to the next group; a backward takes the gradient rows back from the next group and sends the
gradient of its input back to the devices its rows came from. After the last backward the data-parallel group
sums its gradients and every replica steps its own optimizer.

The executor is a generator, so it runs on any transport. Sends go through ``DeviceIO.send`` at once; for a
receive it yields a ``Recv`` and is resumed with the tensor, for the group sum a ``GroupSum`` and is resumed with
the summed flat gradients. A driver that can block (a worker with its ``TensorExchange``) answers each request
as it comes (``run_blocking``); the in-process reference (``training.simulated``) steps every device's generator
in turn and resumes one when what it asks for is there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, TypeVar

import torch

from edgeswarm.hpp.compute import StageCompute
from edgeswarm.hpp.routing import Piece, pieces, routing_matrix
from edgeswarm.messages.tracing import SpanCat
from edgeswarm.planning.hpp.schedule import stage_order

T = TypeVar("T")
Kind = Literal["activation", "gradient"]


@dataclass(frozen=True)
class Position:
    """Where a device sits in the plan: rank ``rank`` of stage ``stage``; ``shares[p][r]`` is the samples per
    micro-batch of rank r of stage p; ``warmup`` is the stage's K_p."""

    stage: int
    rank: int
    shares: Sequence[Sequence[int]]
    micro_batches: int
    warmup: int

    @property
    def stages(self) -> int:
        return len(self.shares)

    @property
    def group(self) -> int:
        """How many devices replicate this stage."""
        return len(self.shares[self.stage])

    def into(self) -> list[Piece]:
        """The activation pieces this device receives from the previous stage (in sender order)."""
        p, r = self.stage, self.rank
        if p == 0:
            return []
        return [pc for pc in pieces(routing_matrix(self.shares[p - 1], self.shares[p])) if pc.receiver == r]

    def out_of(self) -> list[Piece]:
        """The activation pieces this device sends to the next stage (in receiver order)."""
        p, r = self.stage, self.rank
        if p == self.stages - 1:
            return []
        return [pc for pc in pieces(routing_matrix(self.shares[p], self.shares[p + 1])) if pc.sender == r]


@dataclass(frozen=True)
class Recv:
    """The executor waits for the ``rows`` rows of ``kind`` for ``micro_batch`` from rank ``peer`` (of the previous
    stage for an activation, of the next for a gradient)."""

    kind: Kind
    micro_batch: int
    peer: int
    rows: int


@dataclass(frozen=True)
class GroupSum:
    """The executor waits for the sum of its group's flat gradients; ``flat`` is this device's."""

    flat: torch.Tensor


Request = Recv | GroupSum


def _call(fn: Callable[[], T]) -> T:
    return fn()


def _nothing() -> None:
    return None


def _no_wait() -> float:
    return 0.0


def _no_span(name: str, cat: SpanCat, micro_batch: int | None) -> AbstractContextManager[object]:
    return nullcontext()


@dataclass
class DeviceIO:
    """What the executor needs from the world beyond its stage.

    ``batch(mb)``: micro-batch ``mb``'s inputs (first stage; else None) and labels (last stage; else None).
    ``send(kind, stage, rank, mb, rows)``: hand rows to rank ``rank`` of stage ``stage`` (must not block on the
    receiver; the rows must not change after). ``compute(fn)``: runs a forward, backward or optimizer step (a
    device's emulated speed, a lock) and returns its result. ``after_forward()``: a check after each forward (the
    memory budget). ``step()``: the optimizer step after the group sum. ``blocked_s()``: the seconds this round's
    receives have blocked so far (the wait figure; 0 where receives never block). ``span(name, cat, mb)``: a
    context manager that records its block as a span of the round (``tracing.spans``; by default nothing).
    """

    batch: Callable[[int], tuple[torch.Tensor | None, torch.Tensor | None]]
    send: Callable[[Kind, int, int, int, torch.Tensor], None]
    compute: Callable[[Callable[[], object]], object] = _call
    after_forward: Callable[[], None] = _nothing
    step: Callable[[], None] = _nothing
    blocked_s: Callable[[], float] = _no_wait
    span: Callable[[str, SpanCat, int | None], AbstractContextManager[object]] = _no_span


@dataclass
class RoundTimes:
    """One device's round, in seconds: ``compute_s`` in forwards and backwards (``compute_cpu_s`` of this thread's
    CPU time), ``wait_s`` blocked on peers in the 1F1B part, ``overhead_s`` the rest of the 1F1B part (receives'
    bookkeeping, sends, the memory check), ``forward_s``/``backward_s`` per micro-batch, ``allreduce_s`` the group
    sum and optimizer step."""

    compute_s: float = 0.0
    compute_cpu_s: float = 0.0
    wait_s: float = 0.0
    overhead_s: float = 0.0
    forward_s: list[float] = field(default_factory=list)
    backward_s: list[float] = field(default_factory=list)
    allreduce_s: float = 0.0


def device_round(stage: StageCompute, at: Position, io: DeviceIO) -> Generator[Request, torch.Tensor, RoundTimes]:
    """Run this device's share of a round on ``stage`` (see the module's docstring for the protocol); returns its
    times. The caller reads the round's loss and peaks from ``stage`` and then calls ``stage.end_round()``.

    A device with no samples (Alg. 1 may give it none) skips its forwards and backwards; its weights still join
    the group sum with a zero gradient.
    """
    p, r = at.stage, at.rank
    into, out_of = at.into(), at.out_of()
    m = at.micro_batches
    times = RoundTimes(forward_s=[0.0] * m, backward_s=[0.0] * m)
    loop = 0.0
    share = at.shares[p][r]
    for kind, mb in stage_order(at.warmup, m):
        if share == 0:
            continue
        started = time.perf_counter()
        if kind == "F":
            received = None
            if p > 0:
                got = []
                with io.span("wait activation", "wait", mb):
                    for pc in into:
                        got.append((yield Recv("activation", mb, pc.sender, pc.rows)))
                received = torch.cat(got)
            x, labels = io.batch(mb)
            x = received if received is not None else x
            assert x is not None, "the first stage's batch gives its inputs"
            t0, c0 = time.perf_counter(), time.thread_time()
            with io.span("forward", "compute", mb):
                out = io.compute(partial(stage.forward, mb, x, labels))
            times.forward_s[mb] = time.perf_counter() - t0
            times.compute_cpu_s += time.thread_time() - c0
            times.compute_s += times.forward_s[mb]
            io.after_forward()
            assert isinstance(out, torch.Tensor)
            for pc in out_of:
                io.send("activation", p + 1, pc.receiver, mb, out[pc.sender_start:pc.sender_start + pc.rows])
        else:
            grad = None
            if p < at.stages - 1:
                got = []
                with io.span("wait gradient", "wait", mb):
                    for pc in out_of:
                        got.append((yield Recv("gradient", mb, pc.receiver, pc.rows)))
                grad = torch.cat(got)
            t0, c0 = time.perf_counter(), time.thread_time()
            with io.span("backward", "compute", mb):
                grad_in = io.compute(partial(stage.backward, mb, grad))
            times.backward_s[mb] = time.perf_counter() - t0
            times.compute_cpu_s += time.thread_time() - c0
            times.compute_s += times.backward_s[mb]
            if isinstance(grad_in, torch.Tensor):
                for pc in into:
                    io.send("gradient", p - 1, pc.sender, mb, grad_in[pc.receiver_start:pc.receiver_start + pc.rows])
        loop += time.perf_counter() - started
    times.wait_s = io.blocked_s()
    times.overhead_s = max(0.0, loop - times.compute_s - times.wait_s)
    t0 = time.perf_counter()
    if at.group > 1:
        with io.span("allreduce", "collective", None):
            summed = yield GroupSum(stage.flat_gradients())
        stage.set_flat_gradients(summed)
    with io.span("step", "compute", None):  # every device's last span of the round (tracing.schedule.ROUND_END)
        io.step()
    times.allreduce_s = time.perf_counter() - t0
    return times


def run_blocking(round_: Generator[Request, torch.Tensor, RoundTimes], recv: Callable[[Recv], torch.Tensor],
                 group_sum: Callable[[torch.Tensor], torch.Tensor]) -> RoundTimes:
    """Drive ``device_round`` on a transport whose receives block: ``recv`` answers a Recv (raising when the
    tensor cannot come), ``group_sum`` a GroupSum (a ring AllReduce, say). Returns the round's times."""
    try:
        request = next(round_)
        while True:
            value = recv(request) if isinstance(request, Recv) else group_sum(request.flat)
            request = round_.send(value)
    except StopIteration as done:
        times: RoundTimes = done.value
        return times
    finally:
        round_.close()  # a receive that raised leaves the generator suspended: end it now, not at collection
