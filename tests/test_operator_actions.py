"""Operator actions and their ways out, found by an audit of the task lifecycle.

Each test names what happened before its fix. Agents are tiny JSON-RPC peers on loopback
(``tests.serving.json_rpc_peer``); no watcher runs (``no_dispatch``).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from tasks_app.models import Agent, Membership, OperatorAction, RemoteTask, TaskEvent
from tasks_app.services import tasks as task_services
from tasks_app.services.record import record
from tests.people import member
from tests.serving import RpcError, json_rpc_peer

pytestmark = [pytest.mark.django_db]


@pytest.fixture
def calls() -> list[tuple[str, dict]]:
    return []


@pytest.fixture
def replies() -> dict[str, Any]:
    """What the peer answers per method: a result, or an RpcError to raise."""
    return {}


@pytest.fixture
def agent(calls, replies) -> Iterator[Agent]:
    def answer(request: dict) -> Any:
        method, params = request.get("method", ""), request.get("params") or {}
        calls.append((method, params))
        reply = replies.get(method, {})
        if isinstance(reply, RpcError):
            raise reply
        return reply

    with json_rpc_peer(answer) as url:
        yield Agent.objects.create(
            name="ops", base_url=url, interface_url=f"{url}/rpc", binding="JSONRPC",
            protocol_version="1.0",
        )  # fmt: skip


@pytest.fixture
def operator(django_user_model) -> Any:
    return member(django_user_model.objects.create_user("ann", password="pw-12345678"),
                  Membership.Role.OPERATOR)  # fmt: skip


@pytest.fixture
def ann(operator) -> Client:
    client = Client()
    client.force_login(operator)
    return client


def sending(agent: Agent, operator: Any, no_dispatch: list[int]) -> RemoteTask:
    return task_services.start_task(agent, "hello", actor_id=operator.pk)


def actions(task: RemoteTask, name: str) -> list[str]:
    return list(
        OperatorAction.objects.filter(task=task, action=name)
        .order_by("pk")
        .values_list("outcome", flat=True)
    )


# Cancel before the send went out ------------------------------------------------------------


def test_cancel_before_the_send_went_out_withdraws_it(agent, operator, ann, no_dispatch, calls):
    """Cancel was offered on a task still being sent, but only looked the task up at the
    agent ("has no task for this message") and left the outbox full: the watcher then sent
    the message anyway."""
    task = sending(agent, operator, no_dispatch)
    message_id = task.outbox["message"]["messageId"]
    answer = ann.post(reverse("task-cancel", args=[task.pk]), {"reason": "wrong agent"})
    assert answer.status_code == 302
    task.refresh_from_db()
    assert task.outbox is None and task.phase == RemoteTask.Phase.FAILED
    assert "canceled before it was sent" in task.send_error
    assert calls == []  # nothing asked of the agent
    assert task_services.can_retry(task)  # nothing reached it: a retry is safe
    events = list(TaskEvent.objects.filter(task=task).values_list("kind", "raw"))
    assert ("operator", {"operator": {"action": "cancel", "reason": "wrong agent"}}) in events
    assert any(k == "system" and r["system"].get("withdrawn") for k, r in events)
    assert actions(task, "cancel") == ["withdrawn before it was sent"]
    # The log tells it as the view holds it (replay said "sending" against "failed"), and it
    # is no failure to alert on.
    from tasks_app import alerts
    from tasks_app.services import audit

    assert audit.replay(task).ok, audit.replay(task)
    alerts.evaluate(deliver=False)
    from tasks_app.models import Alert

    assert not Alert.objects.filter(task=task).exists()
    # A watcher that loaded the task before the withdrawal does not send it.
    RemoteTask.objects.filter(pk=task.pk).update(phase=RemoteTask.Phase.SENDING)
    token = task_services.acquire_lease(task.pk, "test")
    assert token is not None
    assert task_services.mark_send_attempted(task.pk, token, message_id) is False
    assert task_services.mark_send_attempted(task.pk, "not-the-lease", message_id) is None


def test_a_send_under_way_is_not_withdrawn(agent, operator, no_dispatch):
    """The other side of the compare-and-set: once the watcher marked the send attempted,
    a cancel cannot withdraw it (the agent may have it) and looks it up instead."""
    task = sending(agent, operator, no_dispatch)
    token = task_services.acquire_lease(task.pk, "test")
    assert token is not None
    message_id = task.outbox["message"]["messageId"]
    assert task_services.mark_send_attempted(task.pk, token, message_id) is True
    assert not task_services.withdraw_send(task, reason="", actor_id=operator.pk)
    task.refresh_from_db()
    assert task.outbox is not None and task.phase == RemoteTask.Phase.SENDING


# Naming a task while an operator acts --------------------------------------------------------


def asking(task: RemoteTask, remote_id: str = "t-1") -> dict:
    return {
        "id": remote_id,
        "contextId": task.context_id,
        "status": {
            "state": "TASK_STATE_INPUT_REQUIRED",
            "message": {"messageId": "q-1", "role": "ROLE_AGENT", "parts": [{"text": "Name?"}]},
        },
        "history": [task.request["message"]],
    }


def test_naming_a_task_keeps_an_answer_given_during_the_lookup(
    agent, operator, no_dispatch, monkeypatch, django_user_model
):
    """Refresh (or cancel) of an unnamed task emptied the outbox after its lookup, whatever it
    held: an answer another operator gave during the lookup (up to a minute) was dropped, its
    question marked answered with nothing to send."""
    bob = member(django_user_model.objects.create_user("bob", password="pw-12345678"),
                 Membership.Role.OPERATOR)  # fmt: skip
    task = sending(agent, operator, no_dispatch)
    request_id = task.request["message"]["messageId"]
    RemoteTask.objects.filter(pk=task.pk).update(send_attempted_at=task.created_at)
    task.refresh_from_db()

    def lookup_while_the_task_goes_on(looked_up: RemoteTask) -> task_services.Lookup:
        snapshot = asking(looked_up)
        # Meanwhile: the watcher names the task, the agent asks, Bob answers.
        record(looked_up.pk, {"task": snapshot}, "send-response")
        task_services.clear_outbox(looked_up.pk, request_id)
        task_services.answer_task(RemoteTask.objects.get(pk=looked_up.pk), "Bob", actor_id=bob.pk)
        return task_services.Lookup(task=snapshot)

    monkeypatch.setattr(task_services, "_lookup_now", lookup_while_the_task_goes_on)
    task_services.refresh_task(task, actor_id=operator.pk)
    task.refresh_from_db()
    assert task.remote_id == "t-1" and task.answered_seq == task.asked_seq
    assert task.outbox is not None
    assert task.outbox["message"]["parts"] == [{"text": "Bob"}]


def test_a_listed_task_the_mirror_refuses_leaves_the_task_unnamed_and_says_so(
    agent, operator, ann, no_dispatch, monkeypatch, calls
):
    """A listed task the fold refused (an id no column keeps) was logged as a protocol error,
    nothing raised: refresh said "Refreshed from the agent." and cancel sent CancelTask with
    an empty id."""
    task = sending(agent, operator, no_dispatch)
    RemoteTask.objects.filter(pk=task.pk).update(send_attempted_at=task.created_at)
    task.refresh_from_db()
    listed = {**asking(task, remote_id="x" * 400)}
    monkeypatch.setattr(task_services, "_lookup_now", lambda t: task_services.Lookup(task=listed))
    for action in ("task-refresh", "task-cancel"):
        page = ann.post(reverse(action, args=[task.pk]), {"reason": ""}, follow=True)
        text = page.content.decode()
        assert "could not take" in text and "Refreshed from the agent" not in text
    assert calls == []  # no CancelTask {"id": ""}
    task.refresh_from_db()
    assert task.remote_id == ""
    assert all("could not take" in outcome for outcome in actions(task, "cancel"))
    assert all("could not take" in outcome for outcome in actions(task, "refresh"))
    assert len(actions(task, "cancel")) == len(actions(task, "refresh")) == 1


# What the agent says back ------------------------------------------------------------------


# The agent's answer about ``named``'s task once it is canceled (CancelTask, GetTask).
CANCELED = {"id": "t-9", "contextId": "c-9", "status": {"state": "TASK_STATE_CANCELED"}}


def named(agent: Agent) -> RemoteTask:
    return RemoteTask.objects.create(
        agent=agent, title="t", remote_id="t-9", context_id="c-9", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_WORKING", watch=RemoteTask.Watch.POLL,
    )  # fmt: skip


def test_an_agents_refusal_to_cancel_is_shown_as_one_bounded_line(agent, ann, replies):
    """The refusal was built from the agent's own message: 200,000 characters with line
    breaks and a bidi override went into the flash message (kept in the session) and the page."""
    task = named(agent)
    replies["CancelTask"] = RpcError(-32002, "line one\n" + "X" * 200_000 + "\u202eevil")
    page = ann.post(reverse("task-cancel", args=[task.pk]), {"reason": ""}, follow=True)
    text = page.content.decode()
    assert page.status_code == 200 and "will not cancel this task" in text
    assert "X" * 400 not in text and "line one\n" not in text
    (outcome,) = actions(task, "cancel")
    assert "will not cancel" in outcome and len(outcome) <= 500


def test_refresh_is_in_the_audit_log_and_the_tasks_log(agent, operator, ann, replies):
    """Refresh wrote no audit row and no operator entry, though the audit log lists it."""
    task = named(agent)
    replies["GetTask"] = {
        "id": "t-9",
        "contextId": "c-9",
        "status": {"state": "TASK_STATE_WORKING"},
    }
    ann.post(reverse("task-refresh", args=[task.pk]))
    replies["GetTask"] = RpcError(-32603, "down for maintenance")
    ann.post(reverse("task-refresh", args=[task.pk]))
    outcomes = actions(task, "refresh")
    assert len(outcomes) == 2 and "refreshed" in outcomes[0] and "failed" in outcomes[1]
    entries = TaskEvent.objects.filter(task=task, kind="operator", actor_id=operator.pk)
    assert [e.raw["operator"]["action"] for e in entries] == ["refresh", "refresh"]


def test_watch_again_is_offered_for_a_send_parked_before_it_went_out(agent, operator, no_dispatch):
    """A send parked before it went out (credentials withheld, say) had no "Watch again"
    button, though the action works: the operator waited ten minutes or abandoned it."""
    task = sending(agent, operator, no_dispatch)
    RemoteTask.objects.filter(pk=task.pk).update(
        watcher_status=RemoteTask.WatcherStatus.PARKED, watcher_note="needs attention"
    )
    task.refresh_from_db()
    assert task_services.offered_actions(task)["can_watch_again"]
    task_services.watch_again(task, actor_id=operator.pk)
    task.refresh_from_db()
    assert task.watcher_status == RemoteTask.WatcherStatus.IDLE


def test_watch_again_is_offered_for_a_task_backing_off_with_no_holder(
    agent, operator, ann, no_dispatch, django_capture_on_commit_callbacks
):
    """The service takes a reconnecting task, but the page offered "watch again" only for
    parked and lost ones: an operator who fixed the agent waited out a backoff of up to
    WATCH_BACKOFF_MAX_SECONDS. Offered while nobody holds it; a holder's turn is left alone."""
    task = named(agent)
    hold_off = timezone.now() + timedelta(seconds=300)
    RemoteTask.objects.filter(pk=task.pk).update(
        watcher_status=RemoteTask.WatcherStatus.RECONNECTING, lease_token="",
        lease_expires_at=hold_off, fruitless_turns=3,
    )  # fmt: skip
    task.refresh_from_db()
    assert task_services.offered_actions(task)["can_watch_again"]
    assert (
        'id="watch-again-button"'
        in ann.get(reverse("task-detail", args=[task.pk])).content.decode()
    )
    with django_capture_on_commit_callbacks(execute=True):
        ann.post(reverse("task-watch-again", args=[task.pk]))
    task.refresh_from_db()
    assert task.watcher_status == RemoteTask.WatcherStatus.IDLE and task.lease_expires_at is None
    assert task.fruitless_turns == 0 and no_dispatch == [task.pk]

    held = RemoteTask.objects.create(
        agent=agent, title="h", remote_id="t-10", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_WORKING", watcher_status=RemoteTask.WatcherStatus.RECONNECTING,
        lease_token="tok", lease_expires_at=timezone.now() + timedelta(seconds=4),
    )  # fmt: skip
    assert not task_services.offered_actions(held)["can_watch_again"]
    with pytest.raises(task_services.TaskActionError, match="holds this task now"):
        task_services.watch_again(held, actor_id=operator.pk)


def test_watch_again_refuses_an_ended_or_failed_task_that_kept_its_parked_status(agent, operator):
    """The page offers "watch again" only for unfinished tasks, but the service (and the
    command line through it) took a task settled while parked: an operator entry after the
    task's end and a watcher dispatched for nothing. Refused now in one sentence, nothing written."""
    ended = named(agent)
    RemoteTask.objects.filter(pk=ended.pk).update(
        state="TASK_STATE_COMPLETED", watcher_status=RemoteTask.WatcherStatus.PARKED
    )
    failed = RemoteTask.objects.create(
        agent=agent, title="f", phase=RemoteTask.Phase.FAILED, watch=RemoteTask.Watch.POLL,
        watcher_status=RemoteTask.WatcherStatus.PARKED,
    )  # fmt: skip
    for task, words in ((ended, "has ended"), (failed, "send failed")):
        task.refresh_from_db()
        assert not task_services.offered_actions(task)["can_watch_again"]
        with pytest.raises(task_services.TaskActionError, match=words):
            task_services.watch_again(task, actor_id=operator.pk)
        assert not TaskEvent.objects.filter(task=task, kind="operator").exists()
        assert actions(task, "watch") == []


def test_not_cancelable_asks_gettask_before_calling_it_a_failure(agent, ann, replies):
    """On "not cancelable" only our copy was read: a task the agent had canceled already
    (the mirror not told yet) was reported as refusing to cancel."""
    task = named(agent)
    replies["CancelTask"] = RpcError(-32002, "already canceled")
    replies["GetTask"] = CANCELED
    page = ann.post(reverse("task-cancel", args=[task.pk]), {"reason": ""}, follow=True)
    assert "will not cancel" not in page.content.decode()
    task.refresh_from_db()
    assert task.state == "TASK_STATE_CANCELED" and task.settled_at is not None
    assert actions(task, "cancel") == ["already canceled"]


def test_a_canceled_push_task_is_not_awaiting_push_for_ever(agent, ann, replies, monkeypatch):
    """A cancel settles the task with no watcher to end its "awaiting push": the page said
    so for ever, and retention (which leaves awaited tasks alone) never pruned it (a soak run:
    every canceled push task)."""
    task = named(agent)
    RemoteTask.objects.filter(pk=task.pk).update(
        watch=RemoteTask.Watch.PUSH, watcher_status=RemoteTask.WatcherStatus.AWAITING_PUSH,
        watcher_note="awaiting push notifications",
    )  # fmt: skip
    replies["CancelTask"] = CANCELED
    replies["GetTask"] = CANCELED
    relayed: list[int] = []
    monkeypatch.setattr(task_services, "relay_watcher", relayed.append)
    ann.post(reverse("task-cancel", args=[task.pk]), {"reason": ""})
    task.refresh_from_db()
    assert task.state == "TASK_STATE_CANCELED" and task.settled_at is not None
    assert relayed == [task.pk]  # the lists' rows leave "awaiting push" at once too
    assert task.watcher_status == RemoteTask.WatcherStatus.IDLE
    assert task.watcher_note == "task ended"
    from tasks_app import retention

    later = timezone.now() + timedelta(days=1)
    assert task.pk in retention.due(0, now=later).values_list("pk", flat=True)


def test_a_cancel_answered_task_not_found_asks_gettask_and_finds_the_task_gone(agent, ann, replies):
    """TaskNotFound to CancelTask fell into "Cancel failed" without asking GetTask: the task
    stayed watched as if alive, though the agent had forgotten it (the doc promised "gone")."""
    task = named(agent)
    replies["CancelTask"] = RpcError(-32001, "no such task")
    replies["GetTask"] = RpcError(-32001, "no such task")
    page = ann.post(reverse("task-cancel", args=[task.pk]), {"reason": ""}, follow=True)
    assert "gone at the agent" in page.content.decode()
    task.refresh_from_db()
    assert task.gone_at is not None and task.watcher_status == RemoteTask.WatcherStatus.GONE
    (gone,) = TaskEvent.objects.filter(task=task, kind="system")
    assert gone.raw["system"]["event"] == "gone"
    (outcome,) = actions(task, "cancel")
    assert "gone at the agent" in outcome
    # An agent that answers TaskNotFound for a task that ended: GetTask shows it canceled.
    other = RemoteTask.objects.create(
        agent=agent, title="t", remote_id="t-8", context_id="c-8", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_WORKING", watch=RemoteTask.Watch.POLL,
    )  # fmt: skip
    replies["GetTask"] = {
        "id": "t-8",
        "contextId": "c-8",
        "status": {"state": "TASK_STATE_CANCELED"},
    }
    ann.post(reverse("task-cancel", args=[other.pk]), {"reason": ""})
    other.refresh_from_db()
    assert other.state == "TASK_STATE_CANCELED" and other.gone_at is None
    assert actions(other, "cancel") == ["already canceled"]


# The command line: the same refusals as the page ----------------------------------------------


def test_the_command_line_cannot_cancel_an_ended_task_or_refresh_a_message_reply(
    agent, calls, replies
) -> None:
    """``tasks cancel`` of a completed task logged the operator's entry on the ended task and
    asked the agent; the page refused it (``offered_actions``), the services did not."""
    from io import StringIO

    from django.core.management import CommandError, call_command

    ended = {"id": "t-1", "contextId": "c-1", "status": {"state": "TASK_STATE_COMPLETED"}}
    replies["GetTask"] = ended
    done = RemoteTask.objects.create(agent=agent, title="done", phase=RemoteTask.Phase.TASK)
    record(done, {"task": ended}, "poll")
    reply = RemoteTask.objects.create(agent=agent, title="reply", phase=RemoteTask.Phase.MESSAGE)
    rows = (TaskEvent.objects.count(), OperatorAction.objects.count())
    for args, words in (
        (["cancel", str(done.pk)], "cannot be canceled"),
        (["cancel", str(reply.pk)], "cannot be canceled"),
        (["refresh", str(reply.pk)], "nothing to refresh"),
    ):
        with pytest.raises(CommandError, match=words):
            call_command("tasks", *args, stdout=StringIO())
    assert (TaskEvent.objects.count(), OperatorAction.objects.count()) == rows
    assert calls == []
    # An ended task can still be looked at again.
    call_command("tasks", "refresh", str(done.pk), stdout=StringIO())
    assert [method for method, _ in calls] == ["GetTask"]


def test_a_refresh_settles_an_ended_task_the_agent_no_longer_knows(agent, ann, replies):
    """A task seen ended whose holder stopped before settling it, and an hour on no longer
    watched: the agent has forgotten it, so a refresh said so and left it unsettled, never
    final and never pruned. It settles it, as last seen, and says so."""
    task = RemoteTask.objects.create(
        agent=agent, title="t", remote_id="t-7", context_id="c-7", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_COMPLETED", watch=RemoteTask.Watch.POLL,
    )  # fmt: skip
    replies["GetTask"] = RpcError(-32001, "no such task")
    page = ann.post(reverse("task-refresh", args=[task.pk]), follow=True).content.decode()
    assert "no longer knows this task (it had ended)" in page and "it is final now" in page
    task.refresh_from_db()
    assert task.settled_at is not None and task.state == "TASK_STATE_COMPLETED"
    settled = TaskEvent.objects.get(task=task, kind="system", raw__system__event="settled")
    assert "the agent no longer knows this task" in settled.raw["system"]["detail"]
    # Asked again: nothing more is written, and the sentence does not claim a new settling.
    before = task.last_seq
    again = ann.post(reverse("task-refresh", args=[task.pk]), follow=True).content.decode()
    assert "it is final now" not in again
    task.refresh_from_db()
    assert task.last_seq == before + 1  # the refresh's own operator entry only


def test_a_parked_task_that_ends_by_an_operators_cancel_is_idle_and_its_alert_resolves(
    agent, ann, replies
):
    """A parked task has no holder: when an operator's cancel (or refresh) found it ended and
    settled it, it still said "parked", for ever: its parked alert stayed open, and a task
    with an open alert is never pruned."""
    from django.utils import timezone

    from tasks_app import alerts
    from tasks_app.models import Alert

    task = named(agent)
    now = timezone.now()
    RemoteTask.objects.filter(pk=task.pk).update(
        watcher_status=RemoteTask.WatcherStatus.PARKED, watcher_note="needs attention: stuck",
        watcher_since=now, lease_expires_at=now + timezone.timedelta(seconds=600),
    )  # fmt: skip
    assert alerts.evaluate(now).opened
    assert Alert.objects.filter(task=task, resolved_at__isnull=True).exists()
    replies["CancelTask"] = CANCELED
    ann.post(reverse("task-cancel", args=[task.pk]), {"reason": ""}, follow=True)
    task.refresh_from_db()
    assert task.settled_at is not None and task.state == "TASK_STATE_CANCELED"
    assert task.watcher_status == RemoteTask.WatcherStatus.IDLE
    assert task.watcher_note == "the task has ended; nothing is left to watch"
    assert task.lease_expires_at is None
    alerts.evaluate(timezone.now())
    assert not Alert.objects.filter(task=task, resolved_at__isnull=True).exists()


def test_a_task_taken_by_a_holder_while_its_end_is_recorded_is_left_to_the_holder(agent):
    """The fold decides to unpark on the row it read; a holder that took the task meanwhile
    (watch again) keeps its status: the write matches no row and the batch folds again."""
    from django.db import connection
    from django.utils import timezone

    from tasks_app.services.record import settle

    task = named(agent)
    RemoteTask.objects.filter(pk=task.pk).update(
        state="TASK_STATE_COMPLETED", watcher_status=RemoteTask.WatcherStatus.PARKED,
        lease_expires_at=timezone.now() + timezone.timedelta(seconds=600),
    )  # fmt: skip
    taken = []

    def a_holder_takes_it_first(execute, sql, params, many, context):
        if sql.startswith('UPDATE "tasks_app_remotetask"') and "last_seq" in sql and not taken:
            taken.append(True)
            RemoteTask.objects.filter(pk=task.pk).update(
                lease_token="holder", lease_owner="w1", watcher_status="polling"
            )
        return execute(sql, params, many, context)

    with connection.execute_wrapper(a_holder_takes_it_first):
        settle(task.pk, None, note="not reconciled")
    task.refresh_from_db()
    assert taken and task.settled_at is not None
    assert (task.watcher_status, task.lease_token) == ("polling", "holder")


def test_an_abandoned_task_can_still_be_canceled_at_the_agent(agent, ann, replies, calls):
    """Abandoned means "not watched here", not "ended at the agent": an abandoned task still
    running there was offered no cancel, by any route, and ran on out of reach. It is
    canceled and recorded as any other, and no watcher is started for it."""
    from django.utils import timezone

    task = named(agent)
    RemoteTask.objects.filter(pk=task.pk).update(
        abandoned_at=timezone.now(), watcher_status=RemoteTask.WatcherStatus.ABANDONED
    )
    task.refresh_from_db()
    assert task_services.offered_actions(task)["can_cancel"]
    page = ann.get(reverse("task-detail", args=[task.pk])).content.decode()
    assert reverse("task-cancel", args=[task.pk]) in page
    replies["CancelTask"] = CANCELED
    ann.post(reverse("task-cancel", args=[task.pk]), {"reason": "left running"}, follow=True)
    task.refresh_from_db()
    assert [method for method, _ in calls] == ["CancelTask"]
    assert task.state == "TASK_STATE_CANCELED" and task.settled_at is not None
    assert task.watcher_status == RemoteTask.WatcherStatus.ABANDONED  # still not watched
    assert actions(task, "cancel") == ["requested"]


def test_a_task_abandoned_while_its_send_may_have_landed_can_be_looked_up_and_canceled(agent):
    """Abandoned during its send, the task may exist at the agent, unnamed to us: it was
    offered nothing at all. Its lookup (refresh) and cancel are offered; a send abandoned
    before it went out has nothing at the agent, and is offered neither."""
    from django.utils import timezone

    def sending(**fields: Any) -> RemoteTask:
        return RemoteTask.objects.create(
            agent=agent, title="t", phase=RemoteTask.Phase.SENDING, abandoned_at=timezone.now(),
            request={"message": {"messageId": "m-1", "contextId": "c-1"}}, **fields,
        )  # fmt: skip

    attempted = task_services.offered_actions(sending(send_attempted_at=timezone.now()))
    assert attempted["can_refresh"] and attempted["can_cancel"]
    not_sent = task_services.offered_actions(sending())
    assert not not_sent["can_refresh"] and not not_sent["can_cancel"]
