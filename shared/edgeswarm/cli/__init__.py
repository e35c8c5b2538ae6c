"""The ``edgeswarm`` command line."""
