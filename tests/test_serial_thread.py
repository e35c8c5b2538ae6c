"""runtime.serial: calls in order on one thread, which ends when idle or closed and starts again on the next call."""

from __future__ import annotations

import threading
import time

from edgeswarm.runtime.serial import SerialThread


def _wait(predicate, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_calls_run_in_order_on_one_thread_named_while_busy() -> None:
    runner = SerialThread("round", idle_s=5.0)
    seen: list[tuple[int, int, str]] = []
    done = threading.Event()

    def call(i: int) -> None:
        time.sleep(0.01 if i == 0 else 0)  # the first is slowest: later ones still wait for it
        me = threading.current_thread()
        seen.append((i, me.ident or 0, me.name))
        if i == 4:
            done.set()

    for i in range(5):
        runner.submit(lambda i=i: call(i))
    assert done.wait(5.0)
    assert [i for i, _, _ in seen] == [0, 1, 2, 3, 4]
    assert len({ident for _, ident, _ in seen}) == 1 and {name for _, _, name in seen} == {"round"}
    ident = seen[0][1]
    assert _wait(lambda: any(t.ident == ident and t.name == "round-idle" for t in threading.enumerate()))


def test_a_failing_call_is_logged_and_the_next_still_runs(caplog) -> None:  # type: ignore[no-untyped-def]
    runner = SerialThread("round", idle_s=5.0)
    ran = threading.Event()

    def boom() -> None:
        raise RuntimeError("boom")

    runner.submit(boom)
    runner.submit(ran.set)
    assert ran.wait(5.0)
    assert "boom" in caplog.text


def test_the_thread_ends_when_idle_and_a_later_call_starts_another() -> None:
    runner = SerialThread("serial-test", idle_s=0.05)
    idents: list[int] = []
    runner.submit(lambda: idents.append(threading.get_ident()))
    assert _wait(lambda: len(idents) == 1)
    assert _wait(lambda: not any(t.name.startswith("serial-test") for t in threading.enumerate()))
    runner.submit(lambda: idents.append(threading.get_ident()))
    assert _wait(lambda: len(idents) == 2)


def test_close_runs_what_is_queued_then_ends_the_thread() -> None:
    runner = SerialThread("serial-close", idle_s=30.0)
    ran: list[int] = []
    for i in range(3):
        runner.submit(lambda i=i: (time.sleep(0.02), ran.append(i)))
    runner.close(timeout_s=5.0)
    assert ran == [0, 1, 2]  # every call queued before close ran before it returned
    assert not any(t.name.startswith("serial-close") for t in threading.enumerate())
    runner.close()  # nothing running: returns at once
    runner.submit(lambda: ran.append(3))  # a later call starts another thread
    assert _wait(lambda: ran == [0, 1, 2, 3])
    runner.close()
