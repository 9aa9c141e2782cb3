"""What the task page says about its watcher, said once (found by driving the dashboard: a
parked task's page read "Needs attention: needs attention: the task is over its storage
budget", and its watcher row "needs attention since ... needs attention: ...")."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from tasks_app.models import Agent, RemoteTask
from tasks_app.templatetags.dashboard import note_after_status
from tests.people import member

pytestmark = pytest.mark.django_db


def test_a_parked_tasks_page_says_needs_attention_once(django_user_model):
    client = Client()
    client.force_login(member(django_user_model.objects.create_user("reader")))
    agent = Agent.objects.create(name="words agent", base_url="http://127.0.0.1:9/words")
    task = RemoteTask.objects.create(
        agent=agent, title="t", phase="task", remote_id="r-1", state="TASK_STATE_WORKING",
        watcher_status=RemoteTask.WatcherStatus.PARKED,
        watcher_note="needs attention: the task is over its storage budget (67108864 bytes)",
    )  # fmt: skip
    body = client.get(reverse("task-detail", args=[task.pk])).content.decode()
    assert "needs attention: needs attention" not in body.lower()
    assert "Needs attention: The task is over its storage budget (67108864 bytes)" in body
    assert body.lower().count("the task is over its storage budget") == 2  # banner, watcher row


@pytest.mark.parametrize(
    ("note", "status", "shown"),
    [
        ("needs attention: 8 fruitless turns", "parked", "8 fruitless turns"),
        ("needs attention (looked again)", "parked", "(looked again)"),
        ("needs attention", "parked", ""),
        ("gone at the agent", "gone", ""),
        ("needs attention: x", "polling", "needs attention: x"),  # another status: as it is
        ("switched to poll by an operator", "idle", "switched to poll by an operator"),
    ],
)
def test_a_note_loses_only_the_words_its_status_shows(note, status, shown):
    assert note_after_status(note, status) == shown
