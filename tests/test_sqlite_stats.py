"""The query planner's statistics: on SQLite, refreshed by ``up`` and beat, so that a person's
task list walks the ``updated_at`` index instead of sorting every task of their agents."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone

from tasks_app import access
from tasks_app.models import Agent, Membership, Project, RemoteTask
from tasks_app.runtime import sqlite_stats

pytestmark = pytest.mark.django_db


def test_a_persons_task_list_uses_the_updated_at_index_once_analyzed() -> None:
    mine = Agent.objects.create(
        name="mine", base_url="http://127.0.0.1:9/mine", project=Project.objects.create(name="m")
    )
    other = Agent.objects.create(
        name="other", base_url="http://127.0.0.1:9/other", project=Project.objects.create(name="o")
    )
    now = timezone.now()
    RemoteTask.objects.bulk_create(
        [RemoteTask(agent=mine if i % 10 else other, remote_id=f"r{i}", phase="task", state="TASK_STATE_COMPLETED",
                    updated_at=now - timedelta(seconds=i), created_at=now - timedelta(seconds=i)) for i in range(5000)],
        batch_size=1000,
    )  # fmt: skip
    user = get_user_model().objects.create_user("planner", password="pw-12345678")
    Membership.objects.create(user=user, project=mine.project, role=Membership.Role.VIEWER)
    first_page = access.readable_tasks(user).order_by("-updated_at", "-pk")[:51]
    if connection.vendor != "sqlite":
        assert sqlite_stats.refresh() is False  # PostgreSQL keeps its own statistics
        return
    assert sqlite_stats.refresh() is True
    sql, params = first_page.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN QUERY PLAN " + sql, params)
        plan = " ".join(str(row[-1]) for row in cursor.fetchall())
    assert "updated_at" in plan and "TEMP B-TREE" not in plan, plan
    assert len(list(first_page)) == 51
