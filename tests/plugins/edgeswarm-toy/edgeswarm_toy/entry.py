"""The toy-worker's registry entry: a light module (the registry imports it whenever it is read), naming the
service's class for when it is started. It runs on every device; only the hub sends it requests (the default)."""

from __future__ import annotations

from edgeswarm.service_registry import ServiceEntry

ENTRY = ServiceEntry(target="edgeswarm_toy.service:ToyWorkerService", roles=("device",))
