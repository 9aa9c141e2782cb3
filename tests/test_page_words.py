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


# The agent page's "Reachable ... (last contact ...)" -------------------------------------------


def test_last_contact_follows_the_agents_answers_at_most_once_a_minute():
    """Only the card fetch set "last contact": an agent streaming that moment was "last
    contact 16 minutes ago" (found by driving the dashboard)."""
    from datetime import timedelta

    from django.utils import timezone

    from tasks_app.services import agents as agent_services

    long_ago = timezone.now() - timedelta(minutes=16)
    agent = Agent.objects.create(name="contact", base_url="http://127.0.0.1:9/contact",
                                 reachable=True, last_contact_at=long_ago)  # fmt: skip
    agent_services.mark_reachable(agent.pk)
    agent.refresh_from_db()
    first = agent.last_contact_at
    assert first > long_ago + timedelta(minutes=15)
    agent_services.mark_reachable(agent.pk)  # within the minute: not written again
    agent.refresh_from_db()
    assert agent.last_contact_at == first


def test_an_import_that_cannot_reach_the_agent_marks_it_unreachable():
    """A failed send marked the agent unreachable; a failed import did not, and the agent
    list went on saying "reachable"."""
    from tasks_app.services import imports
    from tasks_app.services.tasks import TaskActionError
    from tests.agents import free_port

    agent = Agent.objects.create(
        name="away", base_url=f"http://127.0.0.1:{free_port()}", reachable=True,
        interface_url=f"http://127.0.0.1:{free_port()}/rpc", binding="JSONRPC",
        protocol_version="1.0",
    )  # fmt: skip
    with pytest.raises(TaskActionError, match="cannot connect"):
        imports.import_tasks(agent)
    agent.refresh_from_db()
    assert agent.reachable is False and agent.last_error
