"""The checkpoint store: the on-disk core, the upload tracker, and the service over a real Mosquitto.

Core: bit-exact round trips of every wire dtype (bfloat16, float16, empty and 0-d tensors included) and of a
stage's weights with its optimizer state, standard safetensors files with a manifest, keep-K pruning, atomic
writes (leftover temporary files are ignored, a crash at either rename leaves the previous version readable), a
flipped byte found by the checksum, truncated, oversized and old-format files refused, unsafe names refused.
Service: save and load a few MB of model state through the client, latest and specific versions, a restart of
the service on the same folder, a corrupted file answered with a checksum failure while the service lives on,
unknown jobs, and malformed or incomplete uploads.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import edgeswarm.messages as m
from edgeswarm import topics
from edgeswarm.bus import Bus
from edgeswarm.checkpoints import CheckpointStore, as_torch, read_checkpoint
from edgeswarm.checkpoints import store as store_module
from edgeswarm.checkpoints.client import list_checkpoints, load_checkpoint, save_checkpoint
from edgeswarm.checkpoints.uploads import FailedUpload, ReadyUpload, UploadTracker, meta_nbytes
from edgeswarm.errors import (
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointTooLargeError,
    CheckpointTransferError,
    CheckpointValueError,
    CheckpointVersionError,
)
from edgeswarm.local.broker import BrokerProcess
from edgeswarm.local.forkserver import ForkedProcess
from edgeswarm.state.units import checkpoint_tensors
from edgeswarm.wire import WireTensor, encode
from helpers import announce, wait_until

MIB = 1024 * 1024
STORE_NODE = "hub"
STORE = "checkpoint-store"


def model_state(seed: int) -> dict[str, Any]:
    """Tensors of every wire dtype, including empty and 0-d ones (bfloat16 as a torch tensor)."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((64, 33)).astype(np.float32)
    weights[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    gen = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": weights,
        "layer.bias": rng.standard_normal(33).astype(np.float16),
        "layer.bf16": (torch.randn(7, 5, generator=gen) * 100).to(torch.bfloat16),
        "opt.step": np.array(seed, dtype=np.int64),
        "opt.counts": rng.integers(-(2**31), 2**31 - 1, size=(3, 4), dtype=np.int32),
        "mask": rng.integers(0, 2, size=(10,)).astype(bool),
        "bytes": rng.integers(0, 256, size=(2, 3, 4), dtype=np.uint8),
        "empty": np.zeros((0,), dtype=np.float32),
        "empty3d": np.zeros((3, 0, 2), dtype=np.int64),
        "scalar": np.array(1.5, dtype=np.float32),
    }


def bits(value: Any) -> tuple[str, tuple[int, ...], bytes]:
    """(wire dtype, shape, raw little-endian bytes) of a numpy array, torch tensor or WireTensor."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bfloat16:
            return "bfloat16", tuple(value.shape), value.view(torch.int16).numpy().tobytes()
        value = value.numpy()
    if isinstance(value, WireTensor):
        return value.dtype, value.shape, value.array.tobytes()
    return value.dtype.name, value.shape, value.tobytes()


def assert_same(info: Any, arrays: dict[str, np.ndarray], expected: dict[str, Any]) -> None:
    assert list(arrays) == list(expected) == info.names  # save order kept
    for entry in info.tensors:
        got = bits(WireTensor(entry.dtype, arrays[entry.name]))
        assert got == bits(expected[entry.name]), entry.name


# --- the core ---------------------------------------------------------------------------------------


def test_put_get_is_bit_exact_for_every_dtype(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ckpt", keep=3)
    state = model_state(1)
    meta = {"round": 12, "lr": 0.05, "plan": "hpp", "final": False}
    info = store.put("job-1", 0, 12, state, meta)
    assert (info.job_id, info.stage, info.version, info.meta) == ("job-1", "0", 12, meta)
    assert info.nbytes == sum(bits(v)[2].__len__() for v in state.values())
    assert {t.name: t.dtype for t in info.tensors}["layer.bf16"] == "bfloat16"
    path = store.data_path("job-1", "0", 12)
    assert store.path("job-1", "0", 12).name == "v0000000012.json"
    assert path.name == f"v0000000012-{info.sha256[:16]}.safetensors" and info.file_bytes == path.stat().st_size

    got_info, arrays = store.get("job-1", "0", 12)
    assert got_info == info
    assert_same(got_info, arrays, state)
    assert arrays["opt.step"].shape == () and arrays["empty3d"].shape == (3, 0, 2)
    assert all(a.flags.writeable for a in arrays.values())
    # torch round trip restores bfloat16.
    as_t = as_torch(got_info, arrays)
    assert as_t["layer.bf16"].dtype == torch.bfloat16
    assert torch.equal(as_t["layer.bf16"].view(torch.int16), state["layer.bf16"].view(torch.int16))
    # A loaded bfloat16 tensor can be saved again as a WireTensor (its uint16 bits with the dtype name).
    again = {e.name: WireTensor(e.dtype, arrays[e.name]) for e in got_info.tensors}
    store.put("job-1", 0, 13, again, meta)
    assert_same(*store.get("job-1", 0), state)  # the latest is 13


def test_the_files_are_standard_safetensors_with_a_manifest(tmp_path: Path) -> None:
    """docs/checkpoints.md: the tensor file loads with plain safetensors; the manifest has its digest and meta."""
    store = CheckpointStore(tmp_path, keep=1)
    tensors = {"a": np.arange(5, dtype=np.int32), "b": np.ones((2, 2), np.float32),
               "c": torch.arange(3, dtype=torch.float32).to(torch.bfloat16)}
    info = store.put("j", "s", 3, tensors, {"step": 7, "lr": 0.1})
    data = store.data_path("j", "s", 3)
    loaded = load_file(data)
    assert list(loaded) and set(loaded) == {"a", "b", "c"}
    assert torch.equal(loaded["a"], torch.arange(5, dtype=torch.int32)) and loaded["c"].dtype == torch.bfloat16
    with safe_open(data, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "edgeswarm.job_id": "j", "edgeswarm.stage": "s",
                                "edgeswarm.version": "3"}
    manifest = json.loads(store.path("j", "s", 3).read_text())
    assert set(manifest) == {"format", "job_id", "stage", "version", "created_at", "meta", "tensors", "file",
                             "file_bytes", "sha256"}
    assert (manifest["format"], manifest["meta"], manifest["file"]) == (2, {"step": 7, "lr": 0.1}, data.name)
    assert [t["name"] for t in manifest["tensors"]] == ["a", "b", "c"]  # save order
    assert manifest["tensors"][2] == {"name": "c", "dtype": "bfloat16", "shape": [3], "nbytes": 6}
    raw = data.read_bytes()
    assert manifest["sha256"] == hashlib.sha256(raw).hexdigest() == info.sha256
    assert manifest["file_bytes"] == len(raw) == info.file_bytes


def test_an_old_format_file_is_refused_clearly(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    folder = store.stage_dir("job", 0)
    folder.mkdir(parents=True)
    old = folder / "v0000000004.ckpt"
    old.write_bytes(b"ESCKPT\x01\x00" + bytes(100))
    for call in (lambda: store.get("job", 0), lambda: store.get("job", 0, 4), lambda: read_checkpoint(old)):
        with pytest.raises(CheckpointFormatError, match=r"earlier format \(a \.ckpt file\).*Delete") as caught:
            call()
        assert str(old) in str(caught.value)
    assert store.versions("job", 0) == []
    store.put("job", 0, 5, {"w": np.zeros(2, np.float32)})  # new versions live beside it
    assert store.get("job", 0)[0].version == 5


def test_keep_prunes_to_the_newest_versions(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for version in (1, 2, 3, 4):
        store.put("job", "stage-0", version, {"w": np.full(3, version, np.float32)})
    assert store.versions("job", "stage-0") == [3, 4]
    names = sorted(p.name for p in store.stage_dir("job", "stage-0").iterdir())
    assert [n[:11] for n in names] == ["v0000000003", "v0000000003", "v0000000004", "v0000000004"]
    assert [n.rsplit(".", 1)[1] for n in names] == ["safetensors", "json"] * 2  # "-" sorts before "."
    assert store.get("job", "stage-0")[0].version == 4
    assert store.get("job", "stage-0", 3)[1]["w"].tolist() == [3, 3, 3]
    with pytest.raises(CheckpointNotFoundError, match=r"stored versions: \[3, 4\]"):
        store.get("job", "stage-0", 1)
    with pytest.raises(CheckpointVersionError, match="older than the 2 kept versions"):
        store.put("job", "stage-0", 2, {"w": np.zeros(3, np.float32)})
    store.put("job", "stage-0", 4, {"w": np.full(3, 40, np.float32)})  # replacing a version is allowed
    assert store.get("job", "stage-0")[1]["w"].tolist() == [40, 40, 40]
    store.put("job", "stage-1", 0, {})  # other stages are separate; a meta-only checkpoint is fine
    assert store.listing() == {"job": {"stage-0": [3, 4], "stage-1": [0]}}
    assert store.list_jobs() == ["job"] and store.stages("job") == ["stage-0", "stage-1"]
    with pytest.raises(CheckpointNotFoundError, match="no job 'other'"):
        store.get("other", 0)


def test_writes_are_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.put("job", 0, 1, {"w": np.arange(4, dtype=np.float32)})
    folder = store.stage_dir("job", 0)
    # What a crash in the middle of a write leaves: a temporary file, never read, removed by a sweep.
    leftover = folder / ".v0000000002.crashed.tmp"
    leftover.write_bytes(b"half a checkpoint")
    assert store.versions("job", 0) == [1]
    assert store.get("job", 0)[0].version == 1

    # A failure between writing and renaming: the previous version stays the latest, and readable.
    before = sorted(p.name for p in folder.iterdir())

    # A crash at either rename (the tensor file's, then the manifest's): the previous version stays the latest,
    # readable, and nothing of the failed write is left behind.
    real_replace = os.replace
    for crash_at in (1, 2):
        calls = []

        def crash(src: Any, dst: Any, crash_at: int = crash_at, calls: list[int] = calls) -> None:
            calls.append(1)
            if len(calls) == crash_at:
                raise OSError("simulated crash before the rename")
            real_replace(src, dst)

        monkeypatch.setattr(store_module.os, "replace", crash)
        with pytest.raises(OSError, match="simulated crash"):
            store.put("job", 0, 2, {"w": np.zeros(4, dtype=np.float32)})
        monkeypatch.undo()
        assert store.versions("job", 0) == [1]
        assert store.get("job", 0)[1]["w"].tolist() == [0, 1, 2, 3]
        assert sorted(p.name for p in folder.iterdir()) == before

    # A crash after the tensor file is in place but before its manifest (a power cut): the orphan is never read,
    # and the sweep removes it with the temporary file.
    (folder / "v0000000002-0123456789abcdef.safetensors").write_bytes(b"orphan")
    assert store.versions("job", 0) == [1]
    assert store.sweep_temp_files() == 2 and not leftover.exists()
    assert sorted(p.name for p in folder.iterdir()) == sorted(set(before) - {leftover.name})

    # Replacing a version: the new one is read, the old tensor file is gone.
    store.put("job", 0, 1, {"w": np.full(4, 9, dtype=np.float32)})
    assert store.get("job", 0)[1]["w"].tolist() == [9, 9, 9, 9]
    assert len(list(folder.glob("v0000000001-*.safetensors"))) == 1


def test_a_corrupt_byte_is_a_clear_checksum_error(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    store.put("job", 0, 1, {"w": np.arange(1000, dtype=np.float32)})
    info = store.put("job", 0, 2, {"w": np.arange(1000, dtype=np.float32) * 2})
    path = store.data_path("job", 0, 2)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # one bit of the payload
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError) as caught:
        store.get("job", 0)
    message = str(caught.value)
    actual = hashlib.sha256(bytes(raw)).hexdigest()
    assert str(path) in message and info.sha256 in message and actual in message and "corrupt" in message
    assert store.get("job", 0, 1)[1]["w"][999] == 999  # other versions are unaffected

    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw[:100]))  # truncated: refused by its size before it is read
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        read_checkpoint(store.path("job", 0, 2))
    path.write_bytes(bytes(raw) + b"x")  # grown
    with pytest.raises(CheckpointCorruptError, match="corrupt"):
        store.get("job", 0, 2)
    path.unlink()
    with pytest.raises(CheckpointCorruptError, match="tensor file .* is missing"):
        store.get("job", 0, 2)
    store.path("job", 0, 2).write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match="manifest .* not JSON"):
        store.get("job", 0, 2)
    store.path("job", 0, 2).write_bytes(store.path("job", 0, 1).read_bytes())  # another version's manifest
    with pytest.raises(CheckpointCorruptError, match="it describes version 1"):
        store.get("job", 0, 2)


def test_a_file_over_the_size_cap_is_refused_before_it_is_read(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    CheckpointStore(tmp_path, keep=1).put("job", 0, 1, {"w": np.zeros(1000, np.float32)})
    small = CheckpointStore(tmp_path, keep=1, max_bytes=100)
    monkeypatch.setattr(store_module, "HEADER_ALLOWANCE", 0)  # the cap is max_bytes plus a header allowance
    with pytest.raises(CheckpointTooLargeError, match="CHECKPOINT_MAX_BYTES"):
        small.get("job", 0)
    monkeypatch.undo()
    with pytest.raises(CheckpointTooLargeError, match="CHECKPOINT_MAX_BYTES"):
        small.put("job", 0, 2, {"w": np.zeros(1000, np.float32)})


def test_a_stage_version_with_optimizer_state_round_trips(tmp_path: Path) -> None:
    """What a stage-worker saves (weights, BatchNorm buffers, momentum buffers) comes back equal, bit for bit."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(0)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(8, 6)).square().sum().backward()
        optimizer.step()
    tensors = checkpoint_tensors(model, optimizer)
    assert any(n.startswith("opt:") for n in tensors) and "1.num_batches_tracked" in tensors
    store = CheckpointStore(tmp_path, keep=2)
    store.put("job", "stage-0", 2, tensors, {"round": 2, "lr": 0.1, "momentum": 0.9})
    info, arrays = store.get("job", "stage-0", 2)
    back = as_torch(info, arrays)
    assert list(back) == list(tensors) and info.meta == {"round": 2, "lr": 0.1, "momentum": 0.9}
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and torch.equal(back[name], value), name


@pytest.mark.parametrize("bad", ["", ".", "..", ".hidden", "../up", "a/b", "a b", "x" * 65, "ü", "a\\b"])
def test_unsafe_names_are_refused(tmp_path: Path, bad: str) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    with pytest.raises(CheckpointValueError, match="not a safe file name"):
        store.put(bad, 0, 1, {"w": np.zeros(1, np.float32)})
    with pytest.raises(CheckpointValueError, match="not a safe file name"):
        store.put("job", bad, 1, {"w": np.zeros(1, np.float32)})
    with pytest.raises(CheckpointValueError):
        store.get(bad, 0)
    with pytest.raises(CheckpointValueError):
        store.versions("job", bad)
    assert list(tmp_path.iterdir()) == []


def test_bad_values_are_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=1)
    for version in (-1, 10**10, 1.5, True):
        with pytest.raises(CheckpointValueError, match="version"):
            store.put("job", 0, version, {})  # type: ignore[arg-type]
    with pytest.raises(CheckpointValueError, match="float64"):
        store.put("job", 0, 1, {"w": np.zeros(2)})
    with pytest.raises(CheckpointValueError, match="tensor name"):
        store.put("job", 0, 1, {"": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointValueError, match="meta"):
        store.put("job", 0, 1, {}, {"nested": {"a": 1}})
    with pytest.raises(CheckpointValueError, match="keep"):
        CheckpointStore(tmp_path, keep=0)


# --- the upload tracker -----------------------------------------------------------------------------


def tensor_msg(tid: str, name: str, index: int, count: int, version: int = 1) -> m.CheckpointTensor:
    return m.CheckpointTensor(transfer_id=tid, job_id="job", stage="0", version=version, name=name, index=index,
                              count=count)


def commit_msg(tid: str, count: int, nbytes: int, version: int = 1,
               meta: dict[str, Any] | None = None) -> m.CheckpointCommit:
    return m.CheckpointCommit(transfer_id=tid, job_id="job", stage="0", version=version, count=count, nbytes=nbytes,
                              meta={"round": 1} if meta is None else meta)


def wt(n: int) -> WireTensor:
    return WireTensor("uint8", np.zeros(n, np.uint8))


def test_upload_tracker_any_order_limits_and_timeouts() -> None:
    tracker: UploadTracker[str] = UploadTracker(max_upload_bytes=100, max_pending_bytes=150, timeout_s=5.0)
    # The commit first, then the tensors out of order, one of them twice.
    assert tracker.commit(commit_msg("a", 2, 30), "token-a", now=0.0) == []
    assert tracker.tensor(tensor_msg("a", "y", 1, 2), wt(20), now=1.0) == []
    assert tracker.tensor(tensor_msg("a", "y", 1, 2), wt(20), now=1.0) == []
    [ready] = tracker.tensor(tensor_msg("a", "x", 0, 2), wt(10), now=2.0)
    assert isinstance(ready, ReadyUpload) and ready.token == "token-a"
    assert [name for name, _ in ready.tensors] == ["x", "y"] and ready.meta == {"round": 1}
    assert tracker.pending_bytes == 0 and tracker.open_uploads == 0
    assert tracker.tensor(tensor_msg("a", "x", 0, 2), wt(10), now=2.0) == []  # late duplicate: ignored

    # Too large for one upload: refused at the tensor; the commit that comes later gets the reason.
    assert tracker.tensor(tensor_msg("b", "x", 0, 2), wt(60), now=3.0) == []
    [failed] = tracker.tensor(tensor_msg("b", "y", 1, 2), wt(60), now=3.0)
    assert isinstance(failed, FailedUpload) and failed.reason == "too_large" and failed.token is None
    [failed] = tracker.commit(commit_msg("b", 2, 120), "token-b", now=3.0)
    assert (failed.reason, failed.token) == ("too_large", "token-b")

    # Over the memory for all incomplete uploads together: busy.
    assert tracker.tensor(tensor_msg("c", "x", 0, 2), wt(90), now=4.0) == []
    [failed] = tracker.tensor(tensor_msg("d", "x", 0, 2), wt(90), now=4.0)
    assert failed.reason == "busy"

    # Inconsistent uploads fail as bad requests.
    [failed] = tracker.tensor(tensor_msg("c", "z", 0, 2), wt(1), now=4.0)
    assert failed.reason == "bad_request" and "both claim index 0" in failed.detail
    [failed] = tracker.commit(commit_msg("c", 2, 91), "token-c", now=4.0)  # "c" failed just above
    assert (failed.reason, failed.token) == ("bad_request", "token-c")

    # An incomplete upload times out; its waiting commit is answered.
    assert tracker.tensor(tensor_msg("e", "x", 0, 3), wt(1), now=10.0) == []
    assert tracker.commit(commit_msg("e", 3, 3), "token-e", now=11.0) == []
    assert tracker.expire(now=15.0) == []
    [failed] = tracker.expire(now=16.5)
    assert (failed.reason, failed.token) == ("incomplete", "token-e") and "2 of 3 tensors" in failed.detail
    assert tracker.pending_bytes == 0 and tracker.open_uploads == 0


def test_upload_tracker_counts_commit_metadata_against_its_memory() -> None:
    meta = {"note": "x" * 96, "round": 3}  # 4 + 96 + 5 + 8 bytes
    assert meta_nbytes(meta) == 113
    tracker: UploadTracker[str] = UploadTracker(max_upload_bytes=1000, max_pending_bytes=300, timeout_s=5.0)
    assert tracker.commit(commit_msg("a", 1, 10, meta=meta), "token-a", now=0.0) == []
    assert tracker.commit(commit_msg("b", 1, 10, meta=meta), "token-b", now=0.0) == []
    assert tracker.pending_bytes == 226, "commits waiting for their tensors hold their meta"
    # A third commit's meta would pass the limit: refused as busy, and its answer goes to its commit.
    [failed] = tracker.commit(commit_msg("c", 1, 10, meta=meta), "token-c", now=0.0)
    assert (failed.reason, failed.token) == ("busy", "token-c") and "commit metadata" in failed.detail
    assert tracker.tensor(tensor_msg("c", "w", 0, 1), wt(10), now=0.0) == []  # the refused upload's tensor: ignored
    assert tracker.pending_bytes == 226 and tracker.open_uploads == 2
    # Completing or expiring an upload releases its meta with its tensors.
    [ready] = tracker.tensor(tensor_msg("a", "w", 0, 1), wt(10), now=1.0)
    assert isinstance(ready, ReadyUpload) and ready.meta == meta and tracker.pending_bytes == 113
    [expired] = tracker.expire(now=10.0)
    assert (expired.reason, expired.token) == ("incomplete", "token-b") and tracker.pending_bytes == 0
    # A commit that comes after its tensors and does not fit fails the whole upload, tensors released too.
    assert tracker.tensor(tensor_msg("d", "w", 0, 2), wt(250), now=11.0) == []
    [failed] = tracker.commit(commit_msg("d", 2, 260, meta=meta), "token-d", now=11.0)
    assert (failed.reason, failed.token) == ("busy", "token-d")
    assert tracker.pending_bytes == 0 and tracker.open_uploads == 0


def test_upload_tracker_caps_the_uploads_open_at_once() -> None:
    tracker: UploadTracker[str] = UploadTracker(max_upload_bytes=1000, max_pending_bytes=10_000, timeout_s=5.0,
                                                max_open_uploads=3)
    for tid in "abc":
        assert tracker.commit(commit_msg(tid, 1, 10), f"token-{tid}", now=0.0) == []
    [failed] = tracker.commit(commit_msg("d", 1, 10), "token-d", now=0.0)
    assert (failed.reason, failed.token) == ("busy", "token-d")
    assert "3 uploads open" in failed.detail and "EDGESWARM_CHECKPOINT_MAX_OPEN_UPLOADS = 3" in failed.detail
    [failed] = tracker.tensor(tensor_msg("e", "w", 0, 1), wt(10), now=0.0)  # a tensor cannot open one either
    assert (failed.reason, failed.token) == ("busy", None)
    [failed] = tracker.commit(commit_msg("e", 1, 10), "token-e", now=0.0)  # its commit gets the reason
    assert (failed.reason, failed.token) == ("busy", "token-e") and "MAX_OPEN_UPLOADS" in failed.detail
    assert tracker.open_uploads == 3
    [ready] = tracker.tensor(tensor_msg("a", "w", 0, 1), wt(10), now=1.0)
    assert isinstance(ready, ReadyUpload)
    assert tracker.commit(commit_msg("f", 1, 10), "token-f", now=1.0) == [], "a closed upload frees its place"


# --- the service over MQTT ----------------------------------------------------------------------------



def start_store(services: Any, broker: BrokerProcess, bus: Bus, directory: Path,
                **env: str) -> ForkedProcess:
    proc = services.start(STORE, STORE_NODE, broker.url, EDGESWARM_CHECKPOINT_DIR=str(directory),
                          EDGESWARM_CHECKPOINT_KEEP="2", **env)
    wait_until(lambda: proc.poll() is not None or ((s := bus.peers.get(STORE_NODE, STORE)) is not None
                                                   and s.state == "online" and s.pid == proc.pid),
               20, message="the checkpoint store to come online")
    assert proc.poll() is None, services.log_of(proc)
    return proc


def stop(proc: ForkedProcess) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0


def probe_ok(bus: Bus) -> m.ProbeReply:
    reply = bus.request(topics.request(STORE_NODE, STORE), m.Probe(), timeout_s=5).body
    assert isinstance(reply, m.ProbeReply) and reply.healthy
    return reply


@pytest.fixture
def trainer(make_bus: Callable[..., Bus]) -> Bus:
    bus = make_bus("trainer-0", "stage-worker")
    announce(bus)
    return bus


def test_service_saves_loads_survives_a_restart_and_reports_corruption(
        broker: BrokerProcess, services: Any, trainer: Bus, tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    proc = start_store(services, broker, trainer, directory)
    rng = np.random.default_rng(5)
    big = {**model_state(2), "big.weight": rng.standard_normal((768, 1024)).astype(np.float32),  # 3 MiB: 3 chunks
           "big.bf16": torch.randn(1024, 1024, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)}
    v1 = save_checkpoint(trainer, STORE_NODE, "job-a", 0, 1, big, meta={"round": 1}, timeout_s=30)
    newer = {**big, "big.weight": big["big.weight"] + 1}
    v2 = save_checkpoint(trainer, STORE_NODE, "job-a", 0, 2, newer, meta={"round": 2}, timeout_s=30)
    assert (v1.version, v2.version, v2.meta) == (1, 2, {"round": 2}) and v2.nbytes > 5 * MIB
    v2_file = directory / "job-a" / "0" / f"v0000000002-{v2.sha256[:16]}.safetensors"
    assert v2.sha256 == hashlib.sha256(v2_file.read_bytes()).hexdigest()

    info, arrays = load_checkpoint(trainer, STORE_NODE, "job-a", 0, timeout_s=30)  # the latest
    assert (info.version, info.meta, info.sha256) == (2, {"round": 2}, v2.sha256)
    assert_same(info, arrays, newer)
    info, arrays = load_checkpoint(trainer, STORE_NODE, "job-a", "0", 1, timeout_s=30)
    assert info.version == 1
    assert_same(info, arrays, big)
    assert list_checkpoints(trainer, STORE_NODE, timeout_s=10) == {"job-a": {"0": [1, 2]}}

    with pytest.raises(CheckpointNotFoundError, match="no job 'nope'"):
        load_checkpoint(trainer, STORE_NODE, "nope", 0, timeout_s=10)
    with pytest.raises(CheckpointNotFoundError, match=r"stored versions: \[1, 2\]"):
        load_checkpoint(trainer, STORE_NODE, "job-a", 0, 7, timeout_s=10)

    # A restart on the same folder: everything is still there.
    stop(proc)
    proc = start_store(services, broker, trainer, directory)
    info, arrays = load_checkpoint(trainer, STORE_NODE, "job-a", 0, timeout_s=30)
    assert info.version == 2 and info.sha256 == v2.sha256
    assert_same(info, arrays, newer)

    # A flipped byte on disk: a clear checksum failure; the service lives on and serves the other version.
    path = v2_file
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError) as caught:
        load_checkpoint(trainer, STORE_NODE, "job-a", 0, 2, timeout_s=10)
    assert str(path) in str(caught.value) and v2.sha256 in str(caught.value) and "SHA-256" in str(caught.value)
    probe_ok(trainer)
    info, arrays = load_checkpoint(trainer, STORE_NODE, "job-a", 0, 1, timeout_s=30)
    assert_same(info, arrays, big)
    assert proc.poll() is None


def test_service_refuses_bad_uploads_and_keeps_running(broker: BrokerProcess, services: Any, trainer: Bus,
                                                        tmp_path: Path) -> None:
    proc = start_store(services, broker, trainer, tmp_path / "checkpoints",
                       EDGESWARM_CHECKPOINT_MAX_BYTES=str(64 * 1024), EDGESWARM_REASSEMBLY_TIMEOUT_S="1")
    data, request = topics.data(STORE_NODE, STORE), topics.request(STORE_NODE, STORE)
    # Garbage bytes and a tensor message without its tensor, on both topics.
    as_trainer = partial(topics.from_sender, sender_node=trainer.sender.node)
    trainer.hub.publish(as_trainer(data), b"\x00garbage" * 10, qos=1)
    trainer.hub.publish(as_trainer(request), b"ES\x01\x00\xff\xff\xff\xff", qos=1)
    no_tensor = m.CheckpointTensor(transfer_id="t0", job_id="job", stage="0", version=1, name="w", index=0, count=1)
    trainer.publish(data, no_tensor)
    trainer.hub.publish(as_trainer(data), encode(trainer.sender.envelope(no_tensor), no_tensor)[:-3], qos=1)

    # An upload whose second tensor never comes: its commit is answered "incomplete" after the timeout.
    trainer.send_tensor(STORE_NODE, STORE, m.CheckpointTensor(transfer_id="t1", job_id="job", stage="0", version=1,
                                                              name="w", index=0, count=2), np.zeros(8, np.float32))
    reply = trainer.request(request, m.CheckpointCommit(transfer_id="t1", job_id="job", stage="0", version=1,
                                                        count=2, nbytes=64), timeout_s=10).body
    assert isinstance(reply, m.CheckpointFailed) and reply.reason == "incomplete", reply
    assert "1 of 2 tensors" in reply.detail

    # Over EDGESWARM_CHECKPOINT_MAX_BYTES (64 KiB here) in all, though each tensor alone is under it.
    with pytest.raises(CheckpointTooLargeError, match="CHECKPOINT_MAX_BYTES"):
        save_checkpoint(trainer, STORE_NODE, "job", 0, 1, {"a": np.zeros(40_000, np.uint8),
                                                           "b": np.zeros(40_000, np.uint8)}, timeout_s=15)

    # Still alive and serving; the bad messages were counted as rejections.
    reply = probe_ok(trainer)
    assert reply.rejected >= 2 and reply.handler_errors == 0
    state = model_state(9)
    save_checkpoint(trainer, STORE_NODE, "job", 0, 1, state, timeout_s=15)
    assert_same(*load_checkpoint(trainer, STORE_NODE, "job", 0, timeout_s=15), state)
    assert proc.poll() is None
    assert not [p for p in (tmp_path / "checkpoints").rglob("*") if p.name.endswith(".tmp")]
    assert os.listdir(tmp_path / "checkpoints") == ["job"]


def test_commits_with_large_meta_and_no_tensors_leave_the_stores_memory_bounded(
        broker: BrokerProcess, services: Any, trainer: Bus, tmp_path: Path) -> None:
    """200 commits with about 1 MB of meta each whose tensors never come (300 of them once held 380 MB): at most
    EDGESWARM_CHECKPOINT_MAX_OPEN_UPLOADS stay open, the bytes the store holds count their meta and stay under that
    many commits' worth, the others are answered busy with the cap named; the store answers probes meanwhile and
    saves and loads a genuine checkpoint once the open ones have timed out."""
    cap = 8
    proc = start_store(services, broker, trainer, tmp_path / "checkpoints",
                       EDGESWARM_CHECKPOINT_MAX_OPEN_UPLOADS=str(cap), EDGESWARM_REASSEMBLY_TIMEOUT_S="10")
    reports: list[Any] = []
    trainer.subscribe(topics.metrics(STORE_NODE, STORE), reports.append, schemas=(m.MetricsReport,))
    meta = {f"note-{i:03d}": chr(ord("a") + i % 26) * 4000 for i in range(256)}
    per_commit = meta_nbytes(meta)
    assert per_commit > 1_000_000
    request = topics.request(STORE_NODE, STORE)
    expectations = []
    for i in range(200):
        exp = trainer.expect()
        trainer.publish(request, commit_msg(f"flood-{i}", 1, 4, meta=meta), correlation_id=exp.correlation_id,
                        reply_to=trainer.reply_topic, ttl_s=120)
        expectations.append(exp)
    probe_ok(trainer)
    replies = [exp.wait(60) for exp in expectations]
    assert all(r is not None and isinstance(r.body, m.CheckpointFailed) for r in replies)
    reasons = [r.body.reason for r in replies]
    assert set(reasons) == {"busy", "incomplete"}, reasons
    assert all("EDGESWARM_CHECKPOINT_MAX_OPEN_UPLOADS = 8" in r.body.detail for r in replies if r.body.reason == "busy")

    # What the store reported holding (its tracker's count, published in its metrics) while the flood lasted.
    wait_until(lambda: reports and reports[-1].body.gauges.get("checkpoint_uploads_open", 1) == 0, 15,
               message="the open uploads released")
    held = [r.body.gauges.get("checkpoint_upload_bytes", 0) for r in reports]
    opened = [r.body.gauges.get("checkpoint_uploads_open", 0) for r in reports]
    assert max(opened) <= cap and max(held) <= cap * per_commit, (max(opened), max(held))
    assert max(held) >= per_commit, "the commits' meta was counted"
    assert reports[-1].body.gauges["checkpoint_upload_bytes"] == 0

    probe_ok(trainer)
    state = model_state(4)
    save_checkpoint(trainer, STORE_NODE, "job", 0, 1, state, meta={"round": 1}, timeout_s=15)
    assert_same(*load_checkpoint(trainer, STORE_NODE, "job", 0, timeout_s=15), state)
    assert proc.poll() is None
    busy_lines = services.log_of(proc).count("checkpoint upload failed (busy)")
    assert busy_lines <= 30 < reasons.count("busy"), f"{busy_lines} log lines for the busy answers: not rate-limited"


def test_client_errors_without_a_store(make_bus: Callable[..., Bus]) -> None:
    bus = make_bus("trainer-1", "stage-worker", request_timeout_s=1.0)
    announce(bus)
    with pytest.raises(CheckpointValueError, match="not a safe file name"):
        save_checkpoint(bus, STORE_NODE, "../job", 0, 1, {}, timeout_s=1)
    with pytest.raises(CheckpointValueError, match="float64"):
        save_checkpoint(bus, STORE_NODE, "job", 0, 1, {"w": np.zeros(3)}, timeout_s=1)
    with pytest.raises(CheckpointTransferError, match="cannot send tensor 'w'"):
        save_checkpoint(bus, STORE_NODE, "job", 0, 1, {"w": np.zeros(3, np.float32)}, timeout_s=1)
    with pytest.raises(CheckpointTimeoutError, match="did not answer within 1 s; is it running"):
        load_checkpoint(bus, STORE_NODE, "job", 0, timeout_s=1)
