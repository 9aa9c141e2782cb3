"""A refused answer reopening its question, raced against people answering it again.

``answer_failed`` (the agent refused the answer, or never got it) and ``answer_task``
(a person answers) both change the same row by compare-and-set. Released together, in
either order, they must leave one of two states and nothing else: the question open
(no answer waits), or exactly one new answer waiting in the outbox. Never an answered
question with nothing to send, which offers no form and sends nothing.
"""

from __future__ import annotations

import threading

import pytest
from django.db import close_old_connections

from tasks_app.models import Agent, RemoteTask
from tasks_app.services import tasks as task_services

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


def _race(task_pk: int) -> tuple[list[bool], list[str], list[str]]:
    """``answer_failed`` and ANSWERERS people released together: (reopened, won, refused)."""
    barrier = threading.Barrier(ANSWERERS + 1)
    won: list[str] = []
    refused: list[str] = []
    reopened: list[bool] = []
    errors: list[BaseException] = []

    def fail() -> None:
        try:
            barrier.wait(timeout=10)
            reopened.append(task_services.answer_failed(task_pk, "refused"))
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)
        finally:
            close_old_connections()

    def answer(i: int) -> None:
        text = f"again {i}"
        try:
            current = RemoteTask.objects.select_related("agent").get(pk=task_pk)
            barrier.wait(timeout=10)
            task_services.answer_task(current, text, question_seq=QUESTION)
            won.append(text)
        except task_services.TaskActionError as exc:
            refused.append(str(exc))
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)
        finally:
            close_old_connections()

    threads = [threading.Thread(target=fail)]
    threads += [threading.Thread(target=answer, args=(i,)) for i in range(ANSWERERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    return reopened, won, refused


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
