"""The tensor exchange every worker kind uses: waits, failures, aborts, retirement, sends per peer, and the checks
of an arrived tensor. In-process with a fake bus: deterministic, and no wait longer than a fraction of a second."""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from edgeswarm.runtime.exchange import (
    ExchangeAborted,
    ExchangeFailed,
    ExchangeTimeout,
    TensorExchange,
    tensor_problem,
)
from edgeswarm.runtime.program import ComputeGate
from edgeswarm.wire import WireTensor


class Key(NamedTuple):
    round: int
    kind: str
    sender: int

    @property
    def scope(self) -> int:
        return self.round

    def __str__(self) -> str:
        return f"{self.kind} tensor (round {self.round}, from rank {self.sender})"


class FakeBus:
    """Records every send_tensor; sends to a node in ``failing`` raise, sends to ``slow`` take a moment."""

    def __init__(self, failing: set[str] = frozenset(), slow: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.sent: list[tuple[str, str, Any, torch.Tensor]] = []
        self.failing = failing
        self.slow = slow
        self.lock = threading.Lock()

    def send_tensor(self, node: str, service: str, message: Any, value: torch.Tensor) -> int:
        if node in self.slow:
            time.sleep(0.01)
        if node in self.failing:
            raise ConnectionError(f"{node} is unreachable")
        with self.lock:
            self.sent.append((node, service, message, value))
        return value.numel() * value.element_size()


def exchange(bus: FakeBus | None = None, wait_s: float = 5.0) -> TensorExchange[Key]:
    return TensorExchange(bus or FakeBus(), "stage-worker", wait_s=wait_s, name="test", scope_name="round")  # type: ignore[arg-type]


def later(delay_s: float, fn: Any, *args: Any) -> threading.Thread:
    thread = threading.Timer(delay_s, fn, args)
    thread.start()
    return thread


def test_a_tensor_put_before_or_after_the_wait_is_taken_once() -> None:
    ex = exchange()
    ex.put(Key(0, "activation", 0), torch.ones(2, 3))
    assert ex.pending() == 1
    assert torch.equal(ex.wait(Key(0, "activation", 0)), torch.ones(2, 3))
    assert ex.pending() == 0
    # Put while waiting: the waiter wakes at once (well before its timeout) and its blocked time is counted.
    ex.blocked_s = 0.0
    later(0.05, ex.put, Key(0, "gradient", 1), torch.zeros(4, 3))
    started = time.monotonic()
    got = ex.wait(Key(0, "gradient", 1), rows=4)
    assert got.shape == (4, 3) and time.monotonic() - started < 1.0
    assert 0.03 < ex.blocked_s < 1.0
    # Keys differing in any field are different tensors.
    ex.put(Key(1, "gradient", 1), torch.zeros(1))
    with pytest.raises(ExchangeTimeout, match=r"no gradient tensor \(round 1, from rank 0\) within 0 s"):
        ex.wait(Key(1, "gradient", 0), timeout_s=0.05)
    assert ex.pending() == 1


def test_a_wait_times_out_and_counts_no_blocked_time() -> None:
    ex = exchange(wait_s=0.1)
    started = time.monotonic()
    with pytest.raises(ExchangeTimeout, match=r"no activation tensor \(round 3, from rank 2\)"):
        ex.wait(Key(3, "activation", 2))
    assert 0.09 < time.monotonic() - started < 1.0
    assert ex.blocked_s == 0.0


def test_the_rows_of_a_tensor_are_checked() -> None:
    ex = exchange()
    ex.put(Key(0, "activation", 0), torch.ones(5, 2))
    with pytest.raises(ExchangeFailed, match="of 5 rows where 4 are expected"):
        ex.wait(Key(0, "activation", 0), rows=4)


def test_failing_a_scope_wakes_its_waiters_and_leaves_other_scopes_alone() -> None:
    ex = exchange()
    ex.put(Key(1, "activation", 0), torch.ones(1))
    later(0.05, ex.fail, 0, "dropped a tensor of the wrong shape")
    started = time.monotonic()
    with pytest.raises(ExchangeFailed, match="wrong shape"):
        ex.wait(Key(0, "activation", 0))
    assert time.monotonic() - started < 1.0
    ex.fail(0, "a second reason")  # the first reason is kept
    with pytest.raises(ExchangeFailed, match="wrong shape"):
        ex.wait(Key(0, "gradient", 0))
    assert torch.equal(ex.wait(Key(1, "activation", 0)), torch.ones(1))
    # A tensor that is already here does not hide the failure: a bad tensor that failed the scope may come before
    # the good one of the same key (whether a wait blocked first must not decide the round).
    ex.put(Key(0, "activation", 5), torch.ones(1))
    with pytest.raises(ExchangeFailed, match="wrong shape"):
        ex.wait(Key(0, "activation", 5))
    ex.forget(0)  # the scope is over: a later one of the same scope starts clean
    ex.put(Key(0, "activation", 5), torch.ones(1))
    assert ex.wait(Key(0, "activation", 5)).numel() == 1


def test_aborting_a_scope_names_it_and_forget_clears_it() -> None:
    ex = exchange()
    later(0.05, ex.abort, 2, "p0 failed")
    with pytest.raises(ExchangeAborted, match="round 2 aborted: p0 failed"):
        ex.wait(Key(2, "activation", 0))
    ex.put(Key(2, "activation", 1), torch.ones(1))
    ex.put(Key(3, "activation", 1), torch.ones(1))
    ex.forget(2)
    assert ex.pending() == 1  # round 3's tensor stays
    ex.put(Key(2, "activation", 0), torch.ones(1))
    assert ex.wait(Key(2, "activation", 0)).numel() == 1  # the abort was forgotten with the round


def test_retiring_gives_every_scope_up_and_drops_later_tensors() -> None:
    ex = exchange()
    ex.put(Key(0, "activation", 0), torch.ones(1))
    errors: list[BaseException] = []

    def waiter(key: Key) -> None:
        try:
            ex.wait(key)
        except ExchangeAborted as exc:
            errors.append(exc)

    threads = [threading.Thread(target=waiter, args=(Key(r, "activation", 1),)) for r in (0, 1)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    ex.retire("a new assignment replaces the stage")
    for t in threads:
        t.join(1.0)
    assert len(errors) == 2 and all("given up: a new assignment replaces the stage" in str(e) for e in errors)
    assert ex.retired and ex.pending() == 0
    ex.put(Key(5, "activation", 0), torch.ones(1))
    assert ex.pending() == 0
    with pytest.raises(ExchangeAborted, match="round 5 given up"):
        ex.wait(Key(5, "activation", 0))


def test_sends_keep_their_order_per_peer_and_go_out_contiguous_on_the_host() -> None:
    bus = FakeBus(slow={"a"})
    ex = exchange(bus)
    base = torch.arange(12.0, requires_grad=True).reshape(3, 4) * 1
    for i in range(5):
        ex.send("a", 0, {"seq": i}, base.t())  # a non-contiguous view that needs grad
        ex.send("b", 0, {"seq": i}, torch.full((2,), float(i)))
    ex.close(timeout_s=2.0)
    for peer in ("a", "b"):
        assert [m["seq"] for node, _, m, _ in bus.sent if node == peer] == list(range(5))
    sent_to_a = [t for node, _, _, t in bus.sent if node == "a"]
    assert all(t.is_contiguous() and not t.requires_grad and t.device.type == "cpu" for t in sent_to_a)
    assert torch.equal(sent_to_a[0], base.detach().t())
    assert {service for _, service, _, _ in bus.sent} == {"stage-worker"}


def test_a_failed_send_fails_its_scope() -> None:
    bus = FakeBus(failing={"gone"})
    ex = exchange(bus)
    ex.send("gone", 7, {"seq": 0}, torch.ones(1))
    with pytest.raises(ExchangeFailed, match="sending to gone failed: gone is unreachable"):
        ex.wait(Key(7, "gradient", 0), timeout_s=1.0)
    ex.put(Key(8, "gradient", 0), torch.ones(1))
    assert ex.wait(Key(8, "gradient", 0), timeout_s=0.1).numel() == 1  # another round is untouched
    ex.close()


def test_close_gives_waiters_up_and_refuses_sends() -> None:
    ex = exchange()
    later(0.05, ex.close)
    with pytest.raises(ExchangeAborted, match="closed"):
        ex.wait(Key(0, "activation", 0))
    with pytest.raises(ExchangeAborted, match="closed"):
        ex.send("a", 0, {}, torch.ones(1))


def test_tensor_problem_names_a_wrong_dtype_or_sample_shape() -> None:
    def view(array: np.ndarray) -> WireTensor:
        return WireTensor(dtype=str(array.dtype), array=array)

    fine = view(np.zeros((3, 64), np.float32))
    assert tensor_problem(fine, dtype="float32", sample_shape=(64,), what="x") is None
    assert tensor_problem(fine, dtype="float32", sample_shape=None, what="x") is None
    assert tensor_problem(None, dtype="float32", sample_shape=None, what="x") == "x: expected float32, got None"
    assert tensor_problem(view(np.zeros((3, 64), np.float64)), dtype="float32", sample_shape=(64,),
                          what="x") == "x: expected float32, got float64"
    assert tensor_problem(view(np.zeros((32, 7), np.float32)), dtype="float32", sample_shape=(64,),
                          what="x") == "x: shape [32, 7], but this stage expects [rows, 64]"
    assert "expects [rows, 3, 8, 8]" in str(tensor_problem(view(np.zeros((2, 3, 8), np.float32)), dtype="float32",
                                                           sample_shape=(3, 8, 8), what="x"))


def test_the_compute_gate_lets_computes_share_it_and_builds_hold_it_alone() -> None:
    gate = ComputeGate()
    events: list[str] = []
    inside = threading.Event()
    release = threading.Event()

    def compute(name: str) -> None:
        with gate.computing():
            events.append(f"{name} in")
            inside.set()
            release.wait(1.0)
            events.append(f"{name} out")

    def build() -> None:
        with gate.building():
            events.append("build")

    first = threading.Thread(target=compute, args=("c1",))
    first.start()
    inside.wait(1.0)
    second = threading.Thread(target=compute, args=("c2",))
    second.start()
    time.sleep(0.05)  # two computes at once
    assert events == ["c1 in", "c2 in"]
    builder = threading.Thread(target=build)
    builder.start()
    time.sleep(0.05)
    assert "build" not in events  # it waits for the computes under way
    release.set()
    for t in (first, second, builder):
        t.join(1.0)
    assert events[-1] == "build"
