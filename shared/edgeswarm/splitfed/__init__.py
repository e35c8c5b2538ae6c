"""The ``train-splitfed`` workload: SmartSplit's split federated learning, each device training the first and last
parts of the model and an edge server (MEC) the middle (spec ``smartsplit-split-fl.md``).

Its role files are every workload package's (docs/adding-a-workload.md): ``spec``, ``planner``, ``coordinator``,
``worker`` (the device's half; ``mec`` the edge server's), ``compute``, ``workload`` and ``bench``; ``simulation``
runs the methods in one process, ``profiling`` and ``gather`` give the planner its figures.
"""
