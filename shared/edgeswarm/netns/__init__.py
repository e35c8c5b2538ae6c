"""Real hosts on one machine: every node of a cluster in its own Linux network namespace, with its own address,
its own broker and kernel-shaped links (``edgeswarm up --netns``), and the faults real networks have."""
