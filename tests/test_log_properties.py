"""The invariants of a task's log, as properties over generated entries and channels.

Each property records generated entries through ``record()`` / ``record_many()`` on the
database the pass runs (SQLite, then PostgreSQL) and checks what docs/architecture.md
("One truth per task") promises: a batch folds as its entries one by one, seqs are
contiguous, the chain verifies and a replay equals the view, a redelivery on a
non-holder channel stores nothing, a settled task never changes, channels interleaved
never roll the status back, and any content an agent sends is stored and reads back.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks_app.a2a import normalize, safejson
from tasks_app.models import Agent, Artifact, ConversationMessage, RemoteTask
from tasks_app.services import record as record_module
from tasks_app.services.audit import replay, verify, view_of
from tasks_app.services.record import Batch, record, record_many, settle
from tasks_app.services.snapshot import task_view
from tests.examples import examples
from tests.test_truth import assert_sound  # contiguous seqs, the chain verifies, replay = view

pytestmark = pytest.mark.django_db

T = "t-1"
STATES = [
    "TASK_STATE_SUBMITTED",
    "TASK_STATE_WORKING",
    "TASK_STATE_INPUT_REQUIRED",
    "TASK_STATE_AUTH_REQUIRED",
    "TASK_STATE_COMPLETED",
    "TASK_STATE_CANCELED",
]
TIMES = [None, "2026-01-01T00:00:01Z", "2026-01-01T00:00:02Z", "2026-01-01T00:00:03+01:00"]
AIDS = ["a-1", "a-2"]
MIDS = ["m-1", "m-2", "m-3"]


def on_database(count: int) -> settings:
    """Settings for a property whose examples each write to the database (in the fast tier,
    a quarter of them, at least 8 rather than 20: these are the tier's slowest properties)."""
    return settings(
        max_examples=examples(count, fewest=8),
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


def message(mid: str, text: str = "hi", role: str = "ROLE_AGENT") -> dict:
    return {"messageId": mid, "role": role, "parts": [{"text": text}]}


def status_body(state: str, mid: str | None, ts: str | None) -> dict:
    body: dict[str, Any] = {"state": state}
    if mid:
        body["message"] = message(mid, f"says {mid}")
    if ts:
        body["timestamp"] = ts
    return body


def status(state: str, mid: str | None = None, ts: str | None = None) -> dict:
    return {
        "statusUpdate": {"taskId": T, "contextId": "c-1", "status": status_body(state, mid, ts)}
    }


def chunk(aid: str, texts: list[str], *, append: bool, last: bool, name: str | None = None) -> dict:
    artifact: dict[str, Any] = {"artifactId": aid, "parts": [{"text": t} for t in texts]}
    if name:
        artifact["name"] = name
    update = {"taskId": T, "contextId": "c-1", "artifact": artifact}
    return {"artifactUpdate": {**update, "append": append, "lastChunk": last}}


def snapshot(
    state: str,
    artifacts: dict[str, list[str] | tuple[list[str], str | None]],
    history: list[str],
    mid: str | None,
    ts: str | None,
) -> dict:
    """``artifacts``: each artifact's texts, or its texts and its name."""
    task: dict[str, Any] = {"id": T, "contextId": "c-1", "status": status_body(state, mid, ts)}
    if artifacts:
        task["artifacts"] = []
        for aid, held in artifacts.items():
            texts, name = held if isinstance(held, tuple) else (held, None)
            artifact: dict[str, Any] = {"artifactId": aid, "parts": [{"text": t} for t in texts]}
            if name:
                artifact["name"] = name
            task["artifacts"].append(artifact)
    if history:
        task["history"] = [message(m) for m in history]
    return {"task": task}


texts = st.lists(st.sampled_from(["x", "y", "z\x00", "\ud800"]), min_size=0, max_size=2)
statuses = st.builds(
    status,
    st.sampled_from(STATES),
    st.sampled_from([None, *MIDS]),
    st.sampled_from(TIMES),
)
chunks = st.builds(
    lambda aid, parts, append, last, name: chunk(aid, parts, append=append, last=last, name=name),
    st.sampled_from(AIDS),
    texts,
    st.booleans(),
    st.booleans(),
    st.sampled_from([None, "n1", "n2"]),
)
snapshots = st.builds(
    snapshot,
    st.sampled_from(STATES),
    st.dictionaries(
        st.sampled_from(AIDS), st.tuples(texts, st.sampled_from([None, "n1", "n2"])), max_size=2
    ),
    st.lists(st.sampled_from(MIDS), max_size=2, unique=True),
    st.sampled_from([None, *MIDS]),
    st.sampled_from(TIMES),
)
messages = st.builds(lambda mid: {"message": message(mid)}, st.sampled_from(MIDS))
agent_entries = st.one_of(statuses, chunks, snapshots, messages)
own_entries = st.sampled_from(
    [
        {"system": {"event": "note", "detail": "a note"}},
        {"system": {"event": "settled", "detail": "settled"}},
        {"operator": {"action": "refresh"}},
        ["not", "an", "object"],
        {"statusUpdate": {"taskId": "other", "status": {"state": "TASK_STATE_WORKING"}}},
    ]
)
entries = st.one_of(agent_entries, agent_entries, agent_entries, own_entries)


def new_task(watch: str = RemoteTask.Watch.STREAM) -> RemoteTask:
    agent = Agent.objects.create(name="a", base_url=f"http://127.0.0.1:1/{Agent.objects.count()}")
    return RemoteTask.objects.create(agent=agent, title="t", watch=watch)


def log_rows(task: RemoteTask) -> list[tuple]:
    """The log as the chain sees it, without the time of day (each task records at its own)."""
    return list(
        task.events.order_by("seq").values_list(
            "seq", "channel", "kind", "note", "state_after", "state_changed", "digest", "raw"
        )
    )


def mirror(task: RemoteTask) -> dict[str, Any]:
    """Everything a fold writes, but times: the view, bookkeeping and the rows behind them."""
    task.refresh_from_db()
    artifacts = [
        (
            a.artifact_id,
            a.name,
            a.description,
            a.position,
            a.complete,
            a.part_count,
            a.digest,
            a.metadata,
            a.updated_seq,
            [(p.index, p.part, p.seq) for p in a.parts.order_by("index")],
        )
        for a in Artifact.objects.filter(task=task).order_by("artifact_id")
    ]
    conversation = list(
        ConversationMessage.objects.filter(task=task)
        .order_by("seq", "message_id")
        .values_list("message_id", "role", "message", "seq")
    )
    return {
        "view": view_of(task),
        "artifacts": artifacts,
        "conversation": conversation,
        "facts": (
            task.remote_id,
            task.context_id,
            task.phase,
            task.state,
            task.status_message,
            task.status_timestamp,
            task.metadata,
            task.last_seq,
            task.asked_seq,
            task.answered_seq,
            task.asked_at is not None,
            task.question_since is not None,
            task.settled_at is not None,
            task.stored_bytes,
        ),
    }


def a_wait_after_the_log_rows(execute, sql, params, many, context):
    """An ``execute_wrapper``: after a call's log rows, a statement the server takes 3 ms
    over (PostgreSQL), so that the work ahead gets a wait to be done in."""
    result = execute(sql, params, many, context)
    if sql.startswith('INSERT INTO "tasks_app_taskevent"') and connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_sleep(0.003)")
    return result


def batches(items: list, cuts: list[int]) -> list[list]:
    """``items`` cut before each index in ``cuts``."""
    edges = [0, *sorted({c for c in cuts if 0 < c < len(items)}), len(items)]
    return [items[a:b] for a, b in itertools.pairwise(edges)]


# A batch folds as its entries one by one -------------------------------------------------------


@on_database(80)
@given(
    objs=st.lists(entries, min_size=1, max_size=10),
    channel=st.sampled_from(["stream", "resubscribe", "poll", "push", "send-response"]),
    cuts=st.lists(st.integers(min_value=1, max_value=9), max_size=4),
)
def test_any_split_into_batches_folds_as_one_by_one(objs, channel, cuts):
    """One record_many, any split into batches and one record() each: the same log and mirror.
    So too when each call is given the next as ``ahead`` (a watcher's calls): on PostgreSQL
    that batch is parsed and folded while the call waits on the database (a wait of a few
    milliseconds is made after the log rows), and taken when it holds."""
    one, whole, split, parsed_ahead = new_task(), new_task(), new_task(), new_task()
    for obj in objs:
        record(one, obj, channel)
    record_many(whole, objs, channel)
    for batch in batches(objs, cuts):
        record_many(split, batch, channel)
    calls = [Batch(batch) for batch in batches(objs, cuts)]
    with connection.execute_wrapper(a_wait_after_the_log_rows):
        for call, ahead in itertools.zip_longest(calls, calls[1:]):
            record_many(parsed_ahead, call, channel, ahead=ahead)
    expected = (log_rows(one), mirror(one))
    assert (log_rows(whole), mirror(whole)) == expected
    assert (log_rows(split), mirror(split)) == expected
    assert (log_rows(parsed_ahead), mirror(parsed_ahead)) == expected
    assert_sound(whole)


@on_database(60)
@given(
    objs=st.lists(entries, min_size=1, max_size=10),
    channel=st.sampled_from(["stream", "poll", "push"]),
    cuts=st.lists(st.integers(min_value=1, max_value=9), max_size=3),
    budget=st.integers(min_value=0, max_value=1500),
    inline=st.integers(min_value=0, max_value=3),
)
def test_batches_fold_alike_at_the_byte_budget_and_with_content_stored_once(
    objs, channel, cuts, budget, inline
):
    """The same, with a budget the entries pass and content stored once by reference."""
    with override_settings(BUDGET_TASK_BYTES=budget, INLINE_CONTENT_BYTES=inline):
        one, split = new_task(), new_task()
        for obj in objs:
            record(one, obj, channel)
        for batch in batches(objs, cuts):
            record_many(split, batch, channel)
        assert (log_rows(split), mirror(split)) == (log_rows(one), mirror(one))
        # Not replayed: content stored once is lost when its artifact is replaced (see
        # test_content_stored_once_outlives_the_artifacts_replacement), and replay then differs.
        assert verify(split).ok


def test_an_entry_the_mirror_holds_costs_no_bytes_in_a_batch_either():
    """Recorded alone, a known message writes nothing, so its bytes were never counted."""
    one, batch = new_task(), new_task()
    hello = {"message": message("m-1")}
    record(one, hello, "push")
    record(one, hello, "push")
    record_many(batch, [hello, hello], "push")
    one.refresh_from_db()
    batch.refresh_from_db()
    assert batch.stored_bytes == one.stored_bytes == len(json.dumps(hello, separators=(",", ":")))


def test_a_chunk_pushed_twice_after_the_end_is_logged_once_in_a_batch_too():
    x = chunk("a-1", ["x"], append=False, last=False)
    one, batch = new_task(), new_task()
    for obj in (status("TASK_STATE_COMPLETED"), x, x):
        record(one, obj, "push")
    record_many(batch, [status("TASK_STATE_COMPLETED"), x, x], "push")
    assert [row[2] for row in log_rows(batch)] == ["statusUpdate", "protocol-error"]
    assert log_rows(batch) == log_rows(one)


def test_a_snapshots_artifacts_are_complete_by_its_own_state_not_the_batchs_last():
    objs = [snapshot("TASK_STATE_WORKING", {"a-1": ["x"]}, [], None, None)]
    objs.append(status("TASK_STATE_COMPLETED"))
    one, batch = new_task(), new_task()
    for obj in objs:
        record(one, obj, "poll")
    record_many(batch, objs, "poll")
    assert Artifact.objects.get(task=one).complete is False
    assert Artifact.objects.get(task=batch).complete is False


def test_artifacts_keep_distinct_places_in_the_snapshots_order():
    """An artifact a snapshot keeps unchanged takes the snapshot's place too: two artifacts at
    one position made the view's order (and so replay on PostgreSQL) a matter of chance."""
    task = new_task()
    record(task, chunk("a-2", ["y"], append=False, last=False), "stream")
    record(
        task, snapshot("TASK_STATE_WORKING", {"a-1": ["x"], "a-2": ["y"]}, [], None, None), "poll"
    )
    task.refresh_from_db()
    held = Artifact.objects.filter(task=task).order_by("artifact_id")
    assert list(held.values_list("artifact_id", "position")) == [("a-1", 0), ("a-2", 1)]
    assert [a["artifactId"] for a in task_view(task)["artifacts"]] == ["a-1", "a-2"]
    record(task, chunk("a-3", ["z"], append=False, last=False), "stream")
    assert sorted(Artifact.objects.filter(task=task).values_list("position", flat=True)) == [
        0,
        1,
        2,
    ]
    assert_sound(task)


# Every log is sound, whatever the channels ---------------------------------------------------


@on_database(60)
@given(
    steps=st.lists(
        st.tuples(
            st.lists(entries, min_size=1, max_size=3),
            st.sampled_from(["stream", "resubscribe", "poll", "push", "operator", "system"]),
        ),
        min_size=1,
        max_size=8,
    ),
    watch=st.sampled_from([RemoteTask.Watch.STREAM, RemoteTask.Watch.POLL]),
)
def test_every_log_is_contiguous_verifies_and_replays(steps, watch):
    task = new_task(watch)
    for objs, channel in steps:
        record_many(task, objs, channel)
        assert_sound(task)


# A redelivery on a channel that is not the holder's stores nothing ---------------------------


@on_database(80)
@given(
    before=st.lists(st.tuples(agent_entries, st.sampled_from(["stream", "poll", "push"]))),
    obj=agent_entries,
    channel=st.sampled_from(["poll", "push"]),
)
def test_the_same_entry_again_on_push_or_poll_stores_nothing(before, obj, channel):
    """A redelivery never changes the mirror and appends nothing: one the mirror took is
    known, and one it refused (a status after the end, say) was logged once already."""
    task = new_task()
    for earlier, earlier_channel in before:
        record(task, earlier, earlier_channel)
    first = record(task, obj, channel)
    seen = mirror(task)
    again = record(task, obj, channel)
    now = mirror(task)
    for key in ("view", "artifacts", "conversation"):
        assert now[key] == seen[key], f"a redelivery changed the {key}"
    assert again.duplicate, f"{first.kinds} {first.notes}, then again: {again.kinds} {again.notes}"
    assert now == seen, "a redelivery changed the task's bookkeeping"


@on_database(40)
@given(objs=st.lists(chunks, min_size=1, max_size=5))
def test_a_holder_stream_takes_every_chunk_it_brings(objs):
    """On the holder's channels each chunk is taken, repeated or not (``_seen_chunk``)."""
    twice, once = new_task(), new_task()
    for obj in objs:
        record(once, obj, "stream")
    record_many(twice, [obj for obj in objs for _ in (1, 2)], "stream")
    # Each chunk's second delivery is applied again: appending doubles parts, replacing does not.
    assert len(log_rows(twice)) == 2 * len(log_rows(once))
    for artifact in mirror(twice)["artifacts"]:
        assert artifact[5] == len(artifact[9])  # part_count counts the part rows


@pytest.mark.parametrize("how", ["one by one", "in one batch", "by a snapshot"])
def test_content_stored_once_outlives_the_artifacts_replacement(how):
    """A big chunk's log row keeps a reference to its part row; a later chunk that replaced the
    artifact (or a snapshot without it) deleted that row, and the content the agent sent was
    in the database no more: ``audit replay`` could not put it back."""
    task = new_task()
    big = chunk("a-1", ["x" * 10], append=False, last=False)
    again = chunk("a-1", ["y"], append=False, last=False)
    snapshot = {"task": {"id": "t-1", "contextId": "c-1", "status": {"state": "TASK_STATE_WORKING"},
                         "artifacts": [{"artifactId": "a-2", "parts": [{"text": "z"}]}]}}  # fmt: skip
    with override_settings(INLINE_CONTENT_BYTES=4):
        if how == "in one batch":
            record_many(task, [big, again], "stream")
        else:
            record(task, big, "stream")
            record(task, again if how == "one by one" else snapshot, "poll")
    first = task.events.get(seq=1).raw
    assert "$stored" in json.dumps(first)  # stored by reference indeed
    assert record_module.with_content(first, record_module.stored_contents(task.pk)) == big
    with override_settings(INLINE_CONTENT_BYTES=4):
        replayed = replay(task)
    assert replayed.ok, str(replayed)


def test_a_snapshot_read_before_the_last_chunks_does_not_drop_them():
    """A ListTasks page (recorded on poll) read while the stream went on, between two chunks
    of one status: the status timestamps are equal, so it was applied and c1 was lost (a gap
    row said so); the next streamed append then landed after c0."""
    task = new_task()
    record(task, status("TASK_STATE_WORKING", ts="2026-01-01T00:00:01Z"), "stream")
    record(task, chunk("a-1", ["c0"], append=False, last=False), "stream")
    record(task, chunk("a-2", ["d0"], append=False, last=False), "stream")
    record(task, chunk("a-1", ["c1"], append=True, last=False), "stream")
    # Read before c1 and before a-2 was made: a-1 is only its beginning, a-2 is not there.
    stale = snapshot("TASK_STATE_WORKING", {"a-1": ["c0"]}, [], None, "2026-01-01T00:00:01Z")
    result = record(task, stale, "poll")
    assert result.kinds == ["task"] and "older than the artifacts" in result.notes[0]
    record(task, chunk("a-1", ["c2"], append=True, last=False), "stream")
    task.refresh_from_db()
    view = task_view(task)["artifacts"]
    assert [[p["text"] for p in a["parts"]] for a in view] == [["c0", "c1", "c2"], ["d0"]]
    assert not task.events.filter(kind="gap").exists()
    # What the snapshot shows beyond the mirror (a chunk it lacks) is news, as before.
    news = snapshot("TASK_STATE_WORKING", {"a-1": ["c0", "x"]}, [], None, "2026-01-01T00:00:01Z")
    assert record(task, news, "poll").kinds == ["gap", "task"]  # not seen live: a gap
    task.refresh_from_db()
    assert [p["text"] for p in task_view(task)["artifacts"][0]["parts"]] == ["c0", "x"]


@pytest.mark.parametrize("batched", [False, True])
def test_a_chunk_a_getTask_already_showed_is_not_doubled(batched):
    """The push drain reads GetTask once notifications pause; one the agent sent meanwhile is
    recorded after it. The snapshot held c2 already, and the push appended it again."""
    task = new_task(RemoteTask.Watch.POLL)
    record(task, chunk("a-1", ["c0"], append=False, last=False), "push")
    record(task, chunk("a-1", ["c1"], append=True, last=False), "push")
    shown = snapshot("TASK_STATE_WORKING", {"a-1": ["c0", "c1", "c2"]}, [], None, None)
    late = chunk("a-1", ["c2"], append=True, last=False)
    if batched:
        record_many(task, [shown, late], "poll")
    else:
        record(task, shown, "poll")
        record(task, late, "push")
    # A chunk the snapshot did not show is appended as ever.
    record(task, chunk("a-1", ["c3"], append=True, last=False), "push")
    task.refresh_from_db()
    parts = [p["text"] for p in task_view(task)["artifacts"][0]["parts"]]
    assert parts == ["c0", "c1", "c2", "c3"]
    assert_sound(task)


# A settled task never changes ----------------------------------------------------------------


def _before_the_end(obj: dict, channel: str) -> bool:
    """Whether ``obj`` is a non-terminal status stamped before the end (05 s) or our send's reply."""
    status = (obj.get("task") or obj.get("statusUpdate") or {}).get("status") or {}
    if status.get("state") in ("TASK_STATE_COMPLETED", "TASK_STATE_CANCELED", "TASK_STATE_FAILED",
                               "TASK_STATE_REJECTED"):  # fmt: skip
        return False
    stamp = status.get("timestamp")
    return channel == "send-response" or (isinstance(stamp, str) and stamp < "2026-01-01T00:00:05Z")


@on_database(60)
@given(
    before=st.lists(agent_entries, max_size=5),
    end=st.sampled_from(["TASK_STATE_COMPLETED", "TASK_STATE_CANCELED"]),
    after=st.lists(
        st.tuples(
            agent_entries,
            st.sampled_from(["stream", "resubscribe", "poll", "push", "send-response"]),
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_after_the_end_entries_are_logged_as_protocol_errors_only(before, end, after):
    task = new_task()
    record_many(task, [*before, status(end, ts="2026-01-01T00:00:05Z")], "stream")
    task.refresh_from_db()
    if task.state not in ("TASK_STATE_COMPLETED", "TASK_STATE_CANCELED"):
        return  # an earlier end (the other one) held; settled below all the same
    settle(task, task_view(task))
    settled = mirror(task)
    for obj, channel in after:
        result = record(task, obj, channel)
        for kind, note in zip(result.kinds, result.notes, strict=True):
            # The agent's error, or only late: a non-terminal status from before the end
            # (stamped earlier, or the reply to our own send), logged as older.
            assert kind == "protocol-error" or (
                note.startswith("older than the status already held")
                and _before_the_end(obj, channel)
            ), (kind, note, obj, channel)
        now = mirror(task)
        assert now["view"] == settled["view"] and now["artifacts"] == settled["artifacts"]
        assert now["conversation"] == settled["conversation"]
    assert_sound(task)


# Channels interleaved never roll the status back -------------------------------------------


def agent_story(data: st.DataObject) -> list[tuple[dict, dict]]:
    """An agent's task told event by event: each event with the agent's Task right after it.

    Chunks append to one artifact; each status has a later timestamp than the one before.
    """
    moments: list[tuple[dict, dict]] = []
    state, ts, parts = "TASK_STATE_WORKING", "2026-01-01T00:00:09Z", []
    for step in range(data.draw(st.integers(min_value=1, max_value=8), label="length")):
        if data.draw(st.booleans(), label="chunk?"):
            parts = [*parts, f"c{step}"]
            event = chunk("a-1", [f"c{step}"], append=len(parts) > 1, last=False)
        else:
            state = data.draw(
                st.sampled_from(["TASK_STATE_WORKING", "TASK_STATE_INPUT_REQUIRED"]), label="state"
            )
            ts = f"2026-01-01T00:00:{10 + step:02d}Z"
            event = status(state, ts=ts)
        moments.append((event, snapshot(state, {"a-1": parts} if parts else {}, [], None, ts)))
    return moments


def status_stamp(task: RemoteTask) -> str:
    task.refresh_from_db()
    return task.status_timestamp.isoformat().replace("+00:00", "Z")


@on_database(60)
@given(data=st.data())
def test_interleaved_channels_never_roll_back_nor_lose_a_chunk(data):
    """The story told live on the stream, and meanwhile, in any order: push redelivering an
    earlier event, and poll snapshots, either the agent's task as it is now or one read before
    an earlier status (older timestamp): the status never goes back and no chunk is lost."""
    moments = agent_story(data)
    task = new_task()
    record(task, snapshot("TASK_STATE_WORKING", {}, [], None, "2026-01-01T00:00:09Z"), "stream")
    latest = status_stamp(task)
    for now, (event, _) in enumerate(moments):
        record(task, event, "stream")
        late = data.draw(st.sampled_from([None, *range(now + 1)]), label="late")
        if late is not None:
            channel = data.draw(st.sampled_from(["push", "poll"]), label="channel")
            older = moments[late][1]["task"]["status"]["timestamp"] < latest
            if channel == "push":
                record(task, moments[late][0], "push")
            elif late == now or older:  # not an equal status with fewer chunks (see the report)
                record(task, moments[late][1], "poll")
        stamp = status_stamp(task)
        assert stamp >= latest, "a late entry rolled the status back"
        latest = stamp
    final = moments[-1][1]["task"]
    task.refresh_from_db()
    view = task_view(task)
    assert view["status"]["state"] == final["status"]["state"]
    assert view.get("artifacts", []) == final.get("artifacts", []), "a chunk was lost"
    assert_sound(task)


@on_database(60)
@given(data=st.data())
def test_push_and_getTask_interleaved_keep_every_chunk_once(data):
    """A push task: notifications in order, some delivered twice, and a GetTask (recorded on
    poll) read at the agent after some of them."""
    moments = agent_story(data)
    task = new_task(RemoteTask.Watch.POLL)
    record(task, snapshot("TASK_STATE_WORKING", {}, [], None, "2026-01-01T00:00:09Z"), "poll")
    for now, (event, _) in enumerate(moments):
        record(task, event, "push")
        if data.draw(st.booleans(), label="again"):
            record(task, event, "push")
        if data.draw(st.booleans(), label="poll"):
            # Read at the agent now, or just after it sent the next notification (queued at
            # the webhook, drained after this GetTask is recorded).
            # (Only now here: ahead is test_a_chunk_a_getTask_already_showed_is_not_doubled.)
            ahead = data.draw(st.sampled_from([0]), label="ahead")
            record(task, moments[min(now + ahead, len(moments) - 1)][1], "poll")
    final = moments[-1][1]["task"]
    task.refresh_from_db()
    view = task_view(task)
    assert view["status"]["state"] == final["status"]["state"]
    assert view.get("artifacts", []) == final.get("artifacts", []), "a chunk was lost or doubled"
    assert_sound(task)


# Any content an agent sends is stored and reads back -------------------------------------------

awkward_text = st.text(max_size=10) | st.sampled_from(
    ["", "\ud800", "a\x00b", "\udfff\ud800", "\ud83d\ude00", "\u202e", '"\\', "NaN"]
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.sampled_from([-0.0, 2.0**53, -(2.0**53), 2.0**53 + 2, 1e16, 1e308, 5e-324, 10**30])
    | awkward_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(awkward_text, inner, max_size=3),
    max_leaves=15,
)
odd_ids = st.sampled_from(["", " ", "\x00", "\ud800", "a" * 300, "a" * 301, "é" * 300, "🙂"])


@on_database(80)
@given(
    value=json_values,
    text=awkward_text,
    aid=odd_ids | awkward_text,
    mid=odd_ids | awkward_text,
    tid=odd_ids | awkward_text,
    channel=st.sampled_from(["stream", "poll", "push"]),
)
def test_any_content_is_stored_reads_back_and_verifies(value, text, aid, mid, tid, channel):
    """Never an exception out of record(); what is stored reads back as it was hashed."""
    task = new_task()
    objs = [
        {"task": {"id": tid, "contextId": tid, "status": {"state": "TASK_STATE_WORKING"}}},
        {
            "artifactUpdate": {
                "taskId": tid,
                "artifact": {
                    "artifactId": aid,
                    "name": text,
                    "parts": [{"text": text}, {"data": value}, {"text": "t", "metadata": value}],
                    "metadata": {"v": value},
                },
            }
        },
        {"message": {"messageId": mid, "role": text, "parts": [{"data": value}]}},
        {"statusUpdate": {"taskId": tid, "status": status_body("TASK_STATE_WORKING", None, None)}},
        {
            "statusUpdate": {
                "taskId": tid,
                "status": {
                    "state": "TASK_STATE_WORKING",
                    "message": {"messageId": mid, "parts": []},
                },
                "metadata": {"v": value},
            }
        },
    ]
    record_many(task, objs, channel)
    task.refresh_from_db()
    for row in task.events.order_by("seq"):
        assert row.raw == safejson.clean(row.raw)[0]  # nothing a database cannot keep
    stored = {a.artifact_id: a for a in Artifact.objects.filter(task=task)}
    clean_aid, clean_value = safejson.clean(aid)[0], safejson.clean(value)[0]
    if clean_aid in stored:
        parts = [p.part for p in stored[clean_aid].parts.order_by("index")]
        sent = [{"data": clean_value}, {"text": "t", "metadata": clean_value}]
        # As normalized: a member that is null is not set (ProtoJSON).
        assert parts[1:] == normalize.artifact({"artifactId": "a", "parts": sent})["parts"]
    assert_sound(task)


def nested(depth: int, kind: str) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return value


@on_database(20)
@given(
    # The deepest an agent's JSON may be (safejson.loads), less the envelope around the value.
    depth=st.integers(min_value=1, max_value=safejson.DEFAULT_MAX_DEPTH - 4),
    kind=st.sampled_from(["list", "dict"]),
)
def test_nesting_an_agent_can_send_is_stored_and_replays(depth, kind):
    task = new_task()
    working = snapshot("TASK_STATE_WORKING", {}, [], None, None)["task"]
    assert record(task, {"task": {**working, "metadata": {"v": nested(depth, kind)}}}, "poll").seqs
    assert_sound(task)


@on_database(20)
@given(depth=st.integers(min_value=3_000, max_value=20_000), kind=st.sampled_from(["list", "dict"]))
def test_nesting_past_the_encoder_is_a_protocol_error_not_an_exception(depth, kind):
    """An object built in-process, nested past the JSON encoder's recursion limit."""
    task = new_task()
    working = snapshot("TASK_STATE_WORKING", {}, [], None, None)["task"]
    result = record(task, {"task": {**working, "metadata": {"v": nested(depth, kind)}}}, "poll")
    assert result.kinds == ["protocol-error"]
    assert_sound(task)


@pytest.mark.parametrize(
    "make", [lambda: 10**5000, lambda: {1, 2}, lambda: object()], ids=["huge-int", "set", "object"]
)
def test_a_value_no_encoder_writes_is_a_protocol_error_not_an_exception(make):
    """Built in-process only (agents' JSON is decoded with these refused)."""
    task = new_task()
    working = snapshot("TASK_STATE_WORKING", {}, [], None, None)["task"]
    result = record(task, {"task": {**working, "metadata": {"v": make()}}}, "poll")
    assert result.kinds == ["protocol-error"]
    assert_sound(task)
