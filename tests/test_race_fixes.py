"""Read-then-write races found by an audit, each now a compare-and-set; each test injects the
other writer inside the window (or releases both at once) and names what happened before.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from tasks_app import alerts, eventloop, outbound
from tasks_app.crypto import decrypt_json
from tasks_app.models import Agent, Alert, RemoteTask, default_project
from tasks_app.services import agents as agent_services
from tasks_app.services import audit, push
from tests.serving import json_rpc_peer
from tests.test_ssrf import CardServer, card

Status = RemoteTask.WatcherStatus


@pytest.fixture
def server() -> Iterator[CardServer]:
    served = CardServer("127.0.0.1")
    served.card(card(f"{served.base}/rpc"))
    yield served
    served.close()


@pytest.mark.django_db
def test_a_card_refresh_does_not_bring_back_credentials_cleared_meanwhile(
    server: CardServer, monkeypatch
) -> None:
    """The refresh saved the whole row it read before its two fetches: credentials an admin
    cleared meanwhile (leaked ones) came back, and were sent again."""
    agent = agent_services.add_agent(server.base, credentials={"token": "leaked-token"})
    real_preview = agent_services.preview_card

    def preview_while_an_admin_clears(url: str) -> Any:
        agent_services.set_credentials(Agent.objects.get(pk=agent.pk), {})
        return real_preview(url)

    monkeypatch.setattr(agent_services, "preview_card", preview_while_an_admin_clears)
    agent_services.refresh_card(Agent.objects.get(pk=agent.pk))
    fresh = Agent.objects.get(pk=agent.pk)
    assert fresh.credentials_encrypted == "" and fresh.credential_origins == []
    assert fresh.card_fetched_at > agent.card_fetched_at  # the card itself was stored


@pytest.mark.django_db
def test_a_card_refresh_keeps_credentials_set_meanwhile(server: CardServer, monkeypatch) -> None:
    agent = agent_services.add_agent(server.base)
    real_preview = agent_services.preview_card

    def preview_while_an_admin_sets(url: str) -> Any:
        agent_services.set_credentials(Agent.objects.get(pk=agent.pk), {"token": "new-token"})
        return real_preview(url)

    monkeypatch.setattr(agent_services, "preview_card", preview_while_an_admin_sets)
    agent_services.refresh_card(Agent.objects.get(pk=agent.pk))
    stored = Agent.objects.get(pk=agent.pk).credentials_encrypted
    assert decrypt_json(stored) == {"token": "new-token"}


@pytest.mark.django_db
def test_credentials_saved_while_a_refresh_moves_the_origin_are_bound_to_the_new_one() -> None:
    """Saved on the row read before, the credentials were bound to the old origin and the
    refresh's pending approval was cleared: withheld from the new origin, nothing to approve."""
    agent = Agent.objects.create(
        name="moving", base_url="http://127.0.0.1:9/moving",
        interface_url="http://127.0.0.1:9/rpc", card_fetched_at=timezone.now(),
    )  # fmt: skip
    moved: list[bool] = []

    def refresh_first(execute, sql, params, many, context):  # the refresh, in the window
        if sql.startswith("UPDATE") and "credentials_encrypted" in sql and not moved:
            moved.append(True)
            Agent.objects.filter(pk=agent.pk).update(
                interface_url="http://127.0.0.1:10/rpc",
                card_fetched_at=timezone.now() + timedelta(seconds=1),
                pending_origin="http://127.0.0.1:10",
            )
        return execute(sql, params, many, context)

    with connection.execute_wrapper(refresh_first):
        agent_services.set_credentials(agent, {"token": "t0ken"})
    fresh = Agent.objects.get(pk=agent.pk)
    assert moved and fresh.interface_url == "http://127.0.0.1:10/rpc"
    assert fresh.credential_origins == ["http://127.0.0.1:10"] and fresh.pending_origin == ""
    assert decrypt_json(fresh.credentials_encrypted) == {"token": "t0ken"}
    assert outbound.credentials_for(fresh).token == "t0ken"  # type: ignore[union-attr]


def push_task(**fields: Any) -> RemoteTask:
    name = f"p-{uuid.uuid4().hex[:8]}"
    agent = Agent.objects.create(name=name, base_url=f"http://127.0.0.1:9/{name}")
    values = {"title": "t", "remote_id": "t-1", "phase": RemoteTask.Phase.TASK,
              "state": "TASK_STATE_WORKING", "watch": RemoteTask.Watch.PUSH,
              "watcher_status": Status.POLLING, **fields}  # fmt: skip
    return RemoteTask.objects.create(agent=agent, **values)


@pytest.mark.django_db
def test_a_notification_heard_does_not_undo_an_abandon_made_meanwhile(monkeypatch) -> None:
    """heard() read the tasks to wake, then wrote on their pks alone: an abandon (or a switch
    to polling, or a park) committed in between was overwritten with "awaiting push"."""
    task = push_task()
    done: list[bool] = []

    def abandon_first(execute, sql, params, many, context):  # the other writer, in the window
        if sql.startswith("UPDATE") and "watcher_note" in sql and not done:
            done.append(True)
            RemoteTask.objects.filter(pk=task.pk).update(
                abandoned_at=timezone.now(), watcher_status=Status.ABANDONED
            )
        return execute(sql, params, many, context)

    with connection.execute_wrapper(abandon_first):
        push.heard({task.pk})
    task.refresh_from_db()
    assert done and task.watcher_status == Status.ABANDONED


@pytest.mark.django_db
def test_a_switch_to_streaming_made_while_the_last_push_config_goes_stands(monkeypatch) -> None:
    """The last config deleted, the task was switched to polling on what had been read before:
    an operator's switch to streaming committed in between was overwritten (two switch rows,
    the page having said "now followed by streaming")."""
    from tasks_app.services import tasks as task_services

    task = push_task()
    Agent.objects.filter(pk=task.agent_id).update(streaming=True)
    real_switch = task_services.switch_watch
    calls: list[str] = []

    def another_operator_first(task: RemoteTask, watch: str, **kw: Any) -> RemoteTask:
        if not calls:  # the other operator's switch, inside the window
            calls.append(RemoteTask.Watch.STREAM)
            real_switch(RemoteTask.objects.get(pk=task.pk), RemoteTask.Watch.STREAM)
        calls.append(watch)
        return real_switch(task, watch, **kw)

    monkeypatch.setattr(task_services, "switch_watch", another_operator_first)
    push._polled_without_configs(RemoteTask.objects.get(pk=task.pk), None)
    assert calls == [RemoteTask.Watch.STREAM, RemoteTask.Watch.POLL]  # the window was hit
    task.refresh_from_db()
    assert task.watch == RemoteTask.Watch.STREAM
    switches = [e.raw["operator"]["watch"] for e in task.events.filter(kind="operator")]
    assert switches == [RemoteTask.Watch.STREAM]


@pytest.mark.django_db
def test_a_notification_heard_leaves_ended_and_parked_tasks_alone() -> None:
    ended = push_task(state="TASK_STATE_COMPLETED", settled_at=timezone.now())
    parked = push_task(watcher_status=Status.PARKED)
    polling = push_task()
    push.heard({ended.pk, parked.pk, polling.pk})
    statuses = dict(
        RemoteTask.objects.filter(pk__in=[ended.pk, parked.pk, polling.pk]).values_list(
            "pk", "watcher_status"
        )
    )
    assert statuses == {
        ended.pk: Status.POLLING, parked.pk: Status.PARKED, polling.pk: Status.AWAITING_PUSH,
    }  # fmt: skip


def refreshed_after_push(status: dict) -> RemoteTask:
    """A push task awaiting push, after the drain's GetTask (``push.refresh_after_push``) of
    an agent that answers every call with the task in ``status``; read again."""
    snapshot = {"id": "t-1", "contextId": "c", "status": status}
    with json_rpc_peer(lambda request: snapshot) as url:
        task = push_task(watcher_status=Status.AWAITING_PUSH)
        Agent.objects.filter(pk=task.agent_id).update(
            base_url=url, interface_url=f"{url}/rpc", binding="JSONRPC", protocol_version="1.0"
        )

        async def refresh() -> None:
            async with outbound.new_http_client() as http:
                await push.refresh_after_push(http, task.pk)

        eventloop.submit(refresh()).result(timeout=60)
    task.refresh_from_db()
    return task


@pytest.mark.django_db(transaction=True)
def test_a_push_task_settled_by_the_drain_stops_awaiting_push(shared_loop) -> None:
    """Settled by the drain's GetTask, no watcher ended its "awaiting push": the page said so
    for ever, and retention (which leaves awaited tasks alone) never pruned it."""
    task = refreshed_after_push({"state": "TASK_STATE_COMPLETED"})
    assert task.settled_at is not None and task.watcher_status == Status.IDLE


@pytest.mark.django_db(transaction=True)
def test_a_push_tasks_settling_waits_for_the_loops_gate_as_a_watchers_does(shared_loop) -> None:
    """A watcher's settle (the fold of the agent's whole, final task) waits its turn at
    ``eventloop.later()``, so tasks ending together do not hold back the loop's streams; the
    settle after a push notification did not wait, so a hundred push tasks ending in the same
    second folded all at once. With the gate held, the drain's GetTask is answered but nothing
    is recorded or settled until the gate opens."""
    import threading
    import time

    from tasks_app.models import TaskEvent

    asked = threading.Event()
    completed = {"id": "t-1", "contextId": "c", "status": {"state": "TASK_STATE_COMPLETED"}}

    def answer(request: dict) -> Any:
        if request.get("method") == "GetTask":
            asked.set()
        return completed

    with json_rpc_peer(answer) as url:
        task = push_task(watcher_status=Status.AWAITING_PUSH)
        Agent.objects.filter(pk=task.agent_id).update(
            base_url=url, interface_url=f"{url}/rpc", binding="JSONRPC", protocol_version="1.0"
        )

        async def hold() -> Any:  # every permit of the gate, as settles already running would
            gate = eventloop.later()
            for _ in range(eventloop.LATER_AT_ONCE):
                await gate.acquire()
            return gate

        async def release(gate: Any) -> None:
            for _ in range(eventloop.LATER_AT_ONCE):
                gate.release()

        async def refresh() -> None:
            async with outbound.new_http_client() as http:
                await push.refresh_after_push(http, task.pk)

        gate = eventloop.submit(hold()).result(timeout=10)
        running = eventloop.submit(refresh())
        assert asked.wait(30)
        time.sleep(1.0)  # ungated, the record and the settle are done well within this
        assert not running.done()
        assert not TaskEvent.objects.filter(task=task).exists()
        eventloop.submit(release(gate)).result(timeout=10)
        running.result(timeout=60)
    task.refresh_from_db()
    assert task.settled_at is not None and task.watcher_status == Status.IDLE


@pytest.mark.django_db
def test_an_alert_is_not_opened_on_what_find_read_before_the_task_had_news() -> None:
    """The task had news between the rule's find and the insert: the alert opened (and was
    delivered), then resolved at the next evaluation (delivered again)."""
    long_ago = timezone.now() - timedelta(hours=3)
    task = push_task(watch=RemoteTask.Watch.POLL)
    RemoteTask.objects.filter(pk=task.pk).update(updated_at=long_ago)
    spec = alerts._silent_working(1800)
    real_find = spec.find

    def find_then_news(now: Any) -> Any:
        found = real_find(now)
        RemoteTask.objects.filter(pk=task.pk).update(updated_at=timezone.now())
        return found

    stale = alerts.RuleSpec(spec.rule, spec.threshold, find_then_news, spec.holds)
    assert alerts._open(stale, timezone.now()) == []
    assert not Alert.objects.filter(task=task).exists()
    # Without news, the same rule opens it.
    RemoteTask.objects.filter(pk=task.pk).update(updated_at=long_ago)
    assert [a.task_id for a in alerts._open(spec, timezone.now())] == [task.pk]


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("empty_push_queue")
def test_one_push_drain_records_at_a_time(shared_loop) -> None:
    """The scheduling flag lapsed while a long drain ran, the next delivery scheduled a
    second, and the two took a task's notifications in two batches: recorded out of order,
    a chunk appended before the chunk it extends was lost."""
    from tests.test_push_webhook import good, status_update

    task = push_task(remote_id="t-1", state="TASK_STATE_SUBMITTED")
    config = push.new_config(task)
    assert good(config, status_update())[0] == 202
    r = push._redis()
    r.set(push.RUNNING_KEY, "another-drain", ex=30)  # a drain that runs
    assert push.drain(max_seconds=0.5) == 0  # waited its time, took nothing
    assert r.llen(push.QUEUE_KEY) == 1 and r.get(push.RUNNING_KEY) == b"another-drain"
    r.delete(push.RUNNING_KEY)  # it ended
    assert push.drain(max_seconds=5) == 1
    assert r.llen(push.QUEUE_KEY) == 0 and r.get(push.RUNNING_KEY) is None
    assert task.events.filter(channel="push").count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_adds_of_one_url_released_together_refuse_one_in_a_sentence(server) -> None:
    """Both passed the look for the URL; the second insert was an IntegrityError, a 500 (on
    PostgreSQL: SQLite's immediate transactions put one add after the other)."""
    import time

    from tests.races import release_together

    def slow_insert(execute, sql, params, many, context):  # both get past any look first
        if sql.startswith("INSERT") and "tasks_app_agent" in sql:
            time.sleep(0.3)
        return execute(sql, params, many, context)

    def add() -> Agent:
        with connection.execute_wrapper(slow_insert):
            return agent_services.add_agent(server.base)

    for _ in range(3):
        outcomes = release_together(add, add)
        added = [o for o in outcomes if isinstance(o, Agent)]
        refused = [o for o in outcomes if isinstance(o, agent_services.AgentError)]
        assert len(added) == 1 and len(refused) == 1, outcomes
        assert "registered" in str(refused[0])
        Agent.objects.all().delete()


@pytest.mark.django_db(transaction=True)
def test_a_send_that_may_still_land_is_not_called_safe_to_retry(shared_loop) -> None:
    """A holder late with its lease while its send was in flight: the next holder found no
    task at the agent yet, called a retry safe, and a retry made a second remote task."""
    from tasks_app import watchers
    from tasks_app.services import tasks as task_services

    message = {"messageId": "m-1", "role": "ROLE_USER", "contextId": "ctx-1",
               "parts": [{"text": "x"}]}  # fmt: skip
    with json_rpc_peer(lambda request: {"tasks": []}) as url:
        agent = Agent.objects.create(
            name="late", base_url=url, interface_url=f"{url}/rpc", binding="JSONRPC",
            protocol_version="1.0",
        )  # fmt: skip
        task = RemoteTask.objects.create(
            agent=agent, phase=RemoteTask.Phase.SENDING, watch=RemoteTask.Watch.POLL,
            request={"message": message}, outbox={"message": message},
            send_attempted_at=timezone.now() - timedelta(seconds=2),
        )  # fmt: skip
        token = task_services.acquire_lease(task.pk, watchers.OWNER)

        async def recover(attempted_ago: float) -> Any:
            row = await eventloop.db(RemoteTask.objects.select_related("agent").get, pk=task.pk)
            row.send_attempted_at = timezone.now() - timedelta(seconds=attempted_ago)
            holder = watchers.Holder(task.pk, token, http=None)
            holder._take(row)
            async with outbound.new_http_client() as http:
                client = outbound.client_for(agent, http)
                return await holder._recover_send(client, row, "the worker stopped while sending")

        turn = eventloop.submit(recover(2)).result(timeout=30)
        assert "looking again" in turn.note and turn.hold_off > 30
        task.refresh_from_db()
        assert task.phase == RemoteTask.Phase.SENDING and task.outbox is not None
        # Once the send must have ended, its absence is believed.
        turn = eventloop.submit(recover(600)).result(timeout=30)
        task.refresh_from_db()
        assert task.phase == RemoteTask.Phase.FAILED and "retrying is safe" in task.send_error


@pytest.mark.django_db
def test_the_agents_config_listing_is_bounded_in_time(monkeypatch) -> None:
    """Ten pages of a full call deadline each: one "ask the agent" click held a web thread
    for about ten minutes (and every page's configs whole in memory)."""
    import time

    def slow_page(request: dict) -> dict:
        time.sleep(0.4)
        return {"configs": [{"id": "x", "url": "http://example.org/" + "u" * 5000}],
                "nextPageToken": uuid.uuid4().hex}  # fmt: skip

    monkeypatch.setattr(push, "LISTING_SECONDS", 1.0)
    with json_rpc_peer(slow_page) as url:
        task = push_task()
        Agent.objects.filter(pk=task.agent_id).update(
            base_url=url, interface_url=f"{url}/rpc", binding="JSONRPC", protocol_version="1.0",
            push=True,
        )  # fmt: skip
        task.refresh_from_db()
        started = time.monotonic()
        listing = push.list_at_agent(task)
    assert time.monotonic() - started < 3
    assert "took longer than 1 s" in listing.problem and 1 <= len(listing.configs) <= 3
    assert all(len(c["url"]) <= 1000 for c in listing.configs)


@pytest.mark.django_db(transaction=True)
def test_a_finished_push_refresher_is_forgotten(shared_loop) -> None:
    """The map of refreshers kept every finished one: it grew by each push-watched task a
    worker had ever refreshed."""
    import time

    task = push_task(remote_id="")  # nothing to ask the agent: the refresh returns at once

    async def want() -> None:
        push._want_refresh({task.pk: "TASK_STATE_COMPLETED"})

    eventloop.submit(want()).result(timeout=10)
    deadline = time.monotonic() + 10
    while task.pk in push._refreshers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert task.pk not in push._refreshers


@pytest.mark.django_db(transaction=True)
def test_an_ended_push_task_is_refreshed_at_once_but_not_for_every_notification(
    shared_loop,
) -> None:
    """A push made the task look ended, and its GetTask says it is still working: each
    notification after it asked for a GetTask at once, one after another for as long as the
    agent pushed (up to PUSH_RATE_PER_CONFIG a second). The first is at once; the next waits
    out PUSH_REFRESH_DELAY_SECONDS (1 s)."""
    import threading
    import time

    calls: list[float] = []
    lock = threading.Lock()
    working = {"id": "t-1", "contextId": "c", "status": {"state": "TASK_STATE_WORKING"}}

    def answer(request: dict) -> Any:
        if request.get("method") == "GetTask":
            with lock:
                calls.append(time.monotonic())
        return working

    with json_rpc_peer(answer) as url:
        task = push_task(state="TASK_STATE_COMPLETED")  # ended by a push, not settled
        Agent.objects.filter(pk=task.agent_id).update(
            base_url=url, interface_url=f"{url}/rpc", binding="JSONRPC", protocol_version="1.0"
        )

        async def notified() -> None:
            push._want_refresh({task.pk: "TASK_STATE_COMPLETED"})

        started = time.monotonic()
        while time.monotonic() - started < 1.5:  # a notification every 20 ms
            eventloop.submit(notified()).result(timeout=10)
            time.sleep(0.02)
        time.sleep(0.3)
    assert calls and calls[0] - started < 0.9  # the first at once (not after the debounce)
    assert 2 <= len(calls) <= 3  # then at most one a second, not one a notification
    assert all(b - a >= 0.9 for a, b in itertools.pairwise(calls))


@pytest.mark.django_db(transaction=True)
def test_a_holders_own_send_that_named_no_task_fails_at_once(shared_loop) -> None:
    """This holder's own streaming send closed without naming a task: its call is over, but
    the failure (and Retry) waited as for another holder's send that may still land."""
    from tasks_app import watchers
    from tasks_app.services import tasks as task_services

    message = {"messageId": "m-2", "role": "ROLE_USER", "contextId": "ctx-2",
               "parts": [{"text": "x"}]}  # fmt: skip
    with json_rpc_peer(lambda request: {"tasks": []}) as url:
        agent = Agent.objects.create(
            name="own", base_url=url, interface_url=f"{url}/rpc", binding="JSONRPC",
            protocol_version="1.0",
        )  # fmt: skip
        task = RemoteTask.objects.create(
            agent=agent, phase=RemoteTask.Phase.SENDING, watch=RemoteTask.Watch.POLL,
            request={"message": message}, send_attempted_at=timezone.now(),
        )  # fmt: skip
        token = task_services.acquire_lease(task.pk, watchers.OWNER)

        async def ended() -> Any:
            row = await eventloop.db(RemoteTask.objects.select_related("agent").get, pk=task.pk)
            holder = watchers.Holder(task.pk, token, http=None)
            holder._take(row)
            holder.sent_here = True
            async with outbound.new_http_client() as http:
                return await holder._ended(row, outbound.client_for(agent, http))

        eventloop.submit(ended()).result(timeout=30)
    task.refresh_from_db()
    assert task.phase == RemoteTask.Phase.FAILED and "retrying is safe" in task.send_error


@pytest.mark.django_db
def test_an_answer_to_a_push_followed_task_goes_out_while_the_agent_goes_on_notifying(
    django_user_model, no_dispatch, django_capture_on_commit_callbacks
) -> None:
    """A push-followed task waits for notifications under a hold-off with no holder. An
    answer's watcher could not take the lease until it ran out, and every notification
    moved it on: the answer waited for as long as the agent went on notifying. The answer
    clears the hold-off, and a notification leaves a task with an answer waiting alone."""
    from tasks_app.models import Membership
    from tasks_app.services import tasks as task_services
    from tests.people import member

    later = timezone.now() + timedelta(seconds=120)
    task = push_task(state="TASK_STATE_INPUT_REQUIRED", watcher_status=Status.AWAITING_PUSH,
                     lease_expires_at=later, asked_seq=1, last_seq=1)  # fmt: skip
    Agent.objects.filter(pk=task.agent_id).update(project_id=default_project())
    ann = member(django_user_model.objects.create_user("ann-push"), Membership.Role.OPERATOR)
    with django_capture_on_commit_callbacks(execute=True):
        task_services.answer_task(RemoteTask.objects.get(pk=task.pk), text="yes", actor_id=ann.pk)
    assert no_dispatch == [task.pk]
    push.heard({task.pk})  # the agent notifies again before the watcher took the lease
    task.refresh_from_db()
    assert task.lease_expires_at is None and task.outbox is not None
    assert task_services.acquire_leases([task.pk], "w1").keys() == {task.pk}


@pytest.mark.django_db(transaction=True)
def test_a_push_task_the_drains_gettask_finds_asking_is_waiting_for_an_answer(shared_loop) -> None:
    """Only a pushed question turned "awaiting push" into "waiting for an answer": when the
    drain's GetTask was the one to show the question (a late reply to the send had moved the
    task back), the task said "awaiting push" until its silence ran out (a soak run)."""
    task = refreshed_after_push({"state": "TASK_STATE_INPUT_REQUIRED"})
    assert task.state == "TASK_STATE_INPUT_REQUIRED"
    assert (task.watcher_status, task.watcher_note) == (Status.IDLE, "waiting for an answer")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("listed", [False, True])
def test_a_send_answered_with_a_task_mirrored_already_says_the_agent_answered(
    shared_loop, listed: bool
) -> None:
    """An agent answering every send with one task id (another row mirrors it): the send
    failed as "interrupted before the agent answered", which it was not; and when the agent
    listed that task under our contextId, the task was taken as found again, refused, and
    followed with no id (SubscribeToTask with an empty id until it was parked)."""
    from tasks_app import watchers

    fixed = {"id": "fixed-1", "contextId": "ctx-0", "status": {"state": "TASK_STATE_SUBMITTED"}}
    calls: list[tuple[str, dict]] = []

    def agent(request: dict) -> dict:
        calls.append((request["method"], request.get("params") or {}))
        if request["method"] == "SendMessage":
            return {"task": fixed}
        # ListTasks by our contextId: the one task, now under ours (as the agent keeps it).
        return {"tasks": [dict(fixed, contextId="ctx-2")] if listed else []}

    message = {"messageId": "m-2", "role": "ROLE_USER", "contextId": "ctx-2",
               "parts": [{"text": "x"}]}  # fmt: skip
    with json_rpc_peer(agent) as url:
        reuser = Agent.objects.create(
            name="reuser", base_url=url, interface_url=f"{url}/rpc", binding="JSONRPC",
            protocol_version="1.0",
        )  # fmt: skip
        first = RemoteTask.objects.create(
            agent=reuser, remote_id="fixed-1", phase=RemoteTask.Phase.TASK,
            state="TASK_STATE_WORKING", watch=RemoteTask.Watch.NONE,
        )  # fmt: skip
        task = RemoteTask.objects.create(
            agent=reuser, phase=RemoteTask.Phase.SENDING, watch=RemoteTask.Watch.POLL,
            request={"message": message}, outbox={"message": message},
        )  # fmt: skip
        assert watchers.watch(task.pk) == "started"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            task.refresh_from_db()
            if task.phase == RemoteTask.Phase.FAILED:
                break
            time.sleep(0.1)
    assert task.phase == RemoteTask.Phase.FAILED
    assert task.send_error.startswith(
        f"the agent answered with no task this dashboard could take (task 'fixed-1' is "
        f"already mirrored as #{first.pk})"
    ), task.send_error
    if listed:
        assert f"'fixed-1', is the task #{first.pk} mirrors already" in task.send_error
    assert [method for method, _ in calls] == ["SendMessage", "ListTasks"]
    # The log replays: the refused reply is refused again (the replay's agent mirrored
    # nothing, and took 'fixed-1' as this task's).
    replayed = audit.replay(task)
    assert replayed.ok, str(replayed)
