"""``/healthz`` while people watch: the channel-layer check must not share the layer that the
web process's websockets receive on.

channels_redis lets one event loop at a time receive on a layer instance. In the web
process daphne's loop receives for every open websocket, and the check ran its round trip
on the same instance from a thread of its own loop: it raised ``RuntimeError`` ("Two event
loops are trying to receive() on one channel layer at once"), so ``/healthz`` answered 503
whenever anyone had a dashboard page open (found by driving the running dashboard with a
browser). Here a loop in another thread receives on the process's layer, as daphne's does,
while the check runs; the real Redis of the suite carries both.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator

import pytest
from channels.layers import channel_layers, get_channel_layer
from django.test import Client

from tasks_app import health


@pytest.fixture
def private_layer(settings) -> Iterator[None]:
    layer = dict(settings.CHANNEL_LAYERS["default"])
    layer["CONFIG"] = {**layer["CONFIG"], "prefix": f"health-{uuid.uuid4().hex[:8]}"}
    settings.CHANNEL_LAYERS = {"default": layer}
    channel_layers.backends.clear()  # get_channel_layer() builds one from these settings
    yield
    channel_layers.backends.clear()


@pytest.fixture
def receiving(private_layer) -> Iterator[None]:
    """A loop in a thread of its own receiving on the process's layer (as daphne's loop does
    for an open websocket) until the test ends."""
    layer = get_channel_layer()
    loop = asyncio.new_event_loop()
    started = threading.Event()

    async def receive_until_stopped() -> None:
        channel = await layer.new_channel()
        started.set()
        await layer.receive(channel)  # nothing is sent to it: cancelled at the end

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    future = asyncio.run_coroutine_threadsafe(receive_until_stopped(), loop)
    assert started.wait(10)
    try:
        yield
    finally:
        loop.call_soon_threadsafe(future.cancel)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        # Closed here: left to the garbage collector, it was closed during a later test, and
        # channels_redis's close then ran this loop inside that test's (a warning in CI).
        if not thread.is_alive():
            loop.close()


def test_the_channel_layer_check_passes_while_a_socket_receives(receiving) -> None:
    for _ in range(3):  # and again: the check leaves nothing behind that the next trips on
        health.check_channel_layer(1.5)


@pytest.mark.django_db
def test_healthz_names_the_channel_layer_ok_while_a_socket_receives(
    receiving, django_user_model
) -> None:
    staff = django_user_model.objects.create_user("ops", password="pw-12345678", is_staff=True)
    client = Client()
    client.force_login(staff)
    checks = client.get("/healthz").json()["checks"]
    assert checks["channel_layer"]["ok"] is True, checks
    assert checks["redis"]["ok"] is True, checks
