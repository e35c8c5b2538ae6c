"""The advertised data-plane address check (edgeswarm.runtime.reachability): what other nodes cannot reach is
refused at start with one line that says what to set."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

import pytest

from edgeswarm.errors import ConfigError
from edgeswarm.runtime.reachability import check_advertised_data_url, is_bridge_address
from edgeswarm.settings import Settings
from helpers import FAST_ENV

LAN_HUB = "mqtts://192.168.1.10:8883"


def settings(hub_url: str = LAN_HUB, data_url: str | None = None, **extra: object) -> Settings:
    return Settings(node_id="jetson-1", hub_url=hub_url, data_url=data_url, **extra)  # type: ignore[arg-type]


def resolver(table: dict[str, Sequence[str]]):  # type: ignore[no-untyped-def]
    """A name resolver that knows only ``table`` (IP literals resolve to themselves)."""
    def resolve(host: str) -> Sequence[str]:
        return table.get(host, [host] if host[0].isdigit() else [])
    return resolve


NO_DNS = resolver({})


@pytest.mark.parametrize("host", ["broker", "BROKER", "node-agent", "jetson-stage-worker"])
def test_a_compose_service_name_is_refused_with_the_fix(host: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_advertised_data_url(settings(data_url=f"mqtts://{host}:8883"), container=True, resolve=NO_DNS)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("EDGESWARM_DATA_URL names mqtts://") and "only this node's compose stack resolves" \
        in message
    assert "set EDGESWARM_DATA_URL to mqtts://<this node's LAN address>:8883" in message


def test_an_unset_data_url_advertises_the_hub_url_and_is_checked_as_such() -> None:
    with pytest.raises(ConfigError, match="EDGESWARM_DATA_URL is unset, so this node advertises the hub URL"):
        check_advertised_data_url(settings(hub_url="mqtts://broker:8883"), container=False, resolve=NO_DNS)
    # A node whose services reach the hub at its LAN address and advertise nothing else: fine (tensors via the hub).
    check_advertised_data_url(settings(), container=True, resolve=NO_DNS)


@pytest.mark.parametrize("container", [False, True])
def test_a_lan_address_is_accepted(container: bool) -> None:
    check_advertised_data_url(settings(data_url="mqtts://192.168.1.22:8883"), container=container, resolve=NO_DNS)
    named = resolver({"jetson-1.local": ["192.168.1.22"]})
    check_advertised_data_url(settings(data_url="mqtts://jetson-1.local:8883"), container=container, resolve=named)


def test_loopback_is_accepted_only_when_the_hub_is_on_loopback_too() -> None:
    for hub in ("mqtt://127.0.0.1:1883", "mqtt://localhost:1883", "mqtt://[::1]:1883"):
        check_advertised_data_url(settings(hub_url=hub, data_url="mqtt://127.0.0.1:1884"), container=False)
        check_advertised_data_url(settings(hub_url=hub), container=True)  # `edgeswarm up --local`: all loopback
    for data in ("mqtts://127.0.0.1:8883", "mqtts://localhost:8883", "mqtts://[::1]:8883"):
        with pytest.raises(ConfigError, match=r"a loopback address, but the hub mqtts://192\.168\.1\.10:8883 is on "
                                              "another machine"):
            check_advertised_data_url(settings(data_url=data), container=False, resolve=NO_DNS)


def test_inside_a_container_a_name_resolving_only_to_bridge_addresses_is_refused() -> None:
    bridge = resolver({"3f2a9c1b7d4e": ["172.18.0.3"], "both": ["172.18.0.3", "192.168.1.22"]})
    with pytest.raises(ConfigError, match=r"resolves here only to Docker bridge addresses \(172\.18\.0\.3\)"):
        check_advertised_data_url(settings(data_url="mqtts://3f2a9c1b7d4e:8883"), container=True, resolve=bridge)
    with pytest.raises(ConfigError, match="Docker bridge addresses"):
        check_advertised_data_url(settings(data_url="mqtts://172.17.0.2:8883"), container=True, resolve=bridge)
    # One reachable address is enough; outside a container a 172.x address may well be a LAN's.
    check_advertised_data_url(settings(data_url="mqtts://both:8883"), container=True, resolve=bridge)
    check_advertised_data_url(settings(data_url="mqtts://172.18.0.3:8883"), container=False, resolve=bridge)
    # A name this node cannot resolve may resolve elsewhere (mDNS): let through.
    check_advertised_data_url(settings(data_url="mqtts://hub.lan:8883"), container=True, resolve=NO_DNS)


def test_docker_bridge_ranges() -> None:
    assert [is_bridge_address(a) for a in ("172.17.0.1", "172.18.0.3", "172.31.255.254")] == [True] * 3
    assert [is_bridge_address(a) for a in ("172.16.0.5", "172.32.0.1", "192.168.1.22", "10.0.0.2", "::1",
                                           "not-an-ip")] == [False] * 6


def test_a_service_refuses_an_internal_data_url_at_start_in_one_line() -> None:
    # No broker is needed: the check runs before the service connects anywhere.
    env = {**os.environ, **FAST_ENV, "EDGESWARM_NODE_ID": "jetson-1", "EDGESWARM_HUB_URL": "mqtt://127.0.0.1:9",
           "EDGESWARM_DATA_URL": "mqtt://broker:1883", "EDGESWARM_ALLOW_ANONYMOUS": "true"}
    result = subprocess.run([sys.executable, "-m", "edgeswarm", "service", "node-agent"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors and "EDGESWARM_DATA_URL names mqtt://broker:1883" in errors[0], result.stderr


def test_the_connect_url_defaults_to_the_advertised_one_and_carries_no_credentials() -> None:
    from pydantic import ValidationError

    plain = settings(data_url="mqtts://192.168.1.22:8883")
    assert plain.data_connect_plane_url == plain.data_plane_url == "mqtts://192.168.1.22:8883"
    assert settings(data_connect_url="").data_connect_plane_url == LAN_HUB, "empty means unset, down to the hub"
    inside = settings(data_url="mqtts://192.168.1.22:8883", data_connect_url="mqtts://broker:8883")
    assert (inside.data_plane_url, inside.data_connect_plane_url) == ("mqtts://192.168.1.22:8883",
                                                                      "mqtts://broker:8883")
    check_advertised_data_url(inside, container=True, resolve=NO_DNS)  # what is checked is what is advertised
    with pytest.raises(ValidationError, match="EDGESWARM_DATA_CONNECT_URL carries credentials"):
        settings(data_connect_url="mqtts://jetson-1:secret@broker:8883")
    with pytest.raises(ValidationError, match="data_connect_url"):
        settings(data_connect_url="http://broker")
