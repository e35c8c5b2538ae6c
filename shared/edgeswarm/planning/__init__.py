"""The planners: pure functions over a ClusterProfile, one sub-package per workload.

``hpp``: Asteroid's hybrid pipeline-parallel training plans (the ``train`` workload); ``serve``: pipelined
inference partitioned and placed for throughput (``serve-pipeline``). What every planner shares sits here:
``vocabulary`` (unit times at a batch size, link matrices, Eq. 3's static memory), ``budget`` and ``deadline``
(the planner's time budget), ``synthetic`` (profiles for tests and benchmarks).
"""
