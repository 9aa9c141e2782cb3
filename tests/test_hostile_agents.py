"""Watchers against misbehaving agents: every hostile loop ends bounded, visible and actionable.

Each test asserts the bound (log rows per task, requests to the agent) as well
as the outcome. The agents are real servers on 127.0.0.1 (``tests.hostile_agents``
and the a2a-sdk demo agent); the watchers run in a real Celery worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from tasks_app.models import Agent, RemoteTask, TaskEvent
from tasks_app.services import tasks as task_services
from tasks_app.services.agents import add_agent
from tasks_app.watchers import TABLE, Event, next_status
from tests.hostile_agents import HostileAgent, hostile_servers
from tests.test_mirror import assert_converged, settled, wait_for

Status = RemoteTask.WatcherStatus
FAST = {
    "WATCH_BACKOFF_BASE_SECONDS": "0.2",
    "WATCH_BACKOFF_MAX_SECONDS": "0.5",
    "WATCH_POLL_MIN_SECONDS": "0.2",
    "WATCH_POLL_MAX_SECONDS": "0.5",
    "WATCH_MAX_FRUITLESS_TURNS": "4",
    "BUDGET_AGENT_PROTOCOL_ERRORS_PER_MINUTE": "1000",
}


@pytest.fixture
def hostile() -> Iterator[Callable[..., HostileAgent]]:
    with hostile_servers() as make:
        yield make


def hostile_row(agent: HostileAgent, *, streaming: bool) -> Agent:
    return Agent.objects.create(
        name=f"hostile {agent.behaviour} {agent.port}",
        base_url=agent.url,
        interface_url=agent.url,
        binding="JSONRPC",
        protocol_version="1.0",
        streaming=streaming,
    )


def kinds(task: RemoteTask, kind: str, event: str | None = None) -> list[TaskEvent]:
    rows = list(TaskEvent.objects.filter(task=task, kind=kind).order_by("seq"))
    if event is not None:
        rows = [r for r in rows if isinstance(r.raw, dict) and (r.raw.get("system") or {}).get("event") == event]
    return rows


def status_of(task: RemoteTask) -> str:
    return RemoteTask.objects.get(pk=task.pk).watcher_status


def page(task: RemoteTask) -> str:
    user, _ = get_user_model().objects.get_or_create(username="watch-operator")
    client = Client()
    client.force_login(user)
    return client.get(f"/tasks/{task.pk}/").content.decode()


def no_traceback(*workers) -> None:
    for worker in workers:
        assert "Traceback" not in worker.log_tail(2000)


# 1. The table ---------------------------------------------------------------------------------


def test_every_watcher_state_has_a_timeout_and_a_way_out():
    assert set(TABLE) == set(Status.values)
    for status, rule in TABLE.items():
        assert rule.timeout.strip() and rule.meaning.strip(), status
        if status != Status.ABANDONED:
            # A way out: some event leads elsewhere, and abandon is always possible.
            assert any(target != status for target in rule.on.values()), status
            assert next_status(status, Event.ABANDON) == Status.ABANDONED
    # A parked task can be watched again or resume on its own; a gone one only by an operator.
    assert next_status(Status.PARKED, Event.OPERATOR_WATCH) == Status.IDLE
    assert next_status(Status.PARKED, Event.PROGRESS, streaming=True) == Status.STREAMING
    assert next_status(Status.GONE, Event.OPERATOR_WATCH) == Status.IDLE
    assert next_status(Status.POLLING, Event.FRUITLESS) == Status.RECONNECTING
    assert next_status(Status.RECONNECTING, Event.PARK) == Status.PARKED
    assert next_status(Status.STREAMING, Event.NOT_FOUND) == Status.GONE




# 2. Backoff by progress; parking ---------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
@pytest.mark.parametrize(("behaviour", "streaming"), [("wrongid", False), ("unspecified", False), ("wrongid", True)])
def test_an_agent_answering_nonsense_is_parked_after_a_few_fruitless_turns(
    hostile, start_celery_worker, start_celery_beat, behaviour, streaming
):
    worker = start_celery_worker(**FAST)
    start_celery_beat(RECONCILE_EVERY_SECONDS="0.5")
    bad = hostile(behaviour)
    task = task_services.start_task(
        hostile_row(bad, streaming=streaming), "go", mode="stream" if streaming else "return-immediately"
    )
    wait_for(lambda: status_of(task) == Status.PARKED, what="the task to be parked")
    parked_at = time.monotonic()
    calls_when_parked = sum(bad.calls.values())
    time.sleep(3)  # an observation window: the reconciler ticks six times in it
    task.refresh_from_db()
    # Bounds: a handful of requests and rows in all, and nothing at all once parked.
    assert sum(bad.calls.values()) == calls_when_parked
    assert bad.calls_since(parked_at) == 0
    assert bad.calls["GetTask"] <= 4 + 1
    assert bad.calls["SubscribeToTask"] <= 4 + 1
    assert len(kinds(task, "protocol-error")) <= 4 + 1
    assert task.last_seq <= 12
    assert len(kinds(task, "system", "parked")) == 1
    assert task.fruitless_turns >= 4 and task.watcher_since is not None
    assert "needs attention" in task.watcher_note
    html = page(task)
    assert "Needs attention" in html
    for button in ('id="watch-again-button"', 'id="refresh-button"', 'id="abandon-confirm"'):
        assert button in html
    # Watch again: a clean slate, then parked again after the same bound, with one more entry.
    task_services.watch_again(task)
    wait_for(lambda: len(kinds(task, "system", "parked")) == 2, what="parked again")
    assert bad.calls["GetTask"] <= 2 * (4 + 1)
    no_traceback(worker)


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_stream_that_closes_cleanly_is_not_reopened_at_once(hostile, start_celery_worker):
    start_celery_worker(**dict(FAST, WATCH_POLL_MIN_SECONDS="0.5", WATCH_POLL_MAX_SECONDS="2"))
    quiet = hostile("quietclose")
    task = task_services.start_task(hostile_row(quiet, streaming=True), "go", mode="stream")
    wait_for(lambda: quiet.calls["SubscribeToTask"] >= 1, what="the first resubscription")
    start = time.monotonic()
    time.sleep(8)
    # Quiet turns wait like polls (0.5 s doubling to 2 s): a few subscriptions, not hundreds.
    assert quiet.calls_since(start, "SubscribeToTask") <= 8
    task.refresh_from_db()
    assert task.watcher_status in (Status.STREAMING, Status.POLLING)  # quiet is not fruitless
    assert task.last_seq <= 4  # equal snapshots append nothing


# 3. Budgets -------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_flooding_stream_is_recorded_within_the_events_per_second_budget(hostile, start_celery_worker):
    rate = 300
    worker = start_celery_worker(**dict(FAST, BUDGET_TASK_EVENTS_PER_SECOND=str(rate)))
    flood = hostile("flood", flood_events=1500)
    task = task_services.start_task(hostile_row(flood, streaming=True), "go", mode="stream")
    wait_for(lambda: len(kinds(task, "statusUpdate")) >= 1500, timeout=60, what="the whole flood recorded")
    rows = kinds(task, "statusUpdate")
    span = (rows[-1].received_at - rows[0].received_at).total_seconds()
    # At most the rate, plus a one-second burst and one batch.
    assert len(rows) <= rate * (span + 1) + 500
    assert len(kinds(task, "system", "throttled")) == 1
    no_traceback(worker)


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_task_over_its_byte_budget_is_parked_with_one_entry(hostile, start_celery_worker):
    worker = start_celery_worker(**dict(FAST, BUDGET_TASK_BYTES="50000"))
    flood = hostile("flood", flood_events=2000)
    task = task_services.start_task(hostile_row(flood, streaming=True), "go", mode="stream")
    wait_for(lambda: status_of(task) == Status.PARKED, what="the task to be parked")
    task.refresh_from_db()
    assert task.stored_bytes <= 50000 + 1
    assert len(kinds(task, "system", "budget-exceeded")) == 1
    assert len(kinds(task, "system", "parked")) == 0  # one entry says so, not two
    assert task.last_seq < 2000 // 2
    assert "budget" in task.watcher_note
    no_traceback(worker)


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_an_agent_over_its_protocol_error_budget_has_its_tasks_parked(hostile, start_celery_worker):
    worker = start_celery_worker(
        **dict(FAST, WATCH_MAX_FRUITLESS_TURNS="100", BUDGET_AGENT_PROTOCOL_ERRORS_PER_MINUTE="3")
    )
    bad = hostile("garbage")
    row = hostile_row(bad, streaming=False)
    tasks = [task_services.start_task(row, f"go {i}", mode="return-immediately") for i in range(2)]
    for task in tasks:
        wait_for(lambda task=task: status_of(task) == Status.PARKED, what="every task of the agent parked")
        task.refresh_from_db()
        assert "protocol errors in a minute" in task.watcher_note
    # Far fewer than the 100 fruitless turns each task would otherwise be allowed.
    assert bad.calls["GetTask"] <= 3 + 2 * 2
    no_traceback(worker)


# 4. Lost replies found again -------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_reply_lost_after_the_agent_got_the_request_is_found_by_context(hostile, start_celery_worker):
    worker = start_celery_worker(**FAST)
    lossy = hostile("lostreply")
    task = task_services.start_task(hostile_row(lossy, streaming=False), "once only", mode="return-immediately")
    wait_for(lambda: settled(task), what="the task to be found and followed")
    assert task.phase == "task" and task.state == "TASK_STATE_COMPLETED"
    assert len(lossy.tasks) == 1 and lossy.calls["SendMessage"] == 1  # no second remote task
    assert task.remote_id == next(iter(lossy.tasks))
    assert task.context_id == task.request["message"]["contextId"]
    assert len(kinds(task, "system", "found-again")) == 1
    assert not task_services.can_retry(task)
    assert task.artifacts.get().parts.get().part == {"text": "done once"}
    no_traceback(worker)


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
@pytest.mark.parametrize("agent_has_it", [True, False])
def test_a_send_interrupted_by_a_crash_is_looked_up_not_repeated(hostile, start_celery_worker, agent_has_it):
    plain = hostile("quietclose")
    row = hostile_row(plain, streaming=False)
    message = {"messageId": "m-crash", "role": "ROLE_USER", "parts": [{"text": "x"}], "contextId": "ctx-crash"}
    if agent_has_it:
        plain._new_task(message, "TASK_STATE_COMPLETED")
    # What a worker killed in the middle of the send leaves behind.
    task = RemoteTask.objects.create(
        agent=row, phase="sending", mode="return-immediately", watch="poll",
        request={"message": message}, outbox={"message": message}, send_attempted_at=timezone.now(),
    )  # fmt: skip
    start_celery_worker(**FAST)
    task_services.dispatch(task.pk)
    wait_for(lambda: settled(task), what="the interrupted send to be resolved")
    assert plain.calls["SendMessage"] == 0  # never sent blindly again
    assert plain.calls["ListTasks"] >= 1
    if agent_has_it:
        assert task.state == "TASK_STATE_COMPLETED" and task.remote_id == next(iter(plain.tasks))
    else:
        assert task.phase == "failed" and "retrying is safe" in task.send_error
        assert task_services.can_retry(task)
        task_services.retry_send(task)
        wait_for(lambda: plain.calls["SendMessage"] == 1, what="the retry")
        sent = next(iter(plain.tasks.values()))["history"][0]
        assert sent["messageId"] == "m-crash"  # the same messageId


# 5. A way out of every phase ---------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_blocking_start_can_be_canceled(agent, celery_worker):
    demo = add_agent(agent.base_url, name="demo")
    task = task_services.start_task(demo, "long 60", mode="blocking")
    wait_for(lambda: RemoteTask.objects.get(pk=task.pk).remote_id != "", what="the agent to name the task")
    task_services.cancel_task(RemoteTask.objects.get(pk=task.pk), reason="changed my mind")
    wait_for(lambda: settled(task), what="the cancel to be seen")
    assert task.state == "TASK_STATE_CANCELED"
    assert_converged(task)


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_task_stuck_in_sending_can_be_abandoned(bad_server, start_celery_worker, start_celery_beat):
    start_celery_worker(**FAST)
    start_celery_beat(RECONCILE_EVERY_SECONDS="0.5")
    silent = Agent.objects.create(
        name="silent", base_url=bad_server.url_for("silent"), interface_url=bad_server.url_for("silent"),
        binding="JSONRPC", protocol_version="1.0", streaming=False,
    )  # fmt: skip
    task = task_services.start_task(silent, "hello?", mode="blocking")
    wait_for(lambda: RemoteTask.objects.get(pk=task.pk).send_attempted_at is not None, what="the send to start")
    html = page(task)
    assert 'id="refresh-button"' in html and 'id="abandon-confirm"' in html and 'id="cancel-confirm"' in html
    user = get_user_model().objects.get(username="watch-operator")
    client = Client()
    client.force_login(user)
    client.post(f"/tasks/{task.pk}/abandon/", {"reason": "agent never answers"})
    task.refresh_from_db()
    assert task.abandoned_at is not None and task.watcher_status == Status.ABANDONED
    entry = kinds(task, "operator")[-1]
    assert entry.raw["operator"] == {"action": "abandon", "by": "watch-operator", "reason": "agent never answers"}
    assert entry.actor_id == user.pk
    assert not RemoteTask.objects.filter(task_services.watchable(), pk=task.pk).exists()
    time.sleep(2)  # reconcile ticks: nothing takes the abandoned task again
    task.refresh_from_db()
    assert task.watcher_status == Status.ABANDONED and task.lease_token == ""


# 6. Tasks the agent forgot ---------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_task_the_agent_forgot_is_gone_and_no_longer_watched(hostile, start_celery_worker, start_celery_beat):
    worker = start_celery_worker(**FAST)
    start_celery_beat(RECONCILE_EVERY_SECONDS="0.5")
    forgetful = hostile("forget", forget_after=1)
    row = hostile_row(forgetful, streaming=False)
    task = task_services.start_task(row, "remember me", mode="return-immediately")
    wait_for(lambda: RemoteTask.objects.get(pk=task.pk).remote_id != "", what="the task to be named")
    Agent.objects.filter(pk=row.pk).update(reachable=False, last_error="was down")
    wait_for(lambda: status_of(task) == Status.GONE, what="the task to be gone")
    calls = sum(forgetful.calls.values())
    time.sleep(3)
    task.refresh_from_db()
    assert sum(forgetful.calls.values()) == calls  # not watched any more
    assert task.gone_at is not None and task.state == "TASK_STATE_WORKING"
    assert len(kinds(task, "system", "gone")) == 1
    assert Agent.objects.get(pk=row.pk).reachable is True  # it answered, if only to say so
    html = page(task)
    assert "Gone at the agent" in html and 'id="abandon-confirm"' in html
    with pytest.raises(task_services.TaskActionError, match="gone at the agent"):
        task_services.refresh_task(task)
    assert len(kinds(task, "system", "gone")) == 1
    no_traceback(worker)


# 7. Answers to auth-required tasks go out at once ----------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
@pytest.mark.parametrize("streaming", [False, True])
def test_an_answer_to_an_auth_required_task_is_sent_at_once(hostile, start_celery_worker, streaming):
    # Polls and quiet waits are long here: only the outbox check can send the answer in time.
    start_celery_worker(**dict(FAST, WATCH_POLL_MIN_SECONDS="60", WATCH_POLL_MAX_SECONDS="120"))
    auth = hostile("authwait")
    task = task_services.start_task(
        hostile_row(auth, streaming=streaming), "needs a login", mode="stream" if streaming else "return-immediately"
    )
    wait_for(lambda: settled(task, ("TASK_STATE_AUTH_REQUIRED",)), what="auth-required")
    time.sleep(1.5)  # the holder is now waiting between turns
    task_services.answer_task(task, "here is the token")
    wait_for(lambda: auth.answered, timeout=10, what="the answer to reach the agent")
    wait_for(lambda: settled(task), what="the task to complete")
    assert task.state == "TASK_STATE_COMPLETED"
    assert auth.calls["SendMessage"] + auth.calls["SendStreamingMessage"] == 2


# The command line: every phase has a way out there too ------------------------------------


@pytest.mark.django_db(transaction=True)
def test_cli_refresh_and_abandon_a_task_that_was_never_named(hostile):
    from django.core.management import CommandError, call_command

    plain = hostile("quietclose")
    row = hostile_row(plain, streaming=False)
    message = {"messageId": "m-cli", "role": "ROLE_USER", "parts": [{"text": "x"}], "contextId": "ctx-cli"}
    task = RemoteTask.objects.create(
        agent=row, phase="failed", mode="blocking", watch="poll", request={"message": message},
        send_error="connection dropped", send_attempted_at=timezone.now(),
    )  # fmt: skip
    assert not task_services.can_retry(task)  # unknown whether the agent has it
    with pytest.raises(CommandError, match="no task for this message"):
        call_command("tasks", "refresh", str(task.pk))
    assert plain.calls["ListTasks"] == 1 and plain.calls["SendMessage"] == 0
    task.refresh_from_db()
    assert task_services.can_retry(task)  # known now: the agent does not have it
    call_command("tasks", "abandon", str(task.pk), "--reason", "not needed")
    task.refresh_from_db()
    assert task.abandoned_at is not None and task.watcher_status == Status.ABANDONED
    assert not task_services.can_retry(task)
    assert kinds(task, "operator")[-1].raw["operator"]["reason"] == "not needed"
    with pytest.raises(CommandError, match="abandoned already"):
        call_command("tasks", "abandon", str(task.pk))
