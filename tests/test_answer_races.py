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
