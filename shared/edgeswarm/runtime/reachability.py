"""Whether the data-plane address a node advertises is one the other nodes can reach.

Peers publish tensors for a node to the broker URL in its status, literally. A name only the node's own compose
stack resolves (``broker``), a container's bridge address, or a loopback address in a cluster whose hub is
elsewhere would make every tensor for the node fail on the sender's side, far from the mistake; a service checks
its own address when it starts instead.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from edgeswarm.errors import ConfigError
from edgeswarm.settings import Settings, is_loopback, parse_broker_url

log = logging.getLogger(__name__)

# compose.yaml names its containers after the services of the registry, the device role's once more with this prefix
# for the Jetson image, beside the broker every node runs. tests/test_deploy.py keeps this in step with compose.yaml.
COMPOSE_BROKER = "broker"
JETSON_PREFIX = "jetson-"


@lru_cache(maxsize=1)
def compose_service_names() -> frozenset[str]:
    """The service names of compose.yaml (and of a plug-in's compose file beside it): on a compose network each
    resolves to a container of this node's stack only. Read from the metadata alone, so a broken plug-in stops only
    the command that uses it, not every service's start."""
    from edgeswarm.service_registry import BUILT_IN, service_names

    jetson = (JETSON_PREFIX + name for name, entry in BUILT_IN.items() if entry.runs_on("device"))
    return frozenset({COMPOSE_BROKER, *service_names(), *jetson})


def __getattr__(name: str) -> Any:
    # COMPOSE_SERVICE_NAMES, read as before the names came from the service registry.
    if name == "COMPOSE_SERVICE_NAMES":
        return compose_service_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Docker's default bridge (172.17.0.0/16) and the default pool its user-defined networks, compose's included, take
# their subnets from (172.18.0.0/16 to 172.31.0.0/16). 192.168.0.0/16 is in that pool too, but it is also the most
# common LAN range, so an address there is never taken for a container's.
DOCKER_BRIDGE_NETWORKS = tuple(ipaddress.ip_network(f"172.{n}.0.0/16") for n in range(17, 32))

_DOCKERENV = Path("/.dockerenv")

Resolver = Callable[[str], Sequence[str]]


def in_container() -> bool:
    """Whether this process runs in a container: Docker creates ``/.dockerenv`` in every one, Podman sets
    ``container`` in the environment."""
    return _DOCKERENV.exists() or bool(os.environ.get("container"))


def resolve_host(host: str) -> list[str]:
    """Every address ``host`` resolves to here; an empty list when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return sorted({str(info[4][0]) for info in infos})


def is_bridge_address(address: str) -> bool:
    """Whether ``address`` lies in one of Docker's default bridge networks."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in DOCKER_BRIDGE_NETWORKS)


def check_advertised_data_url(settings: Settings, *, container: bool | None = None,
                              resolve: Resolver = resolve_host) -> None:
    """Raise ConfigError (one line, with the fix) unless the data-plane URL this node advertises can be reached
    from other nodes.

    Refused: a compose service name (``broker``); a loopback address while the hub is not on loopback (on one
    machine, hub and data plane both on loopback, it is fine); and, inside a container (``container``; default:
    detected), a host that resolves only to Docker bridge addresses. A name that does not resolve here is let
    through: other nodes may resolve it differently (mDNS, their own hosts files).
    """
    advertised = parse_broker_url(settings.data_plane_url)
    host = advertised.host.lower().rstrip(".")
    what = ("EDGESWARM_DATA_URL" if settings.data_url else
            "EDGESWARM_DATA_URL is unset, so this node advertises the hub URL; it")
    fix = (f"set EDGESWARM_DATA_URL to {'mqtts' if advertised.tls else 'mqtt'}://<this node's LAN address>:"
           f"{advertised.port} (the address other nodes reach this node's broker at; deploy/README.md)")
    if host in compose_service_names():
        raise ConfigError(f"{what} names {advertised.url}, a name only this node's compose stack resolves, so other "
                          f"nodes cannot send it tensors: {fix}; this node's services reach their own broker through "
                          "EDGESWARM_DATA_CONNECT_URL")
    hub = parse_broker_url(settings.hub_url)
    if is_loopback(host):
        if is_loopback(hub.host):
            return
        raise ConfigError(f"{what} names {advertised.url}, a loopback address, but the hub {hub.url} is on another "
                          f"machine, whose nodes would send this node's tensors to themselves: {fix}")
    if not (in_container() if container is None else container):
        return
    addresses = resolve(host)
    if addresses and all(is_bridge_address(a) for a in addresses):
        raise ConfigError(f"{what} names {advertised.url}, which resolves here only to Docker bridge addresses "
                          f"({', '.join(addresses)}) that other machines cannot reach: {fix}")
    if not addresses:
        log.warning("the advertised data-plane host %s does not resolve on this node; other nodes must resolve it "
                    "(or set EDGESWARM_DATA_URL to an IP address)", advertised.host)

