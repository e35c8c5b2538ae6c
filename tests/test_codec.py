"""The wire codec: frames, tensors in every dtype and shape, chunking and reassembly, bad input."""

from __future__ import annotations

import random
import struct
import zlib

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import edgeswarm.messages as m
from edgeswarm.errors import (
    ChecksumError,
    ExpiredMessageError,
    InvalidMessageError,
    MalformedFrameError,
    ReassemblyError,
    TensorHeaderError,
    TensorTooLargeError,
    UnknownSchemaError,
    UnsupportedDtypeError,
    UnsupportedSchemaVersionError,
)
from edgeswarm.wire import DTYPES, Reassembler, Sender, decode, encode, tensor_frames, to_wire_array
from edgeswarm.wire.codec import MAX_HEADER_BYTES, PREFIX

SENDER = Sender(node="n1", service="svc", instance="inst1")
BODY = m.BenchData(run_id="r", seq=1)
NUMPY_DTYPES = ["float32", "float16", "int64", "int32", "uint8", "bool"]


def frames_of(value: object, chunk: int) -> list[bytes]:
    return list(tensor_frames(SENDER.envelope(BODY), BODY, value, chunk))


def reassemble(frames: list[bytes], rng: random.Random | None = None) -> object:
    """Feed frames (shuffled and with duplicates when rng is given) and return the completed tensor."""
    order = list(frames)
    if rng is not None:
        order += rng.sample(frames, k=min(3, len(frames)))
        rng.shuffle(order)
    reasm = Reassembler(max_pending_bytes=1 << 30, timeout_s=60)
    done = [t for t in (reasm.add(decode(f)) for f in order) if t is not None]
    assert len(done) == 1, "exactly one completed tensor, duplicates ignored"
    assert reasm.pending_bytes == 0 and reasm.pending_transfers == 0
    return done[0]


def random_array(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.startswith("float"):
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-100 if dtype.startswith("int") else 0, 100, shape).astype(dtype)


shapes = st.lists(st.integers(0, 7), min_size=0, max_size=4).map(tuple)


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(NUMPY_DTYPES), shape=shapes, chunk=st.integers(1, 300), seed=st.integers(0, 2**16),
       transpose=st.booleans())
def test_numpy_round_trip_any_shape_and_chunk(dtype: str, shape: tuple[int, ...], chunk: int, seed: int,
                                              transpose: bool) -> None:
    arr = random_array(dtype, shape, seed)
    if transpose and arr.ndim >= 2:
        arr = arr.T  # non-contiguous input
    out = reassemble(frames_of(arr, chunk), random.Random(seed))
    assert out.dtype == dtype
    assert out.array.shape == arr.shape
    assert np.array_equal(out.array, arr)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(["float32", "float16", "bfloat16", "int64", "int32", "uint8", "bool"]),
       shape=shapes, chunk=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_torch_round_trip_including_bfloat16(dtype: str, shape: tuple[int, ...], chunk: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen).to(getattr(torch, dtype)) if dtype != "bool" else \
        torch.randint(0, 2, shape, generator=gen).bool()
    out = reassemble(frames_of(t, chunk), random.Random(seed)).to_torch()
    assert out.dtype == t.dtype and tuple(out.shape) == tuple(t.shape)
    assert torch.equal(out, t)


def test_non_contiguous_torch_slices_travel_in_logical_order() -> None:
    t = torch.arange(60, dtype=torch.float32).reshape(6, 10)[::2, 3:7]
    assert not t.is_contiguous()
    assert torch.equal(reassemble(frames_of(t, 7)).to_torch(), t)


def test_big_endian_numpy_is_sent_little_endian() -> None:
    arr = np.arange(12, dtype=">i4").reshape(3, 4)
    out = reassemble(frames_of(arr, 1000))
    assert out.dtype == "int32" and out.array.dtype.byteorder in "<="
    assert np.array_equal(out.array, arr)


def test_single_chunk_decode_is_zero_copy_and_read_only() -> None:
    arr = np.arange(1000, dtype=np.float32)
    [frame] = frames_of(arr, 1 << 20)
    out = decode(frame).whole_tensor()
    assert np.shares_memory(out.array, np.frombuffer(frame, dtype=np.uint8))
    assert not out.array.flags.writeable
    t = out.to_torch()  # read-only storage is copied, not shared, for torch
    assert torch.equal(t, torch.from_numpy(arr))


def test_reassembled_tensor_is_writable_and_to_torch_shares_it() -> None:
    arr = np.arange(1000, dtype=np.int64)
    out = reassemble(frames_of(arr, 512))
    assert out.array.flags.writeable
    t = out.to_torch()
    t[0] = 42
    assert out.array[0] == 42


def test_every_wire_dtype_is_accepted_and_others_are_refused() -> None:
    for name in DTYPES:
        value = torch.zeros(3, dtype=getattr(torch, name)) if name == "bfloat16" else np.zeros(3, dtype=name)
        assert to_wire_array(value)[0] == name
    with pytest.raises(UnsupportedDtypeError, match="float64"):
        to_wire_array(np.zeros(3, dtype=np.float64))
    with pytest.raises(UnsupportedDtypeError):
        to_wire_array(torch.zeros(3, dtype=torch.complex64))


# --- control messages ---------------------------------------------------------------------------


def test_control_message_round_trip_and_envelope() -> None:
    body = m.BenchEcho(payload=bytes(range(256)))
    env = SENDER.envelope(body, ttl_s=5, correlation_id="c" * 8, reply_to="edgeswarm/reply/n1/svc/inst1")
    frame = decode(encode(env, body))
    assert frame.body == body and frame.envelope == env and frame.tensor is None
    assert env.expires_at is not None and abs(env.expires_at - env.sent_at - 5) < 1e-6


def test_expired_message_is_rejected() -> None:
    env = SENDER.envelope(m.Probe(), ttl_s=1)
    with pytest.raises(ExpiredMessageError):
        decode(encode(env, m.Probe()), now=env.sent_at + 2)


def _frame_with_header(header: dict[str, object], raw: bytes = b"") -> bytes:
    packed = msgpack.packb(header)
    return PREFIX.pack(b"ES", 1, 0, len(packed)) + packed + raw


def _valid_header() -> dict[str, object]:
    env = SENDER.envelope(m.Probe()).model_dump()
    return {"env": env, "body": {}, "tensor": None}


def test_unknown_schema_and_version_are_rejected_clearly() -> None:
    h = _valid_header()
    h["env"]["schema_name"] = "edgeswarm.nope"  # type: ignore[index]
    with pytest.raises(UnknownSchemaError, match="edgeswarm.nope"):
        decode(_frame_with_header(h))
    h = _valid_header()
    h["env"]["schema_version"] = 7  # type: ignore[index]
    with pytest.raises(UnsupportedSchemaVersionError, match=r"version 7 is not supported.*\[1\]"):
        decode(_frame_with_header(h))


@pytest.mark.parametrize("payload, error", [
    (b"", MalformedFrameError),
    (b"ES\x01", MalformedFrameError),
    (b"XX\x01\x00\x00\x00\x00\x00", MalformedFrameError),
    (b"ES\x02\x00\x00\x00\x00\x00", MalformedFrameError),
    (b"ES\x01\x00\xff\xff\x00\x00{}", MalformedFrameError),  # header length beyond the payload
    (PREFIX.pack(b"ES", 1, 0, 3) + b"\xc1\xc1\xc1", MalformedFrameError),  # not msgpack
    (PREFIX.pack(b"ES", 1, 0, 1) + b"\x90", MalformedFrameError),  # an array, not a map
])
def test_malformed_frames_are_rejected(payload: bytes, error: type[Exception]) -> None:
    with pytest.raises(error):
        decode(payload)


def test_invalid_envelope_and_body_are_rejected() -> None:
    h = _valid_header()
    del h["env"]["sender_node"]  # type: ignore[attr-defined]
    with pytest.raises(InvalidMessageError, match="sender_node"):
        decode(_frame_with_header(h))
    h = _valid_header()
    h["env"]["sender_node"] = "a/b"  # type: ignore[index]
    with pytest.raises(InvalidMessageError):
        decode(_frame_with_header(h))
    h = _valid_header()
    h["body"] = {"unexpected": 1}
    with pytest.raises(InvalidMessageError, match="unexpected"):
        decode(_frame_with_header(h))


def _tensor_header(**desc: object) -> dict[str, object]:
    env = SENDER.envelope(BODY).model_dump()
    base = {"dtype": "float32", "shape": [2, 3], "nbytes": 24, "chunk_size": 1024, "chunk": 0, "n_chunks": 1,
            "crc32": zlib.crc32(bytes(24))}
    base.update(desc)
    return {"env": env, "body": BODY.model_dump(), "tensor": base}


@pytest.mark.parametrize("desc, raw, error", [
    ({"dtype": "float64"}, bytes(24), UnsupportedDtypeError),
    ({"nbytes": 48}, bytes(24), TensorHeaderError),  # nbytes lies about the shape
    ({"shape": [2, 4]}, bytes(24), TensorHeaderError),  # shape lies about nbytes
    ({"shape": [-2, -3]}, bytes(24), TensorHeaderError),
    ({}, bytes(20), TensorHeaderError),  # truncated body
    ({"n_chunks": 2}, bytes(24), TensorHeaderError),
    ({"chunk": 3, "n_chunks": 1}, bytes(24), TensorHeaderError),
    ({"crc32": 12345}, bytes(24), ChecksumError),
    ({"shape": [1 << 20, 1 << 20], "nbytes": 4 << 40, "chunk_size": 1 << 20, "n_chunks": 4 << 20, "chunk": 0},
     bytes(1 << 20), TensorTooLargeError),
    # Issue 13, finding 1: no bytes, but no view either (numpy cannot shape an array of 2**62 columns).
    ({"shape": [0, 2**62], "nbytes": 0, "crc32": zlib.crc32(b"")}, b"", TensorTooLargeError),
    ({"shape": [0] + [2**20] * 3, "nbytes": 0, "crc32": zlib.crc32(b"")}, b"", TensorTooLargeError),
    ({"shape": [1] * 33, "nbytes": 4, "crc32": zlib.crc32(bytes(4))}, bytes(4), TensorHeaderError),  # rank > 32
])
def test_lying_tensor_headers_are_rejected_before_allocation(desc: dict[str, object], raw: bytes,
                                                             error: type[Exception]) -> None:
    with pytest.raises(error):
        decode(_frame_with_header(_tensor_header(**desc), raw), max_tensor_bytes=1 << 30)


def test_empty_tensors_of_any_reasonable_shape_still_decode() -> None:
    for shape in [(0,), (0, 5), (3, 0, 7), (0, 1 << 20)]:
        (frame,) = frames_of(np.zeros(shape, dtype=np.float32), 1 << 20)
        assert decode(frame).whole_tensor().shape == shape


def test_trailing_bytes_without_a_tensor_are_rejected() -> None:
    with pytest.raises(MalformedFrameError, match="trailing"):
        decode(_frame_with_header(_valid_header(), b"junk"))


def test_flipped_bit_in_a_chunk_fails_its_checksum() -> None:
    frame = bytearray(frames_of(np.arange(100, dtype=np.int32), 1 << 20)[0])
    frame[-5] ^= 0x10
    with pytest.raises(ChecksumError):
        decode(bytes(frame))


# --- reassembly ---------------------------------------------------------------------------------


def test_incomplete_transfers_time_out_and_are_freed() -> None:
    now = [0.0]
    reasm = Reassembler(max_pending_bytes=1 << 20, timeout_s=5, clock=lambda: now[0])
    frames = frames_of(np.arange(1000, dtype=np.float32), 1000)
    for f in frames[:-1]:
        assert reasm.add(decode(f)) is None
    assert reasm.pending_bytes == 4000 and reasm.pending_transfers == 1
    now[0] = 10.0
    assert reasm.sweep() == 1
    assert reasm.pending_bytes == 0 and reasm.expired_transfers == 1
    assert reasm.add(decode(frames[-1])) is None, "a late chunk of a freed transfer does not restart it"


def test_a_tensor_of_several_chunks_says_how_its_chunks_after_the_first_arrived() -> None:
    """Bytes after the first chunk over the time they took on the receiver's clock: the path's rate, which the
    closed loop fits a link from; a tensor of one chunk says nothing of it."""
    now = [100.0]
    reasm = Reassembler(max_pending_bytes=1 << 20, timeout_s=5, clock=lambda: now[0])
    frames = frames_of(np.arange(2500, dtype=np.float32), 4000)  # 10,000 bytes: chunks of 4000, 4000 and 2000
    for f in frames:
        done = reasm.add(decode(f))
        now[0] += 0.5
    assert done is not None and done.arrival is not None
    assert (done.arrival.nbytes, done.arrival.chunks, done.arrival.seconds) == (6000, 2, pytest.approx(1.0))
    whole = Reassembler().add(decode(frames_of(np.arange(10, dtype=np.float32), 4000)[0]))
    assert whole is not None and whole.arrival is None


def _lying_first_chunk(sender: Sender, nbytes: int, chunk_size: int, chunk: bytes = b"x") -> bytes:
    """The first chunk frame of a transfer whose header claims ``nbytes`` bytes in chunks of ``chunk_size``."""
    from edgeswarm.wire.tensor import TensorDescriptor

    desc = TensorDescriptor(dtype="uint8", shape=(nbytes,), nbytes=nbytes, chunk_size=chunk_size, chunk=0,
                            n_chunks=-(-nbytes // chunk_size), crc32=zlib.crc32(chunk[:chunk_size]))
    return encode(sender.envelope(BODY), BODY, desc, chunk[:chunk_size])


def test_a_header_alone_reserves_nothing() -> None:
    # Issue 13, finding 2: two 1-byte frames declaring 2 GiB each used to reserve 4 GiB for 30 s.
    reasm = Reassembler(max_pending_bytes=4 << 30, timeout_s=30)
    for _ in range(2):
        assert reasm.add(decode(_lying_first_chunk(SENDER, 2**31, 1))) is None
    assert reasm.pending_transfers == 2
    assert reasm.pending_bytes < 4096, "held: what arrived (two small frames), not what the headers claim"
    # A genuine 4 MB transfer still completes beside them.
    value = np.arange(1_000_000, dtype=np.float32)
    done = [t for t in (reasm.add(decode(f)) for f in frames_of(value, 1 << 20)) if t is not None]
    assert len(done) == 1 and np.array_equal(done[0].array, value)


def test_the_buffer_is_allocated_once_half_the_tensor_arrived() -> None:
    reasm = Reassembler(max_pending_bytes=1 << 30, timeout_s=30)
    frames = frames_of(np.arange(8000, dtype=np.uint8), 1000)  # 8 chunks
    for f in frames[:3]:
        reasm.add(decode(f))
    assert 3000 <= reasm.pending_bytes < 8000, "three chunks held as they came"
    reasm.add(decode(frames[3]))
    assert reasm.pending_bytes == 8000, "half in: the whole buffer, and nothing more"
    done = [t for t in (reasm.add(decode(f)) for f in frames[4:]) if t is not None]
    assert np.array_equal(done[0].array, np.arange(8000, dtype=np.uint8)) and reasm.pending_bytes == 0


def test_reassembly_memory_limit_drops_the_transfer_that_would_exceed_it() -> None:
    reasm = Reassembler(max_pending_bytes=6000, timeout_s=5)
    first = frames_of(np.zeros(1000, dtype=np.float32), 1000)  # 4000 bytes once allocated
    second = frames_of(np.ones(1000, dtype=np.float32), 1000)
    for f in first[:2]:
        assert reasm.add(decode(f)) is None
    assert reasm.pending_bytes == 4000
    assert reasm.add(decode(second[0])) is None  # its first chunk fits
    with pytest.raises(ReassemblyError, match="memory limit"):
        reasm.add(decode(second[1]))  # its buffer would not
    assert reasm.pending_bytes == 4000 and reasm.pending_transfers == 1
    done = [t for t in (reasm.add(decode(f)) for f in first[2:]) if t is not None]
    assert len(done) == 1 and reasm.pending_bytes == 0


def test_one_sender_cannot_starve_another() -> None:
    other = Sender(node="n2", service="svc", instance="inst2")
    now = [0.0]
    reasm = Reassembler(max_pending_bytes=1 << 20, max_sender_bytes=20_000, max_sender_transfers=5, timeout_s=5,
                        clock=lambda: now[0])
    for _ in range(5):
        reasm.add(decode(_lying_first_chunk(SENDER, 1 << 19, 2048, bytes(2048))))
    with pytest.raises(ReassemblyError, match="5 incomplete tensor transfers"):
        reasm.add(decode(_lying_first_chunk(SENDER, 1 << 19, 2048, bytes(2048))))
    now[0] = 10.0
    assert reasm.sweep() == 5 and reasm.sender_bytes("n1") == 0
    for _ in range(4):
        reasm.add(decode(_lying_first_chunk(SENDER, 1 << 19, 2048, bytes(2048))))
    big = list(tensor_frames(SENDER.envelope(BODY), BODY, np.zeros(40_000, np.uint8), 10_000))
    with pytest.raises(ReassemblyError, match="per sender"):
        for f in big[:2]:
            reasm.add(decode(f))
    value = np.arange(4000, dtype=np.int32)  # n2's 16 kB transfer is not held up by n1
    done = [t for t in (reasm.add(decode(f)) for f in tensor_frames(other.envelope(BODY), BODY, value, 4000))
            if t is not None]
    assert len(done) == 1 and np.array_equal(done[0].array, value)
    assert reasm.sender_bytes("n2") == 0 and 0 < reasm.sender_bytes("n1") <= 20_000


def test_chunks_that_disagree_drop_the_transfer() -> None:
    reasm = Reassembler(max_pending_bytes=1 << 20, timeout_s=5)
    env = SENDER.envelope(BODY)
    a = list(tensor_frames(env, BODY, np.zeros(100, dtype=np.float32), 100))
    b = list(tensor_frames(env, BODY, np.zeros(50, dtype=np.float32), 100))  # same msg id, other shape
    reasm.add(decode(a[0]))
    with pytest.raises(ReassemblyError, match="disagrees"):
        reasm.add(decode(b[1]))
    assert reasm.pending_bytes == 0


def test_header_size_is_bounded() -> None:
    too_big = MAX_HEADER_BYTES + 1
    with pytest.raises(MalformedFrameError, match="does not fit"):
        decode(PREFIX.pack(b"ES", 1, 0, too_big) + bytes(too_big))
    assert struct.calcsize("<2sBBI") == 8


def test_an_integer_past_64_bits_is_refused_with_what_to_do() -> None:
    # msgpack carries -2**63 .. 2**64 - 1; a larger int escaped encode as a bare OverflowError.
    body = m.Heartbeat(node="n1", service="svc", instance="inst1", seq=2 ** 64, interval_s=1.0, uptime_s=0.0,
                       free_memory_bytes=0, inbox_depth=0)
    with pytest.raises(InvalidMessageError, match=r"edgeswarm.heartbeat message holds an integer outside .*str type"):
        encode(SENDER.envelope(body), body)
    edge = body.model_copy(update={"seq": 2 ** 64 - 1})
    assert decode(encode(SENDER.envelope(edge), edge)).body.seq == 2 ** 64 - 1  # type: ignore[attr-defined]
