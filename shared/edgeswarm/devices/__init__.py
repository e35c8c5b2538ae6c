"""Device classes, cluster files and the emulation of a device on one machine."""
