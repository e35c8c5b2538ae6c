"""`edgeswarm bench collectives`, run as a real process at small sizes: every cell measured, checked arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgeswarm.bench.collectives import OPS, loopback_bytes_per_s, schedule
from edgeswarm.bus.mqtt import RawPeer
from edgeswarm.cli.bench import parse_size
from edgeswarm.cli.main import main
from edgeswarm.errors import ConfigError
from edgeswarm.local.broker import BrokerProcess
from helpers import FAST_ENV, Ring, weighted_bounds

ENV = {**os.environ, **FAST_ENV, "COLUMNS": "200"}


def edgeswarm(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "edgeswarm", *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_bench_collectives_measures_every_cell_against_paho_and_the_link(tmp_path: Path) -> None:
    out = tmp_path / "coll.json"
    result = edgeswarm("bench", "collectives", "--peers", "2,3", "--sizes", "1KB,12B", "--repeats", "2",
                       "--rate-messages", "300", "--decode-repeats", "5", "--bulk", "2MB", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    cells = [(r["op"], r["peers"], r["size_bytes"]) for r in report["rows"]]
    assert cells == [(op, n, size) for n in (2, 3) for size in (1024, 12) for op in OPS]
    for row in report["rows"]:
        # Every rank sends one frame to each other rank per step (12 bytes: 3 elements, so among 3 peers each owns
        # one): a ring's N - 1 steps to its right neighbour, the AllReduce's twice that, a direct op's one step.
        n = row["peers"]
        assert row["messages"] == (2 if row["op"] == "all_reduce" else 1) * n * (n - 1), row
        assert row["repeats"] == 2 and row["bus_s"] > 0 and row["paho_s"] > 0 and row["link_s"] > 0
    assert [(d["dtype"], d["peers"], d["hidden"], d["repeats"]) for d in report["decode"]] == [
        ("float32", 4, 2048, 5), ("bfloat16", 4, 2048, 5)]
    for d in report["decode"]:
        assert 0 < d["bus_median_s"] <= d["bus_p99_s"] and 0 < d["paho_median_s"] <= d["paho_p99_s"]
    bulk = report["bulk"]
    assert bulk["size_bytes"] == 2 << 20 and bulk["bus_s"] > 0 and bulk["paho_s"] > 0 and bulk["loopback_mb_s"] > 0
    rate = report["rate"]
    assert rate["messages"] == 300 and rate["payload_bytes"] == 1024
    assert rate["bus_per_s"] > 0 and rate["paho_per_s"] > 0
    assert report["loopback_mb_s"] > 0 and report["broker"].startswith("mosquitto")
    # Each goal is reported with what was measured, met or not (the figures here are too noisy to expect either).
    assert [g["name"].split(",")[0] for g in report["goals"]] == [
        "1 KB rate", "every collective", "decode AllReduce", "decode AllReduce", "2 MB bulk"]
    assert all(g["measured"] and isinstance(g["met"], bool) for g in report["goals"])
    assert "bus/paho" in result.stdout and "two instances" in result.stdout and "goals" in result.stdout
    assert "decode AllReduce, 4 ranks x 2048 bfloat16" in result.stdout and "bus/loopback" in result.stdout


def test_bench_collectives_runs_a_process_per_rank_beside_the_one_process_figures(tmp_path: Path) -> None:
    out = tmp_path / "coll.json"
    result = edgeswarm("bench", "collectives", "--peers", "2", "--sizes", "12B", "--ops",
                       "all_gather,direct_all_reduce", "--repeats", "2", "--rate-messages", "100",
                       "--decode-repeats", "3", "--bulk", "0", "--processes", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["processes"] and report["bulk"] is None
    for rows in (report["rows"], report["process_rows"]):
        assert [(r["op"], r["peers"]) for r in rows] == [("all_gather", 2), ("direct_all_reduce", 2)]
        assert all(r["bus_s"] > 0 and r["paho_s"] > 0 for r in rows)
    assert [(d["dtype"], d["peers"]) for d in report["process_decode"]] == [("float32", 4), ("bfloat16", 4)]
    assert sum("a process per rank" in g["name"] for g in report["goals"]) == 3
    assert "a process per rank" in result.stdout
    assert not [line for line in result.stderr.splitlines() if "Traceback" in line], result.stderr


def test_schedule_counts_what_runtime_collectives_send() -> None:
    """The bare paho baseline replays ``schedule``: it must be the traffic the runtime's collectives really send."""
    import torch

    from edgeswarm.runtime import collectives as c

    run = {"all_gather": lambda v, r, b, s, g: c.ring_all_gather(v[b[r][0]:b[r][1]], r, b, s, g),
           "reduce_scatter": c.ring_reduce_scatter, "all_reduce": c.ring_all_reduce,
           "direct_all_gather": lambda v, r, b, s, g: c.direct_all_gather(v[b[r][0]:b[r][1]], r, b, s, g),
           "direct_all_reduce": lambda v, r, b, s, g: c.direct_all_reduce(v, r, len(b), s, g)}
    for n in (2, 3, 5):
        bounds = weighted_bounds(11, [1.0, 0.0, 2.0, 1.0, 3.0][:n])  # uneven, and rank 1 owns nothing
        for op in OPS:
            ring = Ring(n, mesh=op.startswith("direct"))
            ring.run(lambda rank, send, recv: run[op](torch.ones(11), rank, bounds, send, recv))  # noqa: B023
            sent = [[(to, elements * 4) for to, elements in ring.messages[r]] for r in range(n)]
            planned = schedule(op, n, bounds)
            for rank in range(n):
                want = sorted((to, nbytes) for sends, _ in planned[rank] for to, nbytes in sends)
                assert sorted(sent[rank]) == want, (op, n, rank)
                received = sorted((frm, nbytes) for _, receives in planned[rank] for frm, nbytes in receives)
                assert received == sorted((frm, nbytes) for frm in range(n) for to, nbytes in sent[frm]
                                          if to == rank), (op, n, rank)


@pytest.mark.parametrize(("args", "complaint"), [
    (("--peers", "1,2"), "--peers"),
    (("--peers", "7"), "--peers"),
    (("--peers", "two"), "--peers"),
    (("--sizes", "3B"), "--sizes"),
    (("--sizes", "65MB"), "--sizes"),
    (("--sizes", "lots"), "--sizes"),
    (("--rate-messages", "0"), "--rate-messages"),
    (("--ops", "all_gather,broadcast"), "--ops"),
    (("--bulk", "3B"), "--bulk"),
    (("--decode-repeats", "-1"), "--decode-repeats"),
])
def test_bench_collectives_refuses_bad_arguments_before_measuring(args: tuple[str, ...], complaint: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "collectives", *args]) != 0
    err = capsys.readouterr().err
    assert complaint in err and "Traceback" not in err


def test_parse_size_reads_units() -> None:
    assert [parse_size(s) for s in ("1KB", "64kb", "1MB", "16MiB", "512B", "4096")] == [
        1024, 65536, 1 << 20, 16 << 20, 512, 4096]
    with pytest.raises(ConfigError):
        parse_size("1GB")


def test_raw_peer_publishes_and_counts_what_arrives(broker: BrokerProcess) -> None:
    a = RawPeer(broker.url, "raw-a", "raw/a")
    b = RawPeer(broker.url, "raw-b", "raw/b")
    try:
        for _ in range(100):
            a.publish("raw/b", b"x" * 1024)
        assert b.wait_received(100, 10.0)
        assert b.received == 100 and a.received == 0
    finally:
        a.close()
        b.close()


def test_loopback_rate_is_measured() -> None:
    assert loopback_bytes_per_s(total=8 << 20, block=1 << 20) > 0
