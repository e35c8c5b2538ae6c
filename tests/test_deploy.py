"""The deployment files: compose.yaml, deploy/Dockerfile and deploy/mosquitto/mosquitto.conf.

No Docker engine is needed: compose.yaml is checked as data and every service it declares is run as a
plain process with the environment compose would give it; the Mosquitto config is run by a real
Mosquitto. ``docker compose config`` runs too where the compose plugin is installed.
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt
import pytest
import yaml

from edgeswarm import topics
from edgeswarm.bus import Inbound
from edgeswarm.local.broker import free_port, mosquitto_binary, port_open
from edgeswarm.local.launcher import DEVICE_SERVICES, HUB_SERVICES
from edgeswarm.messages import Status
from edgeswarm.services import SERVICES
from edgeswarm.settings import Settings, parse_broker_url
from helpers import REPO, wait_until

COMPOSE_FILE = REPO / "compose.yaml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
MOSQUITTO_CONF = REPO / "deploy" / "mosquitto" / "mosquitto.conf"
DEPLOY_README = REPO / "deploy" / "README.md"

BROKER_SERVICE = "broker"
HUB_PROFILE = "hub"
# The broker as the service containers reach it on the compose network.
COMPOSE_BROKER_HOST = "broker"


# --- compose interpolation ------------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPERATORS = (":-", "-", ":?", "?", ":+", "+")


class Interpolation:
    """One ``${NAME<op><arg>}`` (or ``$NAME``) found in a compose value; ``arg`` is still uninterpolated."""

    def __init__(self, name: str, op: str | None, arg: str | None) -> None:
        self.name, self.op, self.arg = name, op, arg

    @property
    def has_default(self) -> bool:
        return self.op in (":-", "-")


def _braced_end(text: str, start: int) -> int:
    """Index of the ``}`` closing the expression whose argument starts at ``start`` (nesting counted)."""
    depth, i = 0, start
    while i < len(text):
        if text.startswith("$$", i):
            i += 2
        elif text.startswith("${", i):
            depth += 1
            i += 2
        elif text[i] == "}":
            if depth == 0:
                return i
            depth -= 1
            i += 1
        else:
            i += 1
    raise AssertionError(f"unterminated ${{...}} in compose value {text!r}")


def interpolate(text: str, env: dict[str, str], found: list[Interpolation] | None = None) -> str:
    """``text`` with Compose's interpolation applied against ``env`` (the spec's subset compose.yaml may use).

    Every expression met, nested ones included, is appended to ``found``.
    """
    found = [] if found is None else found
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        if text[i] != "$":
            out.append(text[i])
            i += 1
            continue
        if text.startswith("${", i):
            m = _NAME.match(text, i + 2)
            assert m, f"bad interpolation in compose value {text!r}"
            name, j = m.group(), m.end()
            op = next((o for o in _OPERATORS if text.startswith(o, j)), None)
            if op is None:
                assert text[j:j + 1] == "}", f"bad interpolation in compose value {text!r}"
                arg, i = None, j + 1
            else:
                end = _braced_end(text, j + len(op))
                arg, i = text[j + len(op):end], end + 1
        else:
            m = _NAME.match(text, i + 1)
            if not m:
                out.append("$")
                i += 1
                continue
            name, op, arg, i = m.group(), None, None, m.end()
        found.append(Interpolation(name, op, arg))
        value = env.get(name)
        arg_value = interpolate(arg, env, found) if arg is not None else ""
        if op == ":-":
            out.append(value if value else arg_value)
        elif op == "-":
            out.append(value if value is not None else arg_value)
        elif op in (":?", "?"):
            assert value if op == ":?" else value is not None, f"compose needs ${name}: {arg_value}"
            out.append(value or "")
        elif op == ":+":
            out.append(arg_value if value else "")
        elif op == "+":
            out.append(arg_value if value is not None else "")
        else:
            out.append(value or "")
    return "".join(out)


def _strings(node: Any) -> Iterator[str]:
    """Every string value in a parsed YAML document (keys are not interpolated by Compose)."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item)


# --- compose.yaml as data -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(doc, dict), "compose.yaml is not a mapping"
    return doc


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
    """The environment compose would give service ``name``'s container with ``shell_env`` as the shell's."""
    return {k: interpolate(v, shell_env) for k, v in environment_of(compose["services"][name]).items()}


def _setting_name(variable: str) -> str:
    return variable.removeprefix("EDGESWARM_").lower()


def test_compose_declares_the_node_stack(compose: dict[str, Any]) -> None:
    assert "version" not in compose, "Compose v2 spec: no top-level `version:` key"
    assert compose.get("name") == "edgeswarm"
    services = compose["services"]
    assert {BROKER_SERVICE, "coordinator", "node-agent"} <= set(services)

    # Every node runs a broker and a node agent; only the hub runs the coordinator.
    assert services["coordinator"].get("profiles") == [HUB_PROFILE]
    for always in (BROKER_SERVICE, "node-agent"):
        assert not services[always].get("profiles"), f"{always} must run on every node, without a profile"

    assert set(app_services(compose)) == set(SERVICES), "compose.yaml must run exactly edgeswarm.services.SERVICES"
    for name, entry in SERVICES.items():  # the hub profile runs the hub's services, every node the devices'
        assert (services[name].get("profiles") == [HUB_PROFILE]) == (entry.role == "hub"), f"{name}: profiles"
    for name, svc in app_services(compose).items():
        assert svc.get("command") == ["edgeswarm", "service", name], f"{name}: command"
        assert name in SERVICES, f"compose service {name} is not in edgeswarm.services.SERVICES"
        build = svc.get("build")
        assert isinstance(build, dict), f"{name}: build from deploy/Dockerfile"
        assert (build.get("context"), build.get("dockerfile")) == (".", "deploy/Dockerfile"), name
        assert svc.get("depends_on", {}).get(BROKER_SERVICE, {}).get("condition") == "service_healthy"
        assert svc.get("restart") == "unless-stopped"
        assert svc.get("stop_signal") == "SIGTERM"
        assert svc.get("stop_grace_period"), f"{name}: no stop_grace_period"

    # Every edgeswarm service gets the same environment: the shared x-edgeswarm-env anchor.
    assert isinstance(compose.get("x-edgeswarm-env"), dict)
    for name, svc in app_services(compose).items():
        assert environment_of(svc) == environment_of({"environment": compose["x-edgeswarm-env"]}), name


def test_compose_broker(compose: dict[str, Any]) -> None:
    broker = compose["services"][BROKER_SERVICE]
    assert re.fullmatch(r"eclipse-mosquitto:2\.0\.\d+", broker["image"]), \
        f"pin the broker to a 2.0.x release, not {broker['image']!r} (2.1 changed max_packet_size's default)"
    mounts = broker["volumes"]
    conf_mount = next(m for m in mounts if m.endswith("/mosquitto/config/mosquitto.conf:ro"))
    assert (REPO / conf_mount.split(":", 1)[0]).resolve() == MOSQUITTO_CONF.resolve()
    data_mount = next(m for m in mounts if m.split(":")[1] == "/mosquitto/data")
    assert data_mount.split(":")[0] in (compose.get("volumes") or {}), "the broker's data is a named volume"
    assert broker["ports"] == ["${EDGESWARM_BROKER_PORT:-8883}:8883"], "TLS only"
    test = broker["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and test[1].startswith("mosquitto_sub ") and "-p 8883" in test[1]
    assert interpolate(test[1], {}).count("$SYS/broker/uptime") == 1
    assert "--cafile /run/secrets/edgeswarm-ca" in test[1], "the healthcheck checks the broker's certificate"
    # The broker reads its certificate, key, password file and ACL as compose secrets, where the config says.
    conf = MOSQUITTO_CONF.read_text()
    for secret in broker["secrets"]:
        assert secret in compose["secrets"], secret
    for secret in ("broker-cert", "broker-key", "broker-passwd", "broker-acl", "edgeswarm-ca"):
        assert f"/run/secrets/{secret}" in conf, f"mosquitto.conf does not read the {secret} secret"


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
    for required in ("EDGESWARM_NODE_ID", "EDGESWARM_HUB_URL", "EDGESWARM_DATA_URL", "EDGESWARM_DEVICE_CLASS",
                     "EDGESWARM_LOG_LEVEL"):
        assert required in variables, f"compose.yaml does not set {required}"

    # Each ${VAR} either has a default or deploy/README.md tells the user to set it.
    found: list[Interpolation] = []
    for value in _strings(compose):
        interpolate(value, {}, found)
    assert found, "compose.yaml interpolates nothing?"
    for expr in found:
        assert expr.has_default or f"`{expr.name}`" in readme, \
            f"${{{expr.name}}} has no default and deploy/README.md does not document it"
    # The variables an operator sets per node are documented whatever their defaults.
    for documented in ("EDGESWARM_NODE_ID", "EDGESWARM_HUB_URL", "EDGESWARM_DATA_URL", "EDGESWARM_BROKER_PORT",
                       "EDGESWARM_SECRETS"):
        assert f"`{documented}`" in readme, f"deploy/README.md does not document {documented}"

    # With nothing set in the shell, the defaults make a valid hub node on its own broker.
    for name in app_services(compose):
        env = compose_service_env(compose, name, {})
        settings = Settings(**{_setting_name(k): v for k, v in env.items()})  # type: ignore[arg-type]
        assert urlsplit(settings.hub_url).hostname == COMPOSE_BROKER_HOST
        assert parse_broker_url(settings.hub_url).tls, "the services speak TLS to the brokers by default"
        assert settings.data_plane_url == settings.hub_url
        assert settings.mqtt_password_file == Path("/run/secrets/edgeswarm-password")
        assert settings.tls_ca_file == Path("/run/secrets/edgeswarm-ca")
        assert not settings.allow_anonymous
        assert settings.device_class == "native"
        assert settings.max_packet_bytes == int(mosquitto_settings()["max_packet_size"][0]) == 16 * 1024 * 1024

    # A worker node: its own data-plane broker is advertised, control goes to the hub.
    worker = compose_service_env(compose, "node-agent", {"EDGESWARM_NODE_ID": "pi-1",
                                                         "EDGESWARM_HUB_URL": "mqtts://10.0.0.1:8883",
                                                         "EDGESWARM_DATA_URL": "mqtts://10.0.0.21:8883"})
    assert worker["EDGESWARM_HUB_URL"] == "mqtts://10.0.0.1:8883"
    assert worker["EDGESWARM_DATA_URL"] == "mqtts://10.0.0.21:8883"
    # A worker that forgets EDGESWARM_DATA_URL falls back to the hub (correct, only slower), never to
    # `broker`, which on another node would name that node's own broker.
    forgetful = compose_service_env(compose, "node-agent", {"EDGESWARM_HUB_URL": "mqtts://10.0.0.1:8883"})
    assert forgetful["EDGESWARM_DATA_URL"] == "mqtts://10.0.0.1:8883"


def test_interpolation_helper() -> None:
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET:-d}/${EMPTY:-d}/${EMPTY-d}/${UNSET-d}/$SET/$$SET", env) == "v/d//d/v/$SET"
    assert interpolate("${UNSET:-${ALSO_UNSET:-in}}-${UNSET:-${SET}}", env) == "in-v"
    found: list[Interpolation] = []
    interpolate("${A:-${B}}", {}, found)
    assert [(f.name, f.has_default) for f in found] == [("A", True), ("B", False)]


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


def in_test(env: dict[str, str], broker: DeployBroker) -> dict[str, str]:
    """A compose environment with the compose network's broker and the mounted secrets moved to the test's."""
    out = {}
    for key, value in env.items():
        if value.startswith(("mqtt://", "mqtts://")) and urlsplit(value).hostname == COMPOSE_BROKER_HOST:
            value = broker.url
        for name, path in broker.files.items():
            value = value.replace(f"/run/secrets/{name}", str(path))
        out[key] = value
    return out


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


# Every edgeswarm service compose.yaml declares, read at collection time so a new one is run too.
COMPOSE_APP_SERVICES = sorted(name for name in yaml.safe_load(COMPOSE_FILE.read_text())["services"]
                              if name != BROKER_SERVICE)


@pytest.mark.parametrize("service", COMPOSE_APP_SERVICES)
def test_compose_service_runs_with_compose_environment(service: str, compose: dict[str, Any],
                                                       deploy_broker: DeployBroker, services: Any,
                                                       make_bus: Any) -> None:
    """Each service, with the environment and secrets compose gives it, against the deploy config's broker:
    TLS, its own password, the generated ACL."""
    assert service in app_services(compose)
    env = in_test(compose_service_env(compose, service, {}), deploy_broker)
    node = env["EDGESWARM_NODE_ID"]
    assert node == DEPLOY_NODE

    statuses = StatusLog()
    watcher = make_bus(WATCHER, "cli", hub_url=deploy_broker.url, mqtt_username=WATCHER,
                       mqtt_password_file=deploy_broker.files["edgeswarm-password"].parent / WATCHER,
                       tls_ca_file=deploy_broker.files["edgeswarm-ca"])
    watcher.subscribe(topics.status(node, service), statuses, schemas=(Status,))

    proc = services.start(service, node, deploy_broker.url, **env)
    wait_until(lambda: (s := statuses.latest(proc.pid)) is not None and s.state == "online"
               or proc.poll() is not None, 20, message=f"{service} to report online")
    assert proc.poll() is None, f"{service} exited early:\n{services.log_of(proc)}"
    online = statuses.latest(proc.pid)
    assert online is not None and online.state == "online"
    assert (online.node, online.service, online.device_class) == (node, service, "native")
    assert online.data_url == deploy_broker.url and "@" not in online.data_url, "no credentials advertised"
    assert "user hub" in services.log_of(proc)
    assert deploy_broker.files["edgeswarm-password"].read_text().strip() not in services.log_of(proc)

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
    assert int(opts["max_queued_messages"][0]) >= 1000
    assert int(opts["max_queued_bytes"][0]) > 0
    assert int(opts["max_inflight_messages"][0]) > 0
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


# --- deploy/Dockerfile ---------------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
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
    assert not pending, "Dockerfile ends in a continuation"
    return instructions


def _pip_installs(args: str) -> list[str] | None:
    """The arguments of ``pip install`` in a RUN line, or None when it runs no pip install."""
    for command in re.split(r"&&|;", args):
        words = shlex.split(command)
        if "pip" in [Path(w).name for w in words[:3]] and "install" in words:
            return words[words.index("install") + 1:]
    return None


def test_dockerfile() -> None:
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    assert [i for i, _ in instructions].count("FROM") == 1
    assert "ENTRYPOINT" not in [i for i, _ in instructions], "compose runs `edgeswarm service NAME` directly"

    # The image installs the exact torch of this repo's own environment (constraints.txt); the package asks for a range.
    torch_pin = next(line.strip() for line in (REPO / "constraints.txt").read_text().splitlines()
                     if line.startswith("torch=="))
    assert torch_pin == "torch==2.13.0"
    runs = [(n, _pip_installs(args)) for n, (ins, args) in enumerate(instructions) if ins == "RUN"]
    torch_at, torch_args = next((n, a) for n, a in runs if a and torch_pin in a)
    cpu_index = "https://download.pytorch.org/whl/cpu"
    assert "--index-url" in torch_args and torch_args[torch_args.index("--index-url") + 1] == cpu_index
    others = [a for a in torch_args if not a.startswith("-") and a not in (torch_pin, cpu_index)]
    assert not others, f"the torch layer installs torch alone, not {others}"

    copies = [(n, args.split()) for n, (ins, args) in enumerate(instructions) if ins == "COPY"]
    copied = {Path(src).as_posix().rstrip("/") for _, words in copies for src in words[:-1]}
    assert {"pyproject.toml", "README.md", "shared", "services"} <= copied
    first_copy = min(n for n, _ in copies)
    assert torch_at < first_copy, "torch gets its own layer before the project's files"
    project_at = next(n for n, a in runs if a is not None and "." in a)
    assert project_at > max(n for n, _ in copies)
    assert "--no-cache-dir" in dict(runs)[project_at]

    users = [(n, args) for n, (ins, args) in enumerate(instructions) if ins == "USER"]
    assert users, "the image must not run as root"
    last_user_at, last_user = users[-1]
    assert last_user_at > project_at and last_user.split(":")[0] not in ("root", "0")


def test_dockerfile_copy_sources_exist() -> None:
    sources = {src.rstrip("/") for ins, args in dockerfile_instructions() if ins == "COPY"
               for src in args.split()[:-1] if not src.startswith("--")}
    missing = sorted(s for s in sources if not (REPO / s).exists())
    if missing == ["README.md"]:
        pytest.skip("README.md (required by pyproject.toml and copied by deploy/Dockerfile) is not written yet")
    assert not missing, f"deploy/Dockerfile copies files the repository lacks: {missing}"


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


@pytest.mark.parametrize("profile_args", [[], ["--profile", HUB_PROFILE]], ids=["node", "hub"])
def test_docker_compose_config(profile_args: list[str]) -> None:
    reason = _compose_available()
    if reason:
        pytest.skip(f"docker compose config not run: {reason}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EDGESWARM_", "COMPOSE_"))}
    result = subprocess.run(["docker", "compose", "-f", str(COMPOSE_FILE), *profile_args, "config", "-q"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    listed = subprocess.run(["docker", "compose", "-f", str(COMPOSE_FILE), *profile_args, "config", "--services"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    expected = {BROKER_SERVICE, *DEVICE_SERVICES} | (set(HUB_SERVICES) if profile_args else set())
    assert set(listed.stdout.split()) == expected
