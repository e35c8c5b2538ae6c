"""The dashboard: the whole cluster on one live page, served by the hub's ``dashboard`` service.

* ``model``: the snapshot the page draws (pydantic);
* ``snapshot``: pure functions from the observed messages to a snapshot; ``health``: the warnings with their fixes;
* ``observer``: what the service hears on the bus, bounded;
* ``auth``: where it listens and the token it asks for; ``server``: the HTTP server (stdlib), with Server-Sent
  Events pushing each snapshot to the open pages;
* ``static/``: the page, plain HTML, CSS and JavaScript drawing with SVG, shipped as package data and served as
  it is. It uses no third-party JavaScript library (so there is nothing to pin or fetch) and needs no build step.

The plan drawings and per-kind figures come from each job kind's workload (``Workload.plan_view`` and
``Workload.series``, ``edgeswarm.workloads.views``), so a kind added later, a plug-in's included, is drawn too.
"""
