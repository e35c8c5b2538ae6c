"""Versioned message schemas and the envelope every message carries.

Every control message body is a pydantic model registered under a ``(schema_name, schema_version)``
pair. Decoding looks the pair up here, so an unknown name or version is rejected with a message that
says which versions this build understands.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Annotated, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.errors import UnknownSchemaError, UnsupportedSchemaVersionError

# Node ids, service names and instance ids appear in topic levels, so they may not contain '/', '+' or '#'.
NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN)]


MIB = 1 << 20
DEFAULT_MAX_HEADER_BYTES = 64 * 1024


class Message(BaseModel):
    """Base of every message body. Subclasses are registered with :func:`schema`.

    ``MAX_BYTES`` caps the frame header (envelope, body and tensor descriptor, msgpack-encoded) of a message
    of this schema: a larger one is refused by the sender and rejected by the receiver before its body is
    validated, so no message costs more than its schema's cap. Schemas that carry profiles, plans or unit
    lists raise it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    SCHEMA: ClassVar[str] = ""
    VERSION: ClassVar[int] = 0
    MAX_BYTES: ClassVar[int] = DEFAULT_MAX_HEADER_BYTES


class Envelope(BaseModel):
    """The ``env`` map of every frame header: who sent what, when, and where to reply.

    Times are Unix seconds. ``expires_at`` (optional) is when the message stops being meaningful;
    receivers drop it after that. ``reply_to`` is the topic a request's reply goes to and
    ``correlation_id`` ties the reply to the request.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    msg_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    schema_name: str = Field(min_length=1, max_length=128)
    schema_version: int = Field(ge=1)
    sender_node: Name
    sender_service: Name
    sender_instance: Name
    # Finite only: a NaN send time never compares as newer or older (a retained status stamped NaN could never be
    # replaced), and an infinite expiry has no MQTT 5 Message Expiry Interval to mirror it to.
    sent_at: float = Field(allow_inf_nan=False)
    expires_at: float | None = Field(default=None, allow_inf_nan=False)
    correlation_id: str | None = Field(default=None, max_length=64)
    reply_to: str | None = Field(default=None, max_length=256)


# Ids come from the OS's random source in batches: os.urandom releases the GIL, and on a busy process each call
# then waited for the GIL to come back (28 us a message under load, the largest single cost of a small send).
_ID_BATCH = 128
_ids = threading.local()
_id_generation = [0]  # bumped in a forked child, so it never hands out the ids its parent holds too


def _forked() -> None:
    _id_generation[0] += 1


os.register_at_fork(after_in_child=_forked)


def new_id() -> str:
    """A random 128-bit id as 32 hex digits (the format of msg_id), from the OS's cryptographic source."""
    pool: list[str] | None = getattr(_ids, "pool", None)
    if not pool or getattr(_ids, "generation", -1) != _id_generation[0]:
        digits = os.urandom(16 * _ID_BATCH).hex()
        pool = _ids.pool = [digits[i : i + 32] for i in range(0, len(digits), 32)]
        _ids.generation = _id_generation[0]
    return pool.pop()


class Sender(BaseModel):
    """Who is sending: the node, the service on it, and this process's instance id."""

    model_config = ConfigDict(frozen=True)

    node: Name
    service: Name
    instance: Name

    def envelope(
        self,
        message: Message,
        *,
        ttl_s: float | None = None,
        correlation_id: str | None = None,
        reply_to: str | None = None,
        msg_id: str | None = None,
    ) -> Envelope:
        """A fresh envelope for ``message``; ``ttl_s`` seconds from now it expires (None: never)."""
        now = time.time()
        return Envelope(
            msg_id=msg_id or new_id(),
            schema_name=message.SCHEMA,
            schema_version=message.VERSION,
            sender_node=self.node,
            sender_service=self.service,
            sender_instance=self.instance,
            sent_at=now,
            expires_at=None if ttl_s is None else now + ttl_s,
            correlation_id=correlation_id,
            reply_to=reply_to,
        )


_REGISTRY: dict[str, dict[int, type[Message]]] = {}

M = TypeVar("M", bound=type[Message])


def schema(name: str, version: int) -> Callable[[M], M]:
    """Class decorator: register a Message subclass as ``name`` version ``version``."""

    def register(cls: M) -> M:
        versions = _REGISTRY.setdefault(name, {})
        if version in versions and versions[version] is not cls:
            raise RuntimeError(f"schema {name} v{version} registered twice ({versions[version]} and {cls})")
        cls.SCHEMA = name
        cls.VERSION = version
        versions[version] = cls
        return cls

    return register


def resolve(name: str, version: int) -> type[Message]:
    """The Message class registered for ``(name, version)``.

    Raises UnknownSchemaError or UnsupportedSchemaVersionError naming what this build understands.
    """
    versions = _REGISTRY.get(name)
    if versions is None:
        raise UnknownSchemaError(f"unknown schema {name!r}; this build knows {sorted(_REGISTRY)}")
    cls = versions.get(version)
    if cls is None:
        raise UnsupportedSchemaVersionError(
            f"schema {name!r} version {version} is not supported; this build understands "
            f"version(s) {sorted(versions)}. Upgrade the older side of the cluster."
        )
    return cls


def registered() -> list[type[Message]]:
    """Every registered Message class, sorted by schema name and version."""
    return [versions[v] for name in sorted(_REGISTRY) for versions in [_REGISTRY[name]] for v in sorted(versions)]
