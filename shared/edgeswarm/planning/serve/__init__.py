"""Planning of the ``serve-pipeline`` workload: partition a model into a pipeline and place it for throughput."""
