"""Plug-ins from other installed packages: job kinds and services found through entry points.

A package extends edgeswarm without editing it by declaring entry points in one of these groups (in its
``pyproject.toml``, ``[project.entry-points."edgeswarm.workloads"]``):

* ``edgeswarm.workloads``: name = the job kind, value = ``"module:Class"`` of its ``workloads.base.Workload``;
* ``edgeswarm.services``: name = the service, value = ``"module:attr"`` of its ``ServiceEntry``.

Only the metadata is read here: nothing of a plug-in is imported until its kind or service is used, so a broken
plug-in fails the command that uses it (with its name), not every command. A service's entry is the exception: the
topic tree, the ACL and the launcher read every service's roles and writers, so the module its entry point names is
imported whenever the service registry is read; keep the ``ServiceEntry`` in a light module of its own and point its
``target`` at the service class elsewhere (``docs/adding-a-service.md``).
"""

from __future__ import annotations

import logging
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any

from edgeswarm.errors import ConfigError

log = logging.getLogger(__name__)

WORKLOAD_GROUP = "edgeswarm.workloads"
SERVICE_GROUP = "edgeswarm.services"


def discovered(group: str) -> dict[str, str]:
    """The entry points of ``group`` in the installed packages: name -> ``"module:attr"``, in name order."""
    return {ep.name: ep.value for ep in sorted(entry_points(group=group), key=lambda ep: ep.name)}


def load_target(target: str, what: str) -> Any:
    """The object ``"module:attr"`` names. Raises ConfigError naming ``what`` (for example "job kind 'toy'") when it
    cannot be imported, so a broken plug-in is reported as such."""
    module, _, attr = target.partition(":")
    try:
        return getattr(import_module(module), attr) if attr else import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure of a plug-in's import is the plug-in's, reported with it
        raise ConfigError(f"{what} comes from {target!r}, which cannot be loaded: {type(exc).__name__}: {exc}") \
            from None
