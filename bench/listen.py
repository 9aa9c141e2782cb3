"""A relay listener in its own process: ``python -m bench.listen GROUP COUNT TIMEOUT``.

It stands for the web process that a browser's websocket is on: it joins
``GROUP`` on the channel layer (the settings come from the environment the
bench child passes on), prints ``READY`` once joined, counts the log rows that
arrive, and prints ``DONE <count> <monotonic seconds of the last arrival>``
when ``COUNT`` rows arrived or ``TIMEOUT`` seconds passed since ``READY``.

In its own process, the listener's reading and decoding do not compete with the
recording process for the interpreter lock, as in a deployment, where the
worker records and relays and the web process receives.
``time.monotonic()`` is one clock for every process of the machine, so the
recorder compares it with its own start.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time


async def listen(group: str, count: int, timeout: float) -> tuple[int, float]:
    from channels.layers import get_channel_layer

    from bench.inproc import relayed_events

    layer = get_channel_layer()
    channel = await layer.new_channel()
    await layer.group_add(group, channel)
    print("READY", flush=True)
    received, last_at = 0, 0.0
    deadline = time.monotonic() + timeout
    while received < count:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            message = await asyncio.wait_for(layer.receive(channel), left)
        except TimeoutError:
            break
        events = relayed_events(message)
        if events:
            received += len(events)
            last_at = time.monotonic()
    await layer.group_discard(group, channel)
    return received, last_at


def main(argv: list[str]) -> int:
    group, count, timeout = argv[0], int(argv[1]), float(argv[2])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
    import django

    django.setup()
    received, last_at = asyncio.run(listen(group, count, timeout))
    print(f"DONE {received} {last_at!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
