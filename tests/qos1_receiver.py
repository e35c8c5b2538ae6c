"""A slow QoS 1 receiver for tests/test_bus_delivery.py, run as its own process so the test can pause it (SIGSTOP, as
`edgeswarm chaos pause` does).

    python qos1_receiver.py HUB_URL TOPIC_FILTER COUNT OUT_FILE

Subscribes to TOPIC_FILTER at QoS 1 with small inbox shards, writes
``TOPIC MSG_ID`` for every message it handles to OUT_FILE, says ``ready`` on stdout once subscribed, and exits once it
has handled COUNT messages (or after two minutes).
"""

from __future__ import annotations

import sys
import threading
import uuid

from edgeswarm.bus import Bus, Inbound
from edgeswarm.settings import Settings
from edgeswarm.wire import Sender

HOLD_KEEPALIVE_S = 2  # the inbox holds the network thread for at most half of it


def main() -> None:
    hub, topic_filter, count, out_file = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    done = threading.Event()
    handled = [0]
    with open(out_file, "w", buffering=1) as out:

        def handle(msg: Inbound) -> None:
            out.write(f"{msg.topic} {msg.envelope.msg_id}\n")
            handled[0] += 1
            if handled[0] >= count:
                done.set()

        settings = Settings(hub_url=hub, keepalive_s=HOLD_KEEPALIVE_S, workers=2, inbox_capacity=32)
        bus = Bus(settings, Sender(node="rx", service="sink", instance=uuid.uuid4().hex[:12]))
        bus.start()
        bus.subscribe(topic_filter, handle)
        print("ready", flush=True)
        done.wait(120)
        bus.stop()
        print(f"counters {bus.metrics.snapshot()[0]}", flush=True)


if __name__ == "__main__":
    main()
