"""A cluster's credentials folder: who the members are, their passwords, and the brokers' files made from them.

Layout (``edgeswarm credentials --dir DIR``)::

    DIR/roster.yaml            member -> role (hub, device, edge, client); no secrets
    DIR/passwords/<member>     one password per member (mode 600): give each node only its own file
    DIR/mosquitto/passwd       Mosquitto password file (PBKDF2-SHA512 hashes), mode 600
    DIR/mosquitto/acl          Mosquitto ACL from the topic tree (edgeswarm.security.acl)
    DIR/amqtt/passwd           the same users for the embedded amqtt broker (Argon2 hashes), mode 600
    DIR/amqtt/acl.json         its publish and subscribe lists

A member's user name is its node id. Adding members keeps every existing password; removing one drops it from
the broker files (restart or SIGHUP the brokers to apply).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from edgeswarm.errors import ConfigError
from edgeswarm.files import write_atomically
from edgeswarm.security.acl import amqtt_acl, mosquitto_acl
from edgeswarm.security.passwords import argon2_hash, mosquitto_hash, new_password
from edgeswarm.topics import ROLES, Role
from edgeswarm.wire.schema import Name


class Roster(BaseModel):
    """The members of a cluster: node id (= broker user name) -> role."""

    model_config = ConfigDict(extra="forbid")

    members: dict[Name, Role] = {}


def write_private(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to ``path`` all or nothing (edgeswarm.files) with ``mode``, set before any byte is written."""
    write_atomically(path, text.encode(), mode)


class CredentialsDir:
    """The credentials folder at ``path`` (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def roster_file(self) -> Path:
        return self.path / "roster.yaml"

    @property
    def mosquitto_passwd(self) -> Path:
        return self.path / "mosquitto" / "passwd"

    @property
    def mosquitto_acl(self) -> Path:
        return self.path / "mosquitto" / "acl"

    @property
    def amqtt_passwd(self) -> Path:
        return self.path / "amqtt" / "passwd"

    @property
    def amqtt_acl(self) -> Path:
        return self.path / "amqtt" / "acl.json"

    def password_file(self, name: str) -> Path:
        """Where member ``name``'s password is kept: point its EDGESWARM_MQTT_PASSWORD_FILE here."""
        return self.path / "passwords" / name

    def roster(self) -> Roster:
        """The members; an empty roster when the folder has none yet. Raises ConfigError for a damaged file."""
        if not self.roster_file.exists():
            return Roster()
        try:
            return Roster.model_validate(yaml.safe_load(self.roster_file.read_text()) or {})
        except (OSError, yaml.YAMLError, ValidationError) as exc:
            raise ConfigError(f"{self.roster_file} is not a roster of members and roles: {exc}") from None

    def password(self, name: str) -> str:
        """Member ``name``'s password. Raises ConfigError when it has none."""
        try:
            return self.password_file(name).read_text().strip()
        except OSError:
            raise ConfigError(f"{name} has no password in {self.path / 'passwords'}; add it with "
                              f"`edgeswarm credentials --dir {self.path} --device {name}`") from None

    def update(self, add: Mapping[str, Role] = {}, remove: Iterable[str] = ()) -> Roster:  # noqa: B006 - read only
        """Add (or change the role of) members and remove others, give every new member a password, and write
        the roster and the brokers' files again. Returns the new roster."""
        for role in add.values():
            if role not in ROLES:
                raise ConfigError(f"unknown role {role!r}; a member is one of {', '.join(ROLES)}")
        members = {**self.roster().members, **add}
        for name in remove:
            members.pop(name, None)
            self.password_file(name).unlink(missing_ok=True)
        roster = Roster.model_validate({"members": members})
        for name in roster.members:
            if not self.password_file(name).exists():
                write_private(self.password_file(name), new_password() + "\n")
        write_private(self.roster_file, "# edgeswarm cluster members: node id (broker user name) -> role.\n"
                      "# Written by `edgeswarm credentials`; passwords are in passwords/.\n"
                      + yaml.safe_dump(roster.model_dump(), sort_keys=True), mode=0o644)
        self.write_broker_files(roster)
        return roster

    def write_broker_files(self, roster: Roster) -> None:
        """The Mosquitto and amqtt password files and ACLs for ``roster``."""
        passwords = {name: self.password(name) for name in roster.members}
        users = sorted(passwords.items())
        write_private(self.mosquitto_passwd, "".join(f"{n}:{mosquitto_hash(p)}\n" for n, p in users))
        write_private(self.mosquitto_acl, mosquitto_acl(roster.members), mode=0o644)
        write_private(self.amqtt_passwd, "".join(f"{n}:{argon2_hash(p)}\n" for n, p in users))
        write_private(self.amqtt_acl, json.dumps(amqtt_acl(roster.members), indent=1, sort_keys=True), mode=0o644)
