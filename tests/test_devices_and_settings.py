"""Device classes, cluster files, settings from the environment, and the packaging of the library."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from edgeswarm.devices.catalogue import CATALOGUE, MBPS, device_class, link_between
from edgeswarm.devices.cluster import CLUSTERS_DIR, cluster_of, load_cluster
from edgeswarm.devices.emulation import DeviceProfile
from edgeswarm.errors import ConfigError
from edgeswarm.settings import LinkSpec, Settings, parse_broker_url
from helpers import REPO

PAPER_ENVS = {
    "a": {"jetson-nano": 5},
    "b": {"jetson-nx": 3, "jetson-tx2": 2},
    "c": {"jetson-nx": 1, "jetson-tx2": 2, "jetson-nano": 3},
    "d": {"jetson-tx2": 1, "jetson-nano": 3},
}


@pytest.mark.parametrize("env", sorted(PAPER_ENVS))
@pytest.mark.parametrize("mbps", [100, 1000])
def test_asteroid_environments_ship_as_cluster_files(env: str, mbps: int) -> None:
    spec = load_cluster(f"asteroid-env-{env}-{mbps}mbps")
    counts: dict[str, int] = {}
    for d in spec.devices:
        counts[d.device_class] = counts.get(d.device_class, 0) + 1
    assert counts == PAPER_ENVS[env]
    first, last = spec.devices[0].id, spec.devices[-1].id
    assert spec.link(first, last) == LinkSpec(bandwidth_bps=mbps * MBPS, latency_s=0.0005)
    assert set(spec.links_from(first)) == {d.id for d in spec.devices} - {first}


def test_cluster_file_links_overrides_and_class_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "name: t\n"
        "devices:\n  - {id: a, class: jetson-nano}\n  - {id: b, class: rpi4}\n  - {id: c, class: edge-server}\n"
        "links:\n  - {between: [a, b], bandwidth_mbps: 10, latency_ms: 5}\n"
        "  - {between: [c, a], bandwidth_mbps: 50, directed: true}\n"
    )
    spec = load_cluster(str(path))
    assert spec.link("a", "b") == spec.link("b", "a") == LinkSpec(bandwidth_bps=10 * MBPS, latency_s=0.005)
    assert spec.link("c", "a").bandwidth_bps == 50 * MBPS
    assert spec.link("a", "c") == link_between(CATALOGUE["jetson-nano"], CATALOGUE["edge-server"])
    assert spec.link("a", "c").bandwidth_bps == CATALOGUE["jetson-nano"].link.bandwidth_bps


@pytest.mark.parametrize("text, message", [
    ("name: t\ndevices:\n  - {id: a, class: jetson-nano}\n  - {id: a, class: rpi4}\n", "unique"),
    ("name: t\ndevices:\n  - {id: a, class: cray-1}\n", "unknown device class"),
    ("name: t\ndevices:\n  - {id: a, class: rpi4}\nlinks:\n  - {between: [a, z], bandwidth_mbps: 1}\n",
     "unknown device"),
    ("name: t\ndevices: []\n", "devices"),
    ("name: t\ndevices:\n  - {id: 'a/b', class: rpi4}\n", "id"),
    ("name: [unclosed\n", "invalid cluster file"),
])
def test_invalid_cluster_files_say_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_cluster(str(path))


def test_unknown_cluster_name_lists_the_bundled_ones() -> None:
    with pytest.raises(ConfigError, match="asteroid-env-a-100mbps"):
        load_cluster("no-such-cluster")


def test_cluster_of_n_is_heterogeneous_unless_a_class_is_given() -> None:
    mixed = cluster_of(4)
    assert len({d.device_class for d in mixed.devices}) == 4
    same = cluster_of(3, "jetson-nano")
    assert {d.device_class for d in same.devices} == {"jetson-nano"}
    with pytest.raises(ConfigError):
        cluster_of(0)


def test_catalogue_covers_the_issue_classes_and_native() -> None:
    assert {"jetson-nano", "jetson-tx2", "jetson-nx", "rpi4", "laptop", "edge-server"} <= set(CATALOGUE)
    for c in CATALOGUE.values():
        assert c.compute_slowdown >= 1.0 and 0 < c.memory_budget_bytes < c.memory_bytes
    # Relative speeds the Asteroid spec derives: TX2 about 2.5x a Nano, NX about 2x a TX2.
    assert CATALOGUE["jetson-nano"].compute_slowdown / CATALOGUE["jetson-tx2"].compute_slowdown == pytest.approx(2.5)
    assert CATALOGUE["jetson-tx2"].compute_slowdown / CATALOGUE["jetson-nx"].compute_slowdown == pytest.approx(2.0)
    native = device_class("native")
    assert not native.emulated and native.compute_slowdown == 1.0
    with pytest.raises(ConfigError, match="known"):
        device_class("pdp-11")


def test_settings_read_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGESWARM_NODE_ID", "nano-7")
    monkeypatch.setenv("EDGESWARM_HUB_URL", "mqtt://10.0.0.1:1884")
    monkeypatch.setenv("EDGESWARM_DEVICE_CLASS", "jetson-nano")
    monkeypatch.setenv("EDGESWARM_LINKS", '{"tx2-0": {"bandwidth_bps": 12500000, "latency_s": 0.001}}')
    monkeypatch.setenv("EDGESWARM_HEARTBEAT_INTERVAL_S", "0.5")
    s = Settings()
    assert s.node_id == "nano-7" and s.data_plane_url == "mqtt://10.0.0.1:1884"
    assert s.links["tx2-0"].bandwidth_bps == 12.5e6
    assert s.heartbeat_timeout_s == pytest.approx(1.5)
    profile = DeviceProfile.from_settings(s)
    assert profile.device_class == "jetson-nano" and profile.compute_slowdown == 10.0
    assert 0 <= profile.free_memory_bytes() <= profile.memory_budget_bytes


@pytest.mark.parametrize("url", ["http://x:1", "mqtt://", "mqtt://host:notaport"])
def test_bad_broker_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        parse_broker_url(url)


def test_broker_url_defaults_the_port() -> None:
    assert parse_broker_url("mqtt://hub").url == "mqtt://hub:1883"
    assert parse_broker_url("10.1.2.3:1999").port == 1999


class FakeClocks:
    """A wall clock, a thread CPU clock and a sleep that only move when told: ``work`` spends ``cpu_s`` of CPU
    time over ``wall_s`` of wall time, ``sleep`` records what it was asked for and lets that much wall time pass."""

    def __init__(self) -> None:
        self.now = 100.0
        self.cpu_now = 7.0
        self.slept: list[float] = []

    def wall(self) -> float:
        return self.now

    def cpu(self) -> float:
        return self.cpu_now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def work(self, cpu_s: float, wall_s: float) -> str:
        self.cpu_now += cpu_s
        self.now += wall_s
        return "done"


@pytest.mark.parametrize(("slowdown", "cpu_s", "wall_s", "expected_sleep"), [
    (3.0, 0.5, 0.5, 1.0),    # alone on a core: it idles (factor - 1) x its CPU time
    (3.0, 0.5, 0.8, 0.7),    # descheduled 0.3 s by other work: the contention counts towards the slow-down
    (150.0, 0.01, 0.01, 1.49),
    (2.0, 0.5, 1.5, None),   # contention already took longer than the slow-down asks: no sleep
    (1.0, 0.5, 0.5, None),   # a native device never sleeps
])
def test_compute_slowdown_sleeps_until_the_work_took_the_factor_times_its_cpu_time(
        slowdown: float, cpu_s: float, wall_s: float, expected_sleep: float | None) -> None:
    profile = DeviceProfile(device_class="emulated", emulated=True, compute_slowdown=slowdown, memory_budget_bytes=1)
    clocks = FakeClocks()
    start = clocks.now

    result = profile.run(lambda: clocks.work(cpu_s, wall_s), wall=clocks.wall, cpu=clocks.cpu, sleep=clocks.sleep)

    assert result == "done"
    if expected_sleep is None:
        assert clocks.slept == []
        assert clocks.now - start == pytest.approx(wall_s)
    else:
        assert clocks.slept == [pytest.approx(expected_sleep)]
        # The emulated device took exactly the slowed-down CPU time, however the wall time was split.
        assert clocks.now - start == pytest.approx(slowdown * cpu_s)


def test_compute_slowdown_scales_the_calling_threads_real_cpu_time_by_default() -> None:
    """With the default CPU clock (the wall clock frozen, so that no load on the host can change the outcome), the
    sleep asked for is the slow-down times at least the CPU time the work itself measured spending."""
    slow = DeviceProfile(device_class="emulated", emulated=True, compute_slowdown=3.0, memory_budget_bytes=1)
    slept: list[float] = []
    spent: list[float] = []

    def work() -> int:
        before = time.thread_time()
        total = sum(i * i for i in range(50_000))
        spent.append(time.thread_time() - before)
        return total

    assert slow.run(work, wall=lambda: 0.0, sleep=slept.append) == sum(i * i for i in range(50_000))
    assert spent[0] > 0  # Linux's thread CPU clock counts nanoseconds
    assert len(slept) == 1 and slept[0] >= 3.0 * spent[0]


def test_every_package_folder_is_installed() -> None:
    """setup.py installs every package folder under its ``edgeswarm`` name (a new one needs no list entry)."""
    import importlib.util

    for root, prefix in (("shared/edgeswarm", "edgeswarm"), ("services", "edgeswarm.services")):
        for init in (REPO / root).rglob("__init__.py"):
            name = ".".join((prefix, *init.parent.relative_to(REPO / root).parts))
            found = importlib.util.find_spec(name)
            assert found is not None and found.origin is not None, f"{name} is not installed"
            assert Path(found.origin).resolve() == init.resolve(), f"{name} comes from {found.origin}"
    assert sorted(p.name for p in CLUSTERS_DIR.glob("*.yaml"))


def test_an_empty_data_url_means_unset_and_a_bad_one_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    monkeypatch.setenv("EDGESWARM_HUB_URL", "mqtt://hub:1883")
    monkeypatch.setenv("EDGESWARM_DATA_URL", "")
    assert Settings().data_plane_url == "mqtt://hub:1883"
    monkeypatch.setenv("EDGESWARM_DATA_URL", "http://nope")
    with pytest.raises(ValidationError, match="data_url"):
        Settings()
