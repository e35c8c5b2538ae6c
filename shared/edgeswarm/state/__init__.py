"""Model state every workload shares: a model's weights and optimizer state by unit (``units``: extract, load, pack
for the wire, map to checkpoint names) and where a plan's units live in the checkpoint store (``layout``). FedAvg's
averaging of states is ``edgeswarm.aggregation``'s."""
