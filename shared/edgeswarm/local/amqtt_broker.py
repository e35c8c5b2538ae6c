"""The embedded fallback broker: amqtt (MQTT 3.1.1 only), run as its own process.

Used by ``edgeswarm up --local`` when Mosquitto is not on PATH, or with ``--broker amqtt``. It has no
MQTT 5 properties, which is why every edgeswarm message carries its envelope in the payload itself.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal


async def serve(host: str, port: int) -> None:
    """Run an anonymous amqtt broker on ``host:port`` until SIGTERM or SIGINT."""
    from amqtt.broker import Broker

    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}", "max_connections": 1000}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }
    broker = Broker(config)
    await broker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await broker.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
