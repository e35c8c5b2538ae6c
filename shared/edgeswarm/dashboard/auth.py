"""Who may see the dashboard: where it listens and the bearer token it asks for.

Without a token the server listens on loopback only; a host beyond loopback without a token is refused at start
(``check_exposure``). With a token every request needs ``Authorization: Bearer TOKEN``, or the cookie the page's
``?token=`` sets (HttpOnly, SameSite=Strict), compared in constant time.
"""

from __future__ import annotations

import hmac
import os
import secrets
from http.cookies import CookieError, SimpleCookie
from pathlib import Path

from edgeswarm.errors import ConfigError
from edgeswarm.settings import is_loopback

COOKIE = "edgeswarm_dashboard"
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 512


def read_token(path: Path | None, *, create: bool = False, setting: str = "EDGESWARM_DASHBOARD_TOKEN_FILE"
               ) -> str | None:
    """The token in file ``path`` (stripped), None without a file. With ``create``, a missing file is made with a
    random token, readable by its owner only. Raises ConfigError for an unreadable, empty or short token."""
    if path is None:
        return None
    if create and not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(32) + "\n")
        except FileExistsError:
            pass  # made meanwhile by another instance: read theirs
        except OSError as exc:
            raise ConfigError(f"cannot create the token file {path} ({setting}): {exc.strerror or exc}") from None
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {setting} {path}: {exc.strerror or exc}") from None
    if len(token) < MIN_TOKEN_CHARS or len(token) > MAX_TOKEN_CHARS or not token.isprintable() or " " in token:
        raise ConfigError(f"the token in {path} ({setting}) must be {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} printable "
                          "characters without spaces; make one with `python -c 'import secrets; "
                          "print(secrets.token_urlsafe(32))' > FILE`")
    return token


def check_exposure(host: str, token: str | None, *, what: str = "the dashboard", shows: str = "the whole cluster",
                   setting: str = "EDGESWARM_DASHBOARD_TOKEN_FILE, or --token-file",
                   host_setting: str = "EDGESWARM_DASHBOARD_HOST") -> None:
    """Raise ConfigError for a listening ``host`` beyond loopback without a token: ``what`` (a page, an API) gives
    whoever reaches it ``shows``."""
    if token is None and not is_loopback(host):
        raise ConfigError(
            f"{what} would listen on {host!r}, beyond this machine, without a token: anyone who reaches it would "
            f"have {shows}. Give it a token ({setting}: a file holding a long random string) or listen on 127.0.0.1 "
            f"({host_setting}) and reach it through an SSH tunnel")


def token_matches(token: str, offered: str | None) -> bool:
    """Whether ``offered`` is ``token``, compared in constant time."""
    if offered is None or len(offered) > MAX_TOKEN_CHARS:
        return False
    return hmac.compare_digest(offered.encode("utf-8", "replace"), token.encode())


def offered_token(authorization: str | None, cookie_header: str | None) -> str | None:
    """The token a request offers: its ``Authorization: Bearer`` header, else its dashboard cookie."""
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    if cookie_header and len(cookie_header) <= 8192:
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load(cookie_header)
        except CookieError:
            return None
        morsel = jar.get(COOKIE)
        if morsel is not None and morsel.value:
            return morsel.value
    return None


def session_cookie(token: str) -> str:
    """The ``Set-Cookie`` value that lets a browser that came with ``?token=`` in: HttpOnly, so the page's script
    never holds it, SameSite=Strict, so no other site's page sends it."""
    return f"{COOKIE}={token}; HttpOnly; SameSite=Strict; Path=/"
