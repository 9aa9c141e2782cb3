"""Today's promises in the order where they break: callers released at once (``tests.races``),
and where a read comes before a write, the other writer (or a pause) injected in between.

1. A refusal redelivered off the holder's channels is logged once (``record._Fold._refused_again``).
2. An agent URL is unique per project (``services.agents.add_agent``).
3. A push-followed task over its budget is parked by the drain (``services.push.park_over_budget``),
   never while a watcher holds it.
4. Cancel is refused when the page would not offer it (``services.tasks.cancel_task``), also when
   the task ends between the check and the first write.
5. A socket's frames are bounded (``consumers._FrameGate``) while a re-sync's read waits.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import uuid
from typing import Any

import pytest
import redis
from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection

from tasks_app import consumers, watchers
from tasks_app.models import Agent, Project, RemoteTask, TaskEvent
from tasks_app.relay import person_group, task_group
from tasks_app.services import agents as agent_services
from tasks_app.services import push
from tasks_app.services import record as record_module
from tasks_app.services import tasks as task_services
from tasks_app.services.record import record, record_many, settle
from tests import test_consumers
from tests.races import release_together
from tests.serving import json_rpc_peer
from tests.test_consumers import communicator, until_type
from tests.test_race_fixes import push_task
from tests.test_record import snapshot, status
from tests.test_truth import assert_sound

Status = RemoteTask.WatcherStatus

# The channel layer of tests.test_consumers, under a prefix of this test's own (autouse).
private_layer = test_consumers.private_layer
user = test_consumers.user


def completed_task() -> RemoteTask:
    """A task the stream saw complete (each on an agent of its own)."""
    name = f"a-{uuid.uuid4().hex[:8]}"
    agent = Agent.objects.create(name=name, base_url=f"http://127.0.0.1:1/{name}")
    task = RemoteTask.objects.create(agent=agent, title="t", watch=RemoteTask.Watch.PUSH)
    record(task, status("t-1", "TASK_STATE_COMPLETED"), "stream")
    return task


def protocol_errors(task: RemoteTask) -> list[str]:
    return list(
        TaskEvent.objects.filter(task=task, kind="protocol-error")
        .order_by("seq")
        .values_list("note", flat=True)
    )


@pytest.fixture
def slow_refusal_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pause between the look in the log (``_refused_again``) and the compare-and-set: every
    caller has looked before any writes (on PostgreSQL; SQLite's writers take turns)."""
    real = record_module._Fold._refused_again

    def looked_then_paused(self: Any, *args: Any) -> bool:
        found = real(self, *args)
        time.sleep(0.05)
        return found

    monkeypatch.setattr(record_module._Fold, "_refused_again", looked_then_paused)


# 1. A refusal is logged once ------------------------------------------------------------------

REFUSED = [
    pytest.param(status("t-1", "TASK_STATE_FAILED"), id="status-after-the-end"),
    pytest.param(snapshot("t-1", "TASK_STATE_WORKING"), id="illegal-transition"),
]


@pytest.mark.parametrize("refused", REFUSED)
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("slow_refusal_check")
def test_one_refused_push_delivered_by_many_at_once_is_logged_once(refused) -> None:
    """Six deliveries of one refused entry at once: one protocol-error row, the others not
    written (the compare-and-set sent them round again, where the log held it), and each of
    those still counts as a fruitless turn for a watcher."""
    task = completed_task()
    outcomes = release_together(*[lambda: record(task.pk, refused, "push")] * 6)
    assert all(isinstance(o, record_module.Recorded) for o in outcomes), outcomes
    written = [o for o in outcomes if o.seqs]
    repeats = [o for o in outcomes if not o.seqs]
    assert len(written) == 1 and written[0].kinds == ["protocol-error"]
    assert len(repeats) == 5 and all(o.repeated for o in repeats)
    for result in outcomes:
        turn = watchers.Outcome()
        turn.add(result)
        assert turn.problem and not turn.confirmed and not turn.progress
    assert len(protocol_errors(task)) == 1
    assert_sound(task)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("slow_refusal_check")
def test_a_batch_of_refusals_racing_single_deliveries_logs_each_once() -> None:
    """A push batch holding two refused entries twice each, released with single deliveries
    of the same two: one row for each entry, whoever wrote first."""
    task = completed_task()
    illegal = snapshot("t-1", "TASK_STATE_WORKING")
    late = status("t-1", "TASK_STATE_FAILED")
    for _ in range(3):
        outcomes = release_together(
            lambda: record_many(task.pk, [illegal, late, illegal, late], "push"),
            lambda: record(task.pk, illegal, "push"),
            lambda: record(task.pk, late, "push"),
            lambda: record(task.pk, late, "push"),
        )
        assert all(isinstance(o, record_module.Recorded) for o in outcomes), outcomes
        turn = watchers.Outcome()
        for result in outcomes:
            turn.add(result)
        assert turn.problem and not turn.confirmed
        assert len(protocol_errors(task)) == 2
    assert_sound(task)
    task.refresh_from_db()
    assert task.state == "TASK_STATE_COMPLETED"


# 2. One agent per URL per project -------------------------------------------------------------


@pytest.fixture
def both_past_the_look(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each add waits, card in hand, for the other: both have looked for the URL (and found
    nothing) before either inserts."""
    real = agent_services.preview_card
    barrier = threading.Barrier(2)

    def previewed_then_wait(url: str) -> Any:
        preview = real(url)
        barrier.wait(timeout=10)
        return preview

    monkeypatch.setattr(agent_services, "preview_card", previewed_then_wait)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("both_past_the_look")
def test_two_adds_of_one_url_into_one_project_at_once_make_one_agent(agent) -> None:
    project = Project.objects.create(name="blue")
    outcomes = release_together(
        lambda: agent_services.add_agent(agent.base_url, project=project),
        lambda: agent_services.add_agent(agent.base_url, project=project),
    )
    added = [o for o in outcomes if isinstance(o, Agent)]
    refused = [o for o in outcomes if isinstance(o, agent_services.AgentError)]
    assert len(added) == 1 and len(refused) == 1, outcomes  # no IntegrityError escaped
    assert str(refused[0]) == (
        "This URL was registered in project blue a moment ago by someone else."
    )
    assert list(Agent.objects.values_list("project__name", "base_url")) == [
        ("blue", agent.base_url)
    ]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("both_past_the_look")
def test_two_adds_of_one_url_into_two_projects_at_once_make_two_agents(agent) -> None:
    blue, green = Project.objects.create(name="blue"), Project.objects.create(name="green")
    outcomes = release_together(
        lambda: agent_services.add_agent(agent.base_url, project=blue),
        lambda: agent_services.add_agent(agent.base_url, project=green),
    )
    assert all(isinstance(o, Agent) for o in outcomes), outcomes
    assert sorted(Agent.objects.values_list("project__name", "base_url")) == [
        ("blue", agent.base_url),
        ("green", agent.base_url),
    ]


# 3. Parked by the drain, never while held -----------------------------------------------------


def held_or_parked(task: RemoteTask) -> tuple[bool, bool]:
    task.refresh_from_db()
    return task.watcher_status == Status.PARKED, task.lease_token != ""


@pytest.mark.django_db(transaction=True)
def test_a_park_racing_a_watcher_and_a_notification_parks_or_leaves_it_held() -> None:
    """The drain parks, a reconcile tick's watcher takes the lease, a notification is heard,
    all at once: the task ends parked with no lease, or held and not parked; never both."""
    seen: set[tuple[bool, bool]] = set()
    for _ in range(12):
        # Its silence ran out: the reconciler may take it, as the drain may park it.
        task = push_task(watcher_status=Status.AWAITING_PUSH, lease_expires_at=None)
        parked, token, _ = release_together(
            functools.partial(push.park_over_budget, {task.pk}),
            functools.partial(task_services.acquire_lease, task.pk, watchers.OWNER),
            functools.partial(push.heard, {task.pk}),
        )
        assert not isinstance(parked, BaseException) and not isinstance(token, BaseException)
        state = held_or_parked(task)
        assert state in {(True, False), (False, True)}, state
        assert (task.pk in parked) == state[0] and (token is not None) == state[1]
        seen.add(state)
    assert seen  # which orders came up is the machine's business; each one was sound


@pytest.mark.django_db
def test_a_watcher_that_takes_the_lease_before_the_park_keeps_the_task() -> None:
    """The drain learned the task is over its budget; before its park, a watcher took the
    lease: the park leaves the task to its holder."""
    task = push_task(watcher_status=Status.AWAITING_PUSH, lease_expires_at=None)
    taken: list[str | None] = []

    def watcher_first(execute, sql, params, many, context):  # the other writer, in the window
        if sql.startswith("UPDATE") and "watcher_note" in sql and not taken:
            taken.append(task_services.acquire_lease(task.pk, watchers.OWNER))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(watcher_first):
        assert push.park_over_budget({task.pk}) == set()
    assert taken and taken[0] is not None
    assert held_or_parked(task) == (False, True)
    # Once the holder lets it go (its hold-off over), the next drain parks it.
    task_services.release_lease(task.pk, taken[0], status=Status.AWAITING_PUSH)
    assert push.park_over_budget({task.pk}) == {task.pk}
    assert held_or_parked(task) == (True, False)
    assert task_services.acquire_lease(task.pk, watchers.OWNER) is None  # until its recheck


@pytest.mark.django_db
def test_a_park_between_a_notifications_read_and_its_write_stands() -> None:
    """heard() read the task as waiting (polling), then the drain parked it: heard's write
    must not bring it back to "awaiting push"."""
    task = push_task(watcher_status=Status.POLLING, lease_expires_at=None)
    parked: list[set[int]] = []

    def park_first(execute, sql, params, many, context):
        if sql.startswith("UPDATE") and "watcher_note" in sql and not parked:
            parked.append(set())  # the park's own UPDATE goes through unchanged
            parked[0] = push.park_over_budget({task.pk})
        return execute(sql, params, many, context)

    with connection.execute_wrapper(park_first):
        push.heard({task.pk})
    assert parked == [{task.pk}]
    assert held_or_parked(task) == (True, False)


# 4. Cancel racing the end ---------------------------------------------------------------------

COMPLETED = {"id": "t-1", "contextId": "c-1", "status": {"state": "TASK_STATE_COMPLETED"}}


def working_on(url: str) -> RemoteTask:
    name = f"c-{uuid.uuid4().hex[:8]}"
    agent = Agent.objects.create(
        name=name, base_url=f"{url}/{name}", interface_url=f"{url}/rpc", binding="JSONRPC",
        protocol_version="1.0",
    )  # fmt: skip
    task = RemoteTask.objects.create(agent=agent, title="t", watch=RemoteTask.Watch.POLL)
    record(task, snapshot("t-1", "TASK_STATE_WORKING"), "stream")
    task.refresh_from_db()
    return task


def end(task_pk: int) -> None:
    """The task's end as a watcher records it: the agent's status, then the settle."""
    record(task_pk, status("t-1", "TASK_STATE_COMPLETED"), "poll")
    settle(task_pk, {"task": COMPLETED}, note="the watcher's GetTask")


def operator_rows_after_the_end(task: RemoteTask) -> list[int]:
    rows = list(task.events.order_by("seq").values_list("seq", "kind", "raw"))
    ends = [seq for seq, kind, raw in rows if kind == "system" and "settled" in str(raw)]
    return [seq for seq, kind, _ in rows if kind == "operator" and ends and seq > ends[0]]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("no_dispatch")
def test_a_cancel_whose_task_ends_after_its_check_writes_nothing_after_the_end(
    monkeypatch,
) -> None:
    """Cancel checked the row the page had read (working), then the task completed and
    settled, then cancel logged the operator's entry on the settled task and asked the agent.
    It is refused as an ended task's cancel is: nothing logged, nothing asked."""
    asked: list[dict] = []

    def answer(request: dict) -> dict:
        asked.append(request)
        return COMPLETED

    with json_rpc_peer(answer) as url:
        task = working_on(url)
        real = task_services._name_task

        def ended_meanwhile(named: RemoteTask, **kwargs: Any) -> RemoteTask:
            end(named.pk)  # between cancel's check and its first write
            return real(named, **kwargs)

        monkeypatch.setattr(task_services, "_name_task", ended_meanwhile)
        with pytest.raises(task_services.TaskActionError, match="cannot be canceled"):
            task_services.cancel_task(task, reason="late")
    assert asked == []
    assert not task.events.filter(kind="operator").exists()
    assert operator_rows_after_the_end(task) == []
    assert_sound(task)


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("no_dispatch")
def test_a_cancel_released_with_the_tasks_end_logs_nothing_after_the_end() -> None:
    """Cancel and the end released together, the cancel started a little later each round
    (so that the end lands before, inside and after the cancel's check-to-write): either the
    cancel's entry comes before the end, or the cancel is refused; never an operator's row
    after ``settled``."""

    def cancel_after(seconds: float, task: RemoteTask) -> RemoteTask:
        time.sleep(seconds)
        return task_services.cancel_task(task, reason="race")

    with json_rpc_peer(lambda request: COMPLETED) as url:
        for i in range(10):
            task = working_on(url)
            canceled, ended = release_together(
                functools.partial(cancel_after, 0.002 * i, task), functools.partial(end, task.pk)
            )
            assert not isinstance(ended, BaseException), ended
            assert isinstance(canceled, RemoteTask | task_services.TaskActionError), canceled
            assert operator_rows_after_the_end(task) == []
            assert_sound(task)


# 5. Frames while a re-sync's read waits -------------------------------------------------------


def held_read(monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, asyncio.Event, list[int]]:
    """The consumers' log read, its first call paused until released; (started, release, reads)."""
    original = consumers._read_log
    started, release = asyncio.Event(), asyncio.Event()
    reads = [0]

    async def held(*args: Any) -> list[dict]:
        reads[0] += 1
        if reads[0] == 1:
            started.set()
            await release.wait()
        return await original(*args)

    monkeypatch.setattr(consumers, "_read_log", held)
    return started, release, reads


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
async def test_frames_and_rows_arriving_while_a_resync_reads_give_every_row_once(
    user, monkeypatch
) -> None:
    """While a re-sync's read is paused, rows are appended (relayed live) and the page sends
    frames: the frames wait as one re-sync, each is answered, and every row comes once."""
    task = await database_sync_to_async(completed_task)()  # seq 1
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await comm.connect())[0]
    events, _ = await until_type(comm, "synced")
    assert [m["seq"] for m in events] == [1]
    started, release, reads = held_read(monkeypatch)
    await comm.send_json_to({"type": "sync", "after": 1})
    await asyncio.wait_for(started.wait(), 5)

    def appended_meanwhile() -> None:
        for i in range(3):  # after the end: refusals, each its own row
            record(task.pk, status("t-1", "TASK_STATE_FAILED", text=f"late {i}"), "push")

    await database_sync_to_async(appended_meanwhile)()
    flood = 10
    for _ in range(flood):
        await comm.send_json_to({"type": "sync", "after": 1})
    await asyncio.sleep(0.2)
    release.set()
    seqs, answers = [], []
    while len(answers) < flood + 1:
        message = await comm.receive_json_from(timeout=5)
        if message["type"] == "synced":
            answers.append(message)
        else:
            seqs.append(message["seq"])
    assert seqs == [2, 3, 4]
    assert answers == [{"type": "synced", "last_seq": 4}] * (flood + 1)
    assert await comm.receive_nothing(timeout=0.3)
    assert reads[0] == 2
    await comm.disconnect()


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
async def test_a_socket_closed_for_its_frames_while_a_resync_reads_leaves_nothing_behind(
    user, monkeypatch
) -> None:
    """Closed with 4429 while its re-sync's read waits: once the read returns nothing is sent,
    the waiting re-sync does not run, and when the socket ends no task of the socket is left
    running and it is in none of its groups."""
    monkeypatch.setattr(consumers, "FRAME_BURST", 5)
    task = await database_sync_to_async(completed_task)()
    layer = get_channel_layer()
    members = redis.Redis.from_url(settings.REDIS_URL)
    keys = [layer._group_key(task_group(task.pk)), layer._group_key(person_group(user.pk))]
    comm = await communicator(f"/ws/tasks/{task.pk}/?after=0", user)
    assert (await comm.connect())[0]
    await until_type(comm, "synced")
    assert [members.zcard(key) for key in keys] == [1, 1]
    started, release, reads = held_read(monkeypatch)
    await comm.send_json_to({"type": "sync", "after": 1})
    await asyncio.wait_for(started.wait(), 5)
    for _ in range(20):
        await comm.send_json_to({"type": "sync", "after": 1})
    closed = await comm.receive_output(timeout=5)
    assert closed == {"type": "websocket.close", "code": consumers.CLOSE_TOO_MANY_FRAMES}
    release.set()
    assert await comm.receive_nothing(timeout=0.5)
    assert reads[0] == 1  # the re-sync that waited was dropped with the socket
    await comm.disconnect()
    assert comm.future.done()
    pumps = [
        t for t in asyncio.all_tasks() if "_FrameGate" in getattr(t.get_coro(), "__qualname__", "")
    ]
    assert pumps == []
    assert [members.zcard(key) for key in keys] == [0, 0]
    members.close()
