"""Pages as a new user meets them: error pages in the site's style, a favicon, plain
message replies shown as such, artifacts that stop "receiving" when the task has ended."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.staticfiles import finders
from django.template.loader import render_to_string
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from tasks_app.models import Agent, Artifact, ArtifactPart, Membership, RemoteTask, TaskEvent
from tasks_app.svg import timeline_svg
from tests.people import member

pytestmark = pytest.mark.django_db


@pytest.fixture
def client_in(django_user_model) -> Client:
    client = Client()
    client.force_login(
        member(django_user_model.objects.create_user("pages", password="pw-12345678"))
    )
    return client


@pytest.fixture
def agent_row() -> Agent:
    return Agent.objects.create(name="pages agent", base_url="http://127.0.0.1:9/pages")


def test_error_pages_are_in_the_site_style(client_in, django_user_model) -> None:
    missing = client_in.get("/no/such/page/")
    assert missing.status_code == 404
    body = missing.content.decode()
    assert 'id="not-found"' in body and 'class="topbar"' in body and "favicon.svg" in body
    viewer = Client()
    viewer.force_login(
        member(
            django_user_model.objects.create_user("v", password="pw-12345678"),
            Membership.Role.VIEWER,
        )
    )
    task = RemoteTask.objects.create(
        agent=Agent.objects.create(name="a", base_url="http://127.0.0.1:9/x"), phase="task"
    )
    refused = viewer.post(reverse("task-cancel", args=[task.pk]))
    assert refused.status_code == 403
    assert (
        'id="forbidden"' in refused.content.decode()
        and "does not allow this" in refused.content.decode()
    )
    # The 500 page stands alone (it must render when the rest may be broken).
    page = render_to_string("500.html")
    assert 'id="server-error"' in page and "favicon.svg" in page and "{%" not in page


def test_every_page_names_a_favicon_that_exists(client_in) -> None:
    body = client_in.get(reverse("overview")).content.decode()
    assert 'rel="icon"' in body
    assert finders.find("dashboard/favicon.svg")


def test_a_plain_message_reply_is_shown_as_one(client_in, agent_row) -> None:
    reply = RemoteTask.objects.create(
        agent=agent_row, phase=RemoteTask.Phase.MESSAGE, title="hi", last_seq=1
    )
    TaskEvent.objects.create(task=reply, seq=1, channel="send-response", kind="message", raw={"message": {}},
                             received_at=timezone.now() - timedelta(hours=1))  # fmt: skip
    page = client_in.get(reverse("task-detail", args=[reply.pk])).content.decode()
    assert "the agent answered with a message (no task)" in page and "(not named yet)" not in page
    overview = client_in.get(reverse("overview")).content.decode()
    assert "message reply" in overview and ">unknown<" not in overview
    listed = client_in.get(reverse("task-list"), {"phase": "message"}).content.decode()
    assert f"/tasks/{reply.pk}/" in listed
    # Its timeline ends at its last entry: it does not grow with the clock.
    events = [(1, timezone.now() - timedelta(hours=1), "")]
    assert timeline_svg(events, ended=True) == timeline_svg(
        events, ended=True, now=timezone.now() + timedelta(days=1)
    )
    assert timeline_svg(events) != timeline_svg(events, now=timezone.now() + timedelta(days=1))


def test_an_artifact_is_not_receiving_once_the_task_ended(client_in, agent_row) -> None:
    task = RemoteTask.objects.create(
        agent=agent_row, phase="task", state="TASK_STATE_WORKING", remote_id="r-art"
    )
    artifact = Artifact.objects.create(task=task, artifact_id="a-1", name="out", complete=False)
    ArtifactPart.objects.create(artifact=artifact, index=0, part={"text": "partial"})
    assert "receiving…" in client_in.get(reverse("task-detail", args=[task.pk])).content.decode()
    RemoteTask.objects.filter(pk=task.pk).update(state="TASK_STATE_COMPLETED")
    page = client_in.get(reverse("task-detail", args=[task.pk])).content.decode()
    assert "receiving…" not in page and "complete" in page
