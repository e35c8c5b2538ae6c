"""Password hashes in the formats the cluster's brokers read, and fresh random passwords.

Mosquitto 2.0 reads ``user:$7$<iterations>$<salt>$<hash>`` (PBKDF2-HMAC-SHA512, 12-byte salt, base64), the
format ``mosquitto_passwd`` writes; the embedded amqtt broker reads Argon2 hashes (through pwdlib, which amqtt
itself depends on). Passwords are 32 random bytes: guessing one is hopeless whatever the iteration count.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets

PBKDF2_ITERATIONS = 1000


def new_password() -> str:
    """A fresh random password (256 bits, URL-safe text, no characters a shell or a URL would mangle)."""
    return secrets.token_urlsafe(32)


def mosquitto_hash(password: str, *, salt: bytes | None = None, iterations: int = PBKDF2_ITERATIONS) -> str:
    """The Mosquitto 2.0 password-file hash of ``password`` (the part after ``user:``)."""
    salt = os.urandom(12) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def argon2_hash(password: str) -> str:
    """An Argon2 hash of ``password``, as amqtt's password file wants it."""
    from pwdlib import PasswordHash
    from pwdlib.hashers.argon2 import Argon2Hasher

    return str(PasswordHash((Argon2Hasher(),)).hash(password))
