"""Planning of the ``train`` workload: Asteroid's hybrid pipeline parallelism (HPP) and its baselines.

The cost model (Eqs. 3 to 6), Algorithm 1 (``allocation``), Algorithm 2 (``asteroid``), the baselines, the
exhaustive-search oracle, the 1F1B schedule and simulator, the lightweight re-planner and the units a re-plan
moves. Pure functions over a ClusterProfile.
"""
