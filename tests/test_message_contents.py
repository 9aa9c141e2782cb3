"""A message's big part contents are stored once, in the conversation; log rows refer to it.

A file an operator attached (or one an agent sent in a status message) was kept whole twice,
in the log row and in the conversation, and again in every snapshot that repeated it. Now a
log row keeps ``{"$stored": {field, sha256, chars}}`` in place of each content over
``INLINE_CONTENT_BYTES`` that the conversation holds for the message's id; ``with_content``
puts it back from there, so the chain verifies and ``audit replay`` folds the same log. A
message repeated later (an agent's snapshot history carries the operator's first message on
every GetTask) refers to the conversation's copy too, where it is the very content: the
conversation keeps an id's first content only, so a different content under a known id
stays inline.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client, override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks_app.models import ConversationMessage, Membership, RemoteTask, TaskEvent
from tasks_app.services import record as record_module
from tasks_app.services.chain import content_digest
from tasks_app.services.record import STORED, record, record_many
from tests.examples import examples
from tests.people import member
from tests.test_log_properties import log_rows, new_task
from tests.test_truth import assert_sound

pytestmark = pytest.mark.django_db

LIMIT = 16  # INLINE_CONTENT_BYTES in these tests
BIG = "b" * 40
FILE = "Zm9v" * 20  # base64, over the limit


def message(mid: str, *parts: dict, role: str = "ROLE_AGENT") -> dict:
    return {"messageId": mid, "role": role, "parts": list(parts)}


def status(state: str, msg: dict | None = None) -> dict:
    body: dict[str, Any] = {"state": state}
    if msg is not None:
        body["message"] = msg
    return {"statusUpdate": {"taskId": "t-1", "contextId": "c-1", "status": body}}


def snapshot(state: str, history: list[dict]) -> dict:
    task = {"id": "t-1", "contextId": "c-1", "status": {"state": state}, "history": history}
    return {"task": task}


def start(msg: dict) -> dict:
    return {"operator": {"action": "start", "mode": "stream", "message": msg}}


def stored_once(task: Any, obj: dict, seq: int) -> dict:
    """The row at ``seq`` keeps references, and ``with_content`` gives back ``obj`` exactly."""
    raw = TaskEvent.objects.get(task=task, seq=seq).raw
    assert raw != obj and STORED in json.dumps(raw)
    contents = record_module.stored_contents(task.pk)
    assert record_module.with_content(raw, contents) == obj
    return raw


@override_settings(INLINE_CONTENT_BYTES=LIMIT)
def test_an_operators_file_is_kept_in_the_conversation_and_referred_to_by_the_log():
    task = new_task()
    attached = {"raw": FILE, "filename": "f.bin", "mediaType": "application/octet-stream"}
    obj = start(message("m-1", {"text": "hi"}, attached, role="ROLE_USER"))
    record(task, obj, "operator")
    raw = stored_once(task, obj, 1)
    part = raw["operator"]["message"]["parts"][1]
    assert "raw" not in part and part["filename"] == "f.bin"
    assert part[STORED]["chars"] == len(FILE)
    assert raw["operator"]["message"]["parts"][0] == {"text": "hi"}  # small ones stay
    event = TaskEvent.objects.get(task=task, seq=1)
    assert "message content stored once, in the conversation" in event.note
    # The row's digest is still the content's as sent (a redelivery is recognized by it), and
    # the conversation keeps the file whole: one copy in the database.
    assert event.digest == content_digest(obj)[0]
    kept = ConversationMessage.objects.get(task=task, message_id="m-1").message
    assert kept["parts"][1]["raw"] == FILE
    assert FILE not in json.dumps(event.raw)
    assert_sound(task)


@override_settings(INLINE_CONTENT_BYTES=LIMIT)
@pytest.mark.parametrize("batched", [False, True])
def test_an_agents_status_message_and_a_snapshots_new_history_are_stored_once(batched):
    task = new_task()
    objs = [
        status("TASK_STATE_WORKING", message("m-1", {"text": BIG})),
        status("TASK_STATE_WORKING", message("m-1", {"text": BIG})),  # the same, again
        snapshot(
            "TASK_STATE_INPUT_REQUIRED",
            [message("m-1", {"text": BIG}), message("m-2", {"text": BIG + "2"})],
        ),
    ]
    if batched:
        record_many(task, objs, "stream")
    else:
        for obj in objs:
            record(task, obj, "stream")
    rows = list(TaskEvent.objects.filter(task=task).order_by("seq"))
    assert [row.kind for row in rows] == ["statusUpdate", "task"]  # the repeat added nothing
    stored_once(task, objs[0], 1)
    second = stored_once(task, objs[2], 2)
    history = second["task"]["history"]
    # m-1, stored by the first row (before this call, or earlier in the same batch), and m-2,
    # new here: the conversation holds both contents, so the snapshot refers to both.
    for held in history:
        assert STORED in held["parts"][0] and "text" not in held["parts"][0]
    assert_sound(task)


@override_settings(INLINE_CONTENT_BYTES=LIMIT)
@pytest.mark.parametrize("batched", [False, True])
def test_snapshots_repeating_the_operators_file_refer_to_the_conversation(batched):
    """GetTask's history carries the operator's first message on every poll, and a snapshot
    after the end is logged as a protocol error with its content: none keeps the file again."""
    task = new_task(RemoteTask.Watch.POLL)
    attached = {"raw": FILE, "filename": "f.bin"}
    objs = [
        start(message("m-1", {"text": "hi"}, attached, role="ROLE_USER")),
        snapshot(
            "TASK_STATE_WORKING", [message("m-1", {"text": "hi"}, attached, role="ROLE_USER")]
        ),
        snapshot(
            "TASK_STATE_COMPLETED", [message("m-1", {"text": "hi"}, attached, role="ROLE_USER")]
        ),
    ]
    record(task, objs[0], "operator")
    if batched:
        record_many(task, objs[1:], "poll")
    else:
        for obj in objs[1:]:
            record(task, obj, "poll")
    late = snapshot(
        "TASK_STATE_INPUT_REQUIRED", [message("m-1", {"text": "hi"}, attached, role="ROLE_USER")]
    )
    record(task, late, "poll")
    rows = list(TaskEvent.objects.filter(task=task).order_by("seq"))
    assert [row.kind for row in rows] == ["operator", "task", "task", "protocol-error"]
    assert not [row.seq for row in rows if FILE in json.dumps(row.raw)]
    for seq, obj in enumerate([*objs, late], start=1):
        stored_once(task, obj, seq)
    assert_sound(task)


@override_settings(INLINE_CONTENT_BYTES=LIMIT)
def test_a_message_id_repeated_with_other_content_keeps_that_content_inline():
    """The conversation keeps the first content of an id: a second, different one under the same
    id is not stored there, so its log row must keep it."""
    task = new_task()
    first = {"message": message("m-1", {"text": BIG})}
    other = snapshot(
        "TASK_STATE_WORKING",
        [message("m-1", {"text": BIG + "x"}), message("m-2", {"text": BIG + "2"})],
    )
    record_many(task, [first, other], "poll")
    stored_once(task, first, 1)
    raw = stored_once(task, other, 2)  # m-2, new, is stored by this row
    # m-1's second content is in no conversation row: the log row is its only copy.
    assert raw["task"]["history"][0] == message("m-1", {"text": BIG + "x"})
    assert_sound(task)


@override_settings(INLINE_CONTENT_BYTES=LIMIT)
def test_a_refused_entry_keeps_its_content():
    """A status after the end is logged, not applied: no conversation row, no reference."""
    task = new_task()
    record(task, status("TASK_STATE_COMPLETED"), "stream")
    late = status("TASK_STATE_COMPLETED", message("m-9", {"text": BIG}))
    record(task, late, "push")
    row = TaskEvent.objects.filter(task=task).order_by("-seq").first()
    assert row.kind == "protocol-error" and row.raw == late
    assert not ConversationMessage.objects.filter(task=task, message_id="m-9").exists()


contents = st.sampled_from(["s", BIG, BIG + "y", "\ud800" + BIG, BIG + "\x00"])
parts = st.lists(
    st.builds(lambda field, text: {field: text}, st.sampled_from(["text", "raw"]), contents),
    min_size=1,
    max_size=3,
)
messages = st.builds(
    lambda mid, ps: message(mid, *ps), st.sampled_from(["m-1", "m-2", "m-3"]), parts
)
entries = st.one_of(
    st.builds(lambda m: {"message": m}, messages),
    st.builds(lambda m: start({**m, "role": "ROLE_USER"}), messages),
    st.builds(
        status, st.sampled_from(["TASK_STATE_WORKING", "TASK_STATE_INPUT_REQUIRED"]), messages
    ),
    st.builds(
        snapshot,
        st.sampled_from(["TASK_STATE_WORKING", "TASK_STATE_COMPLETED"]),
        st.lists(messages, max_size=3),
    ),
)


@override_settings(INLINE_CONTENT_BYTES=LIMIT)
@settings(
    max_examples=examples(60, fewest=8),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(objs=st.lists(entries, min_size=1, max_size=6), batched=st.booleans())
def test_every_log_with_messages_stored_once_verifies_replays_and_gives_back_what_came(
    objs, batched
):
    task = new_task()
    if batched:
        record_many(task, objs, "poll")
    else:
        for obj in objs:
            record(task, obj, "poll" if "operator" not in obj else "operator")
    assert_sound(task)
    contents_held = record_module.stored_contents(task.pk)
    cleaned = {}  # what each entry became once stored (lone surrogates and NULs replaced)
    for obj in objs:
        entry = record_module.parse_entry(obj)
        cleaned[entry.digest] = entry.raw
    for row in TaskEvent.objects.filter(task=task).exclude(kind__in=["gap", "system"]):
        if row.digest in cleaned:
            assert record_module.with_content(row.raw, contents_held) == cleaned[row.digest]


def test_a_log_stored_under_a_lower_inline_limit_replays_after_it_is_raised():
    """A reference says how long its content is: replay reads the shorter contents it needs
    (it read only those over today's INLINE_CONTENT_BYTES, and the snapshot replayed without
    its file or chunk, a difference, as if the log had been tampered with)."""
    task = new_task()
    with override_settings(INLINE_CONTENT_BYTES=LIMIT):
        record(task, start(message("m-1", {"raw": FILE}, role="ROLE_USER")), "operator")
        record(task, status("TASK_STATE_WORKING", message("m-2", {"text": BIG})), "stream")
        record(task, {"artifactUpdate": {"taskId": "t-1", "artifact": {"artifactId": "a-1",
                                         "parts": [{"text": BIG}]}}}, "stream")  # fmt: skip
    assert STORED in json.dumps(TaskEvent.objects.get(task=task, seq=3).raw)
    assert_sound(task)  # at the default limit (64 KB), over every content here


@override_settings(INLINE_CONTENT_BYTES=LIMIT, BUDGET_TASK_BYTES=2_000)
@pytest.mark.parametrize("batched", [False, True])
def test_a_file_the_agent_repeats_counts_against_the_budget_once(batched):
    """The task's byte budget counts what it stores: a snapshot repeating the operator's file
    in its history stores a reference, and counting the file whole each time parked a polled
    task with an attachment after a few polls (here: six snapshots, 3,700 bytes as sent)."""
    task = new_task(RemoteTask.Watch.POLL)
    attached = {"raw": "Zm9v" * 100, "filename": "f.bin"}
    first = message("m-1", {"text": "hi"}, attached, role="ROLE_USER")
    record(task, start(first), "operator")
    states = ["TASK_STATE_WORKING", "TASK_STATE_INPUT_REQUIRED"] * 3
    snapshots = []
    for i, state in enumerate(states):
        snap = snapshot(state, [first])
        snap["task"]["status"]["timestamp"] = f"2026-01-01T00:00:0{i}Z"
        snapshots.append(snap)
    sent = sum(record_module.parse_entry(s).size for s in snapshots)
    assert sent > 2_000
    if batched:
        record_many(task, snapshots, "poll")
    else:
        for snap in snapshots:
            record(task, snap, "poll")
    task.refresh_from_db()
    assert task.stored_bytes <= 2_000 and not task.events.filter(kind="system").exists()
    assert [row.kind for row in task.events.order_by("seq")] == ["operator", *["task"] * 6]
    # Each snapshot counted without the file: what its log row keeps, give or take the reference.
    stored = sum(len(json.dumps(row.raw)) for row in task.events.filter(kind="task"))
    assert task.stored_bytes <= stored
    assert_sound(task)


@settings(
    max_examples=examples(60, fewest=8),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    objs=st.lists(entries, min_size=1, max_size=6),
    budget=st.integers(min_value=0, max_value=3_000),
)
def test_a_batch_stores_and_counts_its_messages_as_one_by_one(objs, budget):
    """References and the byte budget alike: what an entry refers to, and what it counts, does
    not depend on whether the message it repeats was stored in this batch or an earlier one."""
    with override_settings(INLINE_CONTENT_BYTES=LIMIT, BUDGET_TASK_BYTES=budget):
        one, batch = new_task(), new_task()
        for obj in objs:
            record(one, obj, "poll")
        record_many(batch, objs, "poll")
    one.refresh_from_db()
    batch.refresh_from_db()
    assert log_rows(batch) == log_rows(one)
    assert batch.stored_bytes == one.stored_bytes


@override_settings(INLINE_CONTENT_BYTES=LIMIT)
def test_a_stored_key_an_agent_sends_itself_is_content_not_a_reference():
    """An agent may send a part with a ``$stored`` key, naming a content of the task it sent
    before (its sha256 is no secret). Taken for a reference, it made replay put that content
    in (the replayed artifact differed from the stored one, as if tampered with) or raise (a
    field that is a list); it stays as the agent sent it. And a part is given one reference
    at most: a second overwrote the first, whose content was lost."""
    import hashlib

    task = new_task()
    digest = hashlib.sha256(BIG.encode()).hexdigest()
    fakes = [
        {"text": "own", STORED: {"field": "text", "sha256": digest, "chars": len(BIG)}},
        {STORED: {"field": ["text"], "sha256": digest, "chars": len(BIG)}},
        {STORED: {"field": "raw", "sha256": digest, "chars": 3}},
        {"text": BIG + "1", STORED: "mine"},  # its own key: no reference over it
        {"text": BIG + "2", "raw": BIG + "3"},  # two contents (not a valid part): one reference
    ]
    sent = [
        {
            "artifactUpdate": {
                "taskId": "t-1",
                "artifact": {"artifactId": "a-1", "parts": [{"text": BIG}]},
            }
        },
        *(
            {
                "artifactUpdate": {
                    "taskId": "t-1",
                    "append": True,
                    "artifact": {"artifactId": "a-1", "parts": [fake]},
                }
            }
            for fake in fakes
        ),
    ]
    for obj in sent:
        record(task, obj, "stream")
    contents = record_module.stored_contents(task.pk)
    assert digest in contents  # the agent's first chunk, by reference
    for seq, obj in enumerate(sent[1:4], start=2):
        raw = TaskEvent.objects.get(task=task, seq=seq).raw
        assert raw == obj and record_module.with_content(raw, contents) == obj
    assert TaskEvent.objects.get(task=task, seq=5).raw == sent[4]  # nothing moved
    both = stored_once(task, sent[5], 6)["artifactUpdate"]["artifact"]["parts"][0]
    assert both["raw"] == BIG + "3" and both[STORED]["field"] == "text"
    assert_sound(task)


@override_settings(INLINE_CONTENT_BYTES=LIMIT)
def test_an_entrys_page_says_it_refers_and_its_json_brings_the_contents():
    """The event page showed a reference where the content had been, and its JSON (the
    "whole entry") did not have the content at all."""
    task = new_task()
    obj = status("TASK_STATE_WORKING", message("m-1", {"text": BIG}))
    record_many(task, [obj, status("TASK_STATE_INPUT_REQUIRED")], "stream")
    reader = Client()
    reader.force_login(member(User.objects.create_user("reader"), Membership.Role.VIEWER))
    whole = reader.get(f"/tasks/{task.pk}/events/1/?format=json").json()
    assert whole["raw"] == TaskEvent.objects.get(task=task, seq=1).raw  # the row as hashed
    assert STORED in json.dumps(whole["raw"])
    contents = {item["sha256"]: item["content"] for item in whole["contents"]}
    assert list(contents.values()) == [BIG]
    assert record_module.with_content(whole["raw"], contents) == obj
    assert 'id="raw-refers"' in reader.get(f"/tasks/{task.pk}/events/1/").content.decode()
    plain = reader.get(f"/tasks/{task.pk}/events/2/?format=json").json()
    assert "contents" not in plain
    assert 'id="raw-refers"' not in reader.get(f"/tasks/{task.pk}/events/2/").content.decode()


@override_settings(INLINE_CONTENT_BYTES=LIMIT)
def test_an_entrys_json_finds_its_contents_through_its_own_rows(monkeypatch):
    """An entry's JSON read every big content the task keeps (up to its byte budget) to find
    the one or two it refers to, on every click. Its contents come from its own part rows,
    its messages' conversation rows and the contents kept from replaced parts; the whole
    scan is left for a reference found nowhere there (a snapshot's part another row wrote)."""
    task = new_task()

    def chunk(aid: str, text: str, append: bool = False) -> dict:
        update = {"taskId": "t-1", "artifact": {"artifactId": aid, "parts": [{"text": text}]}}
        return {"artifactUpdate": {**update, "append": append}}

    sent = [
        status("TASK_STATE_WORKING", message("m-1", {"text": BIG})),  # 1: conversation row
        chunk("a-1", BIG + "1"),  # 2: its own part row
        chunk("a-2", BIG + "2"),  # 3: a part row the next entry replaces
        chunk("a-2", "small"),  # 4
    ]
    record_many(task, sent, "stream")
    snap = {"task": {"id": "t-1", "status": {"state": "TASK_STATE_WORKING"},
                     "artifacts": [{"artifactId": "a-1", "parts": [{"text": BIG + "1"}]}]}}  # fmt: skip
    record(task, snap, "poll")  # refers to the part row entry 2 wrote (after a gap row)
    last = TaskEvent.objects.get(task=task, kind="task").seq
    reader = Client()
    reader.force_login(member(User.objects.create_user("reader"), Membership.Role.VIEWER))
    kept = record_module.stored_contents(task.pk)  # the whole scan, for the expected entries

    def contents_of(seq: int) -> list[str]:
        whole = reader.get(f"/tasks/{task.pk}/events/{seq}/?format=json").json()
        contents = {item["sha256"]: item["content"] for item in whole["contents"]}
        expected = TaskEvent.objects.get(task=task, seq=seq)
        assert record_module.with_content(whole["raw"], contents) == record_module.as_it_came(
            expected.raw, expected.digest, kept
        )
        return sorted(contents.values())

    assert contents_of(last) == [BIG + "1"]  # through the task's scan
    assert STORED in json.dumps(TaskEvent.objects.get(task=task, seq=last).raw)

    def no_scan(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the whole task's contents were read for one entry")

    monkeypatch.setattr(record_module, "iter_stored_contents", no_scan)
    monkeypatch.setattr("tasks_app.exports.iter_stored_contents", no_scan)
    assert contents_of(1) == [BIG]
    assert contents_of(2) == [BIG + "1"]
    assert contents_of(3) == [BIG + "2"]  # kept apart when entry 4 replaced the part


@override_settings(INLINE_CONTENT_BYTES=LIMIT)
def test_a_made_up_reference_hashes_only_contents_of_its_length(monkeypatch):
    """A ``$stored`` key an agent sends names a content nothing keeps: its entry's JSON read
    every big content of the task, and hashed each, on every click (the task's scan). Only a
    content of the length a reference says can be the one it names: no other is hashed."""
    task = new_task()
    contents = [f"{n:03d}" + "c" * (LIMIT + 10 + n) for n in range(30)]
    chunks = [
        {"artifactUpdate": {"taskId": "t-1", "artifact": {"artifactId": f"a-{n}", "parts": [{"text": text}]}}}
        for n, text in enumerate(contents)
    ]  # fmt: skip
    history = [message(f"m-{n}", {"text": "m" * (LIMIT + 50 + n)}) for n in range(10)]
    record_many(task, [*chunks, status("TASK_STATE_WORKING", history[0])], "stream")
    made_up = {STORED: {"field": "text", "sha256": "0" * 64, "chars": len(contents[7])}}
    forged = {"artifactUpdate": {"taskId": "t-1", "artifact": {"artifactId": "a-x", "parts": [made_up]}}}  # fmt: skip
    record(task, forged, "stream")
    seq = TaskEvent.objects.get(task=task, raw__artifactUpdate__artifact__artifactId="a-x").seq
    hashed: list[str] = []
    real = record_module._sha256
    monkeypatch.setattr(record_module, "_sha256", lambda text: hashed.append(text) or real(text))
    reader = Client()
    reader.force_login(member(User.objects.create_user("reader"), Membership.Role.VIEWER))
    whole = reader.get(f"/tasks/{task.pk}/events/{seq}/?format=json").json()
    assert whole["raw"] == forged and whole["contents"] == []
    assert hashed == [contents[7]]  # the one content of that length, not the thirty-one others
    hashed.clear()
    monkeypatch.setattr(record_module, "LENGTHS_IN_SQL", 0)  # an export's thousands of lengths
    assert reader.get(f"/tasks/{task.pk}/events/{seq}/?format=json").json() == whole
    assert hashed == [contents[7]]  # chosen by their length here, not by the database


@override_settings(INLINE_CONTENT_BYTES=LIMIT)
def test_a_reference_an_agent_mimics_exactly_is_replayed_as_it_came():
    """A ``$stored`` key shaped exactly like one of ours (the field absent, the right length,
    the sha256 of a content the task keeps) cannot be told from ours by its shape: the
    replay put the content in, folded what the agent never sent, and reported the view as
    differing. The row's digest is the entry's as it came: restoring must give it back."""
    import hashlib

    task = new_task()
    digest = hashlib.sha256(BIG.encode()).hexdigest()
    mimic = {STORED: {"field": "text", "sha256": digest, "chars": len(BIG)}}
    sent = [
        {"artifactUpdate": {"taskId": "t-1", "artifact": {"artifactId": "a-1", "parts": [{"text": BIG}]}}},
        {"artifactUpdate": {"taskId": "t-1", "artifact": {"artifactId": "a-2", "parts": [mimic]}}},
    ]  # fmt: skip
    record_many(task, sent, "stream")
    stored = [e.raw for e in TaskEvent.objects.filter(task=task).order_by("seq")]
    contents = record_module.stored_contents(task.pk)
    assert stored[1] == sent[1] and digest in contents
    rows = TaskEvent.objects.filter(task=task).order_by("seq")
    assert [record_module.as_it_came(e.raw, e.digest, contents) for e in rows] == sent
    assert_sound(task)
    # An export's reader, with the export alone: contents put back, then checked by digest.
    from tasks_app import exports

    document = json.loads(b"".join(exports.json_chunks(RemoteTask.objects.get(pk=task.pk))))
    kept = {item["sha256"]: item["content"] for item in document["contents"]}
    read = []
    for event in document["events"]:
        back = record_module.with_content(event["raw"], kept)
        read.append(back if content_digest(back)[0] == event["digest"] else event["raw"])
    assert (
        read == sent and record_module.with_content(document["events"][1]["raw"], kept) != sent[1]
    )
