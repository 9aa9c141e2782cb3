"""The push webhook's ASGI route (``webhooks.PushRoute``, what daphne serves at ``/push/``).

Called in-process with ASGI messages through the real ``dashboard.asgi.application``,
against the session's real Redis and database: the same answers as the Django view
(``test_push_webhook.py``), a deletion made by another process honoured at once though
the config is cached here, concurrent deliveries batched into shared Redis round trips,
and other paths handed to Django. The end-to-end path over loopback is in
``test_push_live.py``; the speed is benchmark P10.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import pytest

from tasks_app.crypto import decrypt_json
from tasks_app.models import Agent, PushConfig, RemoteTask, TaskEvent
from tasks_app.services import push

# The route looks configs up on its own threads (their own connections): committed rows only.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _empty_queue(empty_push_queue: None) -> None:
    push._config_cache.clear()


@pytest.fixture
def config() -> PushConfig:
    agent = Agent.objects.create(
        name="routed", base_url=f"http://127.0.0.1:1/{uuid.uuid4().hex}/", push=True
    )
    task = RemoteTask.objects.create(
        agent=agent, title="t", remote_id="r-1", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_SUBMITTED", watch=RemoteTask.Watch.PUSH,
    )  # fmt: skip
    return push.new_config(task)


def source() -> str:
    return f"10.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}"


def update(i: int, task_id: str = "r-1") -> bytes:
    ts = f"2026-01-01T00:00:{i % 60:02d}.{i:06d}Z"
    return json.dumps(
        {
            "statusUpdate": {
                "taskId": task_id,
                "contextId": "c",
                "status": {"state": "TASK_STATE_WORKING", "timestamp": ts},
            }
        }
    ).encode()


def credentials(config: PushConfig) -> dict[str, str]:
    values = decrypt_json(config.secrets_encrypted)
    return {
        "x-a2a-notification-token": values["token"],
        "authorization": f"{values['scheme']} {values['credentials']}",
    }


async def call(path: str, body: bytes = b"", headers: dict[str, str] | None = None, *, method: str = "POST",
               addr: str = "") -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    """One HTTP request through the ASGI application, as daphne would make it."""
    from dashboard.asgi import application

    raw = [(b"content-type", b"application/a2a+json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()  # the client stays connected (Django listens for a disconnect)
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": raw,
        "client": (addr or source(), 40000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    await application(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body_out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode().lower(): v.decode() for k, v in start["headers"]}, body_out


def run(coro: Any) -> Any:
    """Run on a fresh loop, closing the loop's Redis client afterwards (no socket left open)."""

    async def main() -> Any:
        try:
            return await coro
        finally:
            batcher = push._batchers.get(asyncio.get_running_loop())
            if batcher is not None:
                await batcher.aclose()

    return asyncio.run(main())


def test_a_genuine_delivery_is_queued_and_recorded(config):
    status, headers, body = run(call(f"/push/{config.config_id}/", update(1), credentials(config)))
    assert (status, json.loads(body)) == (202, {"status": "accepted"})
    assert headers["x-content-type-options"] == "nosniff" and headers["cache-control"] == "no-store"
    items = push._redis().lpop(push.QUEUE_KEY, 10)
    assert len(items) == 1
    push.record_batch(items)
    assert list(
        TaskEvent.objects.filter(task_id=config.task_id).values_list("channel", flat=True)
    ) == ["push"]


def test_refusals_answer_as_the_view_does(config, caplog):
    path = f"/push/{config.config_id}/"
    good = credentials(config)
    assert run(call(path, method="GET"))[0] == 405
    assert run(call(path, update(2), {**good, "content-type": "text/plain"}))[0] == 415
    with caplog.at_level(logging.WARNING, logger="tasks_app.security"):
        assert run(call(path, update(3), {"x-a2a-notification-token": "x" * 43}))[0] == 401
        assert run(call(f"/push/{uuid.uuid4().hex}/", update(4), good))[0] == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "tasks_app.security"]
    assert len(lines) == 2 and all(good["x-a2a-notification-token"] not in line for line in lines)
    assert run(call(path, update(5, task_id="someone-else"), good))[0] == 400
    assert run(call(path, b"{not json", good))[0] == 400
    big = b" " * (push.settings.PUSH_MAX_BODY_BYTES + 1)
    assert run(call(path, big, good))[0] == 413
    assert push._redis().llen(push.QUEUE_KEY) == 0
    # The same delivery twice: the second is a repeat and queues nothing.
    assert run(call(path, update(6), good))[0] == 202
    assert run(call(path, update(6), good))[0] == 200
    assert push._redis().llen(push.QUEUE_KEY) == 1


def test_a_forging_address_is_cut_off_before_any_lookup(config, settings):
    settings.PUSH_REFUSED_PER_SOURCE = 3
    forger = source()

    async def forge() -> list[int]:
        return [
            (await call(f"/push/{uuid.uuid4().hex}/", update(i), addr=forger))[0] for i in range(6)
        ]

    assert run(forge()) == [404, 404, 404, 429, 429, 429]
    assert run(call(f"/push/{config.config_id}/", update(7), credentials(config)))[0] == 202


def test_a_deletion_in_another_process_is_refused_at_once_though_cached_here(config):
    path, good = f"/push/{config.config_id}/", credentials(config)
    assert run(call(path, update(8), good))[0] == 202
    assert config.config_id in push._config_cache
    # Another process deletes it (its own cache, the row and the marker); this one's cache still holds it.
    PushConfig.objects.filter(pk=config.pk).update(deleted_at=push.timezone.now())
    push._redis().set(f"{push.DELETED_PREFIX}{config.config_id}", 1, ex=push.DELETED_MARK_SECONDS)
    assert run(call(path, update(9), good))[0] == 404
    assert push._redis().llen(push.QUEUE_KEY) == 1


def test_concurrent_deliveries_share_round_trips_and_each_is_queued(config):
    path, good = f"/push/{config.config_id}/", credentials(config)
    round_trips: list[int] = []
    original = push._Batcher._round_trip

    async def counted(self: Any, batch: list[Any]) -> list[Any]:
        round_trips.append(len(batch))
        return await original(self, batch)

    async def many() -> list[int]:
        await call(path, update(100), good)  # the config cached, the scripts loaded
        round_trips.clear()
        answers = await asyncio.gather(*(call(path, update(101 + i), good) for i in range(50)))
        return [status for status, _, _ in answers]

    push._Batcher._round_trip = counted  # type: ignore[method-assign]
    try:
        statuses = run(many())
    finally:
        push._Batcher._round_trip = original  # type: ignore[method-assign]
    assert statuses == [202] * 50
    assert push._redis().llen(push.QUEUE_KEY) == 51
    assert sum(round_trips) == 50 and len(round_trips) < 50, round_trips


def test_other_paths_are_django_s(config):
    status, headers, _ = run(call("/push/not/ours/", b"", method="GET"))
    # Django's answer: its 404, with the Content-Security-Policy its middleware sets on every answer.
    assert status == 404 and "content-security-policy" in headers, headers
    assert headers["content-security-policy"] != "default-src 'none'; frame-ancestors 'none'"


def test_a_config_past_its_cache_time_is_used_and_read_again_and_a_removed_row_is_then_refused(
    config,
):
    """A genuine delivery never waits on the database for a config it had; a row removed behind
    the cache's back (no marker: its task deleted) is refused once the background read saw it go,
    and the delivery taken meanwhile is not recorded (the drain checks the config again)."""
    path, good = f"/push/{config.config_id}/", credentials(config)
    assert run(call(path, update(10), good))[0] == 202
    push._config_cache[config.config_id] = (
        push.time.monotonic() - 1,
        push._config_cache[config.config_id][1],
    )
    RemoteTask.objects.filter(pk=config.task_id).update(
        remote_id="r-1"
    )  # unchanged: the row is still there
    PushConfig.objects.filter(pk=config.pk).delete()  # gone behind the cache's back, no marker

    async def deliver_then_wait_for_the_read() -> int:
        status = (await call(path, update(11), good))[0]
        for _ in range(100):  # the background read
            if push._config_cache[config.config_id][1] is None:
                break
            await asyncio.sleep(0.05)
        return status

    assert run(deliver_then_wait_for_the_read()) == 202  # taken with what was cached
    assert push._config_cache[config.config_id][1] is None
    assert run(call(path, update(12), good))[0] == 404
    items = push._redis().lpop(push.QUEUE_KEY, 10)
    assert len(items) == 2
    push.record_batch(items)
    assert TaskEvent.objects.filter(task_id=config.task_id).count() == 0


def test_an_id_nobody_was_given_is_refused_without_a_lookup(config):
    good = credentials(config)
    push._fill_known()
    made_up = uuid.uuid4().hex
    assert run(call(f"/push/{made_up}/", update(20), good))[0] == 404
    assert made_up not in push._config_cache  # refused by the Redis script: no query was made
    assert run(call(f"/push/{config.config_id}/", update(21), good))[0] == 202


def test_a_config_row_made_another_way_is_found_by_the_next_fill(config):
    from tasks_app.crypto import encrypt_json

    restored = PushConfig.objects.create(  # e.g. from a backup: never announced to Redis
        task_id=config.task_id, config_id=uuid.uuid4().hex,
        secrets_encrypted=encrypt_json({"token": "t" * 43, "scheme": "Bearer", "credentials": "c" * 43}),
    )  # fmt: skip
    push._fill_known()
    push._redis().srem(push.KNOWN_KEY, restored.config_id)
    headers = {"x-a2a-notification-token": "t" * 43}
    assert run(call(f"/push/{restored.config_id}/", update(22), headers))[0] == 404
    push._redis().delete(push.KNOWN_READY)  # its time ran out: the next miss fills the set again
    push._config_cache.clear()
    assert run(call(f"/push/{restored.config_id}/", update(23), headers))[0] == 202
