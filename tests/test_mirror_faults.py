"""Agents that misbehave never kill a watcher: each problem is in the log, and watching goes on."""

from __future__ import annotations

import pytest

from tasks_app.models import Agent, RemoteTask, TaskEvent
from tasks_app.services import tasks as task_services
from tasks_app.services.agents import add_agent
from tests.test_mirror import assert_converged, settled, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def bad_agent(url: str, name: str) -> Agent:
    return Agent.objects.create(
        name=name,
        base_url=url,
        interface_url=url,
        binding="JSONRPC",
        protocol_version="1.0",
        streaming=True,
    )


@pytest.mark.parametrize(
    ("mode", "says"),
    [("html", "HTTP 500"), ("badjson", "JSON"), ("wrongtype", "text/plain"), ("v03", "0.3")],
)
def test_a_send_answered_with_garbage_fails_with_the_reason(
    bad_server, agent, celery_worker, mode, says
):
    broken = bad_agent(bad_server.url_for(mode), f"bad {mode}")
    task = task_services.start_task(broken, "quick", mode="stream")
    wait_for(lambda: settled(task), what=f"the send to a {mode} agent to fail")
    assert task.phase == "failed"
    assert says.lower() in task.send_error.lower()
    # The same worker still watches a healthy agent.
    healthy = task_services.start_task(
        add_agent(agent.base_url, name="demo"), "quick", mode="stream"
    )
    wait_for(lambda: settled(healthy), what="a healthy task on the same worker")
    assert healthy.state == "TASK_STATE_COMPLETED"


@pytest.mark.parametrize(
    ("mode", "kind", "says"),
    [
        ("dropped", "system", "connection dropped"),
        ("sseerror", "system", "error"),
    ],
)
def test_a_stream_that_turns_bad_is_logged_and_watched_on(
    bad_server, start_celery_worker, mode, kind, says
):
    """These servers name a task, then misbehave: the task exists, the problem is logged.

    The same note again within WATCH_REPEATED_NOTE_SECONDS is counted, not logged: the
    holder's slice ends (3 s here) and writes the count."""
    start_celery_worker(
        WATCH_BACKOFF_BASE_SECONDS="0.2",
        WATCH_BACKOFF_MAX_SECONDS="0.5",
        WATCH_SLICE_SECONDS="3",
    )
    broken = bad_agent(bad_server.url_for(mode), f"bad {mode}")
    task = task_services.start_task(broken, "quick", mode="stream")
    wait_for(
        lambda: TaskEvent.objects.filter(task=task, kind=kind).count() >= 2, what=f"{kind} entries"
    )
    task.refresh_from_db()
    assert task.phase == "task" and task.remote_id
    notes = " ".join(
        str(e.raw) + e.note for e in TaskEvent.objects.filter(task=task, kind=kind)
    ).lower()
    assert says in notes
    wait_for(
        lambda: RemoteTask.objects.get(pk=task.pk).watcher_status == "reconnecting",
        what="the watcher to keep trying",
    )


def test_an_oversized_event_fails_the_send_with_the_bound(bad_server, start_celery_worker):
    # The bad server's first event is 200 kB: bound events below that for this worker.
    start_celery_worker(WATCH_MAX_EVENT_BYTES="100000")
    broken = bad_agent(bad_server.url_for("oversized"), "bad oversized")
    task = task_services.start_task(broken, "quick", mode="stream")
    wait_for(lambda: settled(task), what="the send to fail")
    assert task.phase == "failed"
    assert "100000-byte limit" in task.send_error


def test_garbage_while_polling_is_logged_and_the_watcher_recovers(
    bad_server, agent, start_celery_worker
):
    start_celery_worker(
        WATCH_SLICE_SECONDS="1.5", WATCH_BACKOFF_BASE_SECONDS="0.2", WATCH_BACKOFF_MAX_SECONDS="0.5"
    )
    demo = add_agent(agent.base_url, name="demo")
    good_url = demo.interface_url
    task = task_services.start_task(demo, "long 60", mode="return-immediately")
    wait_for(lambda: settled(task, ("TASK_STATE_WORKING",)), what="work to start")
    Agent.objects.filter(pk=demo.pk).update(interface_url=bad_server.url_for("badjson"))
    wait_for(
        lambda: TaskEvent.objects.filter(task=task, kind="protocol-error").count() >= 2,
        what="protocol errors in the log",
    )
    task.refresh_from_db()
    assert task.state == "TASK_STATE_WORKING"  # garbage changed nothing
    Agent.objects.filter(pk=demo.pk).update(interface_url=good_url)
    demo.refresh_from_db()
    task_services.cancel_task(task)
    wait_for(lambda: settled(task), what="the recovered watcher to see the cancel")
    assert task.state == "TASK_STATE_CANCELED"
    assert_converged(task)
    note = TaskEvent.objects.filter(task=task, kind="protocol-error").first().note
    assert "json" in note.lower()


def test_an_agent_that_goes_down_is_marked_unreachable_and_retried(
    agent, tcp_proxy, start_celery_worker
):
    start_celery_worker(WATCH_BACKOFF_BASE_SECONDS="0.2", WATCH_BACKOFF_MAX_SECONDS="0.5")
    proxy = tcp_proxy("127.0.0.1", agent.port)
    demo = add_agent(agent.base_url, name="demo")
    Agent.objects.filter(pk=demo.pk).update(interface_url=f"{proxy.url}/jsonrpc")
    task = task_services.start_task(Agent.objects.get(pk=demo.pk), "long 60", mode="stream")
    wait_for(lambda: settled(task, ("TASK_STATE_WORKING",)), what="work to start")
    proxy.refuse()
    proxy.cut()
    wait_for(
        lambda: Agent.objects.get(pk=demo.pk).reachable is False,
        what="the agent to be marked unreachable",
    )
    wait_for(
        lambda: RemoteTask.objects.get(pk=task.pk).watcher_status == "reconnecting",
        what="reconnecting status",
    )
    proxy.accept()
    wait_for(
        lambda: Agent.objects.get(pk=demo.pk).reachable is True,
        timeout=20,
        what="the agent to be back",
    )
    task_services.cancel_task(task)
    wait_for(lambda: settled(task), what="cancel after the outage")
    assert task.state == "TASK_STATE_CANCELED"
    assert_converged(task)
