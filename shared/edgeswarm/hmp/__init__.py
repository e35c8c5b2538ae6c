"""The ``serve-hmp`` workload: Galaxy's hybrid model parallelism, every layer split across devices by heads, MLP
columns and sequence rows (spec ``galaxy-hmp-inference.md``).

Its role files are every workload package's (docs/adding-a-workload.md): ``spec``, ``planner``, ``coordinator``,
``worker``, ``compute`` (with ``layer``, ``sharding`` and ``tiles``), ``workload``, ``cli`` and ``bench``;
``profiling`` and ``gather`` give the planner its figures, ``client`` is how anyone asks for inferences.
"""
