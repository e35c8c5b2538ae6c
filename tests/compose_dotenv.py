"""A node's ``.env`` read the way Docker Compose reads it, for the tests that check deploy/env/'s examples (the
library interpolates compose.yaml with variables it is given: ``edgeswarm.compose_env``)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from edgeswarm.compose_env import interpolate
from edgeswarm.errors import ConfigError

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def _double_quoted(body: str) -> str:
    escapes = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "$": "$$"}
    out, i = [], 0
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body) and body[i + 1] in escapes:
            out.append(escapes[body[i + 1]])
            i += 2
        else:
            out.append(body[i])
            i += 1
    return "".join(out)


def parse_env_text(text: str, *, source: str = ".env", base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of a compose ``.env`` file.

    Lines are ``KEY=VALUE`` (``export KEY=VALUE`` too); blank lines and lines starting with ``#`` are skipped. An
    unquoted value ends at `` #`` (a comment) and is stripped; a single-quoted one is literal; a double-quoted one
    knows ``\\n``, ``\\t``, ``\\\\`` and ``\\"``. Unquoted and double-quoted values are interpolated like compose.yaml,
    against the variables defined above them and then ``base``. Raises ConfigError naming the line on anything else.
    """
    base = dict(base or {})
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _ENV_KEY.fullmatch(key):
            raise ConfigError(f"{source}:{number}: expected KEY=VALUE, got {raw!r}")
        value = value.lstrip()
        known = {**base, **out}
        if value[:1] in ("'", '"'):
            quote = value[0]
            end = 1
            while end < len(value) and value[end] != quote:
                end += 2 if quote == '"' and value[end] == "\\" else 1
            if end >= len(value):
                raise ConfigError(f"{source}:{number}: unterminated {quote} quote in {raw!r}")
            rest = value[end + 1:].strip()
            if rest and not rest.startswith("#"):
                raise ConfigError(f"{source}:{number}: text after the closing quote in {raw!r}")
            body = value[1:end]
            out[key] = body if quote == "'" else interpolate(_double_quoted(body), known)
        else:
            comment = re.search(r"\s#", value)
            if comment:
                value = value[:comment.start()]
            out[key] = interpolate(value.strip(), known)
    return out
