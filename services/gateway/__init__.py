"""The gateway service: an OpenAI-compatible API over the cluster's serve-hmp jobs (edgeswarm.gateway)."""
