"""The built-in services. Each runs as its own process: ``edgeswarm service NAME`` (the entry point of every container).

Their registry is ``edgeswarm.service_registry``: a built-in service is a package here and one entry in its
``BUILT_IN``; a service of another package is an entry point (``docs/adding-a-service.md``). The names below are
re-exported for the code and tests that read them from here; ``SERVICES`` is every service, plug-ins' included.
"""

from __future__ import annotations

from typing import Any

from edgeswarm.service_registry import ServiceEntry, service_class, service_entry, services, services_of

__all__ = ["SERVICES", "ServiceEntry", "service_class", "service_entry", "services", "services_of"]


def __getattr__(name: str) -> Any:
    # SERVICES is read when asked for, not at import: the plug-ins' entries are found then.
    if name == "SERVICES":
        return services()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
