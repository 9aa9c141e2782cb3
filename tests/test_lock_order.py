"""Writers over many task rows lock them in one order, the order every other writer uses.

A lock-order audit found two deadlocks on PostgreSQL, both reproduced on a scratch database:

- the lease renewal and the reconcile tick each updated many rows in one statement, locking
  them in scan order; on a table big enough for synchronized scans (40,000 tasks) the two
  scans started at different blocks and met the rows in opposite orders. Both now lock in
  pk order first (``locked_in_pk_order``), and the tick passes over rows a renewal holds;
- deleting an agent: Django's cascade deletes the tasks' events, artifacts and messages
  before the task rows, while ``record()`` locks the task row before writing those. That
  one is not reachable from the product: the admin refuses to delete an agent that has
  tasks (they are view-only there, ``test_an_agent_with_tasks_cannot_be_deleted``), and
  no page deletes agents. The prune, which does delete tasks, locks them first.

The first needs a table of tens of thousands of rows to show itself, too slow for the suite;
its tests here hold the promise that makes it impossible (the tick never waits for a
renewal) in the order where it would break, and release renewals and ticks together.
"""

from __future__ import annotations

import random
import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.urls import reverse
from django.utils import timezone

from tasks_app import watchers
from tasks_app.models import Agent, RemoteTask
from tasks_app.services import tasks as task_services
from tasks_app.services.record import record
from tests.races import release_together
from tests.test_takeover import _working_tasks

pytestmark = pytest.mark.django_db(transaction=True)

Status = RemoteTask.WatcherStatus


def _lapsed_streams(count: int) -> dict[str, int]:
    """Streams whose holder goes on but whose lease ran out (its renewals met an outage):
    token -> task pk. Their rows are written in a shuffled order, so that the table's
    physical order is not the pk order."""
    lapsed = timezone.now() - timedelta(seconds=1)
    pks = _working_tasks(count)
    random.Random(7).shuffle(pks)
    for pk in pks:  # each update writes a new row version: heap order follows this order
        RemoteTask.objects.filter(pk=pk).update(
            lease_token=f"tok-{pk}", lease_owner="slow-worker", lease_expires_at=lapsed,
            watcher_status=Status.STREAMING, watch="stream",
        )  # fmt: skip
    return {f"tok-{pk}": pk for pk in pks}


@pytest.fixture
def no_watch_batches(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The tick's dispatches, kept here instead of reaching the broker."""
    sent: list[list[int]] = []
    monkeypatch.setattr(watchers.watch_batch, "delay", lambda pks: sent.append(pks))
    return sent


@pytest.mark.postgres_only
def test_a_tick_passes_over_the_rows_a_renewal_holds_without_waiting(no_watch_batches) -> None:
    """The renewal pauses holding its rows; the tick runs meanwhile. It must finish without
    waiting for the renewal (a wait is where the opposite orders deadlocked) and leave those
    rows alone: their holder is renewing them, they are not lost."""
    tokens = _lapsed_streams(6)
    holding, tick_done = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def pause_once_locked(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if "FOR UPDATE" in sql and not holding.is_set():
            holding.set()
            outcome["tick_done_meanwhile"] = tick_done.wait(5)
        return result

    def renew() -> None:
        try:
            with connection.execute_wrapper(pause_once_locked):
                outcome["kept"] = task_services.renew_leases(dict.fromkeys(tokens, "streaming"))
        except Exception as exc:
            outcome["kept"] = exc
        finally:
            connection.close()

    renewal = threading.Thread(target=renew)
    renewal.start()
    assert holding.wait(10), "the renewal never locked its rows"
    watchers._reconcile()
    tick_done.set()
    renewal.join(10)
    assert outcome["tick_done_meanwhile"] is True, "the tick waited for the renewal"
    assert outcome["kept"] == set(tokens)
    rows = RemoteTask.objects.filter(pk__in=tokens.values())
    assert {row.watcher_status for row in rows} == {Status.STREAMING}
    assert all(row.lease_expires_at > timezone.now() for row in rows)
    assert {row.lease_token for row in rows} == set(tokens)


def test_renewals_and_ticks_released_together_all_finish(no_watch_batches) -> None:
    """Two holders renewing (each half of the rows, and one all of them, as a worker whose
    tokens were handed on might) and two overlapping ticks, released at once, five times:
    none fails, and every lease is renewed. A renewal that lost the race to a tick writes its
    holder's status back, so no row is left saying "lost"."""
    tokens = _lapsed_streams(120)
    names = sorted(tokens)
    halves = (names[::2], names[1::2])
    lapsed = timezone.now() - timedelta(seconds=1)
    for _ in range(5):
        RemoteTask.objects.filter(pk__in=tokens.values()).update(lease_expires_at=lapsed)
        outcomes = release_together(
            lambda: task_services.renew_leases(dict.fromkeys(halves[0], "streaming")),
            lambda: task_services.renew_leases(dict.fromkeys(halves[1], "streaming")),
            lambda: task_services.renew_leases(dict.fromkeys(names, "streaming")),
            watchers._reconcile,
            watchers._reconcile,
        )
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        assert not failures, failures
        assert outcomes[2] == set(names)
        rows = RemoteTask.objects.filter(pk__in=tokens.values())
        assert all(row.lease_expires_at > timezone.now() for row in rows)
    task_services.renew_leases(dict.fromkeys(names, "streaming"))
    statuses = set(RemoteTask.objects.filter(pk__in=tokens.values()).values_list(
        "watcher_status", flat=True))  # fmt: skip
    assert statuses == {Status.STREAMING}


def test_an_agent_with_tasks_cannot_be_deleted(admin_client) -> None:
    """Its tasks' log is append-only: the admin's delete is refused, by the page and by the
    list's action, and the record stays whole (the cascade would also have met ``record()``
    in the opposite lock order)."""
    agent = Agent.objects.create(name="kept", base_url="http://127.0.0.1:9/kept")
    task = RemoteTask.objects.create(
        agent=agent, phase="task", remote_id="t-kept", context_id="c", state="TASK_STATE_SUBMITTED"
    )
    record(task, {"statusUpdate": {"taskId": "t-kept", "contextId": "c", "status": {
        "state": "TASK_STATE_WORKING"}}}, "stream")  # fmt: skip
    page = reverse("admin:tasks_app_agent_delete", args=[agent.pk])
    assert admin_client.post(page, {"post": "yes"}).status_code == 403
    listing = reverse("admin:tasks_app_agent_changelist")
    admin_client.post(listing, {
        "action": "delete_selected", "_selected_action": [agent.pk], "post": "yes"})  # fmt: skip
    assert Agent.objects.filter(pk=agent.pk).exists()
    assert RemoteTask.objects.get(pk=task.pk).last_seq == 1  # its log entry, still there
