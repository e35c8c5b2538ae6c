"""Galaxy's hybrid model parallelism (HMP) on one rank: weight shards, tiled collectives and the layer runtime."""
