"""The profile cache: round trips, atomic writes, corrupt and mismatching files, batch-size subsets."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest

from edgeswarm.errors import ProfileRequestError
from edgeswarm.profiling.cache import FORMAT, ProfileCache, restrict
from edgeswarm.profiling.device import check_batch_sizes, compute_flops
from edgeswarm.profiling.gather import symmetric_links
from edgeswarm.values.profiles import ChainFactors, ComputeProfile, LinkProfile, ModelProfile, ModelSpec, UnitProfile

MFP = "a1" * 32
DFP = "host-x86.jetson-nano.10"


def model_profile(fingerprint: str = MFP, units: int = 3) -> ModelProfile:
    return ModelProfile(
        model=ModelSpec(name="mlp", config={"hidden": 16, "width": 0.5}), fingerprint=fingerprint,
        input_bytes_per_sample=3136,
        units=[UnitProfile(index=i, name=f"unit{i}", ops="Linear", output_bytes_per_sample=64 * (i + 1),
                           weight_bytes=1000 * i, flops_per_sample=1e6 * (i + 1)) for i in range(units)])


def compute_profile(batch_sizes: list[int] | None = None, *, device: str = DFP, method: str = "measured",
                    units: int = 3) -> ComputeProfile:
    sizes = batch_sizes or [1, 2, 4, 8]
    return ComputeProfile(
        model_fingerprint=MFP, device_fingerprint=device, batch_sizes=sizes, method=method,  # type: ignore[arg-type]
        forward_s=[[1e-4 * (u + 1) * b for b in sizes] for u in range(units)],
        backward_s=[[2e-4 * (u + 1) * b for b in sizes] for u in range(units)],
        inference_s=[[0.7e-4 * (u + 1) * b for b in sizes] for u in range(units)],
        chain=[ChainFactors(whole=(1 + b / 64, 1.1, 1.2), half=(1 + b / 128, 1.0, 1.1)) for b in sizes])


def test_round_trip_by_fingerprints(tmp_path: Path) -> None:
    cache = ProfileCache(tmp_path / "profiles")
    assert cache.model(MFP) is None and cache.compute(MFP, DFP, "measured") is None
    model, compute = model_profile(), compute_profile()
    cache.put_model(model)
    cache.put_compute(compute)
    assert cache.model(MFP) == model
    assert cache.compute(MFP, DFP, "measured") == compute
    # Keyed by both fingerprints and the method: other keys miss.
    assert cache.compute(MFP, "other-device", "measured") is None
    assert cache.compute(MFP, DFP, "calibrated") is None
    assert cache.model("b2" * 32) is None
    # A fresh cache object on the same folder (another process) sees the same files.
    again = ProfileCache(tmp_path / "profiles")
    assert again.compute(MFP, DFP, "measured") == compute
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json")) == [
        f"profiles/compute/{MFP}/{DFP}.measured.json", f"profiles/models/{MFP}.json"]


def test_a_subset_of_the_cached_grid_hits_and_a_superset_misses(tmp_path: Path) -> None:
    cache = ProfileCache(tmp_path)
    cache.put_compute(compute_profile([1, 2, 4, 8]))
    hit = cache.compute(MFP, DFP, "measured", [2, 8])
    assert hit is not None and hit.batch_sizes == [2, 8]
    assert hit.forward_s[1] == [2e-4 * 2, 2e-4 * 8] and hit.inference_s == [[0.7e-4 * (u + 1) * b for b in (2, 8)]
                                                                            for u in range(3)]
    assert cache.compute(MFP, DFP, "measured", [1, 2, 4, 8]) == compute_profile([1, 2, 4, 8])
    assert cache.compute(MFP, DFP, "measured", [1, 16]) is None
    assert restrict(compute_profile([1, 2]), [1, 2]) == compute_profile([1, 2])
    assert restrict(compute_profile([1, 2, 4, 8]), [2, 8]) == compute_profile([2, 8])  # the chain's factors too
    with pytest.raises(ValueError, match="one entry per batch size"):
        ComputeProfile.model_validate({**compute_profile([1, 2]).model_dump(),
                                       "chain": compute_profile([1]).model_dump()["chain"]})


def test_a_profile_from_before_inference_timings_is_measured_again(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Serving plans on the served forward: a cached profile without one would plan it on training's forward."""
    cache = ProfileCache(tmp_path)
    cache.put_compute(compute_profile().model_copy(update={"inference_s": None}))
    with caplog.at_level(logging.INFO, logger="edgeswarm.profiling.cache"):
        assert cache.compute(MFP, DFP, "measured") is None
    assert "predates inference timings" in caplog.text
    with pytest.raises(ValueError, match="inference_s"):  # the served forward has the shape of the others
        ComputeProfile.model_validate({**compute_profile().model_dump(), "inference_s": [[1.0]]})


def test_a_file_of_an_older_format_is_measured_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Format 1 profiles timed each unit alone, not scaled to the units in a row, and format 2 ones timed forwards
    back to back, without the cold calls, format 3 ones timed the cold calls apart from the hot ones, format 4
    ones timed the units in a row back to back at the end of each batch size's pass, and format 5 ones did not time
    the model's halves in a row: a miss, said so, not corrupt."""
    cache = ProfileCache(tmp_path)
    cache.put_compute(compute_profile())
    path = cache.compute_path(MFP, DFP, "measured")
    doc = json.loads(path.read_text())
    assert doc["format"] == 6 and cache.compute(MFP, DFP, "measured") is not None
    for older in (1, 2, 3, 4, 5):
        path.write_text(json.dumps({**doc, "format": older}))
        with caplog.at_level(logging.INFO):
            assert cache.compute(MFP, DFP, "measured") is None
        assert "from an older edgeswarm" in caplog.text and "corrupt" not in caplog.text


@pytest.mark.parametrize("content", [
    "{not json",
    "",
    json.dumps({"format": 99, "kind": "compute", "profile": {}}),
    json.dumps({"format": FORMAT, "kind": "model", "profile": {}}),
    json.dumps({"format": FORMAT, "kind": "compute", "profile": {"model_fingerprint": MFP}}),
    json.dumps([1, 2, 3]),
])
def test_a_corrupt_file_is_ignored_with_a_warning_and_overwritten(tmp_path: Path, content: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    cache = ProfileCache(tmp_path)
    path = cache.compute_path(MFP, DFP, "measured")
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with caplog.at_level(logging.WARNING):
        assert cache.compute(MFP, DFP, "measured") is None
    assert "ignoring corrupt cached profile" in caplog.text and str(path) in caplog.text
    cache.put_compute(compute_profile())
    assert cache.compute(MFP, DFP, "measured") == compute_profile()


def test_a_file_holding_another_key_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = ProfileCache(tmp_path)
    cache.put_compute(compute_profile(device="another-device"))
    os.replace(cache.compute_path(MFP, "another-device", "measured"), _mkdirs(cache.compute_path(MFP, DFP, "measured")))
    cache.put_model(model_profile("c3" * 32))
    os.replace(cache.model_path("c3" * 32), cache.model_path(MFP))
    with caplog.at_level(logging.WARNING):
        assert cache.compute(MFP, DFP, "measured") is None
        assert cache.model(MFP) is None
    assert caplog.text.count("ignoring cached profile") == 2


def _mkdirs(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_writes_are_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ProfileCache(tmp_path)
    cache.put_compute(compute_profile([1, 2]))
    before = cache.compute_path(MFP, DFP, "measured").read_bytes()

    def broken_fsync(fd: int) -> None:  # the new file's bytes never reach the disk
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        cache.put_compute(compute_profile([1, 2, 4]))
    monkeypatch.undo()
    # The old file is intact and no temporary file is left behind.
    assert cache.compute_path(MFP, DFP, "measured").read_bytes() == before
    assert [p.name for p in cache.compute_path(MFP, DFP, "measured").parent.iterdir()] == [f"{DFP}.measured.json"]

    # Concurrent writers and readers: a reader only ever sees a whole profile.
    grids = [[1, 2], [1, 2, 4], [1, 2, 4, 8], [1, 4, 16]]
    stop = threading.Event()
    seen: list[ComputeProfile | None] = []

    def writer(grid: list[int]) -> None:
        for _ in range(25):
            cache.put_compute(compute_profile(grid))

    def reader() -> None:
        while not stop.is_set():
            seen.append(cache.compute(MFP, DFP, "measured"))

    threads = [threading.Thread(target=writer, args=(g,)) for g in grids]
    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    stop.set()
    r.join(30)
    assert seen and all(p is not None and p.batch_sizes in grids for p in seen)
    assert cache.compute(MFP, DFP, "measured").batch_sizes in grids  # type: ignore[union-attr]


def test_unsafe_fingerprints_are_refused(tmp_path: Path) -> None:
    cache = ProfileCache(tmp_path)
    for bad in ("../escape", "a/b", "", ".."):
        with pytest.raises(ValueError, match="not a safe file name"):
            cache.model_path(bad)
    with pytest.raises(ValueError, match="method"):
        cache.compute_path(MFP, DFP, "guessed")


def test_batch_size_checks_and_compute_flops() -> None:
    assert check_batch_sizes([1, 8, 32]) == [1, 8, 32]
    for bad in ([], [8, 1], [1, 1], [0, 2], [1, 5000], list(range(1, 70))):
        with pytest.raises(ProfileRequestError):
            check_batch_sizes(bad)
    model, compute = model_profile(), compute_profile([1, 8])
    # 3 x (1 + 2 + 3) MFLOPs x 8 samples over (1+2+3) x (1e-4 + 2e-4) x 8 seconds.
    assert compute_flops(model, compute) == pytest.approx(3 * 6e6 * 8 / (6 * 3e-4 * 8))


def test_symmetric_links_take_the_slower_bandwidth_and_the_quieter_round_trip() -> None:
    links = symmetric_links([
        LinkProfile(src="a", dst="b", bandwidth_bps=10e6, latency_s=0.001),
        LinkProfile(src="b", dst="a", bandwidth_bps=12e6, latency_s=0.003),
        LinkProfile(src="a", dst="c", bandwidth_bps=5e6, latency_s=0.002),
        LinkProfile(src="c", dst="c", bandwidth_bps=1e9, latency_s=0.0),
    ])
    assert [(link.src, link.dst, link.bandwidth_bps, link.latency_s) for link in links] == [
        ("a", "b", 10e6, 0.001), ("a", "c", 5e6, 0.002), ("b", "a", 10e6, 0.001), ("c", "a", 5e6, 0.002)]
