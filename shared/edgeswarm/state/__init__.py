"""Model state every workload shares: a model's weights and optimizer state by unit (``units``: extract, load, pack
for the wire, map to checkpoint names), where a plan's units live in the checkpoint store (``layout``), and the
pure averaging of states (``aggregate``: FedAvg's weighted mean)."""
