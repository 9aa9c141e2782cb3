"""A refused answer reopening its question, raced against people answering it again.

``answer_failed`` (the agent refused the answer, or never got it) and ``answer_task``
(a person answers) both change the same row by compare-and-set. Released together, in
either order, they must leave one of two states and nothing else: the question open
(no answer waits), or exactly one new answer waiting in the outbox. Never an answered
question with nothing to send, which offers no form and sends nothing.
"""

from __future__ import annotations

import functools

import pytest

from tasks_app.models import Agent, RemoteTask
from tasks_app.services import tasks as task_services
from tests.races import release_together

pytestmark = pytest.mark.django_db(transaction=True)

ANSWERERS = 4
ROUNDS = 12
QUESTION = 5


def _answered_task(agent: Agent, n: int) -> RemoteTask:
    """A task whose question (seq 5) was answered, the answer still in the outbox."""
    return RemoteTask.objects.create(
        agent=agent,
        phase=RemoteTask.Phase.TASK,
        remote_id=f"r-{n}",
        context_id="c-1",
        state="TASK_STATE_INPUT_REQUIRED",
        last_seq=QUESTION,
        asked_seq=QUESTION,
        answered_seq=QUESTION,
        outbox={"message": {"messageId": "refused", "role": "ROLE_USER", "parts": []}},
    )


def _race(task_pk: int) -> tuple[list[object], list[str], list[str]]:
    """``answer_failed`` and ANSWERERS people released together: (reopened, won, refused)."""
    tasks = [RemoteTask.objects.select_related("agent").get(pk=task_pk) for _ in range(ANSWERERS)]
    texts = [f"again {i}" for i in range(ANSWERERS)]
    reopened, *answers = release_together(
        functools.partial(task_services.answer_failed, task_pk, "refused"),
        *(
            functools.partial(task_services.answer_task, task, text, question_seq=QUESTION)
            for task, text in zip(tasks, texts, strict=True)
        ),
    )
    assert all(isinstance(o, RemoteTask | task_services.TaskActionError) for o in answers), answers
    won = [text for text, o in zip(texts, answers, strict=True) if isinstance(o, RemoteTask)]
    refused = [str(o) for o in answers if isinstance(o, task_services.TaskActionError)]
    return [reopened], won, refused


def test_a_reopened_question_takes_at_most_one_new_answer_and_never_loses_it(monkeypatch):
    dispatched: list[int] = []
    monkeypatch.setattr(task_services, "dispatch", dispatched.append)  # no worker here
    agent = Agent.objects.create(name="races", base_url="http://127.0.0.1:9/races")
    for n in range(ROUNDS):
        task = _answered_task(agent, n)
        reopened, won, refused = _race(task.pk)
        # The refused answer was still waiting: reopening it always succeeds.
        assert reopened == [True]
        assert len(won) <= 1 and len(won) + len(refused) == ANSWERERS
        row = RemoteTask.objects.get(pk=task.pk)
        if won:  # reopened first, then exactly one person's answer was taken
            assert row.answered_seq == QUESTION
            assert row.outbox["message"]["parts"] == [{"text": won[0]}]
            assert dispatched[-1] == task.pk
        else:  # every answer came before the reopening: the question is open
            assert row.answered_seq == QUESTION - 1 and row.outbox is None
        assert not (row.answered_seq == QUESTION and row.outbox is None)
        # "Not delivered" says the refusal only while no new answer followed it.
        assert (row.answer_failed_at is None) == bool(won)


def test_watch_again_pressed_twice_at_once_is_taken_once(monkeypatch):
    """It accepted an idle task, which is what the first caller leaves: two callers released
    together both succeeded, and the log held two watch-again entries."""
    from tasks_app.models import TaskEvent

    monkeypatch.setattr(task_services, "dispatch", lambda pk: None)
    agent = Agent.objects.create(name="a", base_url="http://127.0.0.1:9/again")
    for n in range(4):
        task = RemoteTask.objects.create(
            agent=agent, phase=RemoteTask.Phase.TASK, remote_id=f"w-{n}",
            state="TASK_STATE_WORKING", watcher_status=RemoteTask.WatcherStatus.PARKED,
            fruitless_turns=8,
        )  # fmt: skip
        copies = [RemoteTask.objects.select_related("agent").get(pk=task.pk) for _ in range(2)]
        outcomes = release_together(
            *(functools.partial(task_services.watch_again, copy) for copy in copies)
        )
        assert sum(isinstance(o, RemoteTask) for o in outcomes) == 1, outcomes
        assert TaskEvent.objects.filter(task=task, kind="operator").count() == 1


def test_a_send_failure_from_a_holder_whose_lease_moved_on_changes_nothing():
    """The phase was set to failed while the fenced send-failed entry was refused: the stored
    phase then differed from what the log replays to (an operator abandoned meanwhile)."""
    from tasks_app.models import TaskEvent

    agent = Agent.objects.create(name="a", base_url="http://127.0.0.1:9/fenced")
    task = RemoteTask.objects.create(agent=agent, phase=RemoteTask.Phase.SENDING, lease_token="")
    task_services.fail_send(task.pk, "ConnectError", fence="the-old-holder")
    task.refresh_from_db()
    assert task.phase == RemoteTask.Phase.SENDING and not TaskEvent.objects.filter(task=task)
    RemoteTask.objects.filter(pk=task.pk).update(lease_token="the-holder")
    task_services.fail_send(task.pk, "ConnectError", fence="the-holder")
    task.refresh_from_db()
    assert task.phase == RemoteTask.Phase.FAILED
    assert TaskEvent.objects.filter(task=task, raw__system__event="send-failed").count() == 1


def test_an_answer_given_while_the_first_request_is_being_cleared_is_kept(monkeypatch):
    """The first send's holder clears its request from the outbox once the agent answers; the
    agent's question may be on the page by then. Clearing was a read and then an update: an
    answer given between the two was cleared with the request, and never sent. The answer
    is given here right after the holder's first statement (the injected pause)."""
    import threading

    from django.db import close_old_connections, connection

    monkeypatch.setattr(task_services, "dispatch", lambda pk: None)
    agent = Agent.objects.create(name="a", base_url="http://127.0.0.1:9/cleared")
    task = RemoteTask.objects.create(
        agent=agent, phase=RemoteTask.Phase.TASK, remote_id="r-1", context_id="c-1",
        state="TASK_STATE_INPUT_REQUIRED", last_seq=QUESTION, asked_seq=QUESTION,
        answered_seq=QUESTION - 1,
        outbox={"message": {"messageId": "first", "role": "ROLE_USER", "parts": []}},
    )  # fmt: skip
    answered: list[object] = []

    def answer() -> None:
        try:
            copy = RemoteTask.objects.select_related("agent").get(pk=task.pk)
            answered.append(task_services.answer_task(copy, "green", question_seq=QUESTION))
        finally:
            close_old_connections()

    statements: list[str] = []

    def answer_after_the_first_statement(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        statements.append(sql)
        if len(statements) == 1:  # the person answers inside the holder's window
            person = threading.Thread(target=answer)
            person.start()
            person.join(timeout=20)
        return result

    with connection.execute_wrapper(answer_after_the_first_statement):
        task_services.clear_outbox(task.pk, "first")
    assert statements and len(answered) == 1 and isinstance(answered[0], RemoteTask), answered
    row = RemoteTask.objects.get(pk=task.pk)
    assert row.answered_seq == QUESTION
    assert row.outbox is not None, "the person's answer was cleared with the first request"
    assert row.outbox["message"]["parts"] == [{"text": "green"}]
