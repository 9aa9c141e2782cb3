"""record(): the fold into the snapshot, idempotence, gaps and seq allocation."""

from __future__ import annotations

import datetime as dt
import gc
import json
import threading

import pytest
from django.db import close_old_connections, connection
from django.db.models import TextField
from django.db.models.functions import Cast

from tasks_app.models import Agent, Artifact, ArtifactPart, RemoteTask, TaskEvent
from tasks_app.services import record as record_module
from tasks_app.services.chain import canonical_json
from tasks_app.services.record import record, record_many
from tasks_app.services.snapshot import task_view

pytestmark = pytest.mark.django_db


def status(
    task_id: str, state: str, ts: str | None = None, text: str | None = None, mid: str = ""
) -> dict:
    body: dict = {"state": state}
    if ts:
        body["timestamp"] = ts
    if text:
        body["message"] = {
            "messageId": mid or f"m-{text}",
            "role": "ROLE_AGENT",
            "parts": [{"text": text}],
        }
    return {"statusUpdate": {"taskId": task_id, "contextId": "c-1", "status": body}}


def chunk(task_id: str, text: str, *, append: bool, last: bool = False, aid: str = "a-1") -> dict:
    return {
        "artifactUpdate": {
            "taskId": task_id,
            "contextId": "c-1",
            "artifact": {"artifactId": aid, "name": "out.txt", "parts": [{"text": text}]},
            "append": append,
            "lastChunk": last,
        }
    }


def snapshot(
    task_id: str, state: str, artifacts: list | None = None, ts: str | None = None
) -> dict:
    task: dict = {"id": task_id, "contextId": "c-1", "status": {"state": state}}
    if ts:
        task["status"]["timestamp"] = ts
    if artifacts:
        task["artifacts"] = artifacts
    return {"task": task}


@pytest.fixture
def task(db) -> RemoteTask:
    agent = Agent.objects.create(name="a", base_url="http://127.0.0.1:1/")
    return RemoteTask.objects.create(agent=agent, title="t")


def seqs(task: RemoteTask) -> list[int]:
    return list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("seq", flat=True))


def test_a_call_leaves_no_reference_cycle_to_collect(task):
    """What one call folds is freed when it returns, not by the cyclic collector.

    A fold held its rows, which held the fold: each call's entries and part rows (a
    streamed 1 MB chunk, twice) waited for a collection, which a worker runs rarely
    (``eventloop.tune_gc``), and its memory grew by the size of a 90 MB artifact while it
    streamed (tests/test_hostile_agents.py measures the worker).
    """
    record(task, snapshot("t-1", "TASK_STATE_WORKING"), "stream")
    chunk = {
        "taskId": "t-1",
        "contextId": "c-1",
        "artifact": {"artifactId": "a", "parts": [{"text": "x" * 100_000}]},
    }
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        record_many(
            task,
            [{"artifactUpdate": chunk}, {"artifactUpdate": {**chunk, "append": True}}],
            "stream",
        )
        gc.collect()
        left = [
            type(o).__name__
            for o in gc.garbage
            if isinstance(o, (record_module._Fold, record_module.Entry, ArtifactPart))
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert ArtifactPart.objects.filter(artifact__task=task).count() == 2
    assert left == []


def test_calls_given_the_next_leave_no_reference_cycle_either(task):
    """A batch holds its fold made ahead, which holds what it was made from: nothing of it
    may refer back, or the batch, its entries and the last call's fold wait for the cyclic
    collector; a fold made ahead and never taken too (the stream ended)."""
    from tasks_app.services.record import Batch

    record(task, snapshot("t-1", "TASK_STATE_WORKING"), "stream")
    big = "x" * 100_000
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        calls = [Batch([chunk("t-1", big, append=i > 0)]) for i in range(3)]
        with connection.execute_wrapper(pause_after_the_log_rows):
            record_many(task, calls[0], "stream", ahead=calls[1])
            record_many(task, calls[1], "stream", ahead=calls[2])
        del calls
        gc.collect()
        ours = (record_module._Fold, record_module.Entry, record_module.Batch,
                record_module._FoldAhead, ArtifactPart)  # fmt: skip
        left = [type(o).__name__ for o in gc.garbage if isinstance(o, ours)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert ArtifactPart.objects.filter(artifact__task=task).count() == 2
    assert left == []


def test_our_own_entries_say_what_happened_in_their_rows_note(task):
    """A system row's line under its kind was empty: "answer-failed ... the task is gone"
    was in its raw JSON alone, and the page showed a bare "system"."""
    detail = "TASK_NOT_FOUND: no such task; the task is gone " + "x" * 400
    record(task, {"system": {"event": "answer-failed", "detail": detail}}, "system")
    record(task, {"system": {"event": "gone"}}, "system")
    record(task, {"system": {"detail": "no event named"}}, "system")
    notes = list(task.events.order_by("seq").values_list("note", flat=True))
    assert notes[0].startswith("answer-failed: TASK_NOT_FOUND: no such task; the task is gone")
    assert len(notes[0]) == record_module.SYSTEM_NOTE_CHARS and notes[0].endswith("…")
    assert notes[1:] == ["gone", ""]


def test_first_task_event_adopts_the_remote_id(task):
    result = record(task, snapshot("t-1", "TASK_STATE_SUBMITTED"), "stream")
    task.refresh_from_db()
    assert result.seqs == [1]
    assert (task.remote_id, task.context_id, task.phase, task.state) == (
        "t-1",
        "c-1",
        "task",
        "TASK_STATE_SUBMITTED",
    )


def test_chunks_append_replace_and_complete(task):
    record_many(
        task,
        [
            snapshot("t-1", "TASK_STATE_SUBMITTED"),
            status("t-1", "TASK_STATE_WORKING", text="step 1/3"),
            chunk("t-1", "a", append=False),
            chunk("t-1", "b", append=True),
            chunk("t-1", "c", append=True, last=True),
        ],
        "stream",
    )
    task.refresh_from_db()
    view = task_view(task)
    assert view["artifacts"] == [
        {
            "artifactId": "a-1",
            "name": "out.txt",
            "parts": [{"text": "a"}, {"text": "b"}, {"text": "c"}],
        }
    ]
    assert task.artifacts.get().complete
    record(task, chunk("t-1", "z", append=False), "stream")
    assert task_view(task)["artifacts"][0]["parts"] == [{"text": "z"}]
    assert seqs(task) == [1, 2, 3, 4, 5, 6]


def test_same_status_twice_is_recorded_once(task):
    record(task, snapshot("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:01Z"), "poll")
    first = record(task, status("t-1", "TASK_STATE_COMPLETED", ts="2026-01-01T00:00:02Z"), "push")
    again = record(task, status("t-1", "TASK_STATE_COMPLETED", ts="2026-01-01T00:00:02Z"), "poll")
    same_snapshot = record(
        task, snapshot("t-1", "TASK_STATE_COMPLETED", ts="2026-01-01T00:00:02Z"), "poll"
    )
    assert first.seqs == [2]
    assert again.duplicate and same_snapshot.duplicate
    assert seqs(task) == [1, 2]


def test_terminal_tasks_do_not_change(task):
    record(task, snapshot("t-1", "TASK_STATE_COMPLETED"), "poll")
    result = record(task, status("t-1", "TASK_STATE_WORKING"), "push")
    task.refresh_from_db()
    assert task.state == "TASK_STATE_COMPLETED"
    event = TaskEvent.objects.get(task=task, seq=result.seqs[0])
    assert event.kind == "protocol-error"
    assert "illegal transition" in event.note


def test_the_reply_to_our_send_overtaken_by_push_is_late_not_the_agents_error(task):
    """A fast push task: its notifications (to the end) were recorded before the reply to our
    own SendMessage, which said SUBMITTED. It was logged as the agent's protocol error, and
    counted against its error budget (a soak run: 6 of 98 push tasks)."""
    record(task, snapshot("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:01Z"), "push")
    record(task, status("t-1", "TASK_STATE_COMPLETED", ts="2026-01-01T00:00:03Z"), "push")
    for reply in (
        snapshot("t-1", "TASK_STATE_SUBMITTED", ts="2026-01-01T00:00:00Z"),
        snapshot("t-1", "TASK_STATE_SUBMITTED"),  # no time: still the reply to our send
    ):
        (seq,) = record(task, reply, "send-response").seqs
        row = TaskEvent.objects.get(task=task, seq=seq)
        assert row.kind == "task" and row.note.startswith("older than the status already held")
    # Stamped before the end on another channel: late too. Unstamped, or a state A2A does
    # not have: the agent's error, as before.
    late = record(task, status("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:02Z"), "poll")
    assert TaskEvent.objects.get(task=task, seq=late.seqs[0]).kind == "statusUpdate"
    for wrong in (status("t-1", "TASK_STATE_WORKING"), status("t-1", "TASK_STATE_BOGUS")):
        (seq,) = record(task, wrong, "push").seqs
        assert TaskEvent.objects.get(task=task, seq=seq).kind == "protocol-error"
    task.refresh_from_db()
    assert task.state == "TASK_STATE_COMPLETED"


def test_a_submitted_reply_overtaken_by_pushes_does_not_move_the_task_back(task):
    """The reply to our send (SUBMITTED, unstamped) was recorded after the agent's pushes had
    taken the task to working, or to a question: it moved the task back to submitted, and a
    push task waiting for an answer was shown as awaiting push (a soak run: 7 of 40)."""
    record(task, snapshot("t-1", "TASK_STATE_INPUT_REQUIRED"), "push")
    (seq,) = record(task, snapshot("t-1", "TASK_STATE_SUBMITTED"), "send-response").seqs
    row = TaskEvent.objects.get(task=task, seq=seq)
    assert row.kind == "task" and row.note.startswith("older than the status already held")
    task.refresh_from_db()
    assert task.state == "TASK_STATE_INPUT_REQUIRED"
    # The first word of a task is SUBMITTED as ever; another channel's SUBMITTED is news.
    fresh = RemoteTask.objects.create(agent=task.agent, title="fresh")
    record(fresh, snapshot("t-2", "TASK_STATE_SUBMITTED"), "send-response")
    fresh.refresh_from_db()
    assert fresh.state == "TASK_STATE_SUBMITTED"


def test_a_status_stamped_far_ahead_of_our_clock_does_not_freeze_the_task(task):
    """One status stamped in the year 9999 made every later status "older": the agent's end,
    a cancel's and a refresh's snapshots were logged and not applied, and the holder read
    the task again every second for ever. A stamp past CLOCK_AHEAD orders nothing."""
    record(task, status("t-1", "TASK_STATE_WORKING", "2026-01-01T00:00:00Z"), "stream")
    (seq,) = record(task, status("t-1", "TASK_STATE_WORKING", "9999-12-31T23:59:59Z", "far"),
                    "stream").seqs  # fmt: skip
    assert TaskEvent.objects.get(task=task, seq=seq).note == record_module.AHEAD_NOTE
    ended = record(task, status("t-1", "TASK_STATE_COMPLETED", "2026-01-01T00:00:05Z"), "stream")
    assert ended.progress
    task.refresh_from_db()
    assert task.state == "TASK_STATE_COMPLETED"
    assert task.status_timestamp.year == 2026
    # A task that holds such a stamp already (recorded before the bound) takes the end too.
    held = RemoteTask.objects.create(agent=task.agent, title="held")
    record(held, status("t-2", "TASK_STATE_WORKING", "2026-01-01T00:00:00Z"), "stream")
    far = dt.datetime(9999, 12, 31, tzinfo=dt.UTC)
    RemoteTask.objects.filter(pk=held.pk).update(status_timestamp=far)
    record(held, snapshot("t-2", "TASK_STATE_CANCELED", ts="2026-01-01T00:00:09Z"), "operator")
    held.refresh_from_db()
    assert held.state == "TASK_STATE_CANCELED"


def test_a_snapshot_logged_and_not_applied_is_no_progress(task):
    """A GetTask one chunk behind the stream (or stamped before the held status) is logged,
    not applied; counted as progress, the holder read it again every second, a row each
    time, and never backed off or parked."""
    record_many(task, [snapshot("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:02Z"),
                       chunk("t-1", "one", append=False), chunk("t-1", "two", append=True)],
                "stream")  # fmt: skip
    behind = [{"artifactId": "a-1", "name": "out.txt", "parts": [{"text": "one"}]}]
    lagging = snapshot("t-1", "TASK_STATE_WORKING", behind, ts="2026-01-01T00:00:02Z")
    first = record(task, lagging, "resubscribe")
    assert first.seqs and not first.progress
    # Read again by a poll, it is not logged again (a holder's channel logs each delivery).
    again = record(task, lagging, "poll")
    assert not again.seqs and again.repeated and not again.progress
    older = record(task, snapshot("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:01Z"), "poll")
    assert older.seqs and not older.progress
    newer = record(task, status("t-1", "TASK_STATE_WORKING", "2026-01-01T00:00:03Z"), "stream")
    assert newer.progress


def test_a_question_asked_again_at_the_same_time_is_a_new_question(task):
    """An agent refusing an answer asked again with the same status time and a new message:
    it was the same status, dropped, and the page showed the question answered, with no
    form. A status at that time without a message, or with the same one, is the same."""
    stamp = "2026-01-01T00:00:00Z"
    record(task, status("t-1", "TASK_STATE_INPUT_REQUIRED", stamp, "q1"), "stream")
    task.refresh_from_db()
    first = task.asked_seq
    RemoteTask.objects.filter(pk=task.pk).update(answered_seq=first)  # answered
    assert not record(task, status("t-1", "TASK_STATE_INPUT_REQUIRED", stamp), "poll").seqs
    same = status("t-1", "TASK_STATE_INPUT_REQUIRED", stamp, "q1")
    assert not record(task, same, "resubscribe").seqs
    # The same words under an id made up at each GetTask are the same question too.
    renamed = status("t-1", "TASK_STATE_INPUT_REQUIRED", stamp, "q1", mid="m-made-up")
    assert not record(task, renamed, "poll").seqs
    again = record(task, status("t-1", "TASK_STATE_INPUT_REQUIRED", stamp, "q2"), "stream")
    task.refresh_from_db()
    assert task.asked_seq == again.seqs[0] > first
    assert task.status_message["messageId"] == "m-q2"
    # Steps an agent stamps alike are each kept (the conversation held only the first).
    steps = [status("t-1", "TASK_STATE_WORKING", "2026-01-01T00:00:01Z", s) for s in "123"]
    for step in steps:
        record(task, step, "stream")
    task.refresh_from_db()
    assert task.status_message["messageId"] == "m-3"
    assert task.messages.filter(message_id__in=["m-1", "m-2", "m-3"]).count() == 3
    # Sent again (an agent that replays them at every subscribe): nothing new, no progress.
    again = record_many(task, steps, "resubscribe")
    assert not again.seqs and not again.progress


def test_a_status_update_carrying_only_metadata_merges_it(task):
    """Progress an agent keeps in a status update's metadata, the status unchanged: dropped
    as the same status, the task's metadata never moved (a snapshot's did)."""
    record(task, status("t-1", "TASK_STATE_WORKING"), "stream")
    for progress in (25, 50, 50):
        update = status("t-1", "TASK_STATE_WORKING")
        update["statusUpdate"]["metadata"] = {"progress": progress}
        record(task, update, "push")
    task.refresh_from_db()
    assert task.metadata == {"progress": 50}
    rows = TaskEvent.objects.filter(task=task, kind="statusUpdate", channel="push")
    assert rows.count() == 2  # 50 twice is nothing new
    # While a question waits (its status stamped, the update at the same time with no
    # message): the question is the one asked, not asked again, and its message is kept.
    stamp = "2026-01-01T00:00:00Z"
    record(task, status("t-1", "TASK_STATE_INPUT_REQUIRED", stamp, "q"), "stream")
    task.refresh_from_db()
    asked = task.asked_seq
    update = status("t-1", "TASK_STATE_INPUT_REQUIRED", stamp)
    update["statusUpdate"]["metadata"] = {"progress": 75}
    assert record(task, update, "push").seqs
    task.refresh_from_db()
    assert task.metadata == {"progress": 75}
    assert task.asked_seq == asked and task.status_message["messageId"] == "m-q"


def test_garbage_and_other_tasks_become_protocol_errors(task):
    record(task, snapshot("t-1", "TASK_STATE_WORKING"), "stream")
    results = [
        record(task, "not json at all", "stream"),
        record(task, {"kind": "status-update", "final": True}, "stream"),
        record(task, status("t-other", "TASK_STATE_FAILED"), "stream"),
        record(task, {"statusUpdate": {"taskId": "t-1", "status": {"state": "working"}}}, "stream"),
    ]
    kinds = [TaskEvent.objects.get(task=task, seq=r.seqs[0]).kind for r in results]
    assert kinds == ["protocol-error"] * 4
    task.refresh_from_db()
    assert task.state == "TASK_STATE_WORKING"


def test_resubscribe_snapshot_that_differs_records_a_gap(task):
    record_many(
        task, [snapshot("t-1", "TASK_STATE_WORKING"), chunk("t-1", "a", append=False)], "stream"
    )
    artifact = {"artifactId": "a-1", "name": "out.txt", "parts": [{"text": "a"}, {"text": "b"}]}
    result = record(task, snapshot("t-1", "TASK_STATE_COMPLETED", [artifact]), "resubscribe")
    kinds = list(
        TaskEvent.objects.filter(task=task, seq__in=result.seqs).values_list("kind", flat=True)
    )
    assert kinds == ["gap", "task"]
    gap = TaskEvent.objects.get(task=task, kind="gap")
    assert gap.note.startswith("the stream broke; events in between were not replayed: ")
    assert task_view(task)["artifacts"] == [artifact]
    # The same snapshot again adds nothing, and no second gap.
    assert record(
        task, snapshot("t-1", "TASK_STATE_COMPLETED", [artifact]), "resubscribe"
    ).duplicate


def test_plain_message_reply_ends_the_exchange_without_a_task(task):
    reply = {
        "message": {
            "messageId": "m-r",
            "role": "ROLE_AGENT",
            "contextId": "c-9",
            "parts": [{"text": "hi"}],
        }
    }
    record(task, reply, "send-response")
    task.refresh_from_db()
    assert (task.phase, task.remote_id, task.context_id) == ("message", "", "c-9")
    assert record(task, reply, "send-response").duplicate


@pytest.mark.django_db(transaction=True)
def test_concurrent_writers_never_duplicate_or_skip_a_seq():
    agent = Agent.objects.create(name="a", base_url="http://127.0.0.1:2/")
    task = RemoteTask.objects.create(agent=agent)
    record(task, snapshot("t-1", "TASK_STATE_WORKING"), "stream")
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(15):
                record(task.pk, chunk("t-1", f"{n}-{i}", append=True, aid=f"a-{n}"), "stream")
                record(task.pk, {"operator": {"action": "note", "n": n, "i": i}}, "operator")
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)
        finally:
            close_old_connections()

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert seqs(task) == list(range(1, 1 + 1 + 4 * 15 * 2))
    task.refresh_from_db()
    assert task.last_seq == 121
    for n in range(4):
        parts = task_view(task)["artifacts"]
        texts = {a["artifactId"]: [p["text"] for p in a["parts"]] for a in parts}
        assert texts[f"a-{n}"] == [f"{n}-{i}" for i in range(15)]


def test_each_entry_of_a_batch_carries_the_state_right_after_it(task):
    record_many(
        task,
        [
            snapshot("t-1", "TASK_STATE_SUBMITTED"),
            status("t-1", "TASK_STATE_WORKING", text="go"),
            chunk("t-1", "a", append=False),
            status("t-1", "TASK_STATE_COMPLETED", text="done"),
        ],
        "stream",
    )
    rows = list(
        TaskEvent.objects.filter(task=task)
        .order_by("seq")
        .values_list("state_after", "state_changed")
    )
    assert rows == [
        ("TASK_STATE_SUBMITTED", True),
        ("TASK_STATE_WORKING", True),
        ("TASK_STATE_WORKING", False),
        ("TASK_STATE_COMPLETED", True),
    ]


def test_default_valued_fields_do_not_make_a_snapshot_differ(task):
    """ListTasks results carry "filename": "", "extensions": [] ...; GetTask omits them."""
    lean = {"artifactId": "a-1", "parts": [{"text": "x"}]}
    verbose = {
        "artifactId": "a-1", "name": "", "description": "", "metadata": {}, "extensions": [],
        "parts": [{"text": "x", "filename": "", "mediaType": "", "metadata": {}}],
    }  # fmt: skip
    record(task, snapshot("t-1", "TASK_STATE_COMPLETED", [lean], ts="2026-01-01T00:00:01Z"), "poll")
    assert record(
        task, snapshot("t-1", "TASK_STATE_COMPLETED", [verbose], ts="2026-01-01T00:00:01Z"), "poll"
    ).duplicate
    assert task_view(task)["artifacts"] == [lean]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("watched", [False, True], ids=["sent-ahead", "through-a-cursor"])
def test_the_folds_first_read_is_what_the_orm_reads(task, watched):
    """``read_task``: the task and its artifacts as the ORM reads them (compiled once; one
    round trip on PostgreSQL), ``relax`` only for that transaction, a missing task as None.
    On PostgreSQL the read is sent ahead (below Django's cursor) unless something watches
    statements (an ``execute_wrapper``, as race tests inject pauses): then it goes through
    a cursor, where the wrapper sees it."""
    import contextlib

    from django.db import connection, transaction

    from tasks_app.models import Artifact
    from tasks_app.services.record import TaskRead, read_task

    record_many(task.pk, [chunk("t-1", "x", append=False, aid=aid) for aid in ("a", "b")], "stream")
    record(task.pk, status("t-1", "TASK_STATE_WORKING", text="busy"), "stream")
    seen: list[str] = []

    def watch(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    def fields(row) -> dict:
        return {f.attname: getattr(row, f.attname) for f in type(row)._meta.concrete_fields}

    def synchronous_commit() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            return cursor.fetchone()[0]

    postgres = connection.vendor == "postgresql"
    with connection.execute_wrapper(watch) if watched else contextlib.nullcontext():
        for _ in range(2):  # the second time from the statements compiled the first
            with transaction.atomic():
                read = TaskRead(task.pk, relax=True, artifacts=True)
                assert (read.ahead is not None) == (postgres and not watched)
                current, held = read.result()
                if postgres:
                    assert synchronous_commit() == "off"
            assert fields(current) == fields(RemoteTask.objects.get(pk=task.pk))
            assert current.status_message["parts"] == [{"text": "busy"}]  # JSON decoded
            assert current.updated_at.tzinfo is not None and current.updated_at.utcoffset() == (
                dt.timedelta(0)
            )
            orm = {a.artifact_id: fields(a) for a in Artifact.objects.filter(task_id=task.pk)}
            assert {aid: fields(a) for aid, a in held.items()} == orm and len(orm) == 2
            if postgres:
                assert synchronous_commit() == "on"  # SET LOCAL: that transaction only
        with transaction.atomic():
            assert read_task(task.pk + 1000, relax=True, artifacts=True)[0] is None
            assert read_task(task.pk)[1] is None
            current, held = read_task(task.pk, artifacts=["b", "nope"])
            assert set(held) == {"b"} and current.pk == task.pk
    assert any('FROM "tasks_app_remotetask"' in sql for sql in seen) == watched


@pytest.mark.django_db(transaction=True)
def test_a_batch_that_fails_while_its_read_is_sent_ahead_leaves_the_connection_usable(
    task, monkeypatch
):
    """The read goes out before the batch is parsed; parsing that raises (a bug, a signal)
    must not leave its replies on the wire, or the connection's next statement fails
    ("another command is already in progress"). A statement the server refuses comes out
    as Django's error, and the transaction is rolled back as a cursor's would be."""
    from django.db import DataError, transaction

    from tasks_app.services import sent_ahead

    real = record_module.parse_entry

    def broken(obj):
        raise RuntimeError("parsing broke")

    monkeypatch.setattr(record_module, "parse_entry", broken)
    with pytest.raises(RuntimeError, match="parsing broke"):
        record_many(
            task.pk, [status("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:01Z")], "stream"
        )
    monkeypatch.setattr(record_module, "parse_entry", real)
    assert RemoteTask.objects.get(pk=task.pk).last_seq == 0
    record_many(task.pk, [status("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:01Z")], "stream")
    assert RemoteTask.objects.get(pk=task.pk).last_seq == 1
    if connection.vendor == "postgresql":
        assert sent_ahead.usable()
        with pytest.raises(DataError), transaction.atomic():
            sent_ahead.SentAhead("SELECT 1 / %s", [0]).results()
        with transaction.atomic():
            ahead = sent_ahead.SentAhead("SELECT %s::text", ["it's"])
            assert ahead.began  # BEGIN went with it
            assert ahead.rows(ahead.results()[1]) == [("it's",)]
        assert RemoteTask.objects.filter(pk=task.pk).exists()
        # The BEGIN sent with it is the one psycopg would send, whatever the settings.
        import psycopg

        raw = connection.connection
        kept = raw.isolation_level, raw.read_only, raw.deferrable
        try:
            for level, read_only, deferrable in [
                (None, None, None),
                (psycopg.IsolationLevel.REPEATABLE_READ, True, None),
                (psycopg.IsolationLevel.SERIALIZABLE, False, True),
            ]:
                raw.isolation_level, raw.read_only, raw.deferrable = level, read_only, deferrable
                assert sent_ahead._begin(raw) == raw._get_tx_start_command().decode()
        finally:
            raw.isolation_level, raw.read_only, raw.deferrable = kept


@pytest.mark.django_db(transaction=True)
def test_a_chunk_whose_artifact_id_parsing_changes_is_folded_onto_its_artifact(task):
    """The first read asks for the artifacts the objects name as they came; cleaning can
    change an id (a lone surrogate becomes U+FFFD), and the fold then needs another one.
    Appended chunks under such an id still make one artifact of all their parts."""
    odd = "a-\ud800"
    record_many(task.pk, [chunk("t-1", "one", append=False, aid=odd)], "stream")
    record_many(task.pk, [chunk("t-1", "two", append=True, aid=odd)], "stream")
    record_many(
        task.pk, [chunk("t-1", "three", append=True, aid=odd), chunk("t-1", "x", append=False)],
        "stream",
    )  # fmt: skip
    artifacts = {a["artifactId"]: a for a in task_view(task)["artifacts"]}
    assert set(artifacts) == {"a-\ufffd", "a-1"}
    assert [p["text"] for p in artifacts["a-\ufffd"]["parts"]] == ["one", "two", "three"]


def pause_after_the_log_rows(execute, sql, params, many, context):
    """An ``execute_wrapper``: after a call's log rows are inserted, a statement the server
    takes 50 ms over (PostgreSQL), a wait inside the transaction as a slow COPY would be."""
    result = execute(sql, params, many, context)
    if sql.startswith('INSERT INTO "tasks_app_taskevent"') and connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_sleep(0.05)")
    return result


def test_the_next_call_is_parsed_while_this_one_waits_and_recorded_alike(task, monkeypatch):
    """``ahead``: on PostgreSQL the next call's objects are parsed in this call's waits on
    the database, each object once in all, and the next call records them as it would
    have; on SQLite that call parses them itself. The log is the one the same objects
    make without ``ahead``."""
    from tasks_app.services.record import Batch

    real = record_module.parse_entry
    parsed: list = []
    monkeypatch.setattr(record_module, "parse_entry", lambda obj: parsed.append(obj) or real(obj))
    objs = [
        status("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:01Z"),
        chunk("t-1", "one", append=False),
        status("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:02Z", text="half way"),
        chunk("t-1", "two\ud800", append=True),  # cleaned as it is parsed
        {"statusUpdate": "not an object"},
        chunk("t-1", "three", append=True, last=True),
    ]
    first, second = Batch(objs[:3]), Batch(objs[3:])
    with connection.execute_wrapper(pause_after_the_log_rows):
        record_many(task.pk, first, "stream", ahead=second)
    postgres = connection.vendor == "postgresql"
    assert second.pending is not postgres

    def ids(values: list) -> list[int]:
        return sorted(map(id, values))

    assert ids(parsed) == ids(objs if postgres else objs[:3])
    record_many(task.pk, second, "stream")
    assert ids(parsed) == ids(objs)  # once each
    other_agent = Agent.objects.create(name="b", base_url="http://127.0.0.1:2/")
    alike = RemoteTask.objects.create(agent=other_agent, title="t")
    record_many(alike.pk, objs[:3], "stream")
    record_many(alike.pk, objs[3:], "stream")

    def log(of: RemoteTask) -> list:
        return list(
            TaskEvent.objects.filter(task=of)
            .order_by("seq")
            .values_list("seq", "kind", "note", "state_after", "digest", "raw")
        )

    assert log(task) == log(alike) and len(log(task)) == 6
    assert [p["text"] for p in task_view(task)["artifacts"][0]["parts"]] == [
        "one", "two\ufffd", "three",
    ]  # fmt: skip


def test_an_object_that_breaks_parsing_ahead_fails_its_own_call(task, monkeypatch):
    """Parsing ahead that raises does not fail the call that was waiting: the next call
    meets the error where it is its own, records nothing, and the connection goes on."""
    from tasks_app.services.record import Batch

    real = record_module.parse_entry
    tried: list = []

    def breaks_on_marked(obj):
        if obj.get("marked"):
            tried.append(obj)
            raise RuntimeError("parsing broke")
        return real(obj)

    monkeypatch.setattr(record_module, "parse_entry", breaks_on_marked)
    first = Batch([status("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:01Z")])
    second = Batch([chunk("t-1", "one", append=False), {"marked": True}])
    with connection.execute_wrapper(pause_after_the_log_rows):
        record_many(task.pk, first, "stream", ahead=second)
    assert len(tried) == (1 if connection.vendor == "postgresql" else 0)
    assert seqs(task) == [1]
    with pytest.raises(RuntimeError, match="parsing broke"):
        record_many(task.pk, second, "stream")
    assert seqs(task) == [1]
    record_many(task.pk, [status("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:02Z")], "stream")
    assert seqs(task) == [1, 2]


def counting_adds(monkeypatch) -> list:
    """Each entry a fold adds, as it is added (made ahead or in its call)."""
    added: list = []
    real = record_module._Fold.add

    def add(fold, entry):
        added.append(entry)
        return real(fold, entry)

    monkeypatch.setattr(record_module._Fold, "add", add)
    return added


def log_of(task: RemoteTask) -> list:
    """The log without the time of day (each task records at its own)."""
    return list(
        TaskEvent.objects.filter(task=task)
        .order_by("seq")
        .values_list("seq", "channel", "kind", "note", "state_after", "digest", "raw")
    )


def working(second: int, **kw) -> dict:
    return status("t-1", "TASK_STATE_WORKING", ts=f"2026-01-01T00:00:{second:02d}Z", **kw)


def test_a_fold_made_ahead_is_the_calls_when_the_task_is_as_the_last_call_left_it(
    task, monkeypatch
):
    """On PostgreSQL the next call's fold is made in this call's waits, from the task as
    this call leaves it, and the next call takes it (no entry folded again); the log and
    the mirror are those of the same calls without ``ahead``. On SQLite each call folds
    its own."""
    from tasks_app.services.record import Batch

    objs = [working(1), chunk("t-1", "one", append=False), working(2), chunk("t-1", "two", append=True),
            chunk("t-1", "three", append=True, last=True), working(3)]  # fmt: skip
    first, second = Batch(objs[:2]), Batch(objs[2:])
    with connection.execute_wrapper(pause_after_the_log_rows):
        record_many(task.pk, first, "stream", ahead=second)
    postgres = connection.vendor == "postgresql"
    made = second.folded_ahead
    assert (made is not None and made.done) is postgres
    added = counting_adds(monkeypatch)
    record_many(task.pk, second, "stream")
    assert len(added) == (0 if postgres else 4)
    other = RemoteTask.objects.create(
        agent=Agent.objects.create(name="b", base_url="http://127.0.0.1:2/"), title="t"
    )
    record_many(other.pk, objs[:2], "stream")
    record_many(other.pk, objs[2:], "stream")
    assert log_of(task) == log_of(other) and len(log_of(task)) == 6
    mine, theirs = (task_view(RemoteTask.objects.get(pk=t.pk)) for t in (task, other))
    assert {k: v for k, v in mine.items() if k != "id"} == {
        k: v for k, v in theirs.items() if k != "id"
    }
    received = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list(
        "received_at", flat=True))  # fmt: skip
    assert received == sorted(received)


@pytest.mark.parametrize(
    "meanwhile",
    ["appended", "changed-behind", "artifact-changed-behind", "another-channel", "lease-moved"],
)
def test_a_fold_made_ahead_is_not_the_calls_when_the_task_changed_since(
    task, monkeypatch, meanwhile
):
    """Between the call that made the next fold ahead and the next call, the task changed:
    another writer appended a row; a column the fold reads changed without a row (a state
    set behind the log's back, as no path of ours does: the test of what is compared), or an
    artifact's; the next call is made on another channel; the lease moved to another
    holder. The next call folds for itself, and records what the task as it is now makes
    of its entries."""
    from tasks_app.services.record import Batch

    RemoteTask.objects.filter(pk=task.pk).update(lease_token="mine")
    first = Batch([working(1), chunk("t-1", "one", append=False)])
    second = Batch([working(2), chunk("t-1", "two", append=True)])
    with connection.execute_wrapper(pause_after_the_log_rows):
        record_many(task.pk, first, "stream", ahead=second, fence="mine")
    if meanwhile == "appended":
        record(task.pk, {"system": {"event": "a note"}}, "system")
    elif meanwhile == "changed-behind":
        RemoteTask.objects.filter(pk=task.pk).update(state="TASK_STATE_COMPLETED")
    elif meanwhile == "artifact-changed-behind":
        Artifact.objects.filter(task=task).update(digest="d" * 64)
    elif meanwhile == "lease-moved":
        RemoteTask.objects.filter(pk=task.pk).update(lease_token="theirs")
    added = counting_adds(monkeypatch)
    channel = "resubscribe" if meanwhile == "another-channel" else "stream"
    result = record_many(task.pk, second, channel, fence="mine")
    kinds = [row[2] for row in log_of(task)]
    if meanwhile == "appended":
        assert len(added) == 2 and kinds == ["statusUpdate", "artifactUpdate", "system",
                                             "statusUpdate", "artifactUpdate"]  # fmt: skip
    elif meanwhile == "changed-behind":
        # Refused as after the end: made ahead from a working task, they were taken.
        assert len(added) == 2 and kinds[2:] == ["protocol-error", "protocol-error"]
    elif meanwhile == "artifact-changed-behind":
        # The chunk is chained onto the digest the artifact holds now.
        artifact = Artifact.objects.get(task=task)
        assert len(added) == 2 and artifact.digest == record_module.chain_digest(
            "d" * 64, [{"text": "two"}]
        )
    elif meanwhile == "another-channel":
        assert len(added) == 2 and [row[1] for row in log_of(task)][2:] == ["resubscribe"] * 2
    else:
        assert result.fenced and added == [] and kinds == ["statusUpdate", "artifactUpdate"]


def test_a_fold_ahead_that_would_ask_the_database_is_left_to_its_call(task, monkeypatch):
    """A status carrying a message makes the fold look the message up in the conversation:
    a query, which a wait refuses. The fold is not made ahead; its call makes it, and the
    message is stored once."""
    from tasks_app.services.record import Batch

    first = Batch([working(1)])
    second = Batch([working(2, text="half way"), working(3, text="half way", mid="m-half way")])
    with connection.execute_wrapper(pause_after_the_log_rows):
        record_many(task.pk, first, "stream", ahead=second)
    made = second.folded_ahead
    if connection.vendor == "postgresql":
        assert made is not None and made.failed
    else:
        assert made is None
    added = counting_adds(monkeypatch)
    record_many(task.pk, second, "stream")
    assert len(added) == 2
    assert task.messages.count() == 1
    assert [row[2] for row in log_of(task)] == ["statusUpdate"] * 3


@pytest.mark.django_db(transaction=True)
def test_rows_written_from_their_canonical_text_read_back_as_they_came(task, monkeypatch):
    """A batch big enough for COPY writes each log row's raw from the canonical text parsing
    made (not serialized again): quotes, backslashes, escapes, tabs, non-ASCII and nesting
    come back equal, and the chain still verifies."""
    from tasks_app.services import record as record_module
    from tasks_app.services.audit import verify

    given: list = []
    real_insert = record_module.insert_rows

    def watched(model, objs, **kwargs):
        given.append(kwargs.get("json_texts"))
        return real_insert(model, objs, **kwargs)

    monkeypatch.setattr(record_module, "insert_rows", watched)
    texts = ['say "hi"', "back\\slash \\n not a newline", "tab\tand\nnewline", "é ü 漢字 🙂",
             "\\u0041 written out", "\x01 control", "", "{}[]:,", "100%", "line\r\n"]  # fmt: skip
    objs = [chunk("t-1", text, append=i > 0) for i, text in enumerate(texts)]
    objs[3]["artifactUpdate"]["metadata"] = {"nested": {"list": [1, 2.5, None, True], "k": "v"}}
    record_many(task.pk, objs, "stream")
    stored = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("raw", flat=True))
    assert stored == objs
    assert verify(task).ok
    (log_texts,) = [texts for texts in given if texts and "raw" in texts]
    # Every row from its text but the one with an emoji: its escaped surrogate pair makes
    # the scan send it through the cleaning walk, which serializes as before.
    assert [text is None for text in log_texts["raw"]] == [i == 3 for i in range(len(texts))]
    # Every part row from the text the fold's chain wrote (the emoji's too: it was cleaned).
    (part_texts,) = [texts["part"] for texts in given if texts and "part" in texts]
    assert part_texts == [
        json.dumps(o["artifactUpdate"]["artifact"]["parts"][0], ensure_ascii=False,
                   sort_keys=True, separators=(",", ":"))
        for o in objs
    ]  # fmt: skip
    parts = ArtifactPart.objects.filter(artifact__task=task).order_by("index")
    assert [p.part for p in parts] == [o["artifactUpdate"]["artifact"]["parts"][0] for o in objs]
    if connection.vendor == "sqlite":  # JSON kept as text: the very text, on SQLite too
        kept_parts = parts.annotate(text=Cast("part", TextField())).values_list("text", flat=True)
        assert list(kept_parts) == part_texts
        kept = (
            TaskEvent.objects.filter(task=task)
            .order_by("seq")
            .annotate(text=Cast("raw", TextField()))
            .values_list("text", flat=True)
        )
        assert [
            text == canonical_json(obj).decode() for text, obj in zip(kept, objs, strict=True)
        ] == [i != 3 for i in range(len(texts))]


@pytest.mark.django_db(transaction=True)
def test_rows_inserted_from_their_texts_hold_their_values_after_even_a_failed_insert(task):
    """The rows of a batch are relayed after their insert: on SQLite the insert puts each
    written text in place of its value for the time of the statement, and puts it back."""
    from django.db import IntegrityError, transaction

    from tasks_app.services.record import insert_rows

    def rows(first: int) -> list[TaskEvent]:
        return [
            TaskEvent(task=task, seq=seq, channel="stream", kind="system", raw={"n": seq})
            for seq in (first, first + 1)
        ]

    made = rows(1)
    insert_rows(TaskEvent, made, json_texts={"raw": [canonical_json(e.raw).decode() for e in made]})
    assert [e.raw for e in made] == [{"n": 1}, {"n": 2}]
    again = rows(2)  # seq 2 is taken: the insert fails
    with pytest.raises(IntegrityError), transaction.atomic():
        insert_rows(
            TaskEvent, again, json_texts={"raw": [canonical_json(e.raw).decode() for e in again]}
        )
    assert [e.raw for e in again] == [{"n": 2}, {"n": 3}]
    stored = TaskEvent.objects.filter(task=task).order_by("seq").values_list("raw", flat=True)
    assert list(stored) == [{"n": 1}, {"n": 2}]


def test_a_document_shows_the_log_up_to_the_row_it_was_read_with(task):
    """``tasks show --json``: a row appended after the task was read (a settle landing in
    between, as a CI run found) is not shown beside a snapshot that does not count it."""
    from tasks_app.services.snapshot import task_document

    record_many(
        task.pk, [status("t-1", "TASK_STATE_WORKING", text=f"s{i}") for i in (1, 2)], "stream"
    )
    read = RemoteTask.objects.get(pk=task.pk)
    record(task.pk, {"system": {"event": "note", "detail": "later"}}, "system")
    document = task_document(read)
    assert document["last_seq"] == 2
    assert [event["seq"] for event in document["events"]] == [1, 2]
    assert [e["seq"] for e in task_document(RemoteTask.objects.get(pk=task.pk))["events"]] == [
        1,
        2,
        3,
    ]


# -- rows one entry may make (bytes alone let 3 MB of empty parts make a million rows) -----------


def _message(i: int) -> dict:
    return {"messageId": f"h-{i}", "role": "ROLE_AGENT", "parts": [{"text": f"m {i}"}]}


@pytest.fixture
def few_rows(settings):
    settings.WATCH_MAX_EVENT_ROWS = 50
    settings.WATCH_MAX_EVENT_ARTIFACTS = 5


def _rows_written(task: RemoteTask) -> tuple[int, int, int]:
    from tasks_app.models import Artifact, ArtifactPart, ConversationMessage

    return (
        Artifact.objects.filter(task=task).count(),
        ArtifactPart.objects.filter(artifact__task=task).count(),
        ConversationMessage.objects.filter(task=task).count(),
    )


@pytest.mark.parametrize(
    ("parts", "artifacts", "history", "refused"),
    [
        (50, 1, 0, ""),  # at the limit: taken
        (51, 1, 0, "51 artifact parts and 0 history messages; at most 50 an entry"),
        (10, 5, 0, ""),
        (1, 6, 0, "6 artifacts; at most 5 an entry (WATCH_MAX_EVENT_ARTIFACTS)"),
        (0, 0, 51, "0 artifact parts and 51 history messages; at most 50"),
        (25, 1, 26, "25 artifact parts and 26 history messages"),
    ],
)
def test_a_snapshot_asking_for_more_rows_than_an_entry_may_make_is_a_protocol_error(
    task, few_rows, parts, artifacts, history, refused
):
    task_json = snapshot(
        "t-1",
        "TASK_STATE_WORKING",
        [{"artifactId": f"a-{n}", "parts": [{}] * parts} for n in range(artifacts)],
    )
    task_json["task"]["history"] = [_message(i) for i in range(history)]
    record(task, task_json, "poll")
    event = TaskEvent.objects.get(task=task)
    if refused:
        assert event.kind == "protocol-error" and refused in event.note
        assert _rows_written(task) == (0, 0, 0)
    else:
        assert event.kind == "task"
        assert _rows_written(task) == (artifacts, artifacts * parts, history)


def test_an_artifact_update_asking_for_more_rows_than_an_entry_may_make_is_a_protocol_error(
    task, few_rows
):
    record(task, snapshot("t-1", "TASK_STATE_WORKING"), "stream")
    update = chunk("t-1", "x", append=False)
    update["artifactUpdate"]["artifact"]["parts"] = [{"text": "x"}] * 51
    record(task, update, "stream")
    update["artifactUpdate"]["artifact"]["parts"] = [{"text": "y"}] * 50
    record(task, update, "stream")
    kinds = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("kind", "note"))
    assert [k for k, _ in kinds] == ["task", "protocol-error", "artifactUpdate"]
    assert "51 artifact parts" in kinds[1][1]
    assert _rows_written(task) == (1, 50, 0)


def test_history_ids_are_looked_up_in_slices_and_each_kept_once(task, monkeypatch):
    """A database takes only so many values in one query: SQLite refused 260,000 ids, and the
    error was taken for the database being down (the task polled for ever). One entry now
    holds at most WATCH_MAX_EVENT_ROWS, and a batch's lookup goes in slices: the same
    result as one query."""
    from tasks_app.models import ConversationMessage
    from tasks_app.services import record as record_module

    monkeypatch.setattr(record_module, "LOOKUP_SLICE", 7)
    first = snapshot("t-1", "TASK_STATE_WORKING")
    first["task"]["history"] = [_message(i) for i in range(0, 30, 2)]  # the even ones
    record(task, first, "poll")
    again = snapshot("t-1", "TASK_STATE_WORKING")
    again["task"]["history"] = [_message(i) for i in range(30)]
    record(task, again, "poll")
    stored = list(
        ConversationMessage.objects.filter(task=task).values_list("message_id", flat=True)
    )
    assert sorted(stored) == sorted(f"h-{i}" for i in range(30))  # each once


def test_a_gone_task_with_an_answer_waiting_is_not_watched_and_takes_no_answer(
    task, django_user_model
):
    """The agent forgot the task while an answer was in its outbox: ``watchable()`` still
    matched it (its gone_at bound only some clauses), so every reconcile tick took it up
    again for one GetTask, for ever; and the page offered the answer form."""
    from django.utils import timezone

    from tasks_app.services import tasks as task_services
    from tests.people import member

    record(task, snapshot("t-1", "TASK_STATE_INPUT_REQUIRED"), "stream")
    RemoteTask.objects.filter(pk=task.pk).update(
        phase=RemoteTask.Phase.TASK, gone_at=timezone.now(), watcher_status="gone",
        outbox={"message": {"messageId": "a-1", "role": "ROLE_USER", "parts": [{"text": "y"}]}},
    )  # fmt: skip
    assert not RemoteTask.objects.filter(task_services.watchable(), pk=task.pk).exists()
    RemoteTask.objects.filter(pk=task.pk).update(gone_at=None)  # found again by a refresh
    assert RemoteTask.objects.filter(task_services.watchable(), pk=task.pk).exists()
    RemoteTask.objects.filter(pk=task.pk).update(gone_at=timezone.now(), outbox=None)
    task.refresh_from_db()
    person = member(django_user_model.objects.create_user("op"))
    with pytest.raises(task_services.TaskActionError, match="gone"):
        task_services.answer_task(task, "green", actor_id=person.pk)


def test_a_snapshot_older_than_the_status_held_changes_nothing(task):
    """A ListTasks page (or a GetTask) read before the stream's last status: applied, it rolled
    the task back (a question dropped out of the inbox) and wrote a false gap entry."""
    record(task, snapshot("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:00Z"), "stream")
    record(
        task, status("t-1", "TASK_STATE_INPUT_REQUIRED", "2026-01-01T00:00:05Z", "Name?"), "stream"
    )
    stale = snapshot("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:01Z")
    result = record(task, stale, "poll", gap_check=True)
    assert result.kinds == ["task"] and result.state == "TASK_STATE_INPUT_REQUIRED"
    # Read again by the next poll: logged once already, so nothing is stored.
    assert record(task, stale, "poll", gap_check=False).duplicate
    # The stream's own first snapshot, read again by a poll: known, nothing stored.
    first = snapshot("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:00Z")
    assert record(task, first, "poll", gap_check=True).duplicate
    task.refresh_from_db()
    assert task.state == "TASK_STATE_INPUT_REQUIRED" and task.asked_seq == 2
    kinds = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("kind", "note"))
    assert [k for k, _ in kinds] == ["task", "statusUpdate", "task"]
    assert "older than the status already held" in kinds[2][1]
    # A newer snapshot still applies.
    record(task, snapshot("t-1", "TASK_STATE_COMPLETED", ts="2026-01-01T00:00:09Z"), "poll")
    task.refresh_from_db()
    assert task.state == "TASK_STATE_COMPLETED"


def test_an_agents_entry_over_the_event_limit_is_a_protocol_error_not_kept(task, settings):
    """A stream's events are refused over WATCH_MAX_EVENT_BYTES as they are read; a GetTask or
    ListTasks reply (up to 32 MiB) was stored whole."""
    settings.WATCH_MAX_EVENT_BYTES = 4_000
    record(task, snapshot("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:00Z"), "poll")
    huge = snapshot("t-1", "TASK_STATE_COMPLETED", ts="2026-01-01T00:00:09Z")
    huge["task"]["metadata"] = {"blob": "m" * 5_000}
    result = record_many(task, [huge, status("t-1", "TASK_STATE_WORKING", text="fine")], "poll")
    assert result.kinds == ["protocol-error", "statusUpdate"]
    task.refresh_from_db()
    assert task.state == "TASK_STATE_WORKING" and task.metadata in (None, {})
    row = TaskEvent.objects.get(task=task, kind="protocol-error")
    assert "over the 4,000-byte limit (WATCH_MAX_EVENT_BYTES)" in row.note
    assert len(str(row.raw)) < 500


@pytest.mark.parametrize("part", [None, "text", 5, ["x"]])
def test_an_artifact_part_that_is_not_an_object_is_a_protocol_error(task, part):
    """A null part became SQL NULL in its row: the database refused it and the whole batch
    failed (a push drain lost its notifications, a watcher's turn ended in an error)."""
    record(task, snapshot("t-1", "TASK_STATE_WORKING"), "stream")
    bad = chunk("t-1", "ok", append=False, aid="a-n")
    bad["artifactUpdate"]["artifact"]["parts"].append(part)
    result = record_many(task, [bad, chunk("t-1", "fine", append=False, aid="a-2")], "stream")
    assert result.kinds == ["protocol-error", "artifactUpdate"]
    row = TaskEvent.objects.get(task=task, kind="protocol-error")
    assert "artifact.parts[1] is not an object" in row.note
    assert list(task.artifacts.values_list("artifact_id", flat=True)) == ["a-2"]


def test_a_refusal_redelivered_off_the_stream_is_logged_once(task):
    """A GetTask that reads the same illegal snapshot on every poll, or a push retried, wrote
    a protocol-error row each time; the holder's stream still logs each one it brings."""
    record(task, status("t-1", "TASK_STATE_COMPLETED"), "stream")
    illegal = snapshot("t-1", "TASK_STATE_WORKING")
    late = status("t-1", "TASK_STATE_FAILED")
    for channel in ("poll", "push"):
        for _ in range(3):
            record(task, illegal, channel)
            record(task, late, channel)
    record_many(task, [illegal, late, illegal, late], "poll")
    refusals = TaskEvent.objects.filter(task=task, kind="protocol-error")
    assert refusals.count() == 2
    record_many(task, [illegal, illegal], "stream")
    assert refusals.count() == 4


def test_a_snapshot_that_changes_only_the_metadata_is_applied(task):
    """A GetTask whose status and artifacts were the same as held was dropped as "nothing
    new" even when the agent had changed the task's metadata: the page showed the old."""
    first = snapshot("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:00Z")
    first["task"]["metadata"] = {"progress": 10}
    record(task, first, "poll")
    later = snapshot("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:00Z")
    later["task"]["metadata"] = {"progress": 60}
    result = record(task, later, "poll", gap_check=True)
    assert result.kinds == ["task"]  # news, not a gap: the status and artifacts are the same
    task.refresh_from_db()
    assert task_view(task)["metadata"] == {"progress": 60}
    # Again, or without metadata at all: nothing new.
    assert record(task, later, "poll").duplicate
    assert record(task, snapshot("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:00Z"),
                  "poll").duplicate  # fmt: skip
    task.refresh_from_db()
    assert task_view(task)["metadata"] == {"progress": 60}


def test_a_snapshot_that_renames_an_artifact_with_the_same_parts_is_applied(task):
    """The snapshot compared parts only: an artifact the agent renamed (or whose metadata it
    changed) at the end kept its old name in the mirror."""
    parts = [{"text": "body"}]
    first = snapshot("t-1", "TASK_STATE_WORKING",
                     [{"artifactId": "a-1", "name": "draft.md", "parts": parts}])  # fmt: skip
    record(task, first, "poll")
    renamed = snapshot("t-1", "TASK_STATE_WORKING", [{"artifactId": "a-1", "name": "report.md",
                       "metadata": {"final": True}, "parts": parts}])  # fmt: skip
    result = record(task, renamed, "poll", gap_check=True)
    assert result.kinds == ["task"]  # news, not a gap
    task.refresh_from_db()
    (artifact,) = task_view(task)["artifacts"]
    assert (artifact["name"], artifact["metadata"]) == ("report.md", {"final": True})
    assert artifact["parts"] == parts
    assert record(task, renamed, "poll").duplicate


def test_an_imported_tasks_first_snapshot_is_where_it_begins_not_a_gap(task):
    """An import made the row (remote id, no status yet) and recorded the listed task on
    ``poll``, where a snapshot that differs from the mirror of a streamed task is a gap: every
    imported task began with a red "the stream broke" entry, though no stream ever was (found
    by driving the dashboard). Later snapshots that differ are gaps as before; one with the
    same state says a status was missed, not "WORKING -> WORKING"."""
    RemoteTask.objects.filter(pk=task.pk).update(remote_id="t-9", watch=RemoteTask.Watch.STREAM)
    first = snapshot("t-9", "TASK_STATE_WORKING", ts="2026-01-01T00:00:00Z")
    assert record(task.pk, first, "poll").kinds == ["task"]
    later = snapshot("t-9", "TASK_STATE_WORKING", ts="2026-01-01T00:00:05Z")
    assert record(task.pk, later, "poll").kinds == ["gap", "task"]
    gap = TaskEvent.objects.get(task=task, kind="gap")
    # Read by a poll, not after a stream that broke (a refresh beside an open stream said so).
    assert gap.note == "not seen live; the events in between are not known: a status of " \
        "TASK_STATE_WORKING", gap.note  # fmt: skip
    ended = snapshot("t-9", "TASK_STATE_COMPLETED", ts="2026-01-01T00:00:09Z")
    assert record(task.pk, ended, "poll").kinds == ["gap", "task"]
    assert (
        TaskEvent.objects.filter(kind="gap")
        .order_by("seq")
        .last()
        .note.endswith("state TASK_STATE_WORKING -> TASK_STATE_COMPLETED")
    )


@pytest.mark.django_db(transaction=True)
def test_a_batch_too_small_for_copy_is_written_from_its_texts_too(task, monkeypatch):
    """A live stream's events come one by one, too few for COPY: the one INSERT writes each
    log row's and part row's JSON from the texts parsing and the chain wrote, on PostgreSQL
    as on SQLite, and every value reads back as it came."""
    from tasks_app.services import record as record_module
    from tasks_app.services.audit import verify

    written: list[tuple[str, int]] = []
    real = record_module._bulk_create_with_texts

    def watched(model, objs, batch_size, json_texts):
        written.append(
            (model.__name__, sum(t is not None for ts in json_texts.values() for t in ts))
        )
        return real(model, objs, batch_size, json_texts)

    monkeypatch.setattr(record_module, "_bulk_create_with_texts", watched)
    texts = ['say "hi"', "back\\slash", "é 漢字", "tab\tnew\nline", "\\u0041"]
    objs = [chunk("t-1", text, append=i > 0) for i, text in enumerate(texts)]
    objs[2]["artifactUpdate"]["metadata"] = {"n": [1, 2.5, None, True], "big": 2**70}
    for obj in objs:
        record(task.pk, obj, "stream")
    record_many(task.pk, [status("t-1", "TASK_STATE_WORKING", ts="2026-01-01T00:00:01Z")], "stream")
    stored = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("raw", flat=True))
    assert stored[: len(objs)] == objs and stored[-1]["statusUpdate"]["status"]["timestamp"]
    parts = ArtifactPart.objects.filter(artifact__task=task).order_by("index")
    assert [p.part for p in parts] == [o["artifactUpdate"]["artifact"]["parts"][0] for o in objs]
    assert verify(task).ok
    # Each row, log and part, went from its text; but the log row of the entry with an
    # integer past 64 bits, which the scan sends through the cleaning walk (serialized as
    # before). Its part has no such number: from its text too.
    assert [n for name, n in written if name == "TaskEvent"] == [1, 1, 0, 1, 1, 1]
    assert [n for name, n in written if name == "ArtifactPart"] == [1] * len(objs)
