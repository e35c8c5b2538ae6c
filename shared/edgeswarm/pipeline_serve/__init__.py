"""The ``serve-pipeline`` workload: a model served as a pipeline over the devices, cut and placed for throughput
(spec ``partition-placement-inference.md``).

Its role files are every workload package's (docs/adding-a-workload.md): ``spec``, ``planner`` (``planning.serve``
plans), ``coordinator`` (deploy, stream requests through a bounded window, re-plan and replay when a device is lost),
``worker`` (one forward-only stage per job), ``compute``, ``workload``, ``cli`` and ``bench``; ``client`` is how
anyone asks for inferences.
"""
