"""The roles of a cluster's members, written once.

A member logs in to the brokers in one role (``security.credentials``), and the topic tree grants rights by role
(``topics``, ``security.acl``). Three roles are nodes, which run services (``service_registry``):

* ``hub``: the node that runs the cluster's control (coordinator, planner, checkpoint store);
* ``device``: an edge device that computes (stage-worker, profiler, node-agent);
* ``edge``: an edge server (MEC) that hosts work for devices, such as split learning's server half. It is a node
  like a device (node-agent, profiler), but not a stage-worker: training and serving plans do not place stages on it.

``client`` is a command-line user: it submits and cancels jobs and runs no service.
"""

from __future__ import annotations

from typing import Literal

Role = Literal["hub", "device", "edge", "client"]
ROLES: tuple[Role, ...] = ("hub", "device", "edge", "client")

NodeRole = Literal["hub", "device", "edge"]
NODE_ROLES: tuple[NodeRole, ...] = ("hub", "device", "edge")
