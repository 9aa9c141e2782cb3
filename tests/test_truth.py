"""One truth per task: terminal is final, every chunk once, fenced writers, the hash chain, replay.

Each promise is tested in the order where it breaks: the same event twice,
events after the end, a writer whose lease moved on, a row edited in the
database. The property test drives random interleavings of every channel and
checks the log's invariants after each step, on whichever database the pass
runs (SQLite, then PostgreSQL).
"""

from __future__ import annotations

import io
import json
import threading

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.db import connections
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks_app.a2a import safejson
from tasks_app.models import Agent, ArtifactPart, RemoteTask, TaskEvent
from tasks_app.services import audit
from tasks_app.services import record as record_module
from tasks_app.services.audit import replay, verify
from tasks_app.services.chain import content_digest
from tasks_app.services.record import record, record_many, settle
from tasks_app.services.snapshot import task_document, task_view
from tests.examples import examples
from tests.people import member

pytestmark = pytest.mark.django_db

T = "t-1"


def status(state: str, text: str | None = None, mid: str = "", ts: str | None = None) -> dict:
    body: dict = {"state": state}
    if text:
        body["message"] = {
            "messageId": mid or f"m-{text}",
            "role": "ROLE_AGENT",
            "parts": [{"text": text}],
        }
    if ts:
        body["timestamp"] = ts
    return {"statusUpdate": {"taskId": T, "contextId": "c-1", "status": body}}


def chunk(text: str, *, append: bool = True, last: bool = False, aid: str = "a-1") -> dict:
    return {
        "artifactUpdate": {
            "taskId": T,
            "contextId": "c-1",
            "artifact": {"artifactId": aid, "parts": [{"text": text}]},
            "append": append,
            "lastChunk": last,
        }
    }


def snapshot(
    state: str, artifacts: list | None = None, history: list | None = None, text: str | None = None
) -> dict:
    task: dict = {
        "id": T,
        "contextId": "c-1",
        "status": status(state, text)["statusUpdate"]["status"],
    }
    if artifacts is not None:
        task["artifacts"] = artifacts
    if history is not None:
        task["history"] = history
    return task


def new_task(watch: str = RemoteTask.Watch.STREAM) -> RemoteTask:
    agent = Agent.objects.create(name="a", base_url=f"http://127.0.0.1:1/{Agent.objects.count()}")
    return RemoteTask.objects.create(agent=agent, title="t", watch=watch)


def kinds(task: RemoteTask) -> list[str]:
    return list(task.events.order_by("seq").values_list("kind", flat=True))


def artifact_texts(task: RemoteTask) -> list[str]:
    return [
        "".join(p.get("text", "") for p in a["parts"]) for a in task_view(task).get("artifacts", [])
    ]


def assert_sound(task: RemoteTask) -> None:
    """The invariants of every log: contiguous seqs, the chain verifies, replay equals view."""
    task.refresh_from_db()
    seqs = list(task.events.order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, task.last_seq + 1))
    checked = verify(task)
    assert checked.ok, str(checked)
    replayed = replay(task)
    assert replayed.ok, str(replayed)


def completed_task() -> RemoteTask:
    task = new_task()
    record_many(
        task,
        [
            {"task": snapshot("TASK_STATE_WORKING")},
            chunk("one", append=False),
            status("TASK_STATE_COMPLETED", "done"),
        ],
        "stream",
    )
    return task


# Terminal is final ------------------------------------------------------------------------------


def test_reconcile_once_then_the_task_is_settled():
    task = completed_task()
    agent_truth = snapshot(
        "TASK_STATE_COMPLETED",
        [{"artifactId": "a-1", "parts": [{"text": "one and more"}]}],
        text="done",
    )
    settle(task, agent_truth)
    task.refresh_from_db()
    assert task.settled_at is not None
    # The agent's content won, and the log says what was not seen live.
    assert artifact_texts(task) == ["one and more"]
    assert kinds(task)[-3:] == ["gap", "task", "system"]
    assert_sound(task)


@pytest.mark.parametrize(
    "late",
    [
        pytest.param(
            {
                "task": snapshot(
                    "TASK_STATE_COMPLETED",
                    [{"artifactId": "x", "parts": [{"text": "new"}]}],
                    text="done",
                )
            },
            id="snapshot-same-state-new-artifacts",
        ),
        pytest.param(
            {"task": {**snapshot("TASK_STATE_COMPLETED", text="done"), "metadata": {"k": "v"}}},
            id="snapshot-new-metadata",
        ),
        pytest.param(
            {"message": {"messageId": "late", "role": "ROLE_AGENT", "parts": [{"text": "late"}]}},
            id="late-message",
        ),
        pytest.param(
            status("TASK_STATE_COMPLETED", "a different final word"), id="same-state-status"
        ),
        pytest.param(status("TASK_STATE_WORKING"), id="leaving-terminal"),
        pytest.param(chunk("more"), id="chunk"),
    ],
)
@pytest.mark.parametrize("channel", ["stream", "poll", "push", "resubscribe"])
def test_nothing_changes_a_settled_task(late, channel):
    task = completed_task()
    settle(
        task,
        snapshot(
            "TASK_STATE_COMPLETED", [{"artifactId": "a-1", "parts": [{"text": "one"}]}], text="done"
        ),
    )
    task.refresh_from_db()
    before = task_view(task)
    result = record(task, late, channel)
    task.refresh_from_db()
    assert task_view(task) == before
    last = task.events.order_by("-seq").first()
    assert result.kinds == ["protocol-error"] and last.kind == "protocol-error"
    assert last.raw == late  # the agent's content is kept in the log
    assert_sound(task)


def test_an_equal_snapshot_after_the_end_appends_nothing():
    task = completed_task()
    settle(task, None, note="agent unreachable")
    task.refresh_from_db()
    same = task_view(task)
    assert record(task, {"task": same}, "poll").duplicate
    assert_sound(task)


def test_a_stream_task_finished_unwatched_shows_a_gap():
    task = new_task(watch=RemoteTask.Watch.STREAM)
    record_many(
        task,
        [{"task": snapshot("TASK_STATE_WORKING")}, status("TASK_STATE_WORKING", "progress 16/30")],
        "stream",
    )
    # No holder saw the rest; the next thing known is GetTask's completed task.
    record(task, {"task": snapshot("TASK_STATE_COMPLETED", text="progress 30/30")}, "poll")
    assert kinds(task)[-2:] == ["gap", "task"]
    gap = task.events.get(kind="gap")
    assert "TASK_STATE_WORKING -> TASK_STATE_COMPLETED" in gap.note
    assert_sound(task)


# Every chunk once -------------------------------------------------------------------------------


def test_a_chunk_from_another_channel_is_stored_once():
    task = new_task()
    record_many(
        task,
        [{"task": snapshot("TASK_STATE_WORKING")}, chunk("a", append=False), chunk("b")],
        "stream",
    )
    assert record(task, chunk("b"), "push").duplicate
    assert record(task, chunk("b"), "push").duplicate
    assert artifact_texts(task) == ["ab"]
    assert_sound(task)


def test_a_holder_stream_may_repeat_a_chunk():
    task = new_task()
    record_many(
        task,
        [
            {"task": snapshot("TASK_STATE_WORKING")},
            chunk("-", append=False),
            chunk("-"),
            chunk("-"),
        ],
        "stream",
    )
    assert artifact_texts(task) == ["---"]
    assert_sound(task)


def test_a_writer_whose_lease_moved_on_cannot_write():
    task = new_task()
    RemoteTask.objects.filter(pk=task.pk).update(lease_token="old")
    assert not record(task, {"task": snapshot("TASK_STATE_WORKING")}, "stream", fence="old").fenced
    RemoteTask.objects.filter(pk=task.pk).update(lease_token="new")  # another holder took over
    late = record(task, chunk("from the old holder", append=False), "stream", fence="old")
    assert late.fenced and late.duplicate
    assert record(task, chunk("from the new holder", append=False), "stream", fence="new").seqs
    assert artifact_texts(task) == ["from the new holder"]
    assert_sound(task)


# What tasks show --json says --------------------------------------------------------------------


def test_history_is_shown_as_getTask_shows_it():
    task = new_task()
    sent = {"messageId": "u-1", "role": "ROLE_USER", "parts": [{"text": "ask"}]}
    record(task, {"operator": {"action": "start", "message": sent}}, "operator")
    record_many(
        task,
        [
            {"task": snapshot("TASK_STATE_WORKING")},
            status("TASK_STATE_INPUT_REQUIRED", "What is your name?", mid="q-1"),
        ],
        "stream",
    )
    task.refresh_from_db()
    history = task_document(task)["snapshot"]["history"]
    # The question is the current status message: only in status.message, as GetTask shows it.
    assert [m["messageId"] for m in history] == ["u-1"]
    assert history[0]["taskId"] == T and history[0]["contextId"] == "c-1"
    record(task, status("TASK_STATE_WORKING"), "stream")
    task.refresh_from_db()
    assert [m["messageId"] for m in task_view(task)["history"]] == ["u-1", "q-1"]


# Text no database can hold ----------------------------------------------------------------------


@pytest.mark.parametrize("text", ["\ud800 lone", "nul \x00 here", "\u202e rtl \x07 bell"])
def test_any_string_an_agent_sends_is_stored(text):
    task = new_task()
    result = record_many(
        task,
        [{"task": snapshot("TASK_STATE_WORKING")}, status("TASK_STATE_WORKING", text)],
        "stream",
    )
    assert len(result.seqs) == 2
    task.refresh_from_db()
    stored = task.status_message["parts"][0]["text"]
    assert "\x00" not in stored and all(not 0xD800 <= ord(c) <= 0xDFFF for c in stored)
    if "\x00" in text or "\ud800" in text:
        assert "\ufffd" in stored and "replaced" in task.events.order_by("-seq").first().note
    else:
        assert stored == text  # controls and RTL overrides are kept as sent (escaped when shown)
    assert_sound(task)


# The chain --------------------------------------------------------------------------------------


def test_an_edited_row_breaks_the_chain_at_that_row():
    task = completed_task()
    assert verify(task).ok
    TaskEvent.objects.filter(task=task, seq=2).update(raw={"artifactUpdate": {"forged": True}})
    result = verify(task)
    assert not result.ok and result.broken_seq == 2
    out = io.StringIO()
    with pytest.raises(CommandError):
        call_command("audit", "verify", str(task.pk), stdout=out)
    assert "seq 2" in out.getvalue()


def test_a_deleted_row_breaks_the_chain():
    task = completed_task()
    TaskEvent.objects.filter(task=task, seq=2).delete()
    result = verify(task)
    assert not result.ok and result.broken_seq == 2 and "missing" in result.reason


def working_task() -> RemoteTask:
    task = new_task()
    record_many(
        task, [{"task": snapshot("TASK_STATE_WORKING")}, chunk("one", append=False)], "stream"
    )
    return task


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("when", ["before", "after"])
def test_verify_passes_while_the_task_records_between_its_reads(monkeypatch, when):
    """A row committed before or after verify reads the log is not a broken chain."""
    task = working_task()
    real_rows = audit._rows

    def rows_with_a_commit(task_pk: int, up_to: int | None = None):
        if when == "before":
            record(task_pk, chunk(" more"), "stream")
        yield from real_rows(task_pk, up_to)
        if when == "after":
            record(task_pk, chunk(" more"), "stream")

    monkeypatch.setattr(audit, "_rows", rows_with_a_commit)
    checked = verify(task)
    assert checked.ok, str(checked)
    assert checked.rows == 2 and TaskEvent.objects.filter(task=task).count() == 3
    monkeypatch.setattr(audit, "_rows", real_rows)
    assert_sound(task)


@pytest.mark.django_db(transaction=True)
def test_verify_still_finds_a_row_the_task_does_not_count():
    task = working_task()
    last = TaskEvent.objects.filter(task=task).order_by("-seq").first()
    RemoteTask.objects.filter(pk=task.pk).update(
        last_seq=1, last_hash=TaskEvent.objects.get(task=task, seq=1).hash
    )
    result = verify(task)
    assert not result.ok and result.broken_seq == last.seq and "row 2 too" in result.reason


@pytest.mark.django_db(transaction=True)
def test_replay_reads_one_moment_while_another_process_records(monkeypatch):
    """A commit landing after replay read the log's kinds does not show as a difference.

    The other writer is a thread with its own connection: on SQLite it waits for the
    replay's transaction; on PostgreSQL it commits and the replay does not see it.
    """
    task = working_task()
    real_contents = record_module.stored_contents
    writers: list[threading.Thread] = []

    def record_elsewhere() -> None:
        try:
            record(task.pk, status("TASK_STATE_COMPLETED", "done"), "stream")
        finally:
            connections.close_all()

    def contents_with_a_commit(task_pk: int):
        writer = threading.Thread(target=record_elsewhere)
        writers.append(writer)
        writer.start()
        writer.join(timeout=1)  # done on PostgreSQL; waiting for our transaction on SQLite
        return real_contents(task_pk)

    monkeypatch.setattr(record_module, "stored_contents", contents_with_a_commit)
    replayed = replay(task)
    writers[0].join(timeout=30)
    assert not writers[0].is_alive()
    assert replayed.ok, str(replayed)
    task.refresh_from_db()
    assert task.state == "TASK_STATE_COMPLETED" and task.last_seq == 3
    monkeypatch.setattr(record_module, "stored_contents", real_contents)
    assert_sound(task)


def test_audit_commands_pass_on_a_sound_log():
    task = completed_task()
    out = io.StringIO()
    call_command("audit", "verify", "--all", stdout=out)
    call_command("audit", "replay", str(task.pk), stdout=out)
    assert "every task passed the verify" in out.getvalue() and "equals the view" in out.getvalue()


def test_the_pages_say_whether_the_chain_verifies(client):
    user = member(get_user_model().objects.create_user("auditor", password="pw-123456789"))
    client.force_login(user)
    task = completed_task()
    assert "Hash chain verifies" in client.get(f"/tasks/{task.pk}/").content.decode()
    assert "Hash chain verifies" in client.get(f"/tasks/{task.pk}/events/").content.decode()
    TaskEvent.objects.filter(task=task, seq=3).update(note="edited")
    page = client.get(f"/tasks/{task.pk}/").content.decode()
    assert "Hash chain broken at seq 3" in page
    assert "Hash chain broken at seq 3" in client.get(f"/tasks/{task.pk}/events/").content.decode()


def test_the_admin_cannot_change_the_record(admin_client):
    task = completed_task()
    event = task.events.first()
    assert admin_client.get(f"/admin/tasks_app/taskevent/{event.pk}/change/").status_code == 200
    assert (
        admin_client.post(
            f"/admin/tasks_app/taskevent/{event.pk}/delete/", {"post": "yes"}
        ).status_code
        == 403
    )
    admin_client.post(
        f"/admin/tasks_app/taskevent/{event.pk}/change/", {"note": "forged", "seq": 1}
    )
    assert admin_client.get("/admin/tasks_app/taskevent/add/").status_code == 403
    for model in ("remotetask", "artifact", "conversationmessage", "operatoraction"):
        assert admin_client.get(f"/admin/tasks_app/{model}/add/").status_code == 403
    event.refresh_from_db()
    assert event.note != "forged" and TaskEvent.objects.filter(pk=event.pk).exists()
    assert verify(task).ok


# Random interleavings ---------------------------------------------------------------------------

STATES = [
    "TASK_STATE_WORKING",
    "TASK_STATE_INPUT_REQUIRED",
    "TASK_STATE_COMPLETED",
    "TASK_STATE_FAILED",
]
CHANNELS = ["stream", "resubscribe", "poll", "push", "operator", "system"]

entries = st.one_of(
    st.builds(
        lambda s, t: status(s, t), st.sampled_from(STATES), st.sampled_from([None, "a", "b"])
    ),
    st.builds(
        lambda t, append, last, aid: chunk(t, append=append, last=last, aid=aid),
        st.sampled_from(["x", "y", "\ud800", "z\x00"]),
        st.booleans(),
        st.booleans(),
        st.sampled_from(["a-1", "a-2"]),
    ),
    st.builds(
        lambda s, arts: {
            "task": snapshot(s, [{"artifactId": "a-1", "parts": [{"text": t}]} for t in arts])
        },
        st.sampled_from(STATES),
        st.lists(st.sampled_from(["x", "xy"]), max_size=1),
    ),
    st.builds(
        lambda m: {"message": {"messageId": m, "role": "ROLE_AGENT", "parts": [{"text": m}]}},
        st.sampled_from(["m1", "m2"]),
    ),
    st.just({"system": {"event": "note", "detail": "a system note"}}),
    st.just({"operator": {"action": "refresh"}}),
    st.just({"settle": True}),
    st.just(["not", "an", "object"]),
)


@pytest.mark.slow  # hypothesis, each example on the database
@settings(
    max_examples=examples(40),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    steps=st.lists(
        st.tuples(entries, st.sampled_from(CHANNELS), st.sampled_from(["A", "B"])),
        min_size=1,
        max_size=14,
    )
)
def test_random_interleavings_keep_every_promise(steps):
    """Two writers (holders A and B, fenced by the lease) and every channel, in random order."""
    task = new_task()
    RemoteTask.objects.filter(pk=task.pk).update(lease_token="A")
    settled_view = None
    for i, (obj, channel, writer) in enumerate(steps):
        if i == len(steps) // 2:
            RemoteTask.objects.filter(pk=task.pk).update(lease_token="B")  # B takes the lease over
        fence = writer if channel in ("stream", "resubscribe") else None
        if obj == {"settle": True}:
            task.refresh_from_db()
            settle(task, task_view(task) if task.remote_id else None, fence=fence)
        else:
            digest, _ = content_digest(safejson.clean(obj)[0])
            known_chunk = task.events.filter(kind="artifactUpdate", digest=digest).exists()
            result = record(task, obj, channel, fence=fence)
            task.refresh_from_db()
            if fence is not None and fence != task.lease_token:
                assert result.fenced and result.duplicate
            if known_chunk and channel not in ("stream", "resubscribe"):
                assert result.duplicate, "a chunk already in the log was stored again"
        task.refresh_from_db()
        if settled_view is not None:
            assert task_view(task) == settled_view, "a settled task changed"
        elif task.settled_at is not None:
            settled_view = task_view(task)
        assert_sound(task)


def test_a_batch_folds_as_the_same_entries_one_by_one():
    """A chunk and then a snapshot without it, in one batch: the snapshot still removes it."""
    one, batch = new_task(), new_task()
    entries = [chunk("x", append=False), {"task": snapshot("TASK_STATE_WORKING", [])}]
    for entry in entries:
        record(one, entry, "poll")
    record_many(batch, entries, "poll")
    assert task_view(one) == task_view(batch) and "artifacts" not in task_view(batch)
    assert_sound(batch)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(["\ud800", "a\x00b", "\udfff\ud800", "\u202e"]),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=20,
)


@pytest.mark.slow  # hypothesis, each example on the database
@settings(
    max_examples=examples(60),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(value=json_values)
def test_any_json_an_agent_sends_is_stored_and_keeps_the_chain(value):
    """Huge floats, -0.0, big integers, NaN, lone surrogates, NUL: stored, read back, chain intact."""
    task = new_task()
    result = record(
        task, {"task": {**snapshot("TASK_STATE_WORKING"), "metadata": {"v": value}}}, "poll"
    )
    assert result.seqs == [1]
    assert verify(task).ok, str(verify(task))


# Big contents, stored once ----------------------------------------------------------------------


def stored_chars(task: RemoteTask) -> tuple[int, int]:
    """Characters of the log's raw JSON and of the part rows, as stored."""
    log_chars = sum(len(json.dumps(raw)) for raw in task.events.values_list("raw", flat=True))
    part_chars = sum(
        len(json.dumps(part))
        for part in ArtifactPart.objects.filter(artifact__task=task).values_list("part", flat=True)
    )
    return log_chars, part_chars


def test_a_status_stamped_ahead_of_the_clock_replays_as_it_was_recorded_a_day_later(
    monkeypatch,
):
    """A status more than CLOCK_AHEAD ahead of the clock is folded as unstamped; a replay
    judged it against the clock at replay time, when the same stamp was in the past, and
    the later status it had let through was "older" there: the replay differed."""
    from datetime import timedelta

    from django.utils import timezone

    task = new_task()
    now = timezone.now()

    def stamp(minutes: int) -> str:
        return (now + timedelta(minutes=minutes)).isoformat().replace("+00:00", "Z")

    record(task, {"task": snapshot("TASK_STATE_WORKING")}, "stream")
    record(task, status("TASK_STATE_WORKING", "ahead", ts=stamp(30)), "stream")
    record(task, status("TASK_STATE_COMPLETED", "done", ts=stamp(1)), "stream")
    task.refresh_from_db()
    assert task.state == "TASK_STATE_COMPLETED"
    assert_sound(task)
    later = now + timedelta(days=1)
    monkeypatch.setattr(timezone, "now", lambda: later)
    replayed = replay(task)
    assert replayed.ok, str(replayed)


def test_a_task_that_ended_while_its_question_waited_no_longer_says_it_waits():
    """Canceled, or found ended by a refresh, while its question waited: settled and idle,
    its note still said "waiting for an answer" (a soak run: 10 tasks)."""
    from tasks_app.services.record import WAITING_FOR_ANSWER, settle_if_ended

    task = new_task()
    record(task, {"task": snapshot("TASK_STATE_INPUT_REQUIRED")}, "stream")
    RemoteTask.objects.filter(pk=task.pk).update(
        watcher_status=RemoteTask.WatcherStatus.IDLE, watcher_note=WAITING_FOR_ANSWER
    )
    ended = snapshot("TASK_STATE_CANCELED")
    record(task, {"task": ended}, "operator")
    settle_if_ended(task, ended, note="reconciled with the agent's answer to CancelTask")
    task.refresh_from_db()
    assert task.settled_at is not None
    assert (task.watcher_status, task.watcher_note) == ("idle", "task ended")


def test_a_big_chunk_is_stored_once_and_the_log_still_replays():
    task = new_task()
    big = "x" * 1_000_000
    record_many(
        task,
        [{"task": snapshot("TASK_STATE_WORKING")}, chunk(big, append=False), chunk("tail")],
        "stream",
    )
    row = task.events.get(kind="artifactUpdate", seq=2)
    (part,) = row.raw["artifactUpdate"]["artifact"]["parts"]
    assert "text" not in part and part["$stored"]["chars"] == 1_000_000
    assert "stored once" in row.note
    log_chars, part_chars = stored_chars(task)
    assert log_chars < 10_000 and 1_000_000 <= part_chars < 1_010_000
    assert artifact_texts(task) == [big + "tail"]
    # The same big chunk pushed again is recognized (by its content, not its reference).
    assert record(task, chunk(big, append=False), "push").duplicate
    assert_sound(task)
    # Superseded by the agent's snapshot: the reference stays in the log, replay still agrees.
    record(
        task,
        {
            "task": snapshot(
                "TASK_STATE_WORKING", [{"artifactId": "a-1", "parts": [{"text": "short"}]}]
            )
        },
        "poll",
    )
    assert artifact_texts(task) == ["short"]
    assert_sound(task)


def test_a_big_artifact_in_a_snapshot_is_stored_once():
    task = new_task()
    big = "y" * 300_000
    record(
        task,
        {"task": snapshot("TASK_STATE_COMPLETED", [{"artifactId": "r", "parts": [{"text": big}]}])},
        "poll",
    )
    log_chars, part_chars = stored_chars(task)
    assert log_chars < 5_000 and part_chars >= 300_000
    assert artifact_texts(task) == [big]
    assert_sound(task)


def test_a_task_already_mirrored_by_another_row_is_not_adopted_twice():
    """An import listed the task first; the send's reply then names the same task."""
    agent = Agent.objects.create(name="dup", base_url="http://127.0.0.1:1/dup")
    imported = RemoteTask.objects.create(agent=agent, remote_id=T, phase="task", mode="imported")
    ours = RemoteTask.objects.create(agent=agent, title="ours")
    result = record(ours, {"task": snapshot("TASK_STATE_WORKING")}, "send-response")
    assert (
        result.kinds == ["protocol-error"]
        and f"already mirrored as #{imported.pk}" in result.notes[0]
    )
    ours.refresh_from_db()
    assert ours.remote_id == "" and imported.remote_id == T


def test_our_start_entry_gives_the_task_its_context():
    task = new_task()
    message = {
        "messageId": "u-1",
        "role": "ROLE_USER",
        "contextId": "ours-1",
        "parts": [{"text": "hi"}],
    }
    record(task, {"operator": {"action": "start", "message": message}}, "operator")
    task.refresh_from_db()
    assert task.context_id == "ours-1" and task.remote_id == ""
    assert_sound(task)


def test_an_import_that_lists_our_unanswered_send_records_into_our_row(monkeypatch):
    from tasks_app.models import ImportJob
    from tasks_app.services import imports

    monkeypatch.setattr(imports, "dispatch", lambda pk: None)  # no watcher messages into the broker
    task = new_task()
    message = {
        "messageId": "u-1",
        "role": "ROLE_USER",
        "contextId": "ours-2",
        "parts": [{"text": "hi"}],
    }
    record(task, {"operator": {"action": "start", "message": message}}, "operator")
    job = ImportJob.objects.create(agent=task.agent)
    listed = {
        **snapshot("TASK_STATE_WORKING"),
        "contextId": "ours-2",
        "history": [{**message, "taskId": T}],
    }
    imports._record_page(job, [listed])
    task.refresh_from_db()
    assert (task.remote_id, job.created) == (T, 0)
    assert RemoteTask.objects.filter(agent=task.agent).count() == 1
    # The send's reply, recorded a moment later, is the same task: nothing new, no conflict.
    assert record(task, {"task": listed}, "send-response").duplicate
    assert_sound(task)


def test_an_import_of_an_ended_task_settles_it(monkeypatch):
    from tasks_app.models import ImportJob
    from tasks_app.services import imports

    monkeypatch.setattr(imports, "dispatch", lambda pk: None)
    agent = Agent.objects.create(name="imp", base_url="http://127.0.0.1:1/imp")
    job = ImportJob.objects.create(agent=agent)
    listed = snapshot("TASK_STATE_COMPLETED", [{"artifactId": "r", "parts": [{"text": "done"}]}])
    imports._record_page(job, [listed])
    imports._record_page(job, [listed])  # listed again: nothing new
    task = RemoteTask.objects.get(agent=agent, remote_id=T)
    assert task.settled_at is not None and kinds(task) == ["task", "system"]
    assert_sound(task)


def test_a_recently_ended_unsettled_task_is_watched_once_more():
    from tasks_app.services.tasks import watchable

    task = completed_task()  # ended on the stream; its holder stopped before settling
    assert RemoteTask.objects.filter(watchable(), pk=task.pk).exists()
    settle(task, None, note="test")
    assert not RemoteTask.objects.filter(watchable(), pk=task.pk).exists()


def test_a_person_who_acted_cannot_be_deleted_and_the_chain_stays_whole(client):
    """The actor is part of each row's hash: deleting a person (the admin's Delete) set
    their rows' actor to NULL, and verify then said the chain was broken, for a routine
    admin action. People who acted are kept (deactivated instead); the admin says why."""
    from django.db.models import ProtectedError

    from tasks_app.models import OperatorAction

    ann = get_user_model().objects.create_user("ann")
    task = new_task()
    record(task, {"task": snapshot("TASK_STATE_WORKING")}, "stream")
    record(task, {"operator": {"action": "cancel", "reason": "r"}}, "operator", actor_id=ann.pk)
    OperatorAction.objects.create(task=task, agent=task.agent, actor=ann, action="cancel")
    assert verify(task).ok
    with pytest.raises(ProtectedError):
        ann.delete()
    root = get_user_model().objects.create_superuser("root")
    client.force_login(root)
    page = client.post(f"/admin/auth/user/{ann.pk}/delete/", {"post": "yes"})
    assert page.status_code == 200 and "Cannot delete user" in page.content.decode()
    assert get_user_model().objects.filter(pk=ann.pk).exists()
    assert verify(task).ok
    assert TaskEvent.objects.get(task=task, kind="operator").actor_id == ann.pk
