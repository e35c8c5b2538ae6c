"""Measured spans of what workers did (forward, backward, transfers, collective steps, waiting), collected on the
hub and written as Chrome trace format."""
