"""The push webhook against bad input: each refusal, its status, and that nothing changed.

In-process Django (the real view, middleware and URL) with the session's real Redis; the
end-to-end path with a real agent delivering over loopback is in ``test_push_live.py``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

import pytest
from django.test import Client

from tasks_app.crypto import decrypt_json
from tasks_app.models import Agent, PushConfig, RemoteTask, TaskEvent
from tasks_app.services import push

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("empty_push_queue")]


@pytest.fixture
def task() -> RemoteTask:
    agent = Agent.objects.create(
        name="pushy", base_url=f"http://127.0.0.1:1/{uuid.uuid4().hex}/", push=True
    )
    return RemoteTask.objects.create(
        agent=agent, title="t", remote_id="t-1", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_SUBMITTED", watch=RemoteTask.Watch.PUSH,
    )  # fmt: skip


@pytest.fixture
def config(task: RemoteTask) -> PushConfig:
    return push.new_config(task)


@pytest.fixture
def still_windows(monkeypatch) -> None:
    """The rate windows held at this moment: the refusals a test counts per minute must not
    straddle a minute's end (a slow machine's dozen requests can)."""
    now = int(time.time())
    monkeypatch.setattr(push, "_window", lambda key, seconds: f"{key}:{now // seconds}")


def secrets_of(config: PushConfig) -> dict:
    return decrypt_json(config.secrets_encrypted)


def source() -> str:
    """A fresh source address per call: the refusal counts of one test do not touch another."""
    return f"10.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}"


def status_update(
    task_id: str = "t-1", state: str = "TASK_STATE_WORKING", ts: str = "2026-01-01T00:00:01Z"
) -> bytes:
    return json.dumps(
        {
            "statusUpdate": {
                "taskId": task_id,
                "contextId": "c",
                "status": {"state": state, "timestamp": ts},
            }
        }
    ).encode()


def deliver(
    config_id: str,
    body: bytes,
    *,
    token: str | None = None,
    authorization: str | None = None,
    content_type: str = "application/a2a+json",
    addr: str = "",
) -> tuple[int, dict]:
    headers = {"REMOTE_ADDR": addr or source(), "CONTENT_TYPE": content_type}
    if token is not None:
        headers["HTTP_X_A2A_NOTIFICATION_TOKEN"] = token
    if authorization is not None:
        headers["HTTP_AUTHORIZATION"] = authorization
    response = Client().post(f"/push/{config_id}/", data=body, content_type=content_type, **headers)
    return response.status_code, response.json()


def good(config: PushConfig, body: bytes, **kwargs: object) -> tuple[int, dict]:
    values = secrets_of(config)
    return deliver(
        config.config_id,
        body,
        token=values["token"],
        authorization=f"{values['scheme']} {values['credentials']}",
        **kwargs,  # type: ignore[arg-type]
    )


def queued() -> int:
    return int(push._redis().llen(push.QUEUE_KEY))


def unchanged(task: RemoteTask) -> None:
    """None of the refusals changes a task: no row, no snapshot change, nothing queued."""
    fresh = RemoteTask.objects.get(pk=task.pk)
    assert fresh.last_seq == task.last_seq
    assert fresh.state == task.state
    assert TaskEvent.objects.filter(task=task).count() == 0
    assert queued() == 0


def drain_here() -> dict[int, str]:
    """What the worker's drain records (without its GetTask, which needs an agent)."""
    items = push._redis().lpop(push.QUEUE_KEY, 1000) or []
    return push.record_batch(items)


def test_a_genuine_notification_is_accepted_queued_and_recorded_on_push(task, config):
    status, body = good(config, status_update())
    assert (status, body) == (202, {"status": "accepted"})
    assert queued() == 1
    assert set(drain_here()) == {task.pk}
    event = TaskEvent.objects.get(task=task)
    assert (event.channel, event.kind) == ("push", "statusUpdate")
    config.refresh_from_db()
    assert config.received == 1 and config.last_received_at is not None


def test_a_batch_recorded_again_after_a_kill_is_not_counted_again(task, config):
    """A drain killed after it counted a batch, before it took the batch off the queue: the
    next drain records the same batch again (appending nothing), and counted every
    notification of it a second time."""
    other = RemoteTask.objects.create(
        agent=task.agent, title="u", remote_id="t-2", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_SUBMITTED", watch=RemoteTask.Watch.PUSH,
    )  # fmt: skip
    other_config = push.new_config(other)
    for second in range(1, 4):
        assert good(config, status_update(ts=f"2026-01-01T00:00:0{second}Z"))[0] == 202
    assert good(other_config, status_update("t-2"))[0] == 202
    r = push._redis()
    items = r.lrange(push.QUEUE_KEY, 0, -1)
    stamps = [json.loads(item)["n"] for item in items]
    assert stamps == sorted(set(stamps))  # each delivery stamped, each later one larger
    assert int(r.get(push.QUEUE_BYTES_KEY)) == sum(len(item) for item in items)
    push.record_batch(items)
    push.record_batch(items)  # the batch again, as the next drain reads it
    config.refresh_from_db()
    other_config.refresh_from_db()
    assert (config.received, other_config.received) == (3, 1)
    assert TaskEvent.objects.filter(task=task, channel="push").count() == 3
    # A Redis that lost its keys goes on stamping past what was counted (its clock).
    r.delete(push.SEQ_KEY, push.QUEUE_KEY)
    assert good(config, status_update(ts="2026-01-01T00:00:09Z"))[0] == 202
    later = r.lrange(push.QUEUE_KEY, 0, -1)
    assert json.loads(later[0])["n"] > stamps[-1]
    # Read with what was counted already, only the new one counts.
    push.record_batch(items[:3] + later)
    config.refresh_from_db()
    assert config.received == 4 and config.counted_through == json.loads(later[0])["n"]
    # One queued before deliveries were stamped is counted as it comes.
    unstamped = json.dumps({"c": config.pk, "t": task.pk, "e": json.loads(status_update(
        ts="2026-01-01T00:00:10Z"))})  # fmt: skip
    push.record_batch([unstamped.encode()])
    config.refresh_from_db()
    assert config.received == 5


def test_both_content_types_are_accepted_and_others_refused(task, config):
    assert (
        good(config, status_update(ts="2026-01-01T00:00:02Z"), content_type="application/json")[0]
        == 202
    )
    assert (
        good(
            config,
            status_update(ts="2026-01-01T00:00:03Z"),
            content_type="application/a2a+json; charset=utf-8",
        )[0]
        == 202
    )
    push._redis().delete(push.QUEUE_KEY)
    assert (
        good(config, status_update(ts="2026-01-01T00:00:04Z"), content_type="text/plain")[0] == 415
    )
    unchanged(task)


@pytest.mark.parametrize(
    "which", ["none", "wrong token", "wrong credentials", "wrong scheme", "one wrong of two"]
)
def test_missing_or_wrong_credentials_are_401_with_one_security_line_and_no_secret(
    task, config, which, caplog
):
    values = secrets_of(config)
    right_auth = f"{values['scheme']} {values['credentials']}"
    kwargs: dict = {
        "none": {},
        "wrong token": {"token": "x" * 43},
        "wrong credentials": {"authorization": "Bearer " + "y" * 43},
        "wrong scheme": {"authorization": "Basic " + values["credentials"]},
        "one wrong of two": {"token": "x" * 43, "authorization": right_auth},
    }[which]
    with caplog.at_level(logging.WARNING, logger="tasks_app.security"):
        status, body = deliver(config.config_id, status_update(), **kwargs)
    assert status == 401 and "error" in body
    lines = [r for r in caplog.records if r.name == "tasks_app.security"]
    assert len(lines) == 1
    text = lines[0].getMessage()
    assert "refused" in text and config.config_id in text
    assert (
        values["token"] not in text and values["credentials"] not in text and "x" * 43 not in text
    )
    unchanged(task)


def test_either_credential_alone_is_enough_when_right(task, config):
    values = secrets_of(config)
    assert (
        deliver(config.config_id, status_update(ts="2026-01-01T00:00:05Z"), token=values["token"])[
            0
        ]
        == 202
    )
    assert (
        deliver(
            config.config_id,
            status_update(ts="2026-01-01T00:00:06Z"),
            authorization=f"bearer {values['credentials']}",  # the scheme is case-insensitive
        )[0]
        == 202
    )


def test_unknown_or_deleted_config_is_404(task, config):
    assert good(config, status_update(), addr="10.9.9.9")[0] == 202
    push._redis().delete(push.QUEUE_KEY)
    status, _ = deliver(uuid.uuid4().hex, status_update(), token=secrets_of(config)["token"])
    assert status == 404
    push.mark_deleted(config.config_id, "test")
    assert good(config, status_update(ts="2026-01-01T00:00:09Z"))[0] == 404
    unchanged(task)


def test_a_notification_about_another_task_is_400(task, config):
    status, body = good(config, status_update(task_id="someone-else"))
    assert status == 400 and "another task" in body["error"]
    unchanged(task)


def test_oversized_is_413_before_parsing(task, config, settings):
    settings.PUSH_MAX_BODY_BYTES = 1000
    big = json.dumps({"statusUpdate": {"taskId": "t-1", "pad": "x" * 2000}}).encode()
    assert good(config, big)[0] == 413
    unchanged(task)


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        b'{"foo": {}}',
        b'{"task": {"id": "t-1"}, "statusUpdate": {}}',
        b"[" * 5000,
        b"",
    ],
    ids=["broken", "array", "no kind", "two kinds", "too deep", "empty"],
)
def test_malformed_bodies_are_400(task, config, body):
    assert good(config, body)[0] == 400
    unchanged(task)


def test_get_is_405(config):
    response = Client().get(f"/push/{config.config_id}/")
    assert response.status_code == 405


def test_a_flood_on_one_config_is_429_while_another_config_gets_through(task, config, settings):
    """The per-config rate counts in one-second windows (epoch seconds, as the server keys
    them). However slow this machine is, no window lets more than the rate through, and a
    window that saw more requests than the rate refused the rest."""
    settings.PUSH_RATE_PER_CONFIG = limit = 3
    other_task = RemoteTask.objects.create(
        agent=task.agent, title="u", remote_id="t-2", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_WORKING", watch=RemoteTask.Watch.PUSH,
    )  # fmt: skip
    other = push.new_config(other_task)
    addr = source()
    sent: list[tuple[int, int, int]] = []  # (window when sent, window when answered, status)
    for i in range(300):  # until a refusal was seen; a few windows' worth on any machine
        before = int(time.time())
        status = good(
            config, status_update(ts=f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}Z"), addr=addr
        )[0]
        sent.append((before, int(time.time()), status))
        if status == 429 and len(sent) >= 30:
            break
    statuses = [status for _, _, status in sent]
    assert set(statuses) <= {202, 429}
    assert 429 in statuses
    spanned = {w for before, after, _ in sent for w in (before, after)}
    assert statuses.count(202) <= limit * len(spanned)
    for window in spanned:
        inside = [status for before, after, status in sent if before == after == window]
        assert inside.count(202) <= limit
        assert inside.count(429) >= len(inside) - limit
    assert good(other, status_update(task_id="t-2"), addr=addr)[0] == 202


def test_a_forging_source_is_cut_off_while_other_sources_get_through(
    task, config, settings, still_windows
):
    settings.PUSH_REFUSED_PER_SOURCE = 5
    forger = source()
    statuses = [
        deliver(config.config_id, status_update(), token="forged", addr=forger)[0]
        for _ in range(12)
    ]
    assert statuses[:5] == [401] * 5
    assert statuses[5:] == [429] * 7  # refused before any lookup
    assert queued() == 0
    assert good(config, status_update(), addr=source())[0] == 202


def test_a_forger_rotating_addresses_within_one_ipv6_64_is_cut_off(
    task, config, settings, still_windows
):
    """Counted per exact address, a forger on one IPv6 host (a /64 of its own) was never cut
    off: each request came from a new address."""
    settings.PUSH_REFUSED_PER_SOURCE = 5
    prefix = f"2001:db8:{uuid.uuid4().int % 65535:x}:{uuid.uuid4().int % 65535:x}"
    statuses = [
        deliver(config.config_id, status_update(), token="forged", addr=f"{prefix}::{n:x}")[0]
        for n in range(1, 9)
    ]
    assert statuses == [401] * 5 + [429] * 3
    # Another /64, an IPv4 address and its mapped form are other sources; the mapped form
    # counts as its IPv4 address.
    other = f"2001:db8:{uuid.uuid4().int % 65535:x}:{uuid.uuid4().int % 65535:x}::1"
    assert deliver(config.config_id, status_update(), token="forged", addr=other)[0] == 401
    v4 = source()
    assert [
        deliver(config.config_id, status_update(), token="forged", addr=addr)[0]
        for addr in [v4, f"::ffff:{v4}"] * 3
    ] == [401] * 5 + [429]
    assert push.source_group("not an address") == "not an address"


def test_the_same_delivery_twice_appends_nothing(task, config):
    body = status_update(ts="2026-01-01T00:02:00Z")
    assert good(config, body)[0] == 202
    assert good(config, body) == (200, {"status": "already received"})
    assert queued() == 1
    drain_here()
    assert TaskEvent.objects.filter(task=task).count() == 1
    # Even past the repeat check (another config of the task, the same event), record() appends nothing.
    second = push.new_config(task)
    assert good(second, body)[0] == 202
    drain_here()
    assert TaskEvent.objects.filter(task=task).count() == 1


def test_a_delivery_before_the_agent_named_the_task_is_taken(task, config):
    RemoteTask.objects.filter(pk=task.pk).update(
        remote_id="", phase=RemoteTask.Phase.SENDING, state=""
    )
    body = json.dumps(
        {"task": {"id": "t-new", "contextId": "c", "status": {"state": "TASK_STATE_SUBMITTED"}}}
    ).encode()
    assert good(config, body)[0] == 202
    drain_here()
    task.refresh_from_db()
    assert task.remote_id == "t-new"


def fernet_key() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()


def test_rotate_keys_re_encrypts_push_config_secrets_and_deliveries_still_pass(task, settings):
    """``manage.py rotate_keys`` moves push configs' secrets onto the new key too; the agent's
    token and credentials stay the same, so its deliveries are still accepted afterwards."""
    from io import StringIO

    from django.core.management import CommandError, call_command

    old, lost, new = fernet_key(), fernet_key(), fernet_key()
    settings.FIELD_ENCRYPTION_KEY, settings.FIELD_ENCRYPTION_OLD_KEYS = old, []
    on_old = push.new_config(task)
    values = secrets_of(on_old)
    settings.FIELD_ENCRYPTION_KEY = lost
    on_lost = push.new_config(task)
    settings.FIELD_ENCRYPTION_KEY, settings.FIELD_ENCRYPTION_OLD_KEYS = new, [old]
    on_new = push.new_config(task)
    before = {c.pk: c.secrets_encrypted for c in PushConfig.objects.all()}

    out = StringIO()
    with pytest.raises(CommandError, match=on_lost.config_id) as failed:
        call_command("rotate_keys", stdout=out)
    assert (
        "Push configs: 1 re-encrypted, 1 already on the current key, 1 unreadable."
        in out.getvalue()
    )
    text = out.getvalue() + str(failed.value)
    assert values["token"] not in text and values["credentials"] not in text
    after = {c.pk: c.secrets_encrypted for c in PushConfig.objects.all()}
    assert after[on_old.pk] != before[on_old.pk]
    assert after[on_new.pk] == before[on_new.pk] and after[on_lost.pk] == before[on_lost.pk]

    # The old key can go: the rotated config opens with the new key alone, with the same secrets.
    settings.FIELD_ENCRYPTION_OLD_KEYS = []
    on_old.refresh_from_db()
    assert secrets_of(on_old) == values
    push._config_cache.clear()  # a fresh process: the config is read (and decrypted) again
    assert good(on_old, status_update(ts="2026-01-01T00:03:00Z"))[0] == 202


def test_starting_in_push_mode_on_an_agent_without_push_says_so_under_the_mode_field(
    client, django_user_model, settings
):
    from django.urls import reverse

    from tests.people import member

    settings.PUBLIC_URL = "http://127.0.0.1:8000"  # push is offered by the form
    client.force_login(
        member(django_user_model.objects.create_user(username="pusher", password="pw-12345678"))
    )
    url = f"http://127.0.0.1:1/{uuid.uuid4().hex}/"
    agent = Agent.objects.create(name="no-push", base_url=url, interface_url=url, push=False)
    response = client.post(
        reverse("task-new"), {"agent": agent.pk, "text": "hello", "mode": "push"}
    )
    assert response.status_code == 400
    errors = response.context["form"].errors
    assert errors.get("mode") == [
        "no-push does not declare push notifications: choose another mode."
    ], errors
    assert not RemoteTask.objects.filter(agent=agent).exists()


@pytest.mark.django_db(transaction=True)
def test_notifications_drained_while_the_database_is_down_wait_for_the_next_drain(
    task, config, shared_loop, monkeypatch
):
    """The drain popped its batch before recording it: with the database down they were lost
    (and the agent's retries refused as already seen). They stay in the queue, in order."""
    from django.db import OperationalError

    for n in range(1, 4):
        assert good(config, status_update(ts=f"2026-01-01T00:00:0{n}Z"))[0] == 202
    queued_before = push._redis().lrange(push.QUEUE_KEY, 0, -1)
    assert len(queued_before) == 3
    real_record_batch = push.record_batch

    def database_down(items):  # what every query raises while PostgreSQL restarts
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(push, "record_batch", database_down)
    push._redis().set(push.DRAIN_KEY, 1)
    assert push.drain(max_seconds=5) == 0
    assert push._redis().lrange(push.QUEUE_KEY, 0, -1) == queued_before  # back, in order
    assert not push._redis().exists(push.DRAIN_KEY)  # the next tick schedules a drain again
    assert not TaskEvent.objects.filter(task=task).exists()
    monkeypatch.setattr(push, "record_batch", real_record_batch)  # the database is back
    assert push.drain(max_seconds=5) == 3
    assert TaskEvent.objects.filter(task=task, channel="push").count() == 3
    assert queued() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("stopped", ["before its commit", "after its commit"])
def test_a_drain_stopped_mid_batch_leaves_the_batch_to_the_next_drain(
    task, config, shared_loop, monkeypatch, stopped
):
    """The drain popped its batch before recording it: a worker that ended in between (killed,
    or stopped mid-batch) lost the notifications, with nothing in the task's log to say so.
    A batch leaves the queue only once recorded; the next drain records what the stopped one
    left, and what it had committed already appends nothing."""
    import threading

    from tasks_app import eventloop

    for n in range(1, 4):
        assert good(config, status_update(ts=f"2026-01-01T00:00:0{n}Z"))[0] == 202
    queued_before = push._redis().lrange(push.QUEUE_KEY, 0, -1)
    real_record_batch = push.record_batch
    inside, release = threading.Event(), threading.Event()

    def ends_here(items):  # the worker's last moment, before or after its commit
        if stopped == "after its commit":
            real_record_batch(items)
        inside.set()
        release.wait(10)
        return {}

    monkeypatch.setattr(push, "record_batch", ends_here)
    push._redis().set(push.DRAIN_KEY, 1)
    running = eventloop.submit(push._drain(5))
    assert inside.wait(10)
    running.cancel()  # the drain stops inside its batch, as at a worker's end
    release.set()
    assert push._redis().lrange(push.QUEUE_KEY, 0, -1) == queued_before  # still there, in order
    committed = TaskEvent.objects.filter(task=task, channel="push").count()
    assert committed == (3 if stopped == "after its commit" else 0)

    monkeypatch.setattr(push, "record_batch", real_record_batch)  # the next worker's drain
    assert push.drain(max_seconds=5) == 3
    rows = TaskEvent.objects.filter(task=task, channel="push").order_by("seq")
    assert [row.raw["statusUpdate"]["status"]["timestamp"] for row in rows] == [
        f"2026-01-01T00:00:0{n}Z" for n in range(1, 4)
    ]  # each once, in order
    assert queued() == 0 and int(push._redis().get(push.QUEUE_BYTES_KEY)) == 0


@pytest.mark.django_db(transaction=True)
def test_a_batch_that_makes_the_recorder_fail_is_taken_off_not_drained_forever(
    task, config, shared_loop, monkeypatch
):
    """A batch leaves the queue once recorded; one that makes the recorder raise (not the
    database being down) would raise in every drain after, and hold up every notification
    behind it. It is taken off as the error goes up, and what came after it is recorded."""
    assert good(config, status_update(ts="2026-01-01T00:00:01Z"))[0] == 202
    real_record_batch = push.record_batch

    def broken(items):
        raise ValueError("a recorder bug")

    monkeypatch.setattr(push, "record_batch", broken)
    push._redis().set(push.DRAIN_KEY, 1)
    with pytest.raises(ValueError, match="a recorder bug"):
        push.drain(max_seconds=5)
    assert queued() == 0 and int(push._redis().get(push.QUEUE_BYTES_KEY)) == 0
    monkeypatch.setattr(push, "record_batch", real_record_batch)
    assert good(config, status_update(ts="2026-01-01T00:00:02Z"))[0] == 202
    assert push.drain(max_seconds=5) == 1
    (row,) = TaskEvent.objects.filter(task=task, channel="push")
    assert row.raw["statusUpdate"]["status"]["timestamp"] == "2026-01-01T00:00:02Z"


def test_a_config_made_while_redis_is_down_is_kept_and_known_once_redis_answers(
    task, settings, caplog
):
    """Making a config runs inside a watcher's send: a Redis that is down made it a failed
    turn, and the webhook refused the config's deliveries until its known set was filled."""
    import logging

    from tasks_app.runtime.net import free_port

    working = settings.REDIS_URL
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens: Redis is down
    settings.PUBLIC_URL = "https://dash.example.test"
    with caplog.at_level(logging.WARNING, logger="tasks_app.services.push"):
        config = push.new_config(task)
        push.forget_cached("no-such-config")  # a deletion's mark: said, not raised
    assert PushConfig.objects.filter(pk=config.pk).exists()
    said = [r.getMessage() for r in caplog.records]
    assert any("not added to the webhook's known set (ConnectionError)" in m for m in said)
    assert any("deletion mark was not set (ConnectionError)" in m for m in said)
    settings.REDIS_URL = working  # Redis is back: the next send with the config adds it
    push._redis().srem(push.KNOWN_KEY, config.config_id)
    assert push.config_for_send(task.pk)["id"] == config.config_id
    assert push._redis().sismember(push.KNOWN_KEY, config.config_id)


def test_bodies_their_agent_got_wrong_are_counted_against_the_address(
    task, config, settings, still_windows
):
    """With the config cached, a body with good credentials and bad JSON (or another task's)
    was answered 400 before any count: a parse of up to a megabyte each, without limit."""
    settings.PUSH_REFUSED_PER_SOURCE = 5
    addr = source()
    answers = [good(config, b'{"statusUpdate": {"taskId": "other"}}', addr=addr)[0]]
    answers += [good(config, b"{not json", addr=addr)[0] for _ in range(9)]
    assert answers[:5] == [400] * 5 and set(answers[5:]) == {429}
    unchanged(task)


def test_a_refusal_names_the_config_id_as_a_quoted_value(config, caplog):
    """A config id with a line break wrote a second, forged line into the security log."""
    with caplog.at_level(logging.WARNING, logger="tasks_app.security"):
        deliver("abc%0A2026-01-01 ERROR fake: forged", status_update())
    lines = [r.getMessage() for r in caplog.records if "push webhook refused" in r.getMessage()]
    assert lines and all("\n" not in line for line in lines)


@pytest.mark.parametrize("how", ["abandoned", "canceled"])
def test_a_task_abandoned_or_settled_by_an_operator_has_its_configs_deleted(
    task, config, monkeypatch, django_user_model, django_capture_on_commit_callbacks, how
):
    """Only a watcher's settle deleted the configs: an abandoned task's agent went on
    pushing, and a push changed its state; a settled one's each appended a protocol error."""
    from tasks_app import jobs
    from tasks_app.services import tasks as task_services
    from tests.people import member

    ran: list[int] = []

    def run_now(task_pk: int, note: str) -> None:  # the worker that would take the job
        ran.append(task_pk)
        jobs.forget_push_configs(task_pk, note)

    monkeypatch.setattr(jobs.forget_push_configs, "delay", run_now)
    person = member(django_user_model.objects.create_user(username="op", password="pw-12345678"))
    if how == "abandoned":
        with django_capture_on_commit_callbacks(execute=True):
            task_services.abandon_task(task, actor_id=person.pk, actor_name="op")
    else:
        canceled = {"id": "t-1", "contextId": "c", "status": {"state": "TASK_STATE_CANCELED"}}
        monkeypatch.setattr(task_services.outbound, "run", lambda call: canceled)
        with django_capture_on_commit_callbacks(execute=True):
            task_services.cancel_task(task, actor_id=person.pk)
    assert ran == [task.pk]
    config.refresh_from_db()
    assert config.deleted_at is not None
    before = RemoteTask.objects.get(pk=task.pk)
    status, _ = good(config, status_update(state="TASK_STATE_COMPLETED", ts="2026-01-01T00:05:00Z"))
    assert status == 404 and queued() == 0
    after = RemoteTask.objects.get(pk=task.pk)
    assert (after.state, after.last_seq) == (before.state, before.last_seq)


def test_the_queue_takes_notifications_up_to_its_bytes_and_a_drain_takes_a_bounded_batch(
    task, config, settings, monkeypatch
):
    """Nothing bounded what waited in Redis: sixty 1 MB notifications were 63 MB queued, and
    a drain popped 5,000 at once (5 GB in one worker at that size)."""
    settings.PUSH_QUEUE_MAX_BYTES = 5_000
    pad = "x" * 900

    def body_of(i: int) -> bytes:
        status = {"state": "TASK_STATE_WORKING", "timestamp": f"2026-01-01T00:00:{i:02d}Z"}
        update = {"taskId": "t-1", "contextId": "c", "status": status, "metadata": {"pad": pad}}
        return json.dumps({"statusUpdate": update}).encode()

    bodies = [body_of(i) for i in range(8)]
    answers = [good(config, body)[0] for body in bodies]
    assert answers[:5] == [202] * 5 and answers[5:] == [503] * 3  # ~1 KB each, 5 KB in all
    waiting = int(push._redis().get(push.QUEUE_BYTES_KEY))
    assert 5_000 <= waiting < 6_000 and queued() == 5
    assert deliver(config.config_id, bodies[6], token="nope")[0] == 401  # refusals come first
    monkeypatch.setattr(push, "DRAIN_BATCH_BYTES", 2_500)  # about two of them a batch
    taken = push._read_batch(push._redis())
    assert len(taken) == 2 and int(push._redis().get(push.QUEUE_BYTES_KEY)) == waiting
    assert good(config, bodies[5])[0] == 503  # read, not yet recorded: still queued
    push._redis().set(push.RUNNING_KEY, "this-drain")
    assert push._take_off(push._redis(), "this-drain", taken)  # recorded: taken off
    assert int(push._redis().get(push.QUEUE_BYTES_KEY)) < waiting
    assert good(config, bodies[5])[0] == 202  # room again


def test_our_config_is_deleted_here_whatever_the_agent_answers(task, config):
    """An agent that refused the delete (or was unreachable) kept our config live: its pushes
    went on being accepted, and the operator had no way to stop them but abandoning."""
    refused = push.delete_config(task, config.config_id)  # nothing listens there: refused
    assert refused  # said to the person (the page: "deleted here; the agent did not ...")
    config.refresh_from_db()
    assert config.deleted_at is not None and "the agent refused" in config.deleted_note
    assert good(config, status_update())[0] == 404
    entries = [e.raw["operator"] for e in TaskEvent.objects.filter(task=task, kind="operator")]
    assert entries[0]["action"] == "delete-push-config" and entries[0]["agent"]
    # Its last config gone, the push task is polled from now on (tests/test_push_live.py).
    task.refresh_from_db()
    assert task.watch == RemoteTask.Watch.POLL
    assert [e["action"] for e in entries[1:]] == ["switch-watch"]
