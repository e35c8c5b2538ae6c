"""The checkpoint-store service: versioned model and optimizer state per job and stage, over MQTT."""
