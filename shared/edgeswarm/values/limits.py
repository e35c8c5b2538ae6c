"""Size caps on what the profiler produces and the planner reads: profiles, plans, plan and re-plan requests.

Every cap lives here so that the schemas (edgeswarm.values.profiles, edgeswarm.planning.hpp.types,
edgeswarm.messages.planning), the profiler's request checks and the planner's work estimate agree. The caps
bound the *shape* of a request (how many units, devices, rows); how long planning a request of that shape
takes is bounded separately by the planner's time budget (edgeswarm.planning.budget), because a request can
be within every cap and still ask for hours of search.

Each value leaves generous headroom over real use: the largest profile planned today is a synthetic
EfficientNet-B1 at the paper's L = 213 units (``edgeswarm bench planner``; the zoo's own EfficientNet-B1 has
85 units, GPT-2 small 28), on clusters of 3 to 12 devices, at batch sizes up to 256 and global batches of
at most 2048.
"""

from __future__ import annotations

# Units of one model's layer sequence. About 5x the paper's 213-unit EfficientNet-B1; deep zoo configurations
# fit too (GPT-2 takes 2 units per layer, BERT 4, so n_layer 500 or 250 layers).
MAX_UNITS = 1024

# Devices in one cluster profile. Edge clusters here are 3 to 12 devices (the Asteroid environments have 4 to
# 6); 64 is 5x the largest. The HPP search grows with N^3 per level, so the time budget refuses most plans far
# below this cap anyway: the cap only keeps lists short.
MAX_DEVICES = 64

# Measured links: one per ordered pair of distinct devices (the profiler reports both directions).
MAX_LINKS = MAX_DEVICES * (MAX_DEVICES - 1)

# Batch sizes a device is profiled at, and the largest one: the profiler's own request limits
# (edgeswarm.profiling.device.check_batch_sizes), so every profile it produces is accepted.
MAX_BATCH_SIZE = 4096
MAX_BATCH_GRID = 64

# Samples per training round (M micro-batches of B). 512x the paper's largest global batch (2048); the
# number of micro-batches divides it, so it bounds M as well (a single device may accumulate G micro-batches
# of one sample, so a plan's M can reach G).
MAX_GLOBAL_BATCH = 1 << 20

# A plan's epoch counts the re-plans of one job; 2^31 - 1 keeps it a 32-bit integer for every decoder.
MAX_EPOCH = (1 << 31) - 1

# Strings. Names and fingerprints are identifiers (a model fingerprint is 64 hex digits, a device's 16);
# unit names are module paths (the zoo's longest is 21 characters) and ``ops`` lists a unit's distinct
# operator kinds (the zoo's longest is 100 characters, a GPT-2 attention block).
MAX_ID_CHARS = 128
MAX_UNIT_NAME_CHARS = 512
MAX_OPS_CHARS = 2048

# A model config (ModelSpec.config): the zoo's models take at most 9 keys.
MAX_CONFIG_KEYS = 32
MAX_CONFIG_KEY_CHARS = 64
MAX_CONFIG_VALUE_CHARS = 256

# Byte counts. The cost model keeps prefix sums of them in int64 and multiplies activation sums by B and by the
# warm-up K (at most 2 * MAX_DEVICES - 1). With at most 2^32 bytes per sample per unit (4 GiB; the zoo's units
# save megabytes) and 2^40 per unit otherwise (1 TiB of weights in one unit), those products stay below 2^63
# for MAX_UNITS units.
MAX_SAMPLE_BYTES = 1 << 32
MAX_UNIT_BYTES = 1 << 40
# A device's memory budget: 1 PiB, far beyond any one device, and small enough for the same int64 arithmetic.
MAX_MEMORY_BYTES = 1 << 50
# Peers whose arrivals one device reports a round (LinkSample): a job's plan names a few of them.
MAX_LINK_SAMPLES = 64
