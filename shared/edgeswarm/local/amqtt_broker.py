"""The embedded fallback broker: amqtt (MQTT 3.1.1 only), run as its own process.

Used by ``edgeswarm up --local`` when Mosquitto is not on PATH, or with ``--broker amqtt``. It has no
MQTT 5 properties, which is why every edgeswarm message carries its envelope in the payload itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal


async def serve(host: str, port: int, *, password_file: str | None = None, acl_file: str | None = None,
                certfile: str | None = None, keyfile: str | None = None) -> None:
    """Run an amqtt broker on ``host:port`` until SIGTERM or SIGINT: anonymous, or with ``password_file`` only
    the users it lists (Argon2 hashes), with ``acl_file`` (JSON ``publish-acl`` and ``subscribe-acl``) only
    what they may do, and with ``certfile`` and ``keyfile`` over TLS."""
    from amqtt.broker import Broker

    listener: dict[str, object] = {"type": "tcp", "bind": f"{host}:{port}", "max_connections": 1000}
    if certfile:
        listener.update({"ssl": True, "certfile": certfile, "keyfile": keyfile})
    plugins: dict[str, object] = {}
    if password_file:
        plugins["amqtt.plugins.authentication.FileAuthPlugin"] = {"password_file": password_file}
    else:
        plugins["amqtt.plugins.authentication.AnonymousAuthPlugin"] = {"allow_anonymous": True}
    if acl_file:
        with open(acl_file) as f:
            acl = json.load(f)
        plugins["amqtt.plugins.topic_checking.TopicAccessControlListPlugin"] = {
            "publish_acl": acl["publish-acl"], "acl": acl["subscribe-acl"]}
    config = {"listeners": {"default": listener}, "plugins": plugins}
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
    parser.add_argument("--password-file", default=None)
    parser.add_argument("--acl-file", default=None)
    parser.add_argument("--certfile", default=None)
    parser.add_argument("--keyfile", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(serve(args.host, args.port, password_file=args.password_file, acl_file=args.acl_file,
                      certfile=args.certfile, keyfile=args.keyfile))


if __name__ == "__main__":
    main()
