"""`edgeswarm bench collectives`, run as a real process at small sizes: every cell measured, checked arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgeswarm.bench.collectives import loopback_bytes_per_s
from edgeswarm.bus.mqtt import RawPeer
from edgeswarm.cli.bench import parse_size
from edgeswarm.cli.main import main
from edgeswarm.errors import ConfigError
from edgeswarm.local.broker import BrokerProcess
from helpers import FAST_ENV

ENV = {**os.environ, **FAST_ENV, "COLUMNS": "200"}


def edgeswarm(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "edgeswarm", *args], env=ENV, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_bench_collectives_measures_every_cell_against_paho_and_the_link(tmp_path: Path) -> None:
    out = tmp_path / "coll.json"
    result = edgeswarm("bench", "collectives", "--peers", "2,3", "--sizes", "1KB,12B", "--repeats", "2",
                       "--rate-messages", "300", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    cells = [(r["op"], r["peers"], r["size_bytes"]) for r in report["rows"]]
    assert cells == [(op, n, size) for n in (2, 3) for size in (1024, 12) for op in ("all_gather", "reduce_scatter")]
    for row in report["rows"]:
        # Every rank sends N - 1 slices of one frame each (12 bytes: 3 elements, so among 3 peers each owns one).
        assert row["messages"] == row["peers"] * (row["peers"] - 1)
        assert row["repeats"] == 2 and row["bus_s"] > 0 and row["paho_s"] > 0 and row["link_s"] > 0
    rate = report["rate"]
    assert rate["messages"] == 300 and rate["payload_bytes"] == 1024
    assert rate["bus_per_s"] > 0 and rate["paho_per_s"] > 0
    assert report["loopback_mb_s"] > 0 and report["broker"].startswith("mosquitto")
    assert "bus/paho" in result.stdout and "two instances" in result.stdout


@pytest.mark.parametrize(("args", "complaint"), [
    (("--peers", "1,2"), "--peers"),
    (("--peers", "7"), "--peers"),
    (("--peers", "two"), "--peers"),
    (("--sizes", "3B"), "--sizes"),
    (("--sizes", "65MB"), "--sizes"),
    (("--sizes", "lots"), "--sizes"),
    (("--rate-messages", "0"), "--rate-messages"),
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
