"""Exactly one answer reaches the agent, with answerers released at every point of the window.

The window that used to exist: the holder clears the outbox when the agent
acknowledges the answer, and records the agent's reply a moment later; in
between, the task still reads input-required with an empty outbox. Here the
holder runs in this process (so a pause can be injected exactly there: after
the agent's acknowledgement, before the recording) against a real a2a-sdk
agent, and N answerers are released together before the send, inside the
paused window, and after the reply. The agent's own GetTask must show exactly
one answer.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator

import pytest
from django.db import close_old_connections

from tasks_app import eventloop, relay, watchers
from tasks_app.models import Agent, RemoteTask
from tasks_app.services import tasks as task_services
from tasks_app.services.agents import add_agent
from tests.races import release_together
from tests.test_mirror import agent_call, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

ANSWERERS = 6


def race(task_pk: int, question: int, label: str) -> tuple[list[str], list[str]]:
    """Release ANSWERERS answerers at once; return the texts that won and the refusals."""
    tasks = [RemoteTask.objects.select_related("agent").get(pk=task_pk) for _ in range(ANSWERERS)]
    texts = [f"{label} {i}" for i in range(ANSWERERS)]
    outcomes = release_together(
        *(
            functools.partial(task_services.answer_task, task, text, question_seq=question)
            for task, text in zip(tasks, texts, strict=True)
        )
    )
    refused = [str(o) for o in outcomes if isinstance(o, task_services.TaskActionError)]
    assert all(isinstance(o, RemoteTask | task_services.TaskActionError) for o in outcomes), (
        outcomes
    )
    won = [text for text, o in zip(texts, outcomes, strict=True) if isinstance(o, RemoteTask)]
    return won, refused


def asked(agent) -> tuple[Agent, RemoteTask]:
    """The demo agent added, and a task of it that waits on its question."""
    demo = add_agent(agent.base_url, name="demo")
    task = task_services.start_task(demo, "ask", mode="stream")
    wait_for(
        lambda: RemoteTask.objects.get(pk=task.pk).state == "TASK_STATE_INPUT_REQUIRED",
        what="the question",
    )
    task.refresh_from_db()
    return demo, task


def at_agent(demo: Agent, task: RemoteTask) -> dict:
    """The task as the agent's own GetTask gives it."""
    close_old_connections()
    snapshot = agent_call(demo, lambda client: client.get_task(task.remote_id))
    assert isinstance(snapshot, dict)
    return snapshot


@pytest.fixture
def in_process_holders() -> Iterator[None]:
    """Holders on this process's shared loop; afterwards the loop and its relay are gone again."""
    yield
    if eventloop.running():
        eventloop.submit(watchers.registry.shutdown()).result(timeout=15)
        eventloop.stop()
    relay.use_loop(None)  # later tests publish straight to the channel layer again


def test_exactly_one_answer_reaches_the_agent(agent, monkeypatch, in_process_holders):
    acknowledged = threading.Event()
    resume = threading.Event()
    original_clear = task_services.clear_outbox

    def clear_then_pause(task_pk: int, message_id: str) -> bool:
        if not original_clear(task_pk, message_id):
            return False  # the first send's holder, late: the outbox holds the answer now
        acknowledged.set()
        resume.wait(timeout=20)  # the injected pause: acknowledged, not yet recorded
        return True

    monkeypatch.setattr(task_services, "clear_outbox", clear_then_pause)
    # Holders run here, on this process's shared loop, instead of in a worker.
    monkeypatch.setattr(task_services, "dispatch", lambda pk: watchers.watch(pk))

    resume.set()  # the first send's acknowledgement needs no pause
    demo, task = asked(agent)
    question = task.asked_seq
    assert question > 0

    # 1. Released together before anything is sent: exactly one wins.
    acknowledged.clear()
    resume.clear()
    won, refused = race(task.pk, question, "first")
    assert len(won) == 1, (won, refused)
    assert len(refused) == ANSWERERS - 1 and all("Already answered by" in r for r in refused)

    # 2. Released inside the window (acknowledged by the agent, reply not yet recorded).
    assert acknowledged.wait(timeout=20), "the holder never sent the answer"
    task.refresh_from_db()
    assert task.outbox is None and task.state == "TASK_STATE_INPUT_REQUIRED"  # the old window
    late_won, late_refused = race(task.pk, question, "inside the window")
    assert late_won == [] and len(late_refused) == ANSWERERS
    resume.set()

    # 3. After the reply: the question is gone.
    wait_for(
        lambda: RemoteTask.objects.get(pk=task.pk).state == "TASK_STATE_COMPLETED",
        what="completion",
    )
    after_won, _ = race(task.pk, question, "after the reply")
    assert after_won == []

    snapshot = at_agent(demo, task)
    answers = [
        m
        for m in snapshot.get("history", [])
        if m.get("role") == "ROLE_USER" and m["parts"][0].get("text") != "ask"
    ]
    assert [m["parts"][0]["text"] for m in answers] == won
    assert f"You answered: {won[0]}" in str(snapshot.get("artifacts"))


def test_an_answer_given_while_the_holder_lets_go_is_sent(agent, monkeypatch, in_process_holders):
    """The window: the question's holder has given its lease back but not yet ended when the
    answer's dispatch takes the lease again in the same process. The new turn must run
    (it used to hand its token to the ending holder, and the answer waited for the lease to
    run out and a reconciler; none runs here)."""
    released = threading.Event()
    resume = threading.Event()
    original_release = task_services.release_lease

    def release_then_pause(task_pk: int, token: str, **kwargs):
        result = original_release(task_pk, token, **kwargs)
        if kwargs.get("status") == watchers.Status.IDLE and not released.is_set():
            released.set()
            resume.wait(timeout=20)  # the injected pause: released, the holder not yet ended
        return result

    monkeypatch.setattr(task_services, "release_lease", release_then_pause)
    monkeypatch.setattr(task_services, "dispatch", lambda pk: watchers.watch(pk))
    demo = add_agent(agent.base_url, name="demo")
    task = task_services.start_task(demo, "ask", mode="stream")
    assert released.wait(timeout=30), "the question's holder never let go"
    task.refresh_from_db()
    assert task.state == "TASK_STATE_INPUT_REQUIRED" and task.lease_token == ""
    task_services.answer_task(task, "green")  # dispatched while that holder is paused
    resume.set()
    wait_for(
        lambda: RemoteTask.objects.get(pk=task.pk).state == "TASK_STATE_COMPLETED",
        timeout=30,
        what="the answer to reach the agent and the task to end",
    )


def test_an_answer_given_before_the_holder_lets_go_is_sent(agent, monkeypatch, in_process_holders):
    """The other side of that window: the question's turn is over but its holder has not yet
    given the lease back when the answer is committed, so the answer's own dispatch finds the
    lease held. The holder, once it has let go, sends the task on itself (the answer used to
    wait for a reconciler; none runs here)."""
    ending = threading.Event()
    resume = threading.Event()
    original_release = task_services.release_lease

    def pause_then_release(task_pk: int, token: str, **kwargs):
        if kwargs.get("status") == watchers.Status.IDLE and not ending.is_set():
            ending.set()
            resume.wait(timeout=20)  # the injected pause: the turn is over, the lease still held
        return original_release(task_pk, token, **kwargs)

    dispatched: list[str] = []
    monkeypatch.setattr(task_services, "release_lease", pause_then_release)
    monkeypatch.setattr(task_services, "dispatch", lambda pk: dispatched.append(watchers.watch(pk)))
    demo = add_agent(agent.base_url, name="demo")
    task = task_services.start_task(demo, "ask", mode="stream")
    assert ending.wait(timeout=30), "the question's turn never ended"
    task.refresh_from_db()
    assert task.state == "TASK_STATE_INPUT_REQUIRED" and task.lease_token != ""
    dispatched.clear()
    task_services.answer_task(task, "green")
    assert dispatched == ["held elsewhere"]  # the answer's own dispatch: the lease is held
    resume.set()
    wait_for(
        lambda: RemoteTask.objects.get(pk=task.pk).state == "TASK_STATE_COMPLETED",
        timeout=30,
        what="the answer to reach the agent and the task to end",
    )
    assert dispatched[1:] == ["started"]


@pytest.mark.parametrize("fails", ["after the agent took it", "before it was sent"])
def test_an_answer_whose_send_was_cut_by_the_database_reaches_the_agent_once(
    agent, monkeypatch, in_process_holders, fails
):
    """The database fails while an answer is being sent: before the send, or between the
    agent taking it and the outbox being cleared.

    The holder stops (an unreachable database is nobody's fault: the lease lapses); the
    next holder finds the answer still in the outbox, marked as sent before. It asks the
    agent (GetTask) instead of sending it blindly: sent again only when the agent does not
    have it, so the agent gets it exactly once, the question is not opened again, and the
    log says why.
    """
    from django.db import OperationalError

    from tasks_app.a2a.client import A2AClient
    from tasks_app.models import TaskEvent

    failed = threading.Event()
    original_clear = task_services.clear_outbox
    answering = threading.Event()

    def clear_fails_once(task_pk: int, message_id: str) -> bool:
        # The answer's clearing only: the first send's holder may still clear its request
        # once the question is on the page (it finds the outbox taken by the answer).
        if (
            answering.is_set()
            and message_id != first_request[0]
            and fails == "after the agent took it"
            and not failed.is_set()
        ):
            failed.set()
            raise OperationalError("the database went away")  # the injected failure
        return original_clear(task_pk, message_id)

    sent: list[str] = []
    original_send = A2AClient.send_streaming_message

    def counting_send(self, message, **kwargs):
        if answering.is_set() and fails == "before it was sent" and not failed.is_set():
            failed.set()
            raise OperationalError("the database went away")  # before anything left
        sent.append(message.get("messageId", ""))
        return original_send(self, message, **kwargs)

    monkeypatch.setattr(A2AClient, "send_streaming_message", counting_send)
    monkeypatch.setattr(task_services, "clear_outbox", clear_fails_once)
    monkeypatch.setattr(task_services, "dispatch", lambda pk: watchers.watch(pk))
    first_request: list[str] = [""]
    demo, task = asked(agent)
    first_request[0] = task.request["message"]["messageId"]
    answering.set()
    task_services.answer_task(task, "green", question_seq=task.asked_seq)
    assert failed.wait(timeout=20), "the holder never began sending the answer"
    stuck = RemoteTask.objects.get(pk=task.pk)
    answer_id = stuck.outbox["message"]["messageId"]  # the clearing was lost, or never came
    assert stuck.send_attempted_at is not None
    # No reconciler runs here: the next holder starts once the stopped one's lease lapsed.
    wait_for(lambda: watchers.watch(task.pk) == "started", timeout=20, what="the lease to lapse")
    wait_for(
        lambda: RemoteTask.objects.get(pk=task.pk).state == "TASK_STATE_COMPLETED",
        timeout=30,
        what="the task to end",
    )
    assert sent.count(answer_id) == 1  # sent once, by whichever holder found it unsent

    history = at_agent(demo, task).get("history", [])
    assert [m["messageId"] for m in history if m["messageId"] == answer_id] == [answer_id]
    final = RemoteTask.objects.get(pk=task.pk)
    assert final.outbox is None and final.answered_seq == final.asked_seq
    found = [
        e.raw["system"]["detail"]
        for e in TaskEvent.objects.filter(
            task_id=task.pk, raw__system__event="found-again"
        ).order_by("seq")
    ]
    if fails == "after the agent took it":
        assert found == [
            "the worker stopped while sending an answer; the agent has it, so it is not sent again"
        ]
    else:
        assert found == []
    assert not TaskEvent.objects.filter(task_id=task.pk, raw__system__event="answer-failed")


def test_a_question_the_agent_ended_meanwhile_is_seen_at_the_next_look(
    agent, monkeypatch, in_process_holders
):
    """Once a question was asked nobody looked at the task again: an agent that ended it
    meanwhile (timed out, canceled elsewhere) left it waiting in the inbox until someone
    refreshed it. Every WATCH_QUESTION_RECHECK_SECONDS a holder takes it for one GetTask;
    an unchanged question costs no row and waits for the next look."""
    from datetime import timedelta

    from django.utils import timezone

    monkeypatch.setattr(task_services, "dispatch", lambda pk: watchers.watch(pk))

    class Dispatch:  # the reconciler's batches, to holders in this process
        @staticmethod
        def delay(pks: list[int]) -> None:
            for pk in pks:
                watchers.watch(pk)

    monkeypatch.setattr(watchers, "watch_batch", Dispatch)
    demo, task = asked(agent)
    waiting = RemoteTask.objects.filter(pk=task.pk, watcher_note="waiting for an answer")
    wait_for(waiting.exists, what="the question's turn to end")
    task.refresh_from_db()
    # The next look is the hold-off away: the reconciler leaves it until then.
    assert task.lease_token == ""
    assert task.lease_expires_at > timezone.now() + timedelta(seconds=200)
    watchers._reconcile()
    assert RemoteTask.objects.get(pk=task.pk).lease_expires_at == task.lease_expires_at

    def look_now() -> None:  # the hold-off over (here at once), the reconciler's next tick
        RemoteTask.objects.filter(pk=task.pk).update(lease_expires_at=timezone.now())
        watchers._reconcile()

    # Unchanged: nothing appended, and the next look is the hold-off away again.
    before = RemoteTask.objects.get(pk=task.pk)
    look_now()
    wait_for(
        lambda: RemoteTask.objects.filter(
            pk=task.pk, lease_token="", lease_expires_at__gt=timezone.now()
        ).exists(),
        what="the look to end",
    )
    after = RemoteTask.objects.get(pk=task.pk)
    assert (after.last_seq, after.state, after.asked_seq) == (
        before.last_seq, before.state, before.asked_seq,
    )  # fmt: skip
    # The agent cancels it on its own: no channel of ours hears of it, the next look does.
    agent_call(demo, lambda client: client.cancel_task(task.remote_id))
    look_now()
    wait_for(
        lambda: RemoteTask.objects.filter(
            pk=task.pk, state="TASK_STATE_CANCELED", settled_at__isnull=False
        ).exists(),
        what="the mirror to see the agent's end",
    )
    assert at_agent(demo, task)["status"]["state"] == "TASK_STATE_CANCELED"
    task.refresh_from_db()
    assert task.watcher_note == "task ended" and task.lease_expires_at is None
