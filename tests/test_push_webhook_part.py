"""The webhook part (``manage.py up --only webhook``): uvicorn serving ``/push/`` alone.

Started with the very command line ``up`` uses (``webhook_argv``), against this session's
test database and Redis, and called over loopback: a genuine delivery is queued (and
recorded by the drain), a repeat appends nothing, wrong credentials get 401 with nothing
queued, an unknown config 404, an oversized body 413; pages are not served there, and
``/healthz`` answers. The checks themselves are tested through the web part's route
(``test_push_route.py``) and view (``test_push_webhook.py``): the same ``PushRoute``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest

from tasks_app.crypto import decrypt_json
from tasks_app.management.commands.up import StartupError, parse_roles, webhook_argv
from tasks_app.models import Agent, PushConfig, RemoteTask, TaskEvent
from tasks_app.services import push
from tests.agents import free_port
from tests.infra import READY_TIMEOUT

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def webhook_part(child_env: Callable[..., dict[str, str]], tmp_path) -> Iterator[str]:
    port = free_port()
    log = (tmp_path / "webhook.log").open("wb")
    proc = subprocess.Popen(
        webhook_argv(sys.executable, "127.0.0.1", port, False),
        env=child_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT  # as long as daphne gets (a loaded machine)
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / "webhook.log").read_text()
            assert time.monotonic() < deadline, "the webhook part did not answer"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@pytest.fixture
def config(empty_push_queue: None) -> PushConfig:
    agent = Agent.objects.create(
        name="webhook part", base_url=f"http://127.0.0.1:1/{uuid.uuid4().hex}/", push=True
    )
    task = RemoteTask.objects.create(
        agent=agent, title="t", remote_id="r-part", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_SUBMITTED", watch=RemoteTask.Watch.PUSH,
    )  # fmt: skip
    return push.new_config(task)


def update(ts: str, task_id: str = "r-part") -> bytes:
    return json.dumps(
        {
            "statusUpdate": {
                "taskId": task_id,
                "contextId": "c",
                "status": {"state": "TASK_STATE_WORKING", "timestamp": ts},
            }
        }
    ).encode()


def headers(config: PushConfig, **override: str) -> dict[str, str]:
    values = decrypt_json(config.secrets_encrypted)
    out = {
        "content-type": "application/a2a+json",
        "x-a2a-notification-token": values["token"],
        "authorization": f"{values['scheme']} {values['credentials']}",
    }
    out.update(override)
    return out


@pytest.mark.server  # uvicorn, started here
def test_the_webhook_part_answers_deliveries_like_the_web_part(webhook_part, config):
    url = f"{webhook_part}/push/{config.config_id}/"
    with httpx.Client(timeout=10) as client:
        first = client.post(url, content=update("2026-01-01T00:00:01Z"), headers=headers(config))
        assert (first.status_code, first.json()) == (202, {"status": "accepted"})
        assert first.headers["x-content-type-options"] == "nosniff"
        again = client.post(url, content=update("2026-01-01T00:00:01Z"), headers=headers(config))
        assert (again.status_code, again.json()) == (200, {"status": "already received"})
        assert push._redis().llen(push.QUEUE_KEY) == 1

        wrong = client.post(
            url,
            content=update("2026-01-01T00:00:02Z"),
            headers=headers(config, **{"x-a2a-notification-token": "x" * 43}),
        )
        assert wrong.status_code == 401
        unknown = client.post(
            f"{webhook_part}/push/{uuid.uuid4().hex}/",
            content=update("2026-01-01T00:00:03Z"),
            headers=headers(config),
        )
        assert unknown.status_code == 404
        other_task = client.post(
            url, content=update("2026-01-01T00:00:04Z", "r-other"), headers=headers(config)
        )
        assert other_task.status_code == 400
        big = client.post(
            url, content=b"x" * (push.settings.PUSH_MAX_BODY_BYTES + 1), headers=headers(config)
        )
        assert big.status_code == 413
        assert client.get(url).status_code == 405
        assert push._redis().llen(push.QUEUE_KEY) == 1  # none of the refusals queued anything

        page = client.get(f"{webhook_part}/tasks/")
        assert page.status_code == 404  # pages stay on the web part
        assert client.get(f"{webhook_part}/healthz").json() == {"ok": True}

    items = push._redis().lpop(push.QUEUE_KEY, 10) or []
    assert set(push.record_batch(items)) == {config.task_id}
    event = TaskEvent.objects.get(task_id=config.task_id)
    assert (event.channel, event.kind) == ("push", "statusUpdate")


def test_the_webhook_part_is_a_role_of_up_on_its_own_port():
    assert parse_roles(["webhook"]) == ("webhook",)
    assert parse_roles(["worker,webhook"]) == ("worker", "webhook")
    assert parse_roles(None) == ("web", "worker", "beat")  # the web part answers /push/ itself
    with pytest.raises(StartupError, match="each need a port"):
        parse_roles(["web,webhook"])
    argv = webhook_argv("python", "0.0.0.0", 8001, True)
    assert "dashboard.webhook_asgi:application" in argv and "--proxy-headers" in argv
    assert "--no-proxy-headers" in webhook_argv("python", "127.0.0.1", 8001, False)
