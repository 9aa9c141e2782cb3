"""A polled task's snapshots hold the newest messages of its history, not all of them.

An agent's history grows with every status message, and a poll that stored a changed
snapshot stored the whole history each time: the demo agent's ten-minute task, one status a
second, made a 185 KB row a poll, went over its byte budget and was parked after six
minutes (found by driving the running dashboard). A poll now asks GetTask for the newest
``watchers.POLL_HISTORY`` messages; the GetTask that settles the task asks for all, so
messages said faster than the polls read them still reach the conversation in the end.
A real demo agent, a real worker.
"""

from __future__ import annotations

import pytest

from tasks_app import watchers
from tasks_app.models import ConversationMessage, TaskEvent
from tasks_app.services import tasks as task_services
from tasks_app.services.agents import add_agent
from tests.test_mirror import settled, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_polls_store_the_newest_history_and_the_end_mirrors_all_of_it(agent, start_celery_worker):
    # A poll every 3 s, the agent a status every 0.1 s: about 30 messages between two polls,
    # more than a poll's window.
    start_celery_worker(WATCH_POLL_MIN_SECONDS="3", WATCH_POLL_MAX_SECONDS="3")
    row = add_agent(agent.base_url, name="demo")
    task = task_services.start_task(row, "long 7", mode="return-immediately")
    wait_for(lambda: settled(task), timeout=60, what="the long task to complete")
    assert task.state == "TASK_STATE_COMPLETED"
    rows = TaskEvent.objects.filter(task=task, kind="task", channel="poll").order_by("seq")
    snapshots = [e.raw["task"] for e in rows]
    polled, settling = snapshots[:-1], snapshots[-1]
    assert len(polled) >= 2, len(polled)  # polls while it worked
    sizes = [len(s.get("history") or []) for s in polled]
    assert max(sizes) <= watchers.POLL_HISTORY, sizes
    # The settling GetTask asked for the whole history: the messages no poll's window held
    # are in its snapshot and in the conversation.
    history = settling.get("history") or []
    assert len(history) > watchers.POLL_HISTORY + max(sizes)
    said = {m["messageId"] for m in history}
    mirrored = set(
        ConversationMessage.objects.filter(task=task).values_list("message_id", flat=True)
    )
    assert said <= mirrored
