"""edgeswarm: heterogeneous edge devices training and serving DNNs together over MQTT."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("edgeswarm")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+local"
