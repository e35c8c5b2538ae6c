"""The bus: the only way edgeswarm code talks to MQTT brokers."""

from edgeswarm.bus.bus import Bus, Expectation, Handler, Inbound, RawHandler, RawInbound, ReplyStream

__all__ = ["Bus", "Expectation", "Handler", "Inbound", "RawHandler", "RawInbound", "ReplyStream"]
