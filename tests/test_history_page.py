"""The event log page: full timestamps, notes where there are some, filters by kind and
channel (nonsense answered next to the filter), and the compact and raw views."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from tasks_app.models import Agent, Artifact, RemoteTask, TaskEvent
from tests.people import member

pytestmark = pytest.mark.django_db


@pytest.fixture
def client_in(django_user_model) -> Client:
    client = Client()
    client.force_login(
        member(django_user_model.objects.create_user("hist", password="pw-12345678"))
    )
    return client


@pytest.fixture
def task() -> RemoteTask:
    agent = Agent.objects.create(name="hist agent", base_url="http://127.0.0.1:9/hist")
    task = RemoteTask.objects.create(
        agent=agent, phase="task", remote_id="r-h", state="TASK_STATE_COMPLETED", last_seq=200
    )
    start = timezone.now() - timedelta(minutes=5)
    rows = []
    for seq in range(1, 201):
        state = "TASK_STATE_WORKING" if seq < 200 else "TASK_STATE_COMPLETED"
        kind, channel = (
            ("artifactUpdate", "stream")
            if seq % 3 == 0
            else ("statusUpdate", "poll" if seq % 2 else "stream")
        )
        rows.append(TaskEvent(
            task=task, seq=seq, kind=kind, channel=channel, state_after=state,
            state_changed=seq in (1, 200), received_at=start + timedelta(seconds=seq),
            raw={"n": seq}, note="duplicate chunk" if seq == 7 else "",
        ))  # fmt: skip
    TaskEvent.objects.bulk_create(rows)
    Artifact.objects.create(
        task=task,
        artifact_id="report",
        name="report.txt",
        part_count=50,
        complete=True,
        updated_seq=147,
    )
    RemoteTask.objects.filter(pk=task.pk).update(last_event_at=start + timedelta(seconds=200))
    return task


def test_full_view_has_dates_zones_and_notes_inline(client_in, task) -> None:
    page = client_in.get(reverse("task-events", args=[task.pk])).content.decode()
    assert ">note<" not in page  # no column that is empty on almost every row
    assert "duplicate chunk" in page
    first = TaskEvent.objects.get(task=task, seq=1).received_at
    assert f"{first:%Y-%m-%d %H:%M:%S}" in page and " UTC</time>" in page
    assert 'class="full-time"' in page


def test_filters_by_kind_and_channel_page_with_the_filters_kept(client_in, task) -> None:
    url = reverse("task-events", args=[task.pk])
    page = client_in.get(url, {"kind": "artifactUpdate"}).content.decode()
    seqs = [int(s) for s in __import__("re").findall(r'data-seq="(\d+)"', page)]
    assert seqs and all(s % 3 == 0 for s in seqs) and len(seqs) == 66
    page = client_in.get(url, {"channel": "poll", "kind": "statusUpdate"}).content.decode()
    seqs = [int(s) for s in __import__("re").findall(r'data-seq="(\d+)"', page)]
    assert seqs and all(s % 2 == 1 and s % 3 for s in seqs)
    # The second page keeps the filter.
    page = client_in.get(url, {"channel": "stream"}).content.decode()
    assert "channel=stream" in page and "after=" in page


def test_nonsense_filters_are_answered_next_to_the_filter(client_in, task) -> None:
    response = client_in.get(
        reverse("task-events", args=[task.pk]),
        {"kind": "<script>", "channel": "pigeon", "view": "x"},
    )
    body = response.content.decode()
    assert response.status_code == 400  # as the task list and the audit page answer
    assert body.count("Select a valid choice") == 3 and "<script>" not in body
    # Nothing listed: the whole log would pass for what the filter, as shown, selects.
    assert 'data-seq="' not in body
    assert "Nothing is listed until the filter above is corrected." in body


def test_compact_and_raw_views(client_in, task) -> None:
    url = reverse("task-events", args=[task.pk])
    compact = client_in.get(url, {"view": "compact"}).content.decode()
    assert (
        'id="compact-states"' in compact
        and "#1\u2013#199" in compact
        and "#200\u2013#200" in compact
    )
    assert "report.txt" in compact and "#147" in compact
    raw = client_in.get(url, {"view": "raw"}).content.decode()
    assert 'id="raw-entries"' in raw and "&quot;n&quot;: 1" in raw
