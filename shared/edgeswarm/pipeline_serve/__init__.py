"""The ``serve-pipeline`` workload: a model served as a pipeline over the devices, cut and placed for throughput.

``spec`` is what a user submits; ``edgeswarm.planning.serve`` plans it; ``pipeline`` is the coordinator's program
(deploy, stream requests through a bounded window, re-plan and replay when a device is lost); ``stage`` is the
stage-worker's program (one forward-only stage per job); ``client`` is how anyone asks for inferences.
"""
