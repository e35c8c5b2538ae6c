"""A toy workload for edgeswarm, from its own package: ``kind: toy`` jobs double the numbers 1..steps, one step at a
time, on the devices' ``toy-worker`` services, round-robin over the devices its planner picked."""
