"""Checkpoints: versioned model and optimizer state per job and stage.

``store`` keeps them on disk (atomic writes, a SHA-256 checked on every read, the last K versions);
``uploads`` assembles uploads that arrive tensor by tensor; ``client`` saves and loads them over MQTT
through the checkpoint-store service (``from edgeswarm.checkpoints.client import save_checkpoint,
load_checkpoint``; not imported here, because the messages import this package's types).
"""

from edgeswarm.checkpoints.store import CheckpointStore, read_checkpoint
from edgeswarm.values.checkpoints import CheckpointInfo, TensorEntry, as_torch

__all__ = ["CheckpointInfo", "CheckpointStore", "TensorEntry", "as_torch", "read_checkpoint"]
