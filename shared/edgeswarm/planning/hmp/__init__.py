"""Planning for Galaxy's hybrid model parallelism (``serve-hmp``): how many heads, MLP columns and rows each device
takes in every layer (Algorithm 1 of the paper, spec ``galaxy-hmp-inference.md`` section 3), and the latency each
parallelism is predicted to reach. Pure: no I/O, no torch."""
