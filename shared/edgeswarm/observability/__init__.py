"""Prometheus metrics for the whole cluster, exposed on the hub."""
