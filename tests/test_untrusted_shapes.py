"""Agent JSON of the right syntax and the wrong shape: one clear row or message, never a crash.

An agent decides every value it sends. Before these checks a list where a string was
expected (a state, an id), an id longer than its column, a timestamp with no UTC
moment, or a lone surrogate in an error message raised deep in the fold or in the
database: the push drain lost its whole batch, and a watcher retried the same turn
every 30 s for ever.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks_app import eventloop, watchers
from tasks_app.a2a import a2ui, errors, safejson
from tasks_app.a2a.client import api_key_placement
from tasks_app.models import Agent, PushConfig, RemoteTask, TaskEvent
from tasks_app.services import push
from tasks_app.services import tasks as task_services
from tasks_app.services.record import MAX_ID_CHARS, record
from tests.examples import examples
from tests.serving import json_rpc_peer
from tests.test_chain import json_values

LONG_ID = "x" * (MAX_ID_CHARS + 1)


@pytest.fixture
def task(db) -> RemoteTask:
    agent = Agent.objects.create(name="shapes", base_url=f"http://127.0.0.1:1/{uuid.uuid4().hex}/")
    return RemoteTask.objects.create(
        agent=agent, title="t", remote_id="t-1", context_id="c-1", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_WORKING",
    )  # fmt: skip


def status(state: object = "TASK_STATE_WORKING", **extra: object) -> dict:
    return {"statusUpdate": {"taskId": "t-1", "status": {"state": state}, **extra}}


BAD = [
    (status(["TASK_STATE_WORKING"]), "unknown state"),
    (status({"x": 1}), "unknown state"),
    ({"statusUpdate": {"taskId": ["t-1"], "status": {"state": "TASK_STATE_WORKING"}}}, "taskId is not a string"),
    ({"statusUpdate": {"taskId": LONG_ID, "status": {"state": "TASK_STATE_WORKING"}}}, "taskId is longer than 300"),
    (status(contextId={"c": 1}), "contextId is not a string"),
    (status(state="TASK_STATE_WORKING") | {"statusUpdate": {"taskId": "t-1", "status": {
        "state": "TASK_STATE_WORKING", "message": {"messageId": ["m"], "parts": []}}}},
     "status.message.messageId is not a string"),
    ({"artifactUpdate": {"taskId": "t-1", "artifact": {"artifactId": ["a"], "parts": []}}},
     "artifact.artifactId is not a string"),
    ({"artifactUpdate": {"taskId": "t-1", "artifact": {"artifactId": LONG_ID, "parts": []}}},
     "artifact.artifactId is longer than 300"),
    ({"message": {"messageId": {"id": 1}, "role": "ROLE_AGENT", "parts": []}}, "messageId is not a string"),
    ({"message": {"messageId": "m-1", "contextId": 7, "parts": []}}, "contextId is not a string"),
    ({"task": {"id": "t-1", "status": {"state": "TASK_STATE_WORKING"},
               "artifacts": [{"artifactId": 5, "parts": []}]}}, "artifacts[0].artifactId is not a string"),
    ({"task": {"id": "t-1", "status": {"state": "TASK_STATE_WORKING"},
               "history": [{"messageId": "m", "parts": {}}]}}, "history[0].parts is not a list"),
    ({"task": {"id": "t-1", "status": {"state": "TASK_STATE_WORKING"}, "history": "all of it"}},
     "history is not a list"),
]  # fmt: skip


@pytest.mark.parametrize(("obj", "problem"), BAD, ids=[problem for _, problem in BAD])
def test_a_wrongly_shaped_entry_is_one_protocol_error_row_and_the_task_goes_on(task, obj, problem):
    result = record(task, obj, "stream")
    event = TaskEvent.objects.get(task=task)
    assert event.kind == "protocol-error"
    assert problem in event.note
    assert event.raw == obj  # what the agent said is kept, as it came
    fresh = RemoteTask.objects.get(pk=task.pk)
    assert (fresh.state, fresh.remote_id, fresh.context_id) == ("TASK_STATE_WORKING", "t-1", "c-1")
    assert result.kinds == ["protocol-error"]
    # The next well-formed entry is taken as usual.
    record(task, status("TASK_STATE_COMPLETED"), "stream")
    assert RemoteTask.objects.get(pk=task.pk).state == "TASK_STATE_COMPLETED"


def test_items_that_name_no_id_are_still_skipped_not_refused(task):
    """A snapshot whose history holds a message without an id is taken (the message is not)."""
    snapshot = {"task": {"id": "t-1", "status": {"state": "TASK_STATE_INPUT_REQUIRED"},
                         "history": [{"role": "ROLE_AGENT", "parts": []}, "noise"],
                         "artifacts": [{"parts": []}]}}  # fmt: skip
    record(task, snapshot, "poll")
    assert list(TaskEvent.objects.filter(task=task).values_list("kind", flat=True)) == ["task"]
    assert RemoteTask.objects.get(pk=task.pk).state == "TASK_STATE_INPUT_REQUIRED"
    assert not task.messages.exists() and not task.artifacts.exists()


@pytest.mark.parametrize("stamp", ["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00"])
def test_a_timestamp_with_no_utc_moment_counts_as_none(task, stamp):
    record(task, status("TASK_STATE_INPUT_REQUIRED") | {"statusUpdate": {
        "taskId": "t-1", "status": {"state": "TASK_STATE_INPUT_REQUIRED", "timestamp": stamp}}}, "stream")  # fmt: skip
    fresh = RemoteTask.objects.get(pk=task.pk)
    assert fresh.state == "TASK_STATE_INPUT_REQUIRED"
    assert fresh.status_timestamp is None
    assert TaskEvent.objects.get(task=task).kind == "statusUpdate"


def test_a_long_role_is_cut_to_its_column(task):
    message = {"message": {"messageId": "m-1", "role": "R" * 500, "parts": [{"text": "hi"}]}}
    record(task, message, "stream")
    stored = task.messages.get()
    assert stored.role == "R" * 20
    assert stored.message["role"] == "R" * 500  # the message itself is kept as it came


@pytest.mark.usefixtures("empty_push_queue")
def test_a_badly_shaped_notification_does_not_cost_the_batch_the_other_tasks_notifications(task):
    other = RemoteTask.objects.create(
        agent=task.agent, title="o", remote_id="o-1", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_WORKING",
    )  # fmt: skip
    configs = {t.pk: push.new_config(t) for t in (task, other)}
    bad = {"statusUpdate": {"taskId": "t-1", "status": {"state": ["x"]}}}
    good = {"statusUpdate": {"taskId": "o-1", "status": {"state": "TASK_STATE_COMPLETED"}}}
    items = [
        json.dumps({"t": task.pk, "c": configs[task.pk].pk, "e": bad}).encode(),
        json.dumps({"t": other.pk, "c": configs[other.pk].pk, "e": good}).encode(),
    ]
    touched = push.record_batch(items)
    assert touched == {task.pk: "TASK_STATE_WORKING", other.pk: "TASK_STATE_COMPLETED"}
    assert TaskEvent.objects.get(task=task).kind == "protocol-error"
    assert TaskEvent.objects.get(task=other).kind == "statusUpdate"
    assert sorted(PushConfig.objects.values_list("received", flat=True)) == [1, 1]


def test_error_texts_from_agents_are_one_storable_line():
    err = errors.from_jsonrpc_error(
        {"code": -32603, "message": "bad\ud800\x00 end", "data": [{"reason": 1}]}
    )
    text = str(err)
    text.encode("utf-8")  # a lone surrogate would raise here, and in every database
    assert "bad\ufffd\ufffd end" in text and "INTERNAL_ERROR" in text
    # A reason that is not a string picks no class and is not joined into the text.
    http = errors.from_http_error(500, {"error": {"message": "m", "details": [{"reason": ["X"]}]}})
    assert str(http) == "A2A error HTTP 500: m"
    assert safejson.clean_text("a\udc00b") == "a\ufffdb"


def test_card_fields_of_the_wrong_type_are_ignored_not_raised():
    assert (
        a2ui.declared_version({"capabilities": {"extensions": [{"uri": []}, {"uri": 3}]}}) is None
    )
    card = {"securityRequirements": 1, "securitySchemes": {"k": {"apiKeySecurityScheme": {
        "location": "header", "name": "X-Key"}}}}  # fmt: skip
    assert api_key_placement(card) == ("header", "X-Key")


# A turn that ends in an error ---------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_turns_that_end_in_errors_back_off_then_park_the_task(shared_loop, settings):
    """The same error turn after turn is a fruitless series: backing off, then parked once."""
    settings.WATCH_MAX_FRUITLESS_TURNS = 3
    agent = Agent.objects.create(name="err", base_url=f"http://127.0.0.1:1/{uuid.uuid4().hex}/")
    pk = RemoteTask.objects.create(
        agent=agent, title="t", remote_id="t-1", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_WORKING", watch=RemoteTask.Watch.POLL,
        watcher_status=RemoteTask.WatcherStatus.POLLING,
    ).pk  # fmt: skip

    async def failing_turn(token: str) -> watchers.Turn:
        holder = watchers.Holder(pk, token, http=None)
        holder._take(await eventloop.db(RemoteTask.objects.get, pk=pk))  # as _hold does
        turn = await holder._failed("watcher error: TypeError: unhashable type: 'list'")
        await eventloop.db(
            task_services.release_lease, pk, token, status=turn.status, note=turn.note,
            hold_off=turn.hold_off, fruitless_turns=holder.fruitless,
        )  # fmt: skip
        return turn

    seen = []
    for _ in range(4):
        RemoteTask.objects.filter(pk=pk).update(lease_expires_at=None)
        token = task_services.acquire_lease(pk, watchers.OWNER)
        assert token is not None
        turn = eventloop.submit(failing_turn(token)).result(timeout=30)
        fresh = RemoteTask.objects.get(pk=pk)
        seen.append((fresh.watcher_status, fresh.fruitless_turns))
        assert turn.hold_off >= 30
    assert seen == [
        ("reconnecting", 1),
        ("reconnecting", 2),
        ("parked", 3),
        ("parked", 4),  # a parked task's look that fails again stays parked, no second note
    ]
    kinds = list(TaskEvent.objects.filter(task_id=pk).values_list("kind", "raw"))
    assert sum(kind == "protocol-error" for kind, _ in kinds) == 4
    parked = [
        raw for kind, raw in kinds if kind == "system" and raw["system"].get("event") == "parked"
    ]
    assert len(parked) == 1 and "3 fruitless turns in a row" in parked[0]["system"]["detail"]
    assert "needs attention" in RemoteTask.objects.get(pk=pk).watcher_note


@pytest.mark.django_db(transaction=True)
def test_a_parked_task_is_watched_again_at_its_streams_first_news(shared_loop):
    """A parked task's look opened a stream that brought news, and stayed open: the task was
    judged only when the stream ended, so it showed "needs attention" (and its fruitless
    series went on) for the whole slice while the agent was doing well."""
    import threading
    import time

    from tasks_app.a2a.streams import parse_stream_response

    agent = Agent.objects.create(name="news", base_url=f"http://127.0.0.1:1/{uuid.uuid4().hex}/")
    pk = RemoteTask.objects.create(
        agent=agent, title="t", remote_id="t-1", context_id="c-1", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_WORKING", watch=RemoteTask.Watch.STREAM,
        watcher_status=RemoteTask.WatcherStatus.PARKED, fruitless_turns=8,
        watcher_note="needs attention: 8 fruitless turns in a row",
    ).pk  # fmt: skip
    stream_open = threading.Event()  # cleared: the agent's stream stays open
    stream_open.set()

    def update(state: str, text: str):
        message = {"messageId": f"m-{text}", "role": "ROLE_AGENT", "parts": [{"text": text}]}
        return parse_stream_response(
            {"statusUpdate": {"taskId": "t-1", "contextId": "c-1",
                              "status": {"state": state, "message": message}}}
        )  # fmt: skip

    async def stream():
        yield update("TASK_STATE_WORKING", "step 1")
        while stream_open.is_set():
            await asyncio.sleep(0.02)
        yield update("TASK_STATE_COMPLETED", "done")

    async def look(token: str) -> watchers.Outcome:
        holder = watchers.Holder(pk, token, http=None)
        holder._take(await eventloop.db(RemoteTask.objects.get, pk=pk))  # as _hold does
        holder.streaming, holder.remote_id, holder.state = True, "t-1", "TASK_STATE_WORKING"
        await holder._go(watchers.Event.FOLLOW)
        return await holder._pump(stream(), "resubscribe", "stream")

    token = task_services.acquire_lease(pk, watchers.OWNER)
    assert token is not None
    looking = eventloop.submit(look(token))
    deadline = time.monotonic() + 20
    while RemoteTask.objects.get(pk=pk).watcher_status != "streaming":
        assert time.monotonic() < deadline and not looking.done(), "never watched again"
        time.sleep(0.05)
    row = RemoteTask.objects.get(pk=pk)
    assert row.fruitless_turns == 0 and "needs attention" not in row.watcher_note
    again = TaskEvent.objects.filter(task_id=pk, raw__system__event="watching-again")
    assert again.count() == 1 and not looking.done()  # judged while the stream is open
    stream_open.clear()
    outcome = looking.result(timeout=20)
    assert outcome.progress and again.count() == 1
    assert RemoteTask.objects.get(pk=pk).state == "TASK_STATE_COMPLETED"


def test_an_agent_listing_endless_push_configs_is_shown_a_bounded_page(task):
    """Pages of 150 configs, each with a next page: two pages are read, 200 rows shown."""
    asked: list[str | None] = []

    def pages(request: dict) -> dict:
        asked.append((request.get("params") or {}).get("pageToken"))
        configs = [
            {"id": f"c-{len(asked)}-{i}", "taskId": "t-1", "url": f"https://h.test/{i}"}
            for i in range(150)
        ]
        return {"configs": configs, "nextPageToken": f"p{len(asked)}"}

    with json_rpc_peer(pages) as url:
        Agent.objects.filter(pk=task.agent_id).update(
            base_url=url, interface_url=f"{url}/jsonrpc", binding="JSONRPC",
            protocol_version="1.0", push=True,
        )  # fmt: skip
        task.refresh_from_db()
        listing = push.list_at_agent(task)
    assert asked == [None, "p1"]
    assert len(listing.configs) == push.MAX_LISTED_CONFIGS
    assert listing.configs[-1]["id"] == "c-2-49"
    assert "the first 200 are shown" in listing.problem


@pytest.mark.parametrize("bad_id", ["a/b", ""])
def test_a_push_config_id_no_url_can_hold_is_listed_without_a_delete_button(task, bad_id):
    """The delete form's URL holds the id as one path segment: the page answered 500 for an
    agent's config id that was empty or held a "/"."""
    from django.contrib.auth.models import User
    from django.test import Client

    from tasks_app.models import Membership
    from tests.people import member

    def listed(request: dict) -> dict:
        return {"configs": [
            {"id": bad_id, "taskId": "t-1", "url": "https://h.test/x"},
            {"id": "fine", "taskId": "t-1", "url": "https://h.test/y"},
        ]}  # fmt: skip

    operator = Client()
    operator.force_login(member(User.objects.create_user("op"), Membership.Role.OPERATOR))
    with json_rpc_peer(listed) as url:
        Agent.objects.filter(pk=task.agent_id).update(
            base_url=url, interface_url=f"{url}/jsonrpc", binding="JSONRPC",
            protocol_version="1.0", push=True,
        )  # fmt: skip
        response = operator.get(f"/tasks/{task.pk}/push/")
    assert response.status_code == 200
    body = response.content.decode()
    assert body.count('class="button small danger"') == 1 and "/push/fine/delete/" in body


@pytest.mark.django_db(transaction=True)
def test_a_database_outage_is_no_agents_fault_and_logs_once(shared_loop, monkeypatch, caplog):
    """Every holder meets the outage at once. Counted as a fruitless turn it would park healthy
    tasks; logged per holder it was thousands of tracebacks. The leases lapse instead."""
    import logging

    from django.db import OperationalError

    agent = Agent.objects.create(name="db", base_url=f"http://127.0.0.1:1/{uuid.uuid4().hex}/")
    pks = [
        RemoteTask.objects.create(
            agent=agent, title=f"t{i}", remote_id=f"t-{i}", phase=RemoteTask.Phase.TASK,
            state="TASK_STATE_WORKING", watch=RemoteTask.Watch.POLL,
            watcher_status=RemoteTask.WatcherStatus.POLLING, fruitless_turns=2,
        ).pk
        for i in range(20)
    ]  # fmt: skip
    tokens = {pk: task_services.acquire_lease(pk, watchers.OWNER) for pk in pks}

    async def database_down(self):  # what every query raises while PostgreSQL restarts
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(watchers.Holder, "_hold", database_down)
    monkeypatch.setattr(watchers, "_database_down_logged", [0.0, 0])
    caplog.set_level(logging.WARNING, logger="tasks_app.watchers")

    async def run_all() -> None:
        await asyncio.gather(*(watchers.Holder(pk, tokens[pk], http=None).run() for pk in pks))

    eventloop.submit(run_all()).result(timeout=30)
    lines = [r for r in caplog.records if r.name == "tasks_app.watchers"]
    assert len(lines) == 1 and "the database is unreachable" in lines[0].getMessage()
    assert lines[0].exc_info is None
    for task in RemoteTask.objects.filter(pk__in=pks):
        # Untouched: still its holder's lease (to lapse), status and fruitless count.
        assert task.lease_token == tokens[task.pk]
        assert (task.watcher_status, task.fruitless_turns) == ("polling", 2)
    assert not TaskEvent.objects.filter(task_id__in=pks).exists()


def test_the_reconcile_timer_says_a_database_outage_once_in_a_while(settings, monkeypatch, caplog):
    """A worker's reconcile timer ticks every few seconds: a traceback each while the
    database restarts was noise, bounded but useless."""
    import logging
    import time

    from django.db import OperationalError

    settings.RECONCILE_IN_WORKERS = True
    settings.RECONCILE_EVERY_SECONDS = 0.05
    ticks = []

    def database_down() -> None:  # what a tick meets while PostgreSQL restarts
        ticks.append(1)
        raise OperationalError("the database system is starting up")

    monkeypatch.setattr(watchers, "reconcile_once", database_down)
    monkeypatch.setattr(watchers, "_database_down_logged", [0.0, 0])
    caplog.set_level(logging.WARNING, logger="tasks_app.watchers")
    timer = watchers._ReconcileTimer()
    timer.start()
    try:
        deadline = time.monotonic() + 20
        while len(ticks) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        timer.stop.set()
        timer.thread.join(10)
    assert len(ticks) >= 10
    lines = [r for r in caplog.records if r.name == "tasks_app.watchers"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING and not lines[0].exc_info
    assert "the database is unreachable (OperationalError)" in lines[0].getMessage()


@pytest.mark.usefixtures("empty_push_queue")
def test_a_task_whose_notifications_fail_to_record_says_so_and_the_batch_goes_on(task, monkeypatch):
    """What no check foresaw (a bug, say) fails one task's notifications: they are taken off the
    queue, so the task's log says how many were lost; the other tasks' are recorded."""
    from tasks_app.services import record as record_services

    other = RemoteTask.objects.create(
        agent=task.agent, title="o", remote_id="o-1", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_WORKING",
    )  # fmt: skip
    configs = {t.pk: push.new_config(t) for t in (task, other)}
    real = record_services.record_many

    def failing_for_task(task_pk, objs, channel, **kwargs):
        if task_pk == task.pk and channel == "push":
            raise KeyError("a case nothing handles")
        return real(task_pk, objs, channel, **kwargs)

    monkeypatch.setattr(push, "record_many", failing_for_task)
    ok = {"statusUpdate": {"taskId": "x", "status": {"state": "TASK_STATE_COMPLETED"}}}
    items = [
        json.dumps({"t": t.pk, "c": configs[t.pk].pk, "e": {"statusUpdate": {
            **ok["statusUpdate"], "taskId": t.remote_id}}}).encode()
        for t in (task, task, other)
    ]  # fmt: skip
    assert push.record_batch(items) == {other.pk: "TASK_STATE_COMPLETED"}
    (note,) = TaskEvent.objects.filter(task=task)
    assert note.kind == "protocol-error"
    assert "2 push notification(s) could not be recorded (KeyError)" in note.note
    assert TaskEvent.objects.get(task=other).kind == "statusUpdate"


# -- an answer sent before: what the agent's snapshot says became of it ----------------------

ASKED = {"messageId": "q-1", "role": "ROLE_AGENT", "parts": [{"text": "Name?"}]}
WAITING = {"state": "TASK_STATE_INPUT_REQUIRED", "message": ASKED}


@pytest.mark.parametrize(
    ("snapshot", "fate"),
    [
        ({"status": WAITING, "history": [ASKED, {"messageId": "a-1"}]}, "arrived"),
        # Arrived and answered: the state moved on as well; the history decides first.
        ({"status": {"state": "TASK_STATE_WORKING"}, "history": [{"messageId": "a-1"}]}, "arrived"),
        ({"status": WAITING, "history": [ASKED]}, "waiting"),
        ({"status": WAITING}, "waiting"),  # an agent that keeps no history
        ({"status": {"state": "TASK_STATE_COMPLETED"}}, "moved on"),
        # Asked again: the same state, another question.
        ({"status": {**WAITING, "message": {**ASKED, "messageId": "q-2"}}}, "moved on"),
        # Wrong shapes count as absent, never as an error.
        ({"status": WAITING, "history": "a-1"}, "waiting"),
        ({"status": WAITING, "history": [["a-1"], None, 7]}, "waiting"),
        ({"status": ["TASK_STATE_INPUT_REQUIRED"], "history": None}, "moved on"),
        ([], "moved on"),
    ],
)
def test_what_became_of_an_answer_sent_before(snapshot, fate):
    assert watchers.answer_fate(snapshot, "a-1", "TASK_STATE_INPUT_REQUIRED", ASKED) == fate


@settings(max_examples=examples(200), deadline=None)
@given(snapshot=json_values, history=st.lists(json_values, max_size=5))
def test_any_snapshot_gives_an_answer_a_fate_never_an_exception(snapshot, history):
    shaped = {"status": snapshot, "history": history}
    for value in (snapshot, shaped):
        fate = watchers.answer_fate(value, "a-1", "TASK_STATE_INPUT_REQUIRED", ASKED)
        assert fate in ("arrived", "moved on", "waiting")
    arrived = any(isinstance(m, dict) and m.get("messageId") == "a-1" for m in history)
    assert (
        watchers.answer_fate(shaped, "a-1", "TASK_STATE_INPUT_REQUIRED", ASKED) == "arrived"
    ) == arrived
