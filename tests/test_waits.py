"""Work done while a thread waits on PostgreSQL (``tasks_app.services.waits``).

On PostgreSQL the steps run while a statement's reply is awaited, and only inside
``meanwhile``; a step that raises ends the work and not the statement. On SQLite nothing
is done ahead: the work is left to its own caller.
"""

from __future__ import annotations

import datetime as dt
import itertools

import pytest
from django.db import connection

from tasks_app.services import waits
from tasks_app.services.snapshot import task_view

pytestmark = pytest.mark.django_db


class Steps:
    """Work of ``total`` steps, each noted; the step numbered ``fail_at`` raises."""

    def __init__(self, total: int = 1_000_000, fail_at: int | None = None) -> None:
        self.total, self.fail_at, self.done = total, fail_at, 0

    @property
    def pending(self) -> bool:
        return self.done < self.total

    def step(self) -> None:
        self.done += 1
        if self.done == self.fail_at:
            raise RuntimeError("this step broke")


def slept(seconds: float) -> int:
    """A statement the server takes ``seconds`` over (SQLite: none), and its answer."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_sleep(%s), 7", [seconds])
            return cursor.fetchone()[1]
        cursor.execute("SELECT 7")
        return cursor.fetchone()[0]


def test_work_is_done_while_a_reply_is_awaited_and_only_inside_the_block():
    work = Steps()
    with waits.meanwhile(work):
        assert slept(0.05) == 7
        inside = work.done
    assert slept(0.05) == 7
    if connection.vendor == "postgresql":
        # At least one step while the server slept; none once the block was left.
        assert 0 < inside < work.total
    else:
        assert inside == 0
    assert work.done == inside


def test_a_step_that_raises_ends_the_work_not_the_statement():
    work = Steps(fail_at=3)
    with waits.meanwhile(work):
        assert slept(0.05) == 7
        assert slept(0.05) == 7  # the work is not taken up again in the same block
    assert work.done == (3 if connection.vendor == "postgresql" else 0)
    with waits.meanwhile(Steps(total=0)):  # nothing pending: nothing to do
        assert slept(0) == 7


def test_the_block_left_by_an_exception_leaves_no_work_behind():
    work = Steps()
    with pytest.raises(ZeroDivisionError), waits.meanwhile(work):
        slept(0.01)
        1 / 0  # noqa: B018 - the block ends by an exception
    done = work.done
    assert slept(0.05) == 7
    assert work.done == done


def test_work_put_first_is_done_first():
    order: list[str] = []

    class Named(Steps):
        def __init__(self, name: str) -> None:
            super().__init__(total=3)
            self.name = name

        def step(self) -> None:
            super().step()
            order.append(self.name)

    later, sooner = Named("later"), Named("sooner")
    with waits.meanwhile(later):
        waits.first(sooner)
        assert slept(0.05) == 7
    if connection.vendor == "postgresql":
        assert order == ["sooner"] * 3 + ["later"] * 3
    else:
        assert order == []
    waits.first(Named("outside"))  # outside any block: left to its caller
    assert slept(0.01) == 7 and "outside" not in order


def test_a_step_that_asks_the_database_is_refused_rather_than_left_waiting():
    """The connection is busy while its reply is awaited: a step that queries through Django
    is refused (through psycopg it would wait on the connection's lock for ever), its work
    dropped, and the statement's reply read."""
    from tasks_app.models import Agent

    refused: list[Exception] = []

    class Asks(Steps):
        def step(self) -> None:
            super().step()
            try:
                Agent.objects.count()
            except waits.ConnectionBusy as exc:
                refused.append(exc)
                raise

    work = Asks()
    with waits.meanwhile(work):
        assert slept(0.05) == 7
        assert slept(0.05) == 7
    postgres = connection.vendor == "postgresql"
    assert (work.done, len(refused)) == ((1, 1) if postgres else (0, 0))
    assert Agent.objects.count() == 0  # the connection goes on


def test_an_interruption_in_a_step_is_raised_once_the_reply_is_read():
    """``KeyboardInterrupt`` in a step comes out of the statement after its reply is read,
    so the connection has nothing left on the wire and the next statement runs."""

    class Interrupts(Steps):
        def step(self) -> None:
            super().step()
            raise KeyboardInterrupt

    work = Interrupts()
    postgres = connection.vendor == "postgresql"
    with waits.meanwhile(work):
        if postgres:
            with pytest.raises(KeyboardInterrupt):
                slept(0.05)
        else:
            assert slept(0.05) == 7
    assert work.done == (1 if postgres else 0)
    assert slept(0) == 7


@pytest.mark.django_db(transaction=True)
def test_a_watchers_take_is_recorded_in_calls_each_given_the_next(
    shared_loop, monkeypatch, settings
):
    """A fast stream's take (up to ``watchers.BATCH`` events) is recorded in calls of
    ``RECORD_CALL_EVENTS``, each given the next call of its take as ``ahead``; on PostgreSQL
    folds made ahead are taken. The log holds every event, in order."""
    import time

    from tasks_app import eventloop, watchers
    from tasks_app.a2a import parse_stream_response
    from tasks_app.models import Agent, RemoteTask, TaskEvent
    from tasks_app.services import record as record_module
    from tasks_app.services import tasks as task_services

    settings.BUDGET_TASK_EVENTS_PER_SECOND = 0  # no throttle: the stream is as fast as it goes
    calls: list = []
    taken: list[bool] = []
    real_record_many, real_started_from = (
        watchers.record_many,
        record_module._FoldAhead.started_from,
    )

    def spy(task_pk, batch, channel, **kw):
        calls.append((batch, kw.get("ahead")))
        if len(calls) == 1:
            time.sleep(0.5)  # the stream queues up meanwhile: the next take is a full one
        return real_record_many(task_pk, batch, channel, **kw)

    def started_from(made, *args):
        taken.append(real_started_from(made, *args))
        return taken[-1]

    monkeypatch.setattr(watchers, "record_many", spy)
    monkeypatch.setattr(record_module._FoldAhead, "started_from", started_from)
    count = 700

    async def stream():
        for i in range(count):
            if i % 2:
                yield parse_stream_response({"artifactUpdate": {
                    "taskId": "t-1", "contextId": "c-1", "append": i > 1,
                    "artifact": {"artifactId": "a-1", "parts": [{"text": f"{i}"}]}}})  # fmt: skip
            else:
                yield parse_stream_response({"statusUpdate": {
                    "taskId": "t-1", "contextId": "c-1",
                    "status": {"state": "TASK_STATE_WORKING",
                               "timestamp": f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}Z"}}})  # fmt: skip

    agent = Agent.objects.create(name="fast", base_url="http://127.0.0.1:9/fast/")
    task = RemoteTask.objects.create(
        agent=agent, title="t", remote_id="t-1", context_id="c-1", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_WORKING", watch=RemoteTask.Watch.STREAM,
        # A held time: each later-stamped status is news (unstamped, the same state is not).
        status_timestamp=dt.datetime(2025, 12, 31, tzinfo=dt.UTC),
    )  # fmt: skip
    token = task_services.acquire_lease(task.pk, watchers.OWNER)

    async def follow() -> watchers.Outcome:
        holder = watchers.Holder(task.pk, token, http=None)
        holder._take(await eventloop.db(RemoteTask.objects.get, pk=task.pk))  # as _hold does
        holder.streaming, holder.remote_id, holder.state = True, "t-1", "TASK_STATE_WORKING"
        await holder._go(watchers.Event.FOLLOW)
        return await holder._pump(stream(), "stream", "stream")

    assert eventloop.submit(follow()).result(timeout=120).progress
    given = [(batch, ahead) for batch, ahead in calls if ahead is not None]
    assert len(given) >= 4  # a full take: five calls, four given the next
    for (_, ahead), (batch, _) in itertools.pairwise(calls):
        assert ahead is None or ahead is batch
    assert all(len(batch.objs) <= watchers.RECORD_CALL_EVENTS for batch, _ in calls)
    rows = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("seq", "raw"))
    assert [seq for seq, _ in rows] == list(range(1, count + 1))
    assert [p["text"] for p in task_view(RemoteTask.objects.get(pk=task.pk))["artifacts"][0][
        "parts"]] == [str(i) for i in range(1, count, 2)]  # fmt: skip
    if connection.vendor == "postgresql":
        assert any(taken)
