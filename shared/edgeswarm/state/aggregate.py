"""Averaging model states: FedAvg's weighted mean lives in ``edgeswarm.aggregation``, the one module of aggregation
math (flat and hierarchical FedAvg, the checks that refuse a bad update); this name stays for existing callers."""

from __future__ import annotations

from edgeswarm.aggregation import weighted_mean

__all__ = ["weighted_mean"]
