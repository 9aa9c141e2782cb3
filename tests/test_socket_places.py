"""Open sockets are bounded per person, over every web process (``tasks_app.socket_places``).

Each socket had its own frame budget and nothing bounded how many one person opened: a
script with a viewer's session multiplied every per-socket bound by the sockets it opened.
Real Redis (places and the channel layer, under a private prefix), channels' communicator
on the websocket routes.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer

from tasks_app import consumers, socket_places
from tests import test_consumers
from tests.people import member
from tests.test_consumers import communicator, refused_with

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]

private_layer = test_consumers.private_layer  # a private channel-layer prefix (autouse)
task = test_consumers.task
user = test_consumers.user
CAP = 3


@pytest.fixture(autouse=True)
def small_cap(settings):
    settings.BUDGET_PERSON_SOCKETS = CAP


def places_held(user_id: int) -> int:
    prefix = get_channel_layer().prefix
    return socket_places._client().zcard(socket_places._key(prefix, user_id))


async def test_a_person_past_the_cap_is_refused_and_a_closed_socket_gives_its_place_back(
    task, user, django_user_model
):
    paths = ["/ws/tasks/", f"/ws/tasks/{task.pk}/"]  # both kinds count, together
    opened = []
    for i in range(CAP):
        comm = await communicator(paths[i % 2], user)
        assert await refused_with(comm) is None
        opened.append(comm)
    for path in paths:
        assert (
            await refused_with(await communicator(path, user)) == consumers.CLOSE_TOO_MANY_SOCKETS
        )
    # Another person is not counted with this one.
    other = await database_sync_to_async(
        lambda: member(django_user_model.objects.create_user(username="other"))
    )()
    elsewhere = await communicator("/ws/tasks/", other)
    assert await refused_with(elsewhere) is None
    # A socket that closes gives its place back: the next one is let in.
    await opened.pop().disconnect()
    assert await database_sync_to_async(places_held)(user.pk) == CAP - 1
    again = await communicator(paths[0], user)
    assert await refused_with(again) is None
    for comm in [*opened, again, elsewhere]:
        await comm.disconnect()
    assert await database_sync_to_async(places_held)(user.pk) == 0


async def test_connects_released_at_once_never_pass_the_cap(user):
    comms = [await communicator("/ws/tasks/", user) for _ in range(4 * CAP)]
    codes = await asyncio.gather(*(refused_with(comm) for comm in comms))
    open_ones = [comm for comm, code in zip(comms, codes, strict=True) if code is None]
    assert 1 <= len(open_ones) <= CAP, codes
    assert all(code in (None, consumers.CLOSE_TOO_MANY_SOCKETS) for code in codes)
    assert await database_sync_to_async(places_held)(user.pk) == len(open_ones)
    for comm in comms:
        await comm.disconnect()


async def test_a_place_left_by_a_killed_web_process_lapses(user):
    """A process killed with sockets open never gives their places back; they lapse."""
    prefix = get_channel_layer().prefix
    key = socket_places._key(prefix, user.pk)
    lapsed = {f"dead-{i}": time.time() - 1 for i in range(CAP)}
    await database_sync_to_async(lambda: socket_places._client().zadd(key, lapsed))()
    comm = await communicator("/ws/tasks/", user)
    assert await refused_with(comm) is None
    assert await database_sync_to_async(places_held)(user.pk) == 1
    await comm.disconnect()


async def test_an_open_socket_renews_its_place_and_one_that_lost_it_is_closed(user, monkeypatch):
    """Renewed whatever the browser sends (an idle socket held its place only until it
    lapsed, and then was not counted); a place gone when it renews closes the socket."""
    monkeypatch.setattr(socket_places, "RENEW_AFTER_SECONDS", 0.1)
    prefix = get_channel_layer().prefix
    key = socket_places._key(prefix, user.pk)

    def places() -> list[tuple[bytes, float]]:
        return socket_places._client().zrange(key, 0, -1, withscores=True)

    comm = await communicator("/ws/tasks/", user)
    assert await refused_with(comm) is None
    first = await database_sync_to_async(places)()
    await asyncio.sleep(0.5)  # nothing sent by the browser
    later = await database_sync_to_async(places)()
    assert len(first) == len(later) == 1 and later[0][1] > first[0][1]
    # The place lapsed and went (a stalled process): the socket is closed at its renewal.
    await database_sync_to_async(lambda: socket_places._client().delete(key))()
    closed = await comm.receive_output(timeout=5)
    assert closed == {"type": "websocket.close", "code": consumers.CLOSE_TOO_MANY_SOCKETS}
    await comm.disconnect()
    assert await database_sync_to_async(places)() == []
