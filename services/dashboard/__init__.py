"""The dashboard service: the cluster on one live page (edgeswarm.dashboard)."""
