"""The ``serve-hmp`` workload: Galaxy's hybrid model parallelism, every layer split across devices by heads, MLP
columns and sequence rows (spec ``galaxy-hmp-inference.md``)."""
