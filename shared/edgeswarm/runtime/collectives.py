"""Ring collectives among N peers over any transport: ReduceScatter, AllGather and AllReduce (SUM); and the
direct (one-step) AllReduce and AllGather for small tensors.

Pure: torch only, no I/O. The transport is two callables, ``send(to_rank, step, tensor)`` (returns at once; it owns
``tensor``, which is never modified after) and ``recv(from_rank, step) -> tensor`` (blocks, with its own timeout,
and raises when it gives up). ``edgeswarm.runtime.collective_exchange`` binds them to a ``TensorExchange``; a test
binds them to in-memory queues.

Slices. A flat vector of ``length`` elements is cut into N contiguous slices, ``bounds[j] = (start, end)`` owned
by rank j (``even_bounds``, or any other cut); slices may differ in size and a rank may own zero elements.

Ring. Rank r sends only to its right neighbour r + 1 and receives only from its left neighbour r - 1 (mod N).

* ReduceScatter: at step s (0 .. N-2) rank r sends slice r - s - 1 and adds the slice r - s - 2 arriving from its
  left into its own copy. Slice j starts at rank j + 1 and travels the ring once, so rank j ends holding slice j
  summed over every rank, accumulated in the order x[j+1], x[j+2], ..., x[j] (each rank adds its own value to
  the running sum: ``own + received``).
* AllGather: at step s (0 .. N-2) rank r sends slice r - s (its own at step 0) and copies slice r - s - 1 from its
  left. Every slice is copied, never recomputed, so every rank ends with bit-identical values.
* AllReduce = AllGather after ReduceScatter; each rank sends 2 (N - 1) / N of the vector (even slices).

Steps. Every message is tagged with its step so a transport can keep steps apart: ReduceScatter uses steps
``first_step .. first_step + N - 2`` and AllGather the same (both default ``first_step`` 0); AllReduce runs
ReduceScatter on steps 0 .. N-2 and AllGather on steps N-1 .. 2N-3.

Zero-size slices are skipped on both sides: a slice both ends know (from ``bounds``) to be empty is neither sent
nor waited for, so a transport never carries an empty tensor. With N = 1 nothing is sent: ReduceScatter and
AllReduce return a copy, AllGather the part.

Direct. A ring collective costs N - 1 (AllReduce: 2 (N - 1)) sequential message hops, which for a small tensor
(one decode row, say) is all its time. ``direct_all_reduce`` and ``direct_all_gather`` take one step instead:
every rank sends its whole vector (AllGather: its slice) to every other rank at once, N - 1 messages in parallel,
all on step ``step`` (default 0; the receiver tells them apart by sender), and receives the N - 1 others. Each rank
sends N - 1 times the vector, so they pay off only where a message's fixed cost outweighs its bytes. The
AllReduce sums the N vectors in rank order 0 .. N-1 on every rank (16-bit floats accumulated in float32, then
rounded once), so every rank gets bit-identical values: replicated state stays identical across ranks.

Tiled AllGather: ``on_slice(owner_rank, start, view)`` is called for the caller's own slice first and then for
each slice as it arrives (zero-size ones too, in ring order), so each slice is seen exactly once and computation
on it can overlap the remaining steps. ``view`` is that slice of the result: read it, do not modify it.

Errors: ValueError, with the reason, for a rank outside the ring, bounds that do not cover the vector, or a
received tensor of the wrong length or dtype; the transport's own errors pass through.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Bounds = list[tuple[int, int]]
Send = Callable[[int, int, torch.Tensor], None]
Recv = Callable[[int, int], torch.Tensor]
OnSlice = Callable[[int, int, torch.Tensor], None]


def even_bounds(length: int, parts: int) -> Bounds:
    """``parts`` contiguous [start, end) ranges covering ``length`` elements, sizes differing by at most 1 (the
    first ``length % parts`` ranges are the longer ones)."""
    if parts < 1:
        raise ValueError(f"a ring needs at least one part, not {parts}")
    if length < 0:
        raise ValueError(f"a vector cannot have {length} elements")
    base, extra = divmod(length, parts)
    bounds: Bounds = []
    start = 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def check_bounds(bounds: Sequence[tuple[int, int]], length: int) -> None:
    """Raise ValueError unless ``bounds`` are contiguous [start, end) ranges covering [0, ``length``)."""
    if not bounds:
        raise ValueError("a ring needs at least one slice")
    at = 0
    for j, (start, end) in enumerate(bounds):
        if start != at or end < start:
            raise ValueError(f"slice {j} is [{start}, {end}): slices must be contiguous from 0, the next starting "
                             f"at {at}")
        at = end
    if at != length:
        raise ValueError(f"the slices cover {at} elements of a vector of {length}")


def ring_reduce_scatter(flat: torch.Tensor, rank: int, bounds: Bounds, send: Send, recv: Recv, *,
                        first_step: int = 0) -> torch.Tensor:
    """Slice ``bounds[rank]`` of the element-wise sum of every rank's ``flat`` (same length everywhere; any shape,
    read flattened), as a new 1-D tensor of ``flat``'s dtype and device. ``flat`` is not modified.

    Runs on ring steps ``first_step`` .. ``first_step + N - 2`` (N = ``len(bounds)``); see the module's docstring.
    """
    n = _check_ring(rank, bounds)
    vector = flat.detach().reshape(-1)
    check_bounds(bounds, vector.numel())
    start, end = bounds[rank]
    if n == 1:
        return vector[start:end].clone()
    out = vector.clone()
    _reduce_scatter_into(out, rank, bounds, send, recv, first_step)
    return out[start:end].clone()


def ring_all_gather(part: torch.Tensor, rank: int, bounds: Bounds, send: Send, recv: Recv, *,
                    on_slice: OnSlice | None = None, first_step: int = 0) -> torch.Tensor:
    """Every rank's ``part`` (its slice ``bounds[rank]``, any shape, read flattened) put together into one new 1-D
    tensor of ``bounds[-1][1]`` elements, of ``part``'s dtype and device. ``part`` is not modified.

    ``on_slice(owner_rank, start, view)`` is called for each slice (own first, then as they arrive). Runs on ring
    steps ``first_step`` .. ``first_step + N - 2``; see the module's docstring.
    """
    _check_ring(rank, bounds)
    out, _ = _gather_buffer(part, rank, bounds)
    _all_gather_into(out, rank, bounds, send, recv, first_step, on_slice)
    return out


def ring_all_reduce(flat: torch.Tensor, rank: int, bounds: Bounds, send: Send, recv: Recv, *,
                    on_slice: OnSlice | None = None) -> torch.Tensor:
    """The element-wise sum of every rank's ``flat`` (same length everywhere; any shape, read flattened), as a new
    1-D tensor of ``flat``'s dtype and device, bit-identical on every rank. ``flat`` is not modified.

    ReduceScatter on steps 0 .. N-2, then AllGather on steps N-1 .. 2N-3, calling ``on_slice`` as in
    ``ring_all_gather`` (for the caller's summed slice first).
    """
    n = _check_ring(rank, bounds)
    out = flat.detach().reshape(-1).clone()
    check_bounds(bounds, out.numel())
    if n > 1:
        _reduce_scatter_into(out, rank, bounds, send, recv, 0)
    _all_gather_into(out, rank, bounds, send, recv, n - 1, on_slice)
    return out


def direct_all_reduce(flat: torch.Tensor, rank: int, parts: int, send: Send, recv: Recv, *,
                      step: int = 0) -> torch.Tensor:
    """The element-wise sum of every rank's ``flat`` (same length everywhere; any shape, read flattened) among
    ``parts`` ranks, in one step: ``flat`` goes to every other rank and theirs come here, all on step ``step``.
    Summed in rank order 0 .. parts-1 (16-bit floats in float32, rounded once), so the result, a new 1-D tensor
    of ``flat``'s dtype and device, is bit-identical on every rank. ``flat`` is not modified. An empty vector, or
    one rank, sends nothing."""
    if parts < 1:
        raise ValueError("a ring needs at least one slice")
    if not 0 <= rank < parts:
        raise ValueError(f"rank {rank} is not in a ring of {parts}")
    n = parts
    vector = flat.detach().reshape(-1)
    if n == 1 or vector.numel() == 0:
        return vector.clone()
    mine = vector.clone()  # the transport owns it; every send may share it, as nothing modifies it after
    for k in range(1, n):
        send((rank + k) % n, step, mine)  # each rank starts with its right neighbour: no peer is everyone's first
    got: list[torch.Tensor] = [mine] * n
    for k in range(1, n):
        frm = (rank - k) % n
        got[frm] = _received(recv, frm, step, vector)
    wide = torch.float32 if vector.dtype in (torch.float16, torch.bfloat16) else vector.dtype
    total = got[0].to(wide, copy=True)
    for j in range(1, n):
        total.add_(got[j].to(wide))
    return total.to(vector.dtype)


def direct_all_gather(part: torch.Tensor, rank: int, bounds: Bounds, send: Send, recv: Recv, *,
                      step: int = 0) -> torch.Tensor:
    """Every rank's ``part`` (its slice ``bounds[rank]``, any shape, read flattened) put together into one new 1-D
    tensor of ``bounds[-1][1]`` elements, of ``part``'s dtype and device, in one step: the part goes to every other
    rank and theirs come here, all on step ``step``; zero-size slices are neither sent nor waited for. ``part`` is
    not modified."""
    n = _check_ring(rank, bounds)
    out, piece = _gather_buffer(part, rank, bounds)
    start, end = bounds[rank]
    if end > start:
        mine = piece.clone()
        for k in range(1, n):
            send((rank + k) % n, step, mine)
    for k in range(1, n):
        frm = (rank - k) % n
        a, b = bounds[frm]
        if b > a:
            out[a:b].copy_(_received(recv, frm, step, out[a:b]))
    return out


def _check_ring(rank: int, bounds: Sequence[tuple[int, int]]) -> int:
    n = len(bounds)
    if n < 1:
        raise ValueError("a ring needs at least one slice")
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is not in a ring of {n}")
    return n


def _gather_buffer(part: torch.Tensor, rank: int, bounds: Bounds) -> tuple[torch.Tensor, torch.Tensor]:
    """A new 1-D tensor of every slice's length holding the caller's ``part`` at its slice, and ``part`` flattened.
    Raises ValueError when the bounds do not cover a vector or ``part`` is not the size of its slice."""
    length = bounds[-1][1]
    check_bounds(bounds, length)
    piece = part.detach().reshape(-1)
    start, end = bounds[rank]
    if piece.numel() != end - start:
        raise ValueError(f"rank {rank} owns [{start}, {end}), {end - start} elements, but its part has "
                         f"{piece.numel()}")
    out = torch.empty(length, dtype=piece.dtype, device=piece.device)
    out[start:end].copy_(piece)
    return out, piece


def _received(recv: Recv, left: int, step: int, like: torch.Tensor) -> torch.Tensor:
    """The tensor of ``step`` from ``left``, checked to be ``like``'s length and dtype, flattened."""
    got = recv(left, step)
    if got.numel() != like.numel():
        raise ValueError(f"step {step}: rank {left} sent {got.numel()} values for a slice of {like.numel()}")
    if got.dtype != like.dtype:
        raise ValueError(f"step {step}: rank {left} sent {got.dtype} values for a slice of {like.dtype}")
    return got.reshape(-1)


def _reduce_scatter_into(out: torch.Tensor, rank: int, bounds: Bounds, send: Send, recv: Recv,
                         first_step: int) -> None:
    """Leave the sum of slice ``rank`` in ``out`` (the caller's own values on entry); other slices hold partial
    sums after."""
    n = len(bounds)
    right, left = (rank + 1) % n, (rank - 1) % n
    for s in range(n - 1):
        step = first_step + s
        a, b = bounds[(rank - s - 1) % n]
        if b > a:
            send(right, step, out[a:b].clone())  # the transport owns what it is given
        a, b = bounds[(rank - s - 2) % n]
        if b > a:
            mine = out[a:b]
            mine.add_(_received(recv, left, step, mine))


def _all_gather_into(out: torch.Tensor, rank: int, bounds: Bounds, send: Send, recv: Recv, first_step: int,
                     on_slice: OnSlice | None) -> None:
    """Fill every slice of ``out`` (slice ``rank`` is the caller's on entry) from the ring."""
    n = len(bounds)
    right, left = (rank + 1) % n, (rank - 1) % n
    if on_slice is not None:
        a, b = bounds[rank]
        on_slice(rank, a, out[a:b])
    for s in range(n - 1):
        step = first_step + s
        a, b = bounds[(rank - s) % n]
        if b > a:
            send(right, step, out[a:b].clone())
        owner = (rank - s - 1) % n
        a, b = bounds[owner]
        if b > a:
            out[a:b].copy_(_received(recv, left, step, out[a:b]))
        if on_slice is not None:
            on_slice(owner, a, out[a:b])
