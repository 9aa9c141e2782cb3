"""Task history exports: every event of a 10,000-event task, verifiable offline; who may export.

The offline check here is written from docs/exports.md with the standard library only
(it does not import ``tasks_app.services.chain``), so it proves the format is enough.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
from datetime import UTC, datetime

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.test import AsyncClient, Client
from django.urls import reverse

from tasks_app.models import Agent, Membership, Project, RemoteTask, TaskEvent
from tasks_app.services import audit
from tasks_app.services.chain import content_digest
from tasks_app.services.record import record
from tests.bulklog import bulk_log
from tests.people import member

pytestmark = pytest.mark.django_db(transaction=True)


def canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode(
        "ascii"
    )


def verify_offline(events: list[dict]) -> str:
    """Recompute the chain as docs/exports.md says; returns the last hash (asserts on the way)."""
    previous = ""
    for expected_seq, event in enumerate(events, start=1):
        assert event["seq"] == expected_seq
        moment = datetime.fromisoformat(event["received_at"].replace("Z", "+00:00"))
        assert moment.tzinfo is not None
        form = {
            "actor": event["actor_id"], "channel": event["channel"], "kind": event["kind"],
            "note": event["note"], "raw_sha256": hashlib.sha256(canonical(event["raw"])).hexdigest(),
            "received_at": moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "seq": event["seq"], "state": event["state_after"],
        }  # fmt: skip
        previous = hashlib.sha256(previous.encode("ascii") + canonical(form)).hexdigest()
        assert previous == event["hash"], f"row {event['seq']} does not verify"
    return previous


@pytest.fixture
def world(django_user_model) -> dict:
    alpha = Project.objects.create(name="alpha")
    Project.objects.create(name="beta")
    agent = Agent.objects.create(
        project=alpha, name="alpha agent", base_url="http://127.0.0.1:9/alpha"
    )
    task = RemoteTask.objects.create(
        agent=agent,
        remote_id="t-big",
        context_id="c-1",
        title="big",
        phase="task",
        state="TASK_STATE_WORKING",
    )
    people = {}
    for name, role, project in (
        ("auditor", Membership.Role.AUDITOR, "alpha"), ("viewer", Membership.Role.VIEWER, "alpha"),
        ("operator", Membership.Role.OPERATOR, "alpha"), ("outsider", Membership.Role.AUDITOR, "beta"),
    ):  # fmt: skip
        user = member(
            django_user_model.objects.create_user(name, password="pw-12345678"), role, project
        )
        people[name] = Client()
        people[name].force_login(user)
    return {"task": task, "agent": agent, "people": people, "auditor": people["auditor"]}


def _body(response) -> bytes:
    assert response.streaming, "exports are streamed"
    return b"".join(response.streaming_content)


@pytest.mark.slow  # 10,000 events
def test_a_10000_event_task_exports_every_event_as_json_and_jsonl(world) -> None:
    task = world["task"]
    last = bulk_log(task, 10_000)
    assert audit.verify(task.pk).ok  # the rows chain as record() chains them
    url = reverse("task-export", args=[task.pk])

    response = world["auditor"].get(url, {"format": "json"})
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/json")
    assert "attachment" in response["Content-Disposition"]
    document = json.loads(_body(response))
    assert document["format"] == "a2a-dashboard/task-history" and document["version"] == 1
    assert document["task"]["remote_id"] == "t-big" and document["task"]["last_seq"] == 10_000
    assert document["event_count"] == 10_000 and len(document["events"]) == 10_000
    assert [e["seq"] for e in document["events"]] == list(range(1, 10_001))
    assert verify_offline(document["events"]) == last == document["events_last_hash"]
    first = document["events"][0]
    assert set(first) == {
        "seq",
        "received_at",
        "channel",
        "kind",
        "state_after",
        "note",
        "actor",
        "actor_id",
        "raw",
        "digest",
        "hash",
    }
    assert first["raw"]["statusUpdate"]["metadata"]["p"] == 1 / 7
    assert first["digest"] == content_digest(first["raw"])[0]  # nothing kept apart: as stored

    response = world["auditor"].get(url, {"format": "jsonl"})
    assert response.status_code == 200 and response["Content-Type"].startswith(
        "application/x-ndjson"
    )
    lines = _body(response).decode("ascii").splitlines()
    assert len(lines) == 10_001  # the task, then one event per line
    header = json.loads(lines[0])
    assert header["task"]["id"] == task.pk and "seq" not in header
    events = [json.loads(line) for line in lines[1:]]
    assert events == document["events"]


def test_events_recorded_by_the_service_export_with_their_actor_and_verify(
    world, django_user_model
) -> None:
    task = world["task"]
    operator = django_user_model.objects.get(username="operator")
    record(
        task,
        {"task": {"id": "t-big", "contextId": "c-1", "status": {"state": "TASK_STATE_WORKING"}}},
        "poll",
    )
    record(
        task,
        {"operator": {"action": "refresh", "by": "operator"}},
        "operator",
        actor_id=operator.pk,
    )
    record(task, {"statusUpdate": {"taskId": "t-big", "contextId": "c-1",
                                   "status": {"state": "TASK_STATE_COMPLETED"}}}, "stream")  # fmt: skip
    lines = _body(
        world["auditor"].get(reverse("task-export", args=[task.pk]), {"format": "jsonl"})
    ).splitlines()
    events = [json.loads(line) for line in lines[1:]]
    assert len(events) == RemoteTask.objects.get(pk=task.pk).last_seq >= 2
    assert any(e["actor"] == "operator" and e["actor_id"] == operator.pk for e in events)
    assert events[-1]["state_after"] == "TASK_STATE_COMPLETED"
    verify_offline(events)


async def test_under_asgi_the_export_streams_from_an_async_iterator(world) -> None:
    from asgiref.sync import sync_to_async

    task = world["task"]
    await sync_to_async(bulk_log)(task, 1200)
    client = AsyncClient()
    user = await sync_to_async(lambda: __import__("django.contrib.auth", fromlist=["get_user_model"])
                               .get_user_model().objects.get(username="auditor"))()  # fmt: skip
    await client.aforce_login(user)
    response = await client.get(reverse("task-export", args=[task.pk]), {"format": "jsonl"})
    assert response.status_code == 200 and response.is_async
    chunks = [chunk async for chunk in response.streaming_content]
    assert len(chunks) > 2  # read a batch at a time, not as one piece
    lines = b"".join(chunks).splitlines()
    assert len(lines) == 1201
    verify_offline([json.loads(line) for line in lines[1:]])


def test_who_may_export(world) -> None:
    task = world["task"]
    bulk_log(task, 3)
    url = reverse("task-export", args=[task.pk])
    assert world["people"]["auditor"].get(url).status_code == 200
    for person in (
        "viewer",
        "operator",
    ):  # may read the task, may not audit: 403 (and a refusal row)
        assert world["people"][person].get(url).status_code == 403
    assert task.actions.filter(action="forbidden").count() == 2
    assert world["people"]["outsider"].get(url).status_code == 404  # an auditor of another project
    assert (
        world["people"]["auditor"].get(reverse("task-export", args=[task.pk + 1000])).status_code
        == 404
    )
    assert Client().get(url).status_code == 302  # to the login page
    bad = world["people"]["auditor"].get(url, {"format": "xml"})
    assert bad.status_code == 400 and b"json or jsonl" in bad.content


def test_the_events_page_links_to_the_exports_for_auditors(world) -> None:
    task = world["task"]
    bulk_log(task, 3)
    page = world["people"]["auditor"].get(reverse("task-events", args=[task.pk])).content.decode()
    assert (
        f"/tasks/{task.pk}/export/?format=jsonl" in page
        and f"/tasks/{task.pk}/export/?format=json" in page
    )
    page = world["people"]["viewer"].get(reverse("task-events", args=[task.pk])).content.decode()
    assert 'id="export-links"' not in page
    # Auditing another project offers no export of this one's tasks (the click was a 403 and
    # a refusal row): the links follow this task's project, not any project's audit.
    member(get_user_model().objects.get(username="viewer"), Membership.Role.AUDITOR, "beta")
    page = world["people"]["viewer"].get(reverse("task-events", args=[task.pk])).content.decode()
    assert 'id="export-links"' not in page
    assert world["people"]["viewer"].get(reverse("audit")).status_code == 200  # audits beta


def test_the_command_exports_to_stdout_and_to_a_private_file(world, tmp_path) -> None:
    task = world["task"]
    last = bulk_log(task, 2500)
    out = io.StringIO()
    call_command("audit", "export", str(task.pk), "--format", "jsonl", stdout=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2501 and verify_offline([json.loads(line) for line in lines[1:]]) == last

    target = tmp_path / "history.json"
    call_command(
        "audit",
        "export",
        "t-big",
        "--format",
        "json",
        "--output",
        str(target),
        stderr=io.StringIO(),
    )
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    document = json.loads(target.read_text())
    assert document["event_count"] == 2500 and verify_offline(document["events"]) == last
    assert not [p for p in tmp_path.iterdir() if p.name != "history.json"]  # no temporary file left

    with pytest.raises(
        CommandError, match=r"No task .no-such-task.: neither a local id nor a remote task id"
    ):
        call_command("audit", "export", "no-such-task", stdout=io.StringIO())


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_rows_recorded_while_an_export_streams_are_left_to_the_next_one(world, fmt) -> None:
    """The header names last_seq and last_hash as read first; rows recorded between two
    batches followed it, and the offline check (the last hash is the header's) failed as
    if the export had been tampered with."""
    from tasks_app import exports

    task = world["task"]
    bulk_log(task, 450)
    task.refresh_from_db()
    chunks = exports.json_chunks(task, 200) if fmt == "json" else exports.jsonl_chunks(task, 200)
    first = [next(chunks), next(chunks)]  # the header and the first batch
    for i in range(2):
        record(task, {"statusUpdate": {"taskId": "t-big", "contextId": "c-1", "status": {
            "state": "TASK_STATE_WORKING", "message": {"messageId": f"late-{i}",
            "role": "ROLE_AGENT", "parts": [{"text": "late"}]}}}}, "stream")  # fmt: skip
    body = b"".join(first + list(chunks))
    if fmt == "json":
        doc = json.loads(body)
        header, events = doc["task"], doc["events"]
    else:
        lines = [json.loads(line) for line in body.splitlines()]
        header, events = lines[0]["task"], lines[1:]
    assert header["last_seq"] == 450 and len(events) == 450
    assert verify_offline(events) == header["last_hash"]


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_a_task_removed_while_its_export_streams_does_not_end_as_a_whole_export(
    world, fmt, tmp_path
) -> None:
    """Retention removed the task between two batches: the export ended short of the
    header's last_seq, well-formed, as if it were the whole log (auditors export exactly the
    old tasks retention removes). It fails instead; the command leaves no file."""
    from tasks_app import exports

    task = world["task"]
    bulk_log(task, 450)
    task.refresh_from_db()
    chunks = exports.json_chunks(task, 200) if fmt == "json" else exports.jsonl_chunks(task, 200)
    first = [next(chunks), next(chunks)]
    assert first
    RemoteTask.objects.filter(pk=task.pk).delete()
    with pytest.raises(exports.ExportIncomplete, match=r"removed while it was exported"):
        list(chunks)


def test_a_log_with_a_gap_is_exported_as_it_is_for_the_offline_check(world) -> None:
    """Only a task that went away fails its export: a tampered log is evidence."""
    from tasks_app import exports

    task = world["task"]
    bulk_log(task, 30)
    task.refresh_from_db()
    TaskEvent.objects.filter(task=task, seq=12).delete()
    doc = json.loads(b"".join(exports.json_chunks(task, 10)))
    assert doc["event_count"] == 29 and doc["task"]["last_seq"] == 30


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_an_export_carries_the_contents_its_entries_refer_to(world, fmt, settings) -> None:
    """A big part content is kept once (its artifact's or conversation's row, or apart once
    the artifact was replaced) and the entry keeps a reference: an export of entries alone
    lost the content with the task, and retention exports a task before it deletes it."""
    from tasks_app import exports
    from tasks_app.services.record import references_in, with_content

    settings.INLINE_CONTENT_BYTES = 16
    task = world["task"]
    attached = {"raw": "Zm9v" * 20, "filename": "f.bin"}
    message = {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": "hi"}, attached]}

    def chunk(text: str) -> dict:
        return {"artifactUpdate": {"taskId": "t-big", "contextId": "c-1",
                                   "artifact": {"artifactId": "a-1", "parts": [{"text": text}]}}}  # fmt: skip

    sent = [
        {"operator": {"action": "start", "mode": "stream", "message": message}},
        chunk("A" * 40),
        chunk("B" * 40),  # replaces the artifact: "A" * 40 is kept apart
        {
            "statusUpdate": {
                "taskId": "t-big",
                "contextId": "c-1",
                "status": {"state": "TASK_STATE_COMPLETED"},
            }
        },
    ]
    record(task, sent[0], "operator")
    for obj in sent[1:]:
        record(task, obj, "stream")
    task.refresh_from_db()
    body = b"".join(exports.task_chunks(task, fmt))
    if fmt == "json":
        doc = json.loads(body)
        events, contents = doc["events"], doc["contents"]
        assert doc["event_count"] == len(events) == 4
    else:
        lines = [json.loads(line) for line in body.splitlines()[1:]]
        events = [line for line in lines if "seq" in line]
        contents = [line for line in lines if "seq" not in line]
        assert lines == events + contents  # the contents after the events
    assert verify_offline(events) == task.last_hash
    held = {content["sha256"]: content["content"] for content in contents}
    assert len(held) == len(contents) == 3  # each once
    for digest, content in held.items():
        assert hashlib.sha256(content.encode()).hexdigest() == digest
    assert set(held) == {sha for e in events for sha in references_in(e["raw"])}
    assert [with_content(e["raw"], held) for e in events] == sent


def test_an_export_without_references_has_no_contents(world) -> None:
    from tasks_app import exports

    task = world["task"]
    bulk_log(task, 5)
    task.refresh_from_db()
    assert json.loads(b"".join(exports.json_chunks(task)))["contents"] == []
    assert len(b"".join(exports.jsonl_chunks(task)).splitlines()) == 6


def test_contents_referred_to_under_a_lower_inline_limit_are_exported_after_it_is_raised(
    world, settings
) -> None:
    """A reference says how long its content is: raising INLINE_CONTENT_BYTES later does not
    hide the contents referred to under the old value (they are shorter than the new one)."""
    from tasks_app import exports

    settings.INLINE_CONTENT_BYTES = 16
    task = world["task"]
    chunk = {"artifactUpdate": {"taskId": "t-big", "contextId": "c-1",
                                "artifact": {"artifactId": "a-1", "parts": [{"text": "A" * 40}]}}}  # fmt: skip
    record(task, chunk, "stream")
    settings.INLINE_CONTENT_BYTES = 64 * 1024
    task.refresh_from_db()
    doc = json.loads(b"".join(exports.json_chunks(task)))
    assert [c["content"] for c in doc["contents"]] == ["A" * 40]


@pytest.mark.parametrize("fmt", ["json", "jsonl"])
def test_an_export_of_long_entries_streams_in_bounded_memory(fmt) -> None:
    """Rows were read 200 at a time and written out 200 lines at a time whatever their size:
    an entry's JSON goes up to WATCH_MAX_EVENT_BYTES (a status update's metadata, say), and
    30 rows of 2 MB made an export peak at 184 MB, three times the log. Batches are bounded
    in characters too now, and lines go as soon as they add up to a megabyte."""
    import tracemalloc

    from tasks_app import exports

    agent = Agent.objects.create(name="long", base_url="http://127.0.0.1:1/long/")
    task = RemoteTask.objects.create(agent=agent, title="long", remote_id="r-long")

    def row(seq: int) -> TaskEvent:
        metadata = {"m": f"{seq}" + "x" * 1_000_000}
        return TaskEvent(
            task=task, seq=seq, received_at=datetime(2026, 1, 1, tzinfo=UTC), channel="stream",
            kind="statusUpdate", state_after="TASK_STATE_WORKING", digest="d", hash=f"h{seq}",
            raw={"statusUpdate": {"taskId": "r-long", "metadata": metadata}},
        )  # fmt: skip

    rows = [row(seq) for seq in range(1, 25)]
    TaskEvent.objects.bulk_create(rows, batch_size=4)
    RemoteTask.objects.filter(pk=task.pk).update(last_seq=24, last_hash="h24")
    task.refresh_from_db()
    tracemalloc.start()
    try:
        written = sum(len(chunk) for chunk in exports.task_chunks(task, fmt))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert written > 24_000_000  # every row went out
    assert peak < 16_000_000, f"{peak:,} bytes at the peak for a {written:,}-byte export"


def test_a_task_removed_between_sizing_a_batch_and_reading_it_fails_its_export(
    world, monkeypatch
) -> None:
    """A batch is sized first, then read: retention removing the task between the two, on
    the last batch, left the export ended where its header said, as if whole (it advanced
    past the rows it sized, not past those it read)."""
    from tasks_app import exports

    task = world["task"]
    bulk_log(task, 30)
    task.refresh_from_db()
    real = exports.batch_within

    def sized_then_removed(rows, limit, chars):
        found = real(rows, limit, chars)
        RemoteTask.objects.filter(pk=task.pk).delete()  # inside the window
        return found

    monkeypatch.setattr(exports, "batch_within", sized_then_removed)
    with pytest.raises(exports.ExportIncomplete, match=r"removed while it was exported"):
        list(exports.jsonl_chunks(task))


def test_a_cut_form_that_is_not_ours_is_shown_as_json() -> None:
    from tasks_app.a2ui_render import _json_text

    assert _json_text({"cut": "abc", "chars": 12}) == "abc\n… (cut: 12 characters in all)"
    assert '"chars": "zz"' in _json_text({"cut": "abc", "chars": "zz"})
