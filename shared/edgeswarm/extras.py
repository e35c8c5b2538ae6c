"""The package's optional parts (pyproject.toml's extras): which one a feature needs, and a clear error without it.

The core installs on a bare Jetson or Pi with nothing but what every command needs; the embedded broker (amqtt)
the PNG plots (matplotlib) and bench peers' Flower (flwr) are extras, imported only where used.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from edgeswarm.errors import MissingExtraError

Extra = Literal["broker", "plot", "peers"]

# The top-level module each extra provides, and what it is for (the error message says both).
_EXTRAS: dict[str, tuple[str, str]] = {
    "broker": ("amqtt", "the embedded amqtt broker"),
    "plot": ("matplotlib", "drawing PNGs"),
    "peers": ("flwr", "bench peers' Flower section"),
}


def missing_extra(extra: Extra) -> MissingExtraError:
    """The error to raise when ``extra`` is not installed: it names the module and the pip command that adds it."""
    module, purpose = _EXTRAS[extra]
    return MissingExtraError(f"{purpose} needs {module}, which is not installed: pip install 'edgeswarm[{extra}]'")


def has_extra(extra: Extra) -> bool:
    """Whether ``extra``'s module can be imported here (it is not imported)."""
    return importlib.util.find_spec(_EXTRAS[extra][0]) is not None


def require_extra(extra: Extra) -> None:
    """Raise MissingExtraError unless ``extra`` is installed; call it before work whose end needs the extra."""
    if not has_extra(extra):
        raise missing_extra(extra)
