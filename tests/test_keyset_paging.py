"""Keyset paging (``cursors.after``): the rows after a cursor, ties stepped over by id, and a
deep page that costs its own rows: the page's query seeks to the cursor through the index
instead of walking the index from the first row down to it."""

from __future__ import annotations

import html
import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from tasks_app import cursors
from tasks_app.models import Agent, Membership, OperatorAction, Project, RemoteTask
from tasks_app.runtime import sqlite_stats
from tests.people import member

pytestmark = pytest.mark.django_db

ROWS = 400  # a few pages; runs of four rows share a moment


@pytest.fixture
def world(django_user_model) -> dict:
    project = Project.objects.create(name="paging")
    agent = Agent.objects.create(project=project, name="pager", base_url="http://127.0.0.1:9/p")
    now = timezone.now()
    moments = [now - timedelta(seconds=i // 4) for i in range(ROWS)]
    RemoteTask.objects.bulk_create(
        [RemoteTask(agent=agent, remote_id=f"r{i}", phase="task", state="TASK_STATE_INPUT_REQUIRED",
                    updated_at=moment, created_at=moment, asked_at=moment)
         for i, moment in enumerate(moments)],
        batch_size=500,
    )  # fmt: skip
    person = member(
        django_user_model.objects.create_user("pager", password="pw-12345678"),
        Membership.Role.AUDITOR,
        "paging",
    )
    # Half of the log is another project's, which this auditor does not see.
    elsewhere = Agent.objects.create(
        project=Project.objects.create(name="elsewhere"),
        name="other",
        base_url="http://127.0.0.1:9/o",
    )
    OperatorAction.objects.bulk_create(
        [OperatorAction(action="cancel", agent=(agent, elsewhere)[i % 2], actor=person, created_at=moment)
         for i, moment in enumerate(moments)],
        batch_size=500,
    )  # fmt: skip
    sqlite_stats.refresh()  # the planner's statistics, as up and beat keep them
    client = Client()
    client.force_login(person)
    return {"client": client}


def test_after_gives_the_rows_past_the_cursor_in_order_with_ties_stepped_over(world) -> None:
    ordered = list(OperatorAction.objects.order_by("-created_at", "-id"))
    for index in (0, 1, 2, 3, 4, 5, 150, 151, ROWS - 2, ROWS - 1):
        cursor = ordered[index]
        rest = OperatorAction.objects.filter(
            cursors.after("created_at", cursor.created_at, cursor.pk, descending=True)
        ).order_by("-created_at", "-id")
        assert list(rest) == ordered[index + 1 :]
    ascending = list(RemoteTask.objects.order_by("asked_at", "pk"))
    for index in (0, 3, 4, 199, ROWS - 1):
        cursor = ascending[index]
        rest = RemoteTask.objects.filter(
            cursors.after("asked_at", cursor.asked_at, cursor.pk, descending=False)
        ).order_by("asked_at", "pk")
        assert list(rest) == ascending[index + 1 :]


def _deep_page(client: Client, path: str, hops: int) -> tuple[str, list[tuple[str, tuple]]]:
    """Follow the page's own "next" link ``hops`` times from ``path``; the last page's
    statements with their parameters (bound, as the page sends them: a plan made for
    literals can differ)."""
    url = path
    for _ in range(hops):
        found = re.search(r'href="([^"]+)"[^>]*id="next-page"', client.get(url).content.decode())
        assert found, f"no next page after {url}"
        link = html.unescape(found.group(1))
        url = path + link if link.startswith("?") else link
    sent: list[tuple[str, tuple]] = []

    def keep(execute, sql, params, many, context):
        sent.append((sql, tuple(params or ())))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(keep):
        response = client.get(url)
    assert response.status_code == 200
    return url, sent


@pytest.mark.parametrize(
    ("name", "table"),
    [("audit", "tasks_app_operatoraction"), ("task-list", "tasks_app_remotetask"),
     ("inbox", "tasks_app_remotetask")],
)  # fmt: skip
def test_a_deep_page_seeks_to_its_cursor(world, name: str, table: str) -> None:
    url, sent = _deep_page(world["client"], reverse(name), 3)
    assert "cursor=" in url
    # The page's own query: its rows in order, a page and one more.
    paged = [(sql, params) for sql, params in sent
             if f'FROM "{table}"' in sql and "ORDER BY" in sql and "LIMIT" in sql]  # fmt: skip
    assert paged, [sql for sql, _ in sent]
    if connection.vendor != "sqlite":
        return  # PostgreSQL's plans for tables this small say nothing of large ones
    for sql, params in paged:
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN QUERY PLAN " + sql, params)
            plan = [str(row[-1]) for row in cursor.fetchall()]
        assert not [step for step in plan if step.startswith(f"SCAN {table}")], (sql, plan)
        seeks = [step for step in plan if step.startswith(f"SEARCH {table}")]
        assert any("<" in step or ">" in step for step in seeks), (sql, plan)
