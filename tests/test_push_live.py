"""Push end to end: a real a2a-sdk agent delivers to the live webhook (daphne) over loopback.

A worker process sends the message with a push config inline, then holds nothing; the
webhook queues each notification, the worker's drain records it on channel ``push`` and
checks it with GetTask. Also: signed notifications from an agent that signs, the
silence fallback to polling, and the operator's switch back to polling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tasks_app.models import PushConfig, RemoteTask, TaskEvent
from tasks_app.services import push as push_services
from tasks_app.services import tasks as task_services
from tasks_app.services.agents import add_agent
from tests.agents import REPO_ROOT, AgentHandle, free_port
from tests.test_mirror import agent_call, assert_converged, assert_log_is_gapless, wait_for

# agent: the signing agent is a demo agent started here (signing_agent).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.agent, pytest.mark.slow]


@pytest.fixture
def web(start_daphne, settings):
    server = start_daphne()
    settings.PUBLIC_URL = server.url  # this process decides the start mode
    return server


def start_signing_agent() -> AgentHandle:
    """The demo agent with ``--sign-push``: its notifications carry an ES256 JWT."""
    port = free_port()
    env = dict(os.environ)
    # Prepended: the loopback-only hook's folder (tests/conftest.py) stays on the path.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks_app.demo_agent", "--host", "127.0.0.1", "--port", str(port),
         "--delay", "0.05", "--sign-push"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    handle = AgentHandle(base_url=f"http://127.0.0.1:{port}", port=port, process=proc)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(handle.card_url, timeout=1).status_code == 200:
                return handle
        except httpx.HTTPError:
            time.sleep(0.05)
    handle.stop()
    raise RuntimeError("the signing demo agent did not start")


@pytest.fixture
def signing_agent() -> Iterator[AgentHandle]:
    handle = start_signing_agent()
    try:
        yield handle
    finally:
        handle.stop()


def channels(task: RemoteTask) -> list[tuple[str, str]]:
    return list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("channel", "kind"))


def settled(task: RemoteTask) -> bool:
    task.refresh_from_db()
    return task.settled_at is not None


def test_a_long_task_is_followed_to_completion_by_push_alone(agent, web, start_celery_worker):
    start_celery_worker(PUBLIC_URL=web.url, PUSH_SILENCE_SECONDS="120")
    stored = add_agent(agent.base_url)
    task = task_services.start_task(stored, "batch 6 0.3", mode="push")
    assert task.watch == RemoteTask.Watch.PUSH
    seen_status: set[str] = set()

    def done() -> bool:
        task.refresh_from_db()
        seen_status.add(task.watcher_status)
        return task.settled_at is not None

    wait_for(done, 60, "the push-watched task to settle")
    log = channels(task)
    agent_rows = [(c, k) for c, k in log if k in ("statusUpdate", "artifactUpdate")]
    # Every update came by push: no stream was opened, and no poll found anything new.
    assert agent_rows and {c for c, _ in agent_rows} == {"push"}, log
    assert not [c for c, _ in log if c in ("stream", "resubscribe")]
    assert "polling" not in seen_status and "streaming" not in seen_status
    # The GetTask after notifications waits for a pause: not one per notification.
    assert len([1 for c, k in log if (c, k) == ("poll", "task")]) <= 2, log
    assert "awaiting-push" in seen_status
    assert sum(1 for _, k in agent_rows if k == "artifactUpdate") == 6
    assert task.state == "TASK_STATE_COMPLETED"
    # The mirror equals the agent's GetTask; the log replays and its chain verifies.
    assert_converged(task)
    assert_log_is_gapless(task)
    # The config was ours, given with its own id; it was deleted when the task settled (just
    # after: the settle commits, then the agent is asked to delete it, in the agent's turn).
    config = PushConfig.objects.get(task=task)
    assert config.registered_at is not None and config.received >= 13
    wait_for(
        lambda: PushConfig.objects.filter(pk=config.pk, deleted_at__isnull=False).exists(),
        30,
        "the settled task's config to be deleted",
    )
    listing = agent_call(stored, lambda c: c.list_push_configs(task.remote_id))
    assert listing["configs"] == []  # type: ignore[index]


def test_a_signed_agent_is_verified_end_to_end(signing_agent, web, start_celery_worker):
    start_celery_worker(PUBLIC_URL=web.url, PUSH_SILENCE_SECONDS="120")
    stored = add_agent(signing_agent.base_url)
    task = task_services.start_task(stored, "batch 3 0.3", mode="push")
    wait_for(lambda: settled(task), 60, "the signed push task to settle")
    config = PushConfig.objects.get(task=task)
    assert config.jwks_url == f"{signing_agent.base_url}/.well-known/jwks.json"
    assert "credentials" not in push_services.decrypt_json(config.secrets_encrypted)
    assert {c for c, k in channels(task) if k in ("statusUpdate", "artifactUpdate")} == {"push"}
    assert_converged(task)


def test_a_silent_push_task_falls_back_to_polling_and_the_page_says_so(
    agent, web, start_celery_worker, start_celery_beat, settings
):
    # The agent is told a URL where nobody listens: every delivery fails, so the task is silent.
    dead = f"http://127.0.0.1:{free_port()}"
    fast = {
        "PUSH_SILENCE_SECONDS": "1",
        "RECONCILE_EVERY_SECONDS": "0.5",
        "WATCH_POLL_MIN_SECONDS": "0.3",
    }
    start_celery_worker(PUBLIC_URL=dead, **fast)
    start_celery_beat(**fast)
    stored = add_agent(agent.base_url)
    task = task_services.start_task(stored, "batch 8 0.4", mode="push")
    notes: list[tuple[str, str]] = []

    def done() -> bool:
        task.refresh_from_db()
        notes.append((task.watcher_status, task.watcher_note))
        return task.settled_at is not None

    wait_for(done, 60, "the silent task to be followed by polls to its end")
    assert ("awaiting-push", "awaiting push notifications") in notes
    polling = [
        note for status, note in notes if status == "polling" and "no push notification" in note
    ]
    assert polling, notes
    log = channels(task)
    assert not [c for c, _ in log if c == "push"]
    assert [k for c, k in log if c == "poll"], log  # followed by GetTask alone
    assert task.state == "TASK_STATE_COMPLETED"
    assert_converged(task)


def _awaiting_push(agent: AgentHandle, text: str) -> RemoteTask:
    """A push task on the demo agent, once its watcher awaits notifications (refreshed)."""
    stored = add_agent(agent.base_url)
    task = task_services.start_task(stored, text, mode="push")
    wait_for(
        lambda: RemoteTask.objects.get(pk=task.pk).watcher_status == "awaiting-push",
        30,
        "awaiting push",
    )
    task.refresh_from_db()
    return task


def test_the_operator_switches_a_push_task_back_to_polling(
    agent, web, start_celery_worker, admin_user
):
    dead = f"http://127.0.0.1:{free_port()}"
    start_celery_worker(PUBLIC_URL=dead, PUSH_SILENCE_SECONDS="600")
    task = _awaiting_push(agent, "batch 4 0.3")
    task_services.switch_watch(task, "poll", actor_id=admin_user.pk)
    wait_for(lambda: settled(task), 60, "the switched task to settle")
    task.refresh_from_db()
    assert task.watch == RemoteTask.Watch.POLL
    assert TaskEvent.objects.filter(
        task=task, kind="operator", raw__operator__action="switch-watch"
    ).exists()
    assert_converged(task)


def test_switching_a_push_task_to_streaming_stops_its_push(
    agent, web, start_celery_worker, admin_user
):
    """The switch left the push configs at the agent: it went on pushing beside the stream,
    and a chunk pushed before the stream brought it was appended twice, with false gaps
    after (found by driving the dashboard). The configs are deleted at the agent and here
    before a watcher starts the stream; the task ends with each chunk once."""
    start_celery_worker(PUBLIC_URL=web.url, PUSH_SILENCE_SECONDS="120")
    stored = add_agent(agent.base_url)
    task = task_services.start_task(stored, "batch 20 0.3", mode="push")
    wait_for(
        lambda: (
            TaskEvent.objects.filter(task=task, channel="push", kind="artifactUpdate").count() >= 2
        ),
        30,
        "the first chunks by push",
    )
    task.refresh_from_db()
    task_services.switch_watch(task, "stream", actor_id=admin_user.pk)
    # Gone as the switch returns, while the task still runs: at the agent and here.
    listing = agent_call(stored, lambda c: c.list_push_configs(task.remote_id))
    assert listing["configs"] == []  # type: ignore[index]
    assert not PushConfig.objects.filter(task=task, deleted_at__isnull=True).exists()
    wait_for(lambda: settled(task), 60, "the switched task to settle")
    task.refresh_from_db()
    assert task.watch == RemoteTask.Watch.STREAM and task.state == "TASK_STATE_COMPLETED"
    # Each of the 20 chunks appended once in the log, whichever channel brought it (a
    # chunk pushed before the switch may reach the stream's first snapshot instead: the
    # `gap` that says so is true), and the mirror is the agent's.
    appended = [
        json.dumps(e.raw["artifactUpdate"]["artifact"]["parts"], sort_keys=True)
        for e in TaskEvent.objects.filter(task=task, kind="artifactUpdate")
    ]
    assert len(appended) == len(set(appended)), appended
    assert_converged(task)


def test_deleting_a_push_tasks_last_config_has_it_polled(
    agent, web, start_celery_worker, admin_user
):
    """The task said "awaiting push notifications" after its only config was deleted, and was
    looked at again only when its silence ran out (found by driving the dashboard)."""
    start_celery_worker(PUBLIC_URL=web.url, PUSH_SILENCE_SECONDS="600")
    task = _awaiting_push(agent, "batch 12 0.5")
    config = PushConfig.objects.get(task=task)
    push_services.delete_config(task, config.config_id, actor_id=admin_user.pk)
    task.refresh_from_db()
    assert task.watch == RemoteTask.Watch.POLL
    # Followed by polls to its end, long before the 600 s of silence.
    wait_for(lambda: settled(task), 60, "the task to be polled to its end")
    task.refresh_from_db()
    assert task.state == "TASK_STATE_COMPLETED"
    assert TaskEvent.objects.filter(task=task, channel="poll", kind="task").exists()


def test_a_worker_without_public_url_polls_a_push_task_for_good(
    agent, settings, start_celery_worker
):
    """The start decided on push, but the worker that sends cannot give the agent an address:
    it says so once, switches the task to polling (kept on the task, as a refused
    resubscription is) and follows it to the end."""
    settings.PUBLIC_URL = "http://127.0.0.1:9"  # this process decides the start mode
    start_celery_worker(PUBLIC_URL="")
    stored = add_agent(agent.base_url)
    task = task_services.start_task(stored, "batch 3 0.3", mode="push")
    assert task.watch == RemoteTask.Watch.PUSH
    wait_for(lambda: settled(task), 60, "the task to settle by polling")
    assert task.watch == RemoteTask.Watch.POLL and task.state == "TASK_STATE_COMPLETED"
    unavailable = [
        e
        for e in TaskEvent.objects.filter(task=task, kind="system")
        if (e.raw.get("system") or {}).get("event") == "push-unavailable"
    ]
    assert len(unavailable) == 1
    assert not PushConfig.objects.filter(task=task).exists()
