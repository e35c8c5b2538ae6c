"""Ring collectives (``edgeswarm.runtime.collectives``): ReduceScatter, AllGather and AllReduce equal torch's sums for
1 to 6 peers, even, uneven and zero-size slices, float32 and bfloat16; the tiled AllGather hands every slice over
once; the direct (one-step) AllReduce sums in rank order, bit-identical on every rank, and the direct AllGather
puts the parts together. In-process over a threaded in-memory transport (a queue per ordered pair of ranks, which
also checks that both ends of a link agree on which steps carry a tensor)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from edgeswarm.runtime.collectives import (
    Bounds,
    check_bounds,
    direct_all_gather,
    direct_all_reduce,
    even_bounds,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from helpers import Ring, weighted_bounds

SIZES = [1, 2, 3, 4, 5, 6]
LAYOUTS = ["even", "uneven", "zeros", "lone"]


def _layouts(n: int, length: int) -> dict[str, Bounds]:
    """Even, uneven (weights 1..n) and zero-size (every other rank owns nothing, one rank owns all) slices."""
    zeros = [0.0 if r % 2 else 1.0 for r in range(n)]
    lone = [0.0] * n
    lone[n // 2] = 1.0
    return {"even": even_bounds(length, n), "uneven": weighted_bounds(length, list(range(1, n + 1))),
            "zeros": weighted_bounds(length, zeros), "lone": weighted_bounds(length, lone)}


def _vectors(n: int, length: int, dtype: torch.dtype, *, integral: bool) -> list[torch.Tensor]:
    """Seeded inputs; integral ones (small integers) sum exactly in float32 and bfloat16, in any order."""
    gen = torch.Generator().manual_seed(n * 1000 + length)
    if integral:
        return [torch.randint(-8, 9, (length,), generator=gen).to(dtype) for _ in range(n)]
    return [torch.randn(length, generator=gen).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_equals_torchs_sum(n: int, dtype: torch.dtype, layout: str) -> None:
    length = 37
    bounds = _layouts(n, length)[layout]
    vectors = _vectors(n, length, dtype, integral=True)
    copies = [v.clone() for v in vectors]
    ring = Ring(n)
    results = ring.run(lambda r, send, recv: ring_all_reduce(vectors[r], r, bounds, send, recv))
    want = torch.stack(vectors).sum(dim=0)
    assert len(results) == n
    for rank, got in enumerate(results):
        assert got.dtype == dtype and got.shape == (length,)
        assert torch.equal(got, want), rank
    assert all(torch.equal(v, c) for v, c in zip(vectors, copies, strict=True)), "inputs are not modified"
    # Steps 0 .. N-2 reduce-scatter, N-1 .. 2N-3 all-gather, each in order on every link.
    assert all(steps == sorted(steps) and set(steps) <= set(range(2 * n - 2)) for steps in ring.steps)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_of_random_floats_is_the_sum_and_the_same_on_every_rank(n: int, layout: str) -> None:
    length = 1001
    bounds = _layouts(n, length)[layout]
    vectors = _vectors(n, length, torch.float32, integral=False)
    results = Ring(n).run(lambda r, send, recv: ring_all_reduce(vectors[r].reshape(7, 143), r, bounds, send, recv))
    want = torch.stack([v.double() for v in vectors]).sum(dim=0)
    assert torch.allclose(results[0].double(), want, rtol=0, atol=1e-5)
    assert all(torch.equal(r, results[0]) for r in results), "every rank holds the same bits"


def test_all_reduce_sums_each_slice_starting_right_of_its_owner() -> None:
    """The documented summation order: slice j accumulates x[j+1], x[j+2], ..., x[j] (own + received at each
    rank), so a result can be reproduced bit for bit elsewhere."""
    n, length = 4, 400
    vectors = [torch.randn(length, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    bounds = even_bounds(length, n)
    results = Ring(n).run(lambda r, send, recv: ring_all_reduce(vectors[r], r, bounds, send, recv))
    want = torch.empty(length)
    for j, (a, b) in enumerate(bounds):
        acc = vectors[(j + 1) % n][a:b].clone()
        for k in range(2, n + 1):
            acc = vectors[(j + k) % n][a:b] + acc
        want[a:b] = acc
    assert torch.equal(results[0], want)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_reduce_scatter_leaves_rank_j_its_summed_slice_j(n: int, dtype: torch.dtype, layout: str) -> None:
    length = 29
    bounds = _layouts(n, length)[layout]
    vectors = _vectors(n, length, dtype, integral=True)
    ring = Ring(n)
    results = ring.run(lambda r, send, recv: ring_reduce_scatter(vectors[r], r, bounds, send, recv))
    want = torch.stack(vectors).sum(dim=0)
    for rank, got in enumerate(results):
        a, b = bounds[rank]
        assert got.dtype == dtype and torch.equal(got, want[a:b]), rank
    assert all(set(steps) <= set(range(n - 1)) for steps in ring.steps)
    # Each rank sends every slice once but the one it ends owning (empty ones are not sent at all).
    for rank in range(n):
        assert ring.sent[rank] == sum(hi - lo for j, (lo, hi) in enumerate(bounds) if j != rank), rank


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_all_gather_puts_every_part_together_and_tiles_each_slice_once(n: int, dtype: torch.dtype,
                                                                       layout: str) -> None:
    length = 23
    bounds = _layouts(n, length)[layout]
    full = _vectors(1, length, dtype, integral=False)[0]
    seen: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in range(n)]

    def body(rank: int, send: Any, recv: Any) -> torch.Tensor:
        a, b = bounds[rank]
        return ring_all_gather(full[a:b].clone(), rank, bounds, send, recv,
                               on_slice=lambda owner, start, view: seen[rank].append((owner, start, view.clone())))

    ring = Ring(n)
    results = ring.run(body)
    for rank, got in enumerate(results):
        assert torch.equal(got, full), rank
        owners = [owner for owner, _, _ in seen[rank]]
        assert owners[0] == rank and sorted(owners) == list(range(n)), (rank, owners)
        for owner, start, view in seen[rank]:
            a, b = bounds[owner]
            assert start == a and torch.equal(view, full[a:b])
    assert all(set(steps) <= set(range(n - 1)) for steps in ring.steps)


def test_all_reduce_tiles_the_summed_slices() -> None:
    n, length = 3, 10
    vectors = _vectors(n, length, torch.float32, integral=True)
    bounds = weighted_bounds(length, [2, 0, 3])
    tiles: list[list[int]] = [[] for _ in range(n)]
    Ring(n).run(lambda r, send, recv: ring_all_reduce(vectors[r], r, bounds, send, recv,
                                                      on_slice=lambda owner, _start, _view: tiles[r].append(owner)))
    assert [t[0] for t in tiles] == [0, 1, 2] and all(sorted(t) == [0, 1, 2] for t in tiles)


def test_one_rank_is_a_copy_and_sends_nothing() -> None:
    x = torch.arange(5.0)

    def never(*_: object) -> torch.Tensor:
        raise AssertionError("a ring of one sends and receives nothing")

    for fn in (ring_all_reduce, ring_reduce_scatter, ring_all_gather):
        got = fn(x, 0, [(0, 5)], never, never)
        assert torch.equal(got, x) and got.data_ptr() != x.data_ptr()


def test_bounds() -> None:
    assert even_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert even_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    for n in SIZES:
        for length in (0, 1, 7, 1000):
            for bounds in _layouts(n, length).values():
                check_bounds(bounds, length)
                assert len(bounds) == n
    with pytest.raises(ValueError, match="at least one part"):
        even_bounds(5, 0)
    with pytest.raises(ValueError, match="cover 4 elements of a vector of 5"):
        check_bounds([(0, 2), (2, 4)], 5)
    with pytest.raises(ValueError, match="contiguous"):
        check_bounds([(0, 2), (3, 5)], 5)


def test_refusals_are_value_errors_with_the_reason() -> None:
    x = torch.zeros(6)

    def nothing(*_: object) -> None:
        return None

    with pytest.raises(ValueError, match="rank 3 is not in a ring of 3"):
        ring_all_reduce(x, 3, even_bounds(6, 3), nothing, nothing)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank -1"):
        ring_reduce_scatter(x, -1, even_bounds(6, 3), nothing, nothing)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cover 5 elements of a vector of 6"):
        ring_all_reduce(x, 0, even_bounds(5, 2), nothing, nothing)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="its part has 6"):
        ring_all_gather(x, 0, even_bounds(6, 2), nothing, nothing)  # type: ignore[arg-type]

    def short(_frm: int, _step: int) -> torch.Tensor:
        return torch.zeros(2)

    with pytest.raises(ValueError, match="step 0: rank 1 sent 2 values for a slice of 3"):
        ring_all_reduce(x, 0, even_bounds(6, 2), nothing, short)  # type: ignore[arg-type]

    def wrong_dtype(_frm: int, _step: int) -> torch.Tensor:
        return torch.zeros(3, dtype=torch.float64)

    with pytest.raises(ValueError, match="float64"):
        ring_reduce_scatter(x, 0, even_bounds(6, 2), nothing, wrong_dtype)  # type: ignore[arg-type]


# --- direct collectives -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_direct_all_reduce_equals_torchs_sum_in_one_step(n: int, dtype: torch.dtype) -> None:
    length = 37
    vectors = _vectors(n, length, dtype, integral=True)
    copies = [v.clone() for v in vectors]
    ring = Ring(n, mesh=True)
    results = ring.run(lambda r, send, recv: direct_all_reduce(vectors[r].reshape(1, length), r, n, send, recv))
    want = torch.stack(vectors).sum(dim=0)
    assert len(results) == n
    for rank, got in enumerate(results):
        assert got.dtype == dtype and got.shape == (length,)
        assert torch.equal(got, want), rank
    assert all(torch.equal(v, c) for v, c in zip(vectors, copies, strict=True)), "inputs are not modified"
    # One step: every rank sends its whole vector once to each other rank, all on step 0.
    assert all(steps == [0] * (n - 1) for steps in ring.steps)
    assert all(sent == (n - 1) * length for sent in ring.sent)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_direct_all_reduce_sums_in_rank_order_and_every_rank_holds_the_same_bits(n: int, dtype: torch.dtype) -> None:
    length = 1001
    vectors = _vectors(n, length, dtype, integral=False)
    results = Ring(n, mesh=True).run(lambda r, send, recv: direct_all_reduce(vectors[r], r, n, send, recv, step=3))
    acc = vectors[0].float()
    for v in vectors[1:]:
        acc = acc + v.float()  # rank order 0 .. n-1, 16-bit floats in float32, rounded once
    want = acc.to(dtype)
    assert all(torch.equal(got, want) for got in results), "the documented order, on every rank"
    exact = torch.stack([v.double() for v in vectors]).sum(dim=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2 * float(exact.abs().max())
    assert torch.allclose(results[0].double(), exact, rtol=0, atol=tol)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_direct_all_gather_puts_every_part_together_in_one_step(n: int, dtype: torch.dtype, layout: str) -> None:
    length = 23
    bounds = _layouts(n, length)[layout]
    full = _vectors(1, length, dtype, integral=False)[0]
    ring = Ring(n, mesh=True)
    results = ring.run(lambda r, send, recv: direct_all_gather(full[bounds[r][0]:bounds[r][1]].clone(), r, bounds,
                                                               send, recv))
    assert len(results) == n and all(torch.equal(got, full) for got in results)
    for rank, (a, b) in enumerate(bounds):  # its part to every other rank, on step 0; an empty part never
        assert ring.sent[rank] == (n - 1) * (b - a) and ring.steps[rank] == ([0] * (n - 1) if b > a else [])


def test_direct_collectives_of_nothing_or_one_rank_send_nothing() -> None:
    def never(*_: object) -> torch.Tensor:
        raise AssertionError("nothing to send or receive")

    x = torch.arange(5.0)
    got = direct_all_reduce(x, 0, 1, never, never)
    assert torch.equal(got, x) and got.data_ptr() != x.data_ptr()
    assert direct_all_reduce(torch.zeros(0), 2, 4, never, never).numel() == 0
    assert torch.equal(direct_all_gather(x, 0, [(0, 5)], never, never), x)
    with pytest.raises(ValueError, match="rank 3 is not in a ring of 3"):
        direct_all_reduce(x, 3, 3, never, never)

    def short(_frm: int, _step: int) -> torch.Tensor:
        return torch.zeros(2)

    with pytest.raises(ValueError, match="rank 1 sent 2 values for a slice of 5"):
        direct_all_reduce(x, 0, 2, lambda *_: None, short)


# --- over Mosquitto, through real TensorExchanges ---------------------------------------------------------------

SVC = "coll"
JOB = "job1"


class Peers:
    """``n`` bus instances on the test broker, each with a TensorExchange and a CollectivePort whose data-plane
    handler is ``CollectivePort.accept`` for the ring of every bus in order; ``refused[r]`` collects what rank r's
    port dropped."""

    def __init__(self, make_bus: Callable[..., Any], n: int, *, dtype: str = "float32") -> None:
        from edgeswarm import topics
        from edgeswarm.messages.collectives import CollectiveTensor
        from edgeswarm.runtime.collective_exchange import CollectivePort
        from edgeswarm.runtime.exchange import TensorExchange
        from helpers import announce

        self.buses = [make_bus(f"n{r}", SVC) for r in range(n)]
        self.nodes = [bus.sender.node for bus in self.buses]
        self.exchanges = [TensorExchange(bus, SVC, wait_s=10.0, name=f"n{r}", scope_name="scope")
                          for r, bus in enumerate(self.buses)]
        self.ports = [CollectivePort(x, JOB, dtype=dtype) for x in self.exchanges]
        self.refused: list[list[Any]] = [[] for _ in range(n)]
        for rank, (bus, port) in enumerate(zip(self.buses, self.ports, strict=True)):
            bus.subscribe(topics.data(bus.sender.node, SVC), self._handler(rank, port), schemas=(CollectiveTensor,),
                          plane="data")
            announce(bus)
        for bus in self.buses:
            for node in self.nodes:
                bus.peers.wait_for(node, SVC, timeout_s=10)

    def _handler(self, rank: int, port: Any) -> Callable[[Any], None]:
        def on_data(msg: Any) -> None:
            refused = port.accept(msg, self.nodes, rank)
            if refused is not None:
                self.refused[rank].append(refused)
        return on_data

    def run(self, body: Callable[[int, Any, Any], torch.Tensor], scope: int, **ring: Any) -> list[Any]:
        """``body(rank, send, recv)`` on every rank at once, over ``port.ring(nodes, rank, scope, **ring)``; the
        results (or the exception each rank raised) by rank."""
        results: list[Any] = [None] * len(self.nodes)

        def worker(rank: int) -> None:
            send, recv = self.ports[rank].ring(self.nodes, rank, scope, **ring)
            try:
                results[rank] = body(rank, send, recv)
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                results[rank] = exc

        threads = [threading.Thread(target=worker, args=(r,)) for r in range(len(self.nodes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        return results

    def close(self) -> None:
        for x in self.exchanges:
            x.close(timeout_s=1.0)


def test_all_gather_and_reduce_scatter_among_three_peers_over_mosquitto(make_bus) -> None:
    peers = Peers(make_bus, 3)
    try:
        length = 1000
        bounds = weighted_bounds(length, [3, 0, 2])  # rank 1 owns nothing
        gen = torch.Generator().manual_seed(3)
        full = torch.randn(length, generator=gen)
        tiles: list[list[int]] = [[], [], []]

        def gather(rank: int, send: Any, recv: Any) -> torch.Tensor:
            a, b = bounds[rank]
            return ring_all_gather(full[a:b].clone(), rank, bounds, send, recv,
                                   on_slice=lambda owner, _start, _view: tiles[rank].append(owner))

        gathered = peers.run(gather, scope=1)
        assert all(isinstance(g, torch.Tensor) and torch.equal(g, full) for g in gathered), gathered
        assert all(sorted(t) == [0, 1, 2] and t[0] == r for r, t in enumerate(tiles))

        vectors = [torch.randint(-50, 50, (length,), generator=gen).float() for _ in range(3)]
        want = torch.stack(vectors).sum(dim=0)
        scattered = peers.run(lambda r, send, recv: ring_reduce_scatter(vectors[r], r, bounds, send, recv), scope=2,
                              collective=5)
        for rank, got in enumerate(scattered):
            a, b = bounds[rank]
            assert isinstance(got, torch.Tensor) and torch.equal(got, want[a:b]), rank
        summed = peers.run(lambda r, send, recv: ring_all_reduce(vectors[r], r, bounds, send, recv), scope=3, qos=0,
                           deadline_s=5.0)
        assert all(torch.equal(s, want) for s in summed), summed
        assert peers.refused == [[], [], []]
    finally:
        peers.close()


def test_a_bfloat16_all_reduce_over_mosquitto(make_bus) -> None:
    peers = Peers(make_bus, 3, dtype="bfloat16")
    try:
        gen = torch.Generator().manual_seed(4)
        vectors = [torch.randint(-8, 9, (301,), generator=gen).to(torch.bfloat16) for _ in range(3)]
        bounds = even_bounds(301, 3)
        summed = peers.run(lambda r, send, recv: ring_all_reduce(vectors[r], r, bounds, send, recv), scope=0)
        assert all(s.dtype == torch.bfloat16 and torch.equal(s, torch.stack(vectors).sum(dim=0)) for s in summed)
    finally:
        peers.close()


def test_forged_and_misplaced_senders_are_refused(make_bus) -> None:
    """A node outside the ring, and a member claiming a rank it is not or that may not send to the receiver, are
    dropped by the one sender check; the genuine slices still make the sum."""
    from edgeswarm.messages.collectives import CollectiveTensor
    from helpers import wait_until

    peers = Peers(make_bus, 3)
    try:
        mallory = make_bus("mallory", SVC)
        bounds = even_bounds(30, 3)
        poison = torch.full((10,), 1e6)
        # Rank 1's left neighbour is rank 0 (n0): each of these claims a slice of step 0 for rank 1.
        for who, claimed in ((mallory, 0), (peers.buses[2], 0), (peers.buses[2], 2)):
            who.send_tensor("n1", SVC, CollectiveTensor(job_id=JOB, epoch=0, scope=7, step=0, sender=claimed), poison)
        # A resend request for n0 from mallory claiming rank 1, the only rank that may ask n0.
        mallory.send_tensor("n0", SVC, CollectiveTensor(job_id=JOB, epoch=0, scope=7, step=0, sender=1, resend=True),
                            torch.empty(0))
        wait_until(lambda: len(peers.refused[1]) == 3 and len(peers.refused[0]) == 1, timeout_s=10)
        assert all(r.reason == "sender" for rs in peers.refused for r in rs), peers.refused
        details = sorted(r.detail for r in peers.refused[1])  # the three buses' frames arrive in any order
        assert "from mallory claiming rank 0: rank 0 of the ring is n0" in details[0]
        assert "from n2 claiming rank 0: rank 0 of the ring is n0" in details[1]
        assert "from n2 claiming rank 2: only rank 0 sends that to rank 1" in details[2]
        (asked,) = peers.refused[0]
        assert "resend request" in asked.detail and "rank 1 of the ring is n1" in asked.detail
        vectors = [torch.arange(30.0) * (r + 1) for r in range(3)]
        summed = peers.run(lambda r, send, recv: ring_all_reduce(vectors[r], r, bounds, send, recv), scope=7)
        assert all(torch.equal(s, torch.arange(30.0) * 6) for s in summed), summed
    finally:
        peers.close()


def test_a_direct_all_reduce_among_four_peers_over_mosquitto(make_bus) -> None:
    """Every member sends to every other: frames between non-neighbours are marked direct and taken; the sum is
    exact and the same bits everywhere, at QoS 1 and at QoS 0; a direct AllGather too."""
    peers = Peers(make_bus, 4)
    try:
        gen = torch.Generator().manual_seed(8)
        vectors = [torch.randn(77, generator=gen) for _ in range(4)]
        want = ((vectors[0] + vectors[1]) + vectors[2]) + vectors[3]
        for scope, qos in ((1, 1), (2, 0)):
            summed = peers.run(lambda r, send, recv: direct_all_reduce(vectors[r], r, 4, send, recv), scope=scope,
                               collective=3, qos=qos, deadline_s=5.0)
            assert all(isinstance(s, torch.Tensor) and torch.equal(s, want) for s in summed), summed
        bounds = weighted_bounds(77, [1, 0, 2, 1])
        full = torch.cat(vectors)[:77]
        gathered = peers.run(lambda r, send, recv: direct_all_gather(full[bounds[r][0]:bounds[r][1]].clone(), r,
                                                                     bounds, send, recv), scope=3)
        assert all(isinstance(g, torch.Tensor) and torch.equal(g, full) for g in gathered), gathered
        assert peers.refused == [[], [], [], []]
    finally:
        peers.close()


def test_forged_direct_slices_are_refused(make_bus) -> None:
    """``direct`` lets any member send, but only as the rank it holds: a node outside the ring, a member claiming
    another's rank, and a frame claiming the receiver's own rank are dropped; the genuine direct sum still holds."""
    from edgeswarm.messages.collectives import CollectiveTensor
    from helpers import wait_until

    peers = Peers(make_bus, 4)
    try:
        mallory = make_bus("mallory", SVC)
        poison = torch.full((12,), 1e6)

        def forged(claimed: int) -> CollectiveTensor:
            return CollectiveTensor(job_id=JOB, epoch=0, scope=9, step=0, sender=claimed, direct=True)

        # Rank 1's left neighbour is rank 0; rank 3 may send to it directly, but nobody else as rank 3 or rank 1.
        for who, claimed in ((mallory, 3), (peers.buses[2], 3), (peers.buses[1], 1)):
            who.send_tensor("n1", SVC, forged(claimed), poison)
        wait_until(lambda: len(peers.refused[1]) == 3, timeout_s=10)
        assert all(r.reason == "sender" for r in peers.refused[1]), peers.refused
        details = sorted(r.detail for r in peers.refused[1])
        assert "from mallory claiming rank 3: rank 3 of the ring is n3" in details[0]
        assert "from n1 claiming rank 1: rank 1 does not send to itself" in details[1]
        assert "from n2 claiming rank 3: rank 3 of the ring is n3" in details[2]
        vectors = [torch.arange(12.0) * (r + 1) for r in range(4)]
        summed = peers.run(lambda r, send, recv: direct_all_reduce(vectors[r], r, 4, send, recv), scope=9)
        assert all(torch.equal(s, torch.arange(12.0) * 10) for s in summed), summed
        assert [len(r) for r in peers.refused] == [0, 3, 0, 0]
    finally:
        peers.close()


def test_a_direct_slice_lost_at_qos_0_is_asked_for_again(make_bus) -> None:
    peers = Peers(make_bus, 3)
    try:
        # Rank 0's slice to rank 2 (not its right neighbour: a direct frame) is lost; rank 2 asks rank 0 for it.
        dropped = _drop_first(peers.ports[0], lambda m: m.direct and not m.resend)
        vectors = [torch.randint(-50, 50, (40,), generator=torch.Generator().manual_seed(r)).float() for r in range(3)]
        summed = peers.run(lambda r, send, recv: direct_all_reduce(vectors[r], r, 3, send, recv), scope=5, qos=0,
                           deadline_s=0.5)
        assert len(dropped) == 1
        assert peers.ports[2].asked == 1 and peers.ports[0].resent == 1
        assert all(isinstance(s, torch.Tensor) and torch.equal(s, torch.stack(vectors).sum(dim=0)) for s in summed), \
            summed
        assert peers.refused == [[], [], []]
    finally:
        peers.close()


def test_a_wrong_dtype_from_the_genuine_neighbour_fails_the_scope(make_bus) -> None:
    from edgeswarm.messages.collectives import CollectiveTensor
    from edgeswarm.runtime.exchange import ExchangeFailed

    peers = Peers(make_bus, 2)
    try:
        peers.buses[0].send_tensor("n1", SVC, CollectiveTensor(job_id=JOB, epoch=0, scope=4, step=0, sender=0),
                                   torch.zeros(5, dtype=torch.int64))
        send, recv = peers.ports[1].ring(peers.nodes, 1, 4)
        with pytest.raises(ExchangeFailed, match="expected a 1-D float32 tensor, got int64"):
            recv(0, 0)
        assert [r.reason for r in peers.refused[1]] == ["tensor"]
    finally:
        peers.close()


def _drop_first(port: Any, lost: Callable[[Any], bool], times: int = 1) -> list[Any]:
    """Make ``port``'s exchange lose its first ``times`` sends whose message ``lost`` picks (as QoS 0 may);
    returns the list the lost messages go to."""
    exchange = port.exchange
    real = exchange.send
    dropped: list[Any] = []

    def send(peer: str, scope: Any, message: Any, tensor: torch.Tensor, **kw: Any) -> None:
        if len(dropped) < times and lost(message):
            dropped.append((message, kw))
            return
        real(peer, scope, message, tensor, **kw)

    exchange.send = send
    return dropped


def test_a_slice_lost_at_qos_0_is_asked_for_again_and_the_sum_is_exact(make_bus) -> None:
    peers = Peers(make_bus, 3)
    try:
        dropped = _drop_first(peers.ports[0], lambda m: m.step == 1 and not m.resend)
        vectors = [torch.randint(-50, 50, (99,), generator=torch.Generator().manual_seed(r)).float() for r in range(3)]
        bounds = weighted_bounds(99, [1, 2, 3])
        summed = peers.run(lambda r, send, recv: ring_all_reduce(vectors[r], r, bounds, send, recv), scope=5, qos=0,
                           deadline_s=0.5)
        assert [(m.step, kw) for m, kw in dropped] == [(1, {"qos": 0})]
        # Rank 1 asked rank 0 for it (ranks after it, held up as long, may have asked for theirs too: harmless).
        assert peers.ports[1].asked >= 1 and peers.ports[0].resent == 1
        assert all(isinstance(s, torch.Tensor) and torch.equal(s, torch.stack(vectors).sum(dim=0)) for s in summed), \
            summed
        assert peers.ports[0].kept_bytes() > 0  # what it sent at QoS 0 is kept until the scope is forgotten
        peers.ports[0].forget(5)
        assert peers.ports[0].kept_bytes() == 0
    finally:
        peers.close()


def test_a_slice_lost_twice_fails_the_scope_within_two_deadlines(make_bus) -> None:
    from edgeswarm.runtime.exchange import ExchangeFailed, ExchangeTimeout

    peers = Peers(make_bus, 2)
    try:
        _drop_first(peers.ports[0], lambda m: m.step == 0, times=2)  # the slice, then its resend at QoS 1
        vectors = [torch.ones(10), torch.ones(10)]
        results = peers.run(lambda r, send, recv: ring_all_reduce(vectors[r], r, even_bounds(10, 2), send, recv),
                            scope=6, qos=0, deadline_s=0.3)
        assert isinstance(results[1], ExchangeTimeout) and "asked again once" in str(results[1])
        # Rank 0 waits for rank 1's all-gather slice, which rank 1 never sends once it failed.
        assert isinstance(results[0], (ExchangeTimeout, ExchangeFailed))
        with pytest.raises(ExchangeFailed):  # the scope is failed: any other wait of it gives up at once
            peers.exchanges[1].wait(_another_key(6), timeout_s=5)
    finally:
        peers.close()


def _another_key(scope: int) -> Any:
    """A key of ``scope`` that no ring of the tests waits for."""
    from edgeswarm.runtime.collective_exchange import CollectiveKey

    return CollectiveKey(scope, 9, 0, 0)
