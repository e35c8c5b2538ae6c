"""compose.yaml read the way Docker Compose reads it: the file's interpolation of a node's variables, its YAML anchors
and merges, and the services one profile runs with the command, environment, secrets and mounts compose gives them.

The netns launcher starts each node's services from this, so a node in a namespace runs exactly what its container
would. Pure but for reading the two files.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from edgeswarm.errors import ConfigError

# compose.yaml sits at the repository root, three levels above this file in a checkout (shared/edgeswarm/...). An
# installed wheel has no compose.yaml: its callers pass the file.
DEFAULT_COMPOSE_FILE = Path(__file__).resolve().parents[2] / "compose.yaml"
# Where compose mounts a service's secrets when their entry names no target.
SECRETS_DIR = PurePosixPath("/run/secrets")

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# compose-go's operators, longest first so that ":-" is not read as ":" followed by "-".
_OPERATORS = (":-", ":?", ":+", "-", "?", "+")
# Keys of a service compose.yaml may carry that change the environment in ways this module does not follow: refused
# rather than silently giving a service another environment than its container would have.
_UNSUPPORTED_SERVICE_KEYS = ("env_file", "extends")


class MissingComposeVariableError(ConfigError):
    """A ``${NAME:?message}`` (or ``${NAME?message}``) met an unset variable: compose refuses the file, and so does
    this module, with the file's own message."""


class Interpolation(BaseModel):
    """One ``${NAME<op><arg>}`` or ``$NAME`` met in a compose value; ``arg`` is still uninterpolated."""

    model_config = ConfigDict(frozen=True)

    name: str
    op: str | None = None
    arg: str | None = None


class ComposeVolume(BaseModel):
    """One short-syntax mount (``source:target[:mode]``). A bind mount's ``source`` is an absolute host path (compose
    resolves relative ones against the compose file's folder); a named volume's is the volume's name."""

    model_config = ConfigDict(frozen=True)

    source: str
    target: str
    read_only: bool = False
    named: bool = False


class ComposeService(BaseModel):
    """A service as compose would run it: ``command`` as the container's argv (empty: the image's own),
    ``environment`` fully interpolated, ``secrets`` from the path inside the container to the host file."""

    model_config = ConfigDict(frozen=True)

    name: str
    command: list[str]
    environment: dict[str, str]
    profiles: list[str]
    secrets: dict[str, str]
    volumes: list[ComposeVolume]

    def environment_on_host(self) -> dict[str, str]:
        """``environment`` for the service run as a plain process on the host: a value naming one of its secrets'
        paths inside the container (/run/secrets/...) names the host file compose would mount there instead."""
        return {key: self.secrets.get(value, value) for key, value in self.environment.items()}


# --- interpolation ---------------------------------------------------------------------------------------------

def _braced_end(text: str, start: int) -> int:
    """Index of the ``}`` closing the expression whose argument starts at ``start`` (nested ``${`` counted)."""
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
    raise ConfigError(f"invalid interpolation format: unterminated ${{...}} in {text!r}")


def interpolate(text: str, variables: Mapping[str, str], found: list[Interpolation] | None = None) -> str:
    """``text`` with compose's interpolation applied against ``variables``.

    ``$$`` is a literal ``$``; ``$NAME`` and ``${NAME}`` are the value (empty when unset); ``${NAME:-default}``
    takes the default when unset or empty, ``${NAME-default}`` only when unset; ``${NAME:?message}`` raises
    MissingComposeVariableError with the message when unset or empty, ``${NAME?message}`` only when unset;
    ``${NAME:+alt}`` / ``${NAME+alt}`` give ``alt`` when set (and non-empty). Defaults may nest expressions. A ``$``
    followed by anything else stays as it is; a malformed ``${...}`` is a ConfigError. Every expression met, nested
    ones included, is appended to ``found``.
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
            if not m:
                raise ConfigError(f"invalid interpolation format in {text!r}")
            name, j = m.group(), m.end()
            op = next((o for o in _OPERATORS if text.startswith(o, j)), None)
            if op is None:
                if text[j:j + 1] != "}":
                    raise ConfigError(f"invalid interpolation format in {text!r}")
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
        found.append(Interpolation(name=name, op=op, arg=arg))
        value = variables.get(name)
        arg_value = interpolate(arg, variables, found) if arg is not None else ""
        if op == ":-":
            out.append(value if value else arg_value)
        elif op == "-":
            out.append(value if value is not None else arg_value)
        elif op in (":?", "?"):
            if not (value if op == ":?" else value is not None):
                raise MissingComposeVariableError(f"required variable {name} is missing a value: {arg_value}")
            out.append(value or "")
        elif op == ":+":
            out.append(arg_value if value else "")
        elif op == "+":
            out.append(arg_value if value is not None else "")
        else:
            out.append(value or "")
    return "".join(out)


def _interpolate_tree(node: Any, variables: Mapping[str, str], found: list[Interpolation]) -> Any:
    # Values only: compose never interpolates mapping keys.
    if isinstance(node, str):
        return interpolate(node, variables, found)
    if isinstance(node, dict):
        return {key: _interpolate_tree(value, variables, found) for key, value in node.items()}
    if isinstance(node, list):
        return [_interpolate_tree(item, variables, found) for item in node]
    return node


# --- the file ----------------------------------------------------------------------------------------------------

def _compose_path(compose_file: Path | None) -> Path:
    path = compose_file or DEFAULT_COMPOSE_FILE
    if not path.is_file():
        raise ConfigError(f"no compose file at {path} (pass the path of the repository's compose.yaml)")
    return path


def raw_document(compose_file: Path | None = None) -> dict[str, Any]:
    """compose.yaml as YAML data, anchors and ``<<`` merges resolved, nothing interpolated."""
    path = _compose_path(compose_file)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("services"), dict):
        raise ConfigError(f"{path} is not a compose file (no services mapping)")
    return doc


def load_document(variables: Mapping[str, str], compose_file: Path | None = None,
                  found: list[Interpolation] | None = None) -> dict[str, Any]:
    """compose.yaml as compose sees it before applying it: anchors and merges resolved and every value interpolated
    with ``variables`` (what ``docker compose config`` validates against the Compose Specification's schema). Raises
    MissingComposeVariableError for a required variable ``variables`` lacks, whatever profile would run."""
    doc: dict[str, Any] = _interpolate_tree(raw_document(compose_file), variables, [] if found is None else found)
    return doc


def _scalar(value: Any) -> str:
    # YAML reads `true` and `1` as non-strings; compose hands the container their YAML spelling.
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def _environment(name: str, raw: Any, variables: Mapping[str, str]) -> dict[str, str]:
    """A service's ``environment`` (mapping or list form). A key without a value takes the variable of that name,
    and is left out when there is none (compose's pass-through)."""
    pairs: Iterable[tuple[str, Any]]
    if raw is None:
        return {}
    if isinstance(raw, dict):
        pairs = raw.items()
    elif isinstance(raw, list):
        pairs = [tuple(item.split("=", 1)) if "=" in item else (item, None) for item in map(str, raw)]  # type: ignore[misc]
    else:
        raise ConfigError(f"service {name}: environment is neither a mapping nor a list")
    env: dict[str, str] = {}
    for key, value in pairs:
        if value is None:
            if key in variables:
                env[str(key)] = variables[key]
        else:
            env[str(key)] = _scalar(value)
    return env


def _host_path(path: str, project_dir: Path) -> str:
    """A host path as compose resolves it: relative to the compose file's folder, ``~`` expanded."""
    return str((project_dir / Path(path).expanduser()).resolve())


def _secrets(name: str, raw: Any, declared: Mapping[str, Any], project_dir: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in raw or []:
        if isinstance(entry, str):
            source, target = entry, entry
        elif isinstance(entry, dict) and isinstance(entry.get("source"), str):
            source, target = entry["source"], str(entry.get("target") or entry["source"])
        else:
            raise ConfigError(f"service {name}: secret entry {entry!r} is neither a name nor {{source, target}}")
        spec = declared.get(source)
        if not isinstance(spec, dict) or not isinstance(spec.get("file"), str):
            raise ConfigError(f"service {name}: secret {source} is not declared with a file")
        in_container = PurePosixPath(target)
        if not in_container.is_absolute():
            in_container = SECRETS_DIR / in_container
        out[str(in_container)] = _host_path(spec["file"], project_dir)
    return out


def _volumes(name: str, raw: Any, project_dir: Path) -> list[ComposeVolume]:
    volumes = []
    for entry in raw or []:
        if not isinstance(entry, str):
            raise ConfigError(f"service {name}: only short-syntax volumes (source:target[:mode]) are read, "
                              f"not {entry!r}")
        parts = entry.split(":")
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
            raise ConfigError(f"service {name}: volume {entry!r} is not source:target[:ro|rw]")
        source, target = parts[0], parts[1]
        named = not source.startswith((".", "/", "~"))
        volumes.append(ComposeVolume(source=source if named else _host_path(source, project_dir), target=target,
                                     read_only=len(parts) == 3 and parts[2] == "ro", named=named))
    return volumes


def _command(name: str, raw: Any) -> list[str]:
    if raw is None:
        return []
    if isinstance(raw, str):
        return shlex.split(raw)
    if isinstance(raw, list):
        return [_scalar(word) for word in raw]
    raise ConfigError(f"service {name}: command is neither a list nor a string")


def active_profiles(profile: str) -> set[str]:
    """The profiles a COMPOSE_PROFILES-style value turns on (``hub,device``: both)."""
    return {p.strip() for p in profile.split(",") if p.strip()}


def services_for(profile: str, variables: Mapping[str, str],
                 compose_file: Path | None = None) -> list[ComposeService]:
    """The services ``docker compose --profile PROFILE up`` runs with ``variables`` as the node's ``.env`` and shell,
    in file order: those of the profile (or of any of a comma-separated list, like COMPOSE_PROFILES) and every
    service without a profile (the broker). Raises MissingComposeVariableError when a required variable is unset,
    ConfigError when the file uses what this reader does not follow (``env_file``, ``extends``, long-syntax mounts).
    """
    path = _compose_path(compose_file)
    doc = load_document(variables, path)
    project_dir = path.resolve().parent
    wanted = active_profiles(profile)
    declared_secrets = doc.get("secrets") or {}
    services = []
    for name, spec in doc["services"].items():
        if not isinstance(spec, dict):
            raise ConfigError(f"service {name} is not a mapping")
        profiles = [str(p) for p in spec.get("profiles") or []]
        if profiles and not wanted & set(profiles):
            continue
        unsupported = [key for key in _UNSUPPORTED_SERVICE_KEYS if key in spec]
        if unsupported:
            raise ConfigError(f"service {name}: {', '.join(unsupported)} is not followed by edgeswarm.compose_env")
        services.append(ComposeService(
            name=str(name), command=_command(name, spec.get("command")),
            environment=_environment(name, spec.get("environment"), variables), profiles=profiles,
            secrets=_secrets(name, spec.get("secrets"), declared_secrets, project_dir),
            volumes=_volumes(name, spec.get("volumes"), project_dir)))
    return services
