"""``edgeswarm credentials`` and ``edgeswarm certs``: the members of a cluster, their passwords, the brokers'
password file and ACL, and the TLS certificates (deploy/README.md walks through using them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from edgeswarm.cli.console import console
from edgeswarm.errors import ConfigError
from edgeswarm.roles import ROLES, Role
from edgeswarm.security.certs import DEFAULT_DAYS, CertsDir
from edgeswarm.security.credentials import CredentialsDir
from edgeswarm.wire.schema import NAME_PATTERN

DEFAULT_DIR = "secrets"


def add_security_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    creds = sub.add_parser("credentials", help="add or remove cluster members: a password each, and the brokers' "
                           "password file and ACL generated from the topic tree")
    creds.add_argument("--dir", default=DEFAULT_DIR, help="the credentials folder (default: ./secrets)")
    for role, what in (("hub", "the hub node (coordinator, planner, checkpoint store)"),
                       ("device", "a device node"), ("edge", "an edge server (MEC) that hosts work for devices"),
                       ("client", "a command-line user (submits and cancels jobs)")):
        creds.add_argument(f"--{role}", action="append", default=[], metavar="NAME", help=f"add {what} (repeatable)")
    creds.add_argument("--remove", action="append", default=[], metavar="NAME", help="remove a member (repeatable)")

    certs = sub.add_parser("certs", help="a CA for the cluster and TLS certificates for its brokers (and clients)")
    certs.add_argument("--dir", default=DEFAULT_DIR, help="the credentials folder (default: ./secrets)")
    certs.add_argument("--broker", action="append", default=[], metavar="NAME=HOST[,HOST...]",
                       help="a certificate for broker NAME (its node id), valid for every host name or address "
                       "the nodes reach it at (repeatable)")
    certs.add_argument("--client", action="append", default=[], metavar="NAME",
                       help="a client certificate for member NAME, to log in without a password (repeatable)")
    certs.add_argument("--days", type=int, default=DEFAULT_DAYS, help="validity of the certificates in days")


def _name(value: str) -> str:
    import re

    if not re.fullmatch(NAME_PATTERN, value):
        raise ConfigError(f"{value!r} is not a node id: 1 to 64 letters, digits, '_', '.' or '-'")
    return value


def run_credentials(args: argparse.Namespace) -> int:
    folder = CredentialsDir(Path(args.dir))
    add: dict[str, Role] = {}
    for role in ROLES:
        for name in getattr(args, role):
            add[_name(name)] = role  # type: ignore[assignment]
    before = set(folder.roster().members)
    roster = folder.update(add=add, remove=[_name(n) for n in args.remove])
    if not roster.members:
        raise ConfigError("the cluster has no members yet: add some with --hub, --device, --edge and --client")
    table = Table(title=f"cluster members in {folder.path}")
    for col in ("member", "role", "password file (EDGESWARM_MQTT_PASSWORD_FILE)", ""):
        table.add_column(col)
    for name, role in sorted(roster.members.items()):
        table.add_row(name, role, str(folder.password_file(name)), "new" if name not in before else "")
    console.print(table)
    console.print(f"broker files: {folder.mosquitto_passwd} and {folder.mosquitto_acl} (Mosquitto), "
                  f"{folder.amqtt_passwd.parent}/ (amqtt). Restart the brokers (or send them SIGHUP) to apply.")
    return 0


def run_certs(args: argparse.Namespace) -> int:
    certs = CertsDir(Path(args.dir))
    made = certs.ensure_ca()
    console.print(f"CA: {certs.ca_cert}" + (" (new)" if made else " (kept)") + f"; its key {certs.ca_key} stays "
                  "with you, only the certificate goes to the nodes (EDGESWARM_TLS_CA_FILE)")
    for spec in args.broker:
        name, _, hosts = spec.partition("=")
        cert, key = certs.issue_broker(_name(name), [h.strip() for h in hosts.split(",") if h.strip()],
                                       days=args.days)
        console.print(f"broker {name}: {cert} and {key} ({hosts})")
    for name in args.client:
        cert, key = certs.issue_client(_name(name), days=args.days)
        console.print(f"client {name}: {cert} and {key} (EDGESWARM_TLS_CERT_FILE, EDGESWARM_TLS_KEY_FILE)")
    return 0
