"""The ``train-hpp`` workload (alias ``train``): Asteroid's hybrid pipeline-parallel training, each stage on a group
of devices with data parallelism inside it (spec ``asteroid-hpp-training.md``).

Its role files are every workload package's (docs/adding-a-workload.md): ``spec``, ``planner``, ``coordinator``,
``worker``, ``compute``, ``workload``, ``cli`` and ``bench``.
"""
