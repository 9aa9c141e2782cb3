"""A2UI surfaces folded by record(): every version's messages, diagnoses, duplicates, replay.

Messages are built with the A2UI project's own Python models (``a2ui-core``) where that
helps, so what is folded is what a real agent built with that SDK sends.
"""

from __future__ import annotations

import uuid

import pytest
from a2ui.core.schema.v0_8 import server_to_client as s08
from a2ui.core.schema.v0_9 import server_to_client as s09
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks_app.a2a import a2ui
from tasks_app.models import Agent, RemoteTask, Surface, TaskEvent
from tasks_app.services.audit import replay, surfaces_view
from tasks_app.services.record import record, record_many
from tests.examples import examples

pytestmark = pytest.mark.django_db

OLD = "application/json+a2ui"
NEW = "application/a2ui+json"


@pytest.fixture
def task(db) -> RemoteTask:
    agent = Agent.objects.create(name="a", base_url="http://127.0.0.1:1/")
    return RemoteTask.objects.create(agent=agent, title="t")


def dump(model) -> dict:
    return model.model_dump(by_alias=True, exclude_none=True, mode="json")


def part(messages, media: str = NEW, *, by_metadata: bool = False) -> dict:
    """A data part marked A2UI (one message, or a list of them)."""
    data = messages
    if by_metadata:
        return {"data": data, "metadata": {"mimeType": media}}
    return {"data": data, "mediaType": media}


def status(
    parts: list, *, mid: str, state: str = "TASK_STATE_INPUT_REQUIRED", ts: str = ""
) -> dict:
    body: dict = {
        "state": state,
        "message": {"messageId": mid, "role": "ROLE_AGENT", "parts": parts},
    }
    if ts:
        body["timestamp"] = ts
    return {"statusUpdate": {"taskId": "t-1", "contextId": "c-1", "status": body}}


def reply(parts: list, *, mid: str) -> dict:
    return {"message": {"messageId": mid, "role": "ROLE_AGENT", "contextId": "c-1", "parts": parts}}


def artifact_chunk(parts: list, *, aid: str = "ui", append: bool = False) -> dict:
    return {
        "artifactUpdate": {
            "taskId": "t-1",
            "contextId": "c-1",
            "artifact": {"artifactId": aid, "parts": parts},
            "append": append,
        }
    }


def kinds(task: RemoteTask) -> list[str]:
    return list(task.events.order_by("seq").values_list("kind", flat=True))


def errors(task: RemoteTask) -> list[str]:
    return list(
        task.events.filter(kind=TaskEvent.Kind.PROTOCOL_ERROR)
        .order_by("seq")
        .values_list("note", flat=True)
    )


def v08_booking() -> list[dict]:
    comps = [
        {"id": "root", "component": {"Column": {"children": {"explicitList": ["title", "when", "who", "go"]}}}},
        {"id": "title", "component": {"Text": {"text": {"path": "/title"}, "usageHint": "h2"}}},
        {"id": "when", "component": {"DateTimeInput": {"value": {"path": "/form/date"}, "enableDate": True}}},
        {"id": "who", "component": {"MultipleChoice": {
            "selections": {"path": "/form/people"},
            "options": [{"label": {"literalString": "One"}, "value": "1"},
                        {"label": {"literalString": "Two"}, "value": "2"}],
            "maxAllowedSelections": 1}}},
        {"id": "go", "component": {"Button": {"child": "go-label", "primary": True, "action": {
            "name": "book", "context": [{"key": "date", "value": {"path": "/form/date"}},
                                        {"key": "source", "value": {"literalString": "dash"}}]}}}},
        {"id": "go-label", "component": {"Text": {"text": {"literalString": "Book"}}}},
    ]  # fmt: skip
    return [
        dump(s08.SurfaceUpdateMessage(surfaceUpdate=s08.SurfaceUpdate(surfaceId="book", components=comps))),
        dump(s08.DataModelUpdateMessage(dataModelUpdate=s08.DataModelUpdate(
            surfaceId="book", contents=[{"key": "title", "valueString": "Book a table"},
                                        {"key": "form", "valueMap": [{"key": "date", "valueString": ""}]}]))),
        dump(s08.BeginRenderingMessage(beginRendering=s08.BeginRendering(surfaceId="book", root="root"))),
    ]  # fmt: skip


def v09_card(sid: str = "card") -> list[dict]:
    comps = [
        {"id": "root", "component": "Card", "child": "col"},
        {"id": "col", "component": "Column", "children": ["h", "list"]},
        {"id": "h", "component": "Text", "text": {"path": "/heading"}, "variant": "h3"},
        {"id": "list", "component": "List", "children": {"componentId": "row", "path": "/items"}},
        {"id": "row", "component": "Text", "text": {"path": "name"}},
    ]
    return [
        dump(s09.CreateSurfaceMessage(createSurface=s09.CreateSurface(surfaceId=sid, catalogId=a2ui.V09_CATALOG))),
        dump(s09.UpdateComponentsMessage(updateComponents=s09.UpdateComponents(surfaceId=sid, components=comps))),
        dump(s09.UpdateDataModelMessage(updateDataModel=s09.UpdateDataModel(
            surfaceId=sid, value={"heading": "Booked", "items": [{"name": "Ann"}]}))),
    ]  # fmt: skip


def test_v08_surface_is_folded_into_the_v091_form(task):
    result = record(task, status([part(v08_booking(), OLD, by_metadata=True)], mid="m-1"), "poll")
    surface = Surface.objects.get(task=task, surface_id="book")
    assert (surface.version, surface.ready, surface.deleted, surface.problem) == (
        "0.8",
        True,
        False,
        "",
    )
    assert surface.root_id == "root"
    assert surface.updated_seq == result.seqs[0]
    comps = surface.components
    assert comps["title"] == {
        "id": "title",
        "component": "Text",
        "text": {"path": "/title"},
        "variant": "h2",
    }
    assert comps["root"]["children"] == ["title", "when", "who", "go"]
    assert comps["who"]["component"] == "ChoicePicker"
    assert comps["who"]["variant"] == "mutuallyExclusive"
    assert comps["who"]["value"] == {"path": "/form/people"}
    assert comps["who"]["options"][0] == {"label": "One", "value": "1"}
    assert comps["go"]["variant"] == "primary"
    assert comps["go"]["action"] == {
        "event": {"name": "book", "context": {"date": {"path": "/form/date"}, "source": "dash"}}
    }
    assert surface.data_model == {"title": "Book a table", "form": {"date": ""}}
    assert kinds(task) == ["statusUpdate"]


def test_v09_and_v091_create_update_data_model_and_delete(task):
    record(task, reply([part(v09_card("a"), OLD)], mid="m-1"), "stream")
    record(task, reply([part(v09_card("b"), NEW)], mid="m-2"), "stream")
    a, b = Surface.objects.get(surface_id="a"), Surface.objects.get(surface_id="b")
    assert (a.version, b.version) == ("0.9", "0.9.1")
    assert a.ready and a.root_id == "root" and a.problem == ""
    assert a.components["list"]["children"] == {"componentId": "row", "path": "/items"}
    assert a.data_model == {"heading": "Booked", "items": [{"name": "Ann"}]}
    update = {
        "version": "v0.9",
        "updateDataModel": {"surfaceId": "a", "path": "/items/0/name", "value": "Bo"},
    }
    seq = record(task, reply([part(update, OLD)], mid="m-3"), "stream").seqs[0]
    a.refresh_from_db()
    assert a.data_model["items"] == [{"name": "Bo"}] and a.updated_seq == seq
    remove = {"version": "v0.9", "updateDataModel": {"surfaceId": "a", "path": "/heading"}}
    record(task, reply([part(remove, OLD)], mid="m-4"), "stream")
    a.refresh_from_db()
    assert "heading" not in a.data_model
    assert "unresolvable data path '/heading'" in a.problem
    delete = {"version": "v0.9", "deleteSurface": {"surfaceId": "b"}}
    record(task, reply([part(delete, NEW)], mid="m-5"), "stream")
    b.refresh_from_db()
    assert b.deleted and b.components == {}


def test_artifact_parts_fold_and_appended_chunks_continue_the_surface(task):
    create, components, data = v09_card()
    record(task, artifact_chunk([part([create, components])]), "stream")
    record(task, artifact_chunk([part(data)], append=True), "stream")
    surface = Surface.objects.get(task=task, surface_id="card")
    assert surface.data_model["heading"] == "Booked" and surface.problem == ""


def test_invalid_message_is_a_protocol_error_with_the_schema_path(task):
    bad = {"version": "v0.9", "updateComponents": {"surfaceId": "card", "components": [
        {"id": "root", "component": "Text", "text": 42}]}}  # fmt: skip
    create = v09_card()[0]
    result = record(task, reply([{"text": "hello"}, part([create, bad])], mid="m-1"), "stream")
    assert kinds(task) == ["message", "protocol-error"]
    note = errors(task)[0]
    assert "surface 'card'" in note and "/updateComponents/components/0/text" in note
    assert "schema path /" in note
    surface = Surface.objects.get(task=task)
    assert surface.problem.startswith("schema: at /updateComponents/components/0/text")
    assert surface.raw_json == bad
    assert surface.updated_seq == result.seqs[0]
    # the rest of the task keeps working
    record(task, status([{"text": "still here"}], mid="m-2", state="TASK_STATE_WORKING"), "stream")
    task.refresh_from_db()
    assert task.state == "TASK_STATE_WORKING"


def test_a_long_refused_message_is_kept_on_its_surface_cut(task):
    """A refused message was kept whole on its surface, and read and written out again on
    each draw (a 3 MB one made the task page, the inbox and the surfaces' redraw peak at
    60 MB for a page of 0.2 MB). The surface keeps its first characters; the log keeps it all."""
    from django.contrib.auth.models import User
    from django.test import Client

    from tasks_app.models import Membership
    from tests.people import member

    create = v09_card()[0]
    bad = {"version": "v0.9", "updateComponents": {"surfaceId": "card", "components": [
        {"id": "root", "component": "Text", "text": 42, "padding": "p" * 300_000}]}}  # fmt: skip
    record(task, reply([{"text": "hello"}, part([create, bad])], mid="m-1"), "stream")
    surface = Surface.objects.get(task=task)
    assert surface.problem
    kept = surface.raw_json
    assert set(kept) == {"cut", "chars"} and len(kept["cut"]) == a2ui.RAW_KEPT_CHARS
    assert kept["chars"] > 300_000 and kept["cut"].startswith('{"version":"v0.9"')
    logged = TaskEvent.objects.get(task=task, kind="message")
    assert "p" * 300_000 in str(logged.raw)  # the log keeps the message whole
    reader = Client()
    reader.force_login(member(User.objects.create_user("reader"), Membership.Role.VIEWER))
    page = reader.get(f"/tasks/{task.pk}/").content.decode()
    assert f"(cut: {kept['chars']:,} characters in all)" in page


def test_missing_component_is_diagnosed_once(task):
    create = v09_card()[0]
    broken = {"version": "v0.9", "updateComponents": {"surfaceId": "card", "components": [
        {"id": "root", "component": "Card", "child": "nowhere"}]}}  # fmt: skip
    record(task, reply([part([create, broken])], mid="m-1"), "stream")
    surface = Surface.objects.get(task=task)
    assert surface.problem == "missing component 'nowhere' (child of 'root')"
    assert surface.raw_json == broken
    assert errors(task) == ["A2UI surface 'card': missing component 'nowhere' (child of 'root')"]
    # A data update leaves the problem as it is: no second diagnosis.
    data = {"version": "v0.9", "updateDataModel": {"surfaceId": "card", "path": "/x", "value": 1}}
    record(task, reply([part(data)], mid="m-2"), "stream")
    assert len(errors(task)) == 1
    # The agent fixes it: the problem goes.
    fixed = {"version": "v0.9", "updateComponents": {"surfaceId": "card", "components": [
        {"id": "nowhere", "component": "Text", "text": "ok"}]}}  # fmt: skip
    record(task, reply([part(fixed)], mid="m-3"), "stream")
    surface.refresh_from_db()
    assert surface.problem == "" and surface.raw_json is None


def test_too_deep_and_too_large(task):
    create = v09_card("deep")[0]
    chain = [
        {"id": "root" if i == 0 else f"c{i}", "component": "Card", "child": f"c{i + 1}"}
        for i in range(a2ui.MAX_TREE_DEPTH + 1)
    ] + [{"id": f"c{a2ui.MAX_TREE_DEPTH + 1}", "component": "Text", "text": "bottom"}]
    deep = {"version": "v0.9", "updateComponents": {"surfaceId": "deep", "components": chain}}
    record(task, reply([part([create, deep])], mid="m-1"), "stream")
    assert Surface.objects.get(surface_id="deep").problem.startswith("too deep")
    big_create = v09_card("big")[0]
    big = {
        "version": "v0.9",
        "updateDataModel": {
            "surfaceId": "big",
            "value": {"blob": "x" * (a2ui.MAX_DATA_MODEL_BYTES + 1)},
        },
    }
    record(task, reply([part([big_create, big])], mid="m-2"), "stream")
    surface = Surface.objects.get(surface_id="big")
    assert surface.problem.startswith("too large: the data model is")
    assert surface.data_model == {}  # the update was not applied
    assert any("too large" in e for e in errors(task)) and any(
        "too deep" in e for e in errors(task)
    )


def test_unsupported_version_and_user_parts_are_not_folded(task):
    future = {"version": "v0.10", "createSurface": {"surfaceId": "f", "catalogId": "x"}}
    record(task, reply([part(future)], mid="m-1"), "stream")
    assert errors(task) == ["A2UI surface 'f': unsupported A2UI version 'v0.10'"]
    assert Surface.objects.get(surface_id="f").problem == "unsupported A2UI version 'v0.10'"
    # Our own messages (an action we sent) are client-to-server: never folded as a surface.
    mine = {
        "messageId": "u-1",
        "role": "ROLE_USER",
        "parts": [part([{"version": "v0.9", "action": {}}])],
    }
    record(task, {"operator": {"action": "answer", "message": mine}}, "operator")
    assert len(errors(task)) == 1


def test_duplicate_delivery_appends_nothing_new(task):
    event = status([part(v09_card())], mid="m-1", ts="2026-01-01T00:00:00Z")
    first = record(task, event, "stream")
    surface = Surface.objects.get(task=task)
    again = record(task, event, "push")
    also = record(task, reply([part(v09_card())], mid="m-1"), "poll")  # same message id
    assert first.seqs and again.duplicate and also.duplicate
    assert task.events.count() == 1
    surface2 = Surface.objects.get(task=task)
    assert surface2.updated_seq == surface.updated_seq and surface2.components == surface.components
    # A snapshot carrying the same status message and the same artifacts: nothing either.
    snap = {"task": {"id": "t-1", "contextId": "c-1", "status": event["statusUpdate"]["status"]}}
    assert record(task, snap, "poll").duplicate


def test_action_is_cleared_when_the_surface_changes(task, django_user_model):
    record(task, reply([part(v09_card())], mid="m-1"), "stream")
    surface = Surface.objects.get(task=task)
    user = django_user_model.objects.create(username="p")
    won = Surface.objects.filter(
        pk=surface.pk, updated_seq=surface.updated_seq, action_seq__isnull=True
    ).update(action_seq=99, action_by=user, action_name="book")
    assert won == 1
    update = {
        "version": "v0.9",
        "updateDataModel": {"surfaceId": "card", "path": "/heading", "value": "New"},
    }
    record(task, reply([part(update)], mid="m-2"), "stream")
    surface.refresh_from_db()
    assert surface.action_seq is None and surface.action_by is None and surface.action_name == ""


def test_replay_reproduces_surfaces_and_diagnoses(task):
    bad = {
        "version": "v0.9",
        "updateComponents": {"surfaceId": "card", "components": [{"id": "root"}]},
    }
    record_many(
        task,
        [
            reply([part(v08_booking(), OLD)], mid="m-1"),
            status([part([v09_card()[0], bad])], mid="m-2", ts="2026-01-01T00:00:01Z"),
            artifact_chunk([part(v09_card("art"))]),
        ],
        "stream",
    )
    record(task, reply([part(v09_card()[1:])], mid="m-3"), "stream")
    assert kinds(task) == ["message", "statusUpdate", "protocol-error", "artifactUpdate", "message"]
    result = replay(task)
    assert result.ok, str(result)
    # A changed surface is a difference replay names.
    Surface.objects.filter(task=task, surface_id="art").update(data_model={"forged": True})
    assert "surfaces" in str(replay(task))


def test_snapshot_artifacts_fold_when_they_change(task):
    create, comps, data = v09_card()

    def snap(parts: list, ts: str) -> dict:
        return {
            "task": {
                "id": "t-1",
                "contextId": "c-1",
                "status": {"state": "TASK_STATE_WORKING", "timestamp": ts},
                "artifacts": [{"artifactId": "ui", "parts": parts}],
            }
        }

    first = record(task, snap([part([create, comps])], "2026-01-01T00:00:00Z"), "poll")
    surface = Surface.objects.get(task=task)
    assert surface.updated_seq == first.seqs[0] and surface.data_model == {}
    assert record(task, snap([part([create, comps])], "2026-01-01T00:00:00Z"), "poll").duplicate
    later = record(task, snap([part([create, comps]), part(data)], "2026-01-01T00:00:01Z"), "poll")
    surface.refresh_from_db()
    assert surface.data_model["heading"] == "Booked" and surface.updated_seq == later.seqs[0]
    assert errors(task) == [] and replay(task).ok


def test_too_many_messages_in_one_event(task):
    create = v09_card()[0]
    updates = [
        {"version": "v0.9", "updateDataModel": {"surfaceId": "card", "path": f"/k{i}", "value": i}}
        for i in range(a2ui.MAX_MESSAGES_PER_EVENT + 10)
    ]
    record(task, reply([part([create, *updates])], mid="m-1"), "stream")
    limit = a2ui.MAX_MESSAGES_PER_EVENT
    assert errors(task) == [
        f"A2UI: too large: {limit + 11} messages in one event (at most {limit}); "
        "the rest is not folded"
    ]
    surface = Surface.objects.get(task=task)
    assert len(surface.data_model) == limit - 1  # the create, then the first updates
    assert replay(task).ok


def test_diagnoses_per_event_are_bounded(task):
    """Each refused message is diagnosed, but one event makes at most five rows of them: a
    chunk of 200 messages in an unknown version wrote 200 protocol-error rows."""
    unknown = [{"version": "v7", "createSurface": {"surfaceId": f"s{i}"}} for i in range(30)]
    record(task, reply([part(unknown)], mid="m-1"), "stream")
    limit = a2ui.MAX_DIAGNOSES_PER_EVENT
    listed = [f"A2UI surface 's{i}': unsupported A2UI version 'v7'" for i in range(limit - 1)]
    rest = 30 - (limit - 1)
    assert errors(task) == [
        *listed,
        f"A2UI: {rest} more problems in this event, not listed (at most {limit} entries an event)",
    ]
    # Each surface keeps its own problem all the same, and the log replays to the same.
    assert Surface.objects.filter(task=task).count() == 30
    assert all(s.problem for s in Surface.objects.filter(task=task))
    assert replay(task).ok


def test_components_per_event_are_bounded(task):
    half = a2ui.MAX_COMPONENTS // 2 + 10

    def many(sid: str) -> dict:
        items = [
            {"id": "root", "component": "Column", "children": [f"d{i}" for i in range(half - 1)]}
        ]
        items += [{"id": f"d{i}", "component": "Divider"} for i in range(half - 1)]
        return {"version": "v0.9", "updateComponents": {"surfaceId": sid, "components": items}}

    record(
        task,
        reply([part([create_for("a"), many("a"), create_for("b"), many("b")])], mid="m-1"),
        "stream",
    )
    assert len(Surface.objects.get(surface_id="a").components) == half
    assert Surface.objects.get(surface_id="b").components == {}  # created, its components refused
    assert errors(task) == [
        f"A2UI surface 'b': too large: more than {a2ui.MAX_COMPONENTS} components in one event; "
        "1 message(s) not folded"
    ]


def create_for(sid: str) -> dict:
    return v09_card(sid)[0]


def test_v08_data_model_update_at_a_path_and_delete(task):
    record(task, reply([part(v08_booking(), OLD)], mid="m-1"), "stream")
    update = dump(
        s08.DataModelUpdateMessage(
            dataModelUpdate=s08.DataModelUpdate(
                surfaceId="book",
                path="form",
                contents=[{"key": "date", "valueString": "2026-12-24"}],
            )
        )
    )
    seq = record(task, reply([part(update, OLD)], mid="m-2"), "stream").seqs[0]
    surface = Surface.objects.get(surface_id="book")
    assert surface.data_model["form"] == {"date": "2026-12-24"} and surface.updated_seq == seq
    delete = dump(s08.DeleteSurfaceMessage(deleteSurface=s08.DeleteSurface(surfaceId="book")))
    record(task, reply([part(delete, OLD)], mid="m-3"), "stream")
    surface.refresh_from_db()
    assert surface.deleted and not surface.ready and surface.components == {}
    assert errors(task) == [] and replay(task).ok


POOL = [
    ("create", lambda sid: v09_card(sid)[0]),
    ("components", lambda sid: v09_card(sid)[1]),
    ("data", lambda sid: v09_card(sid)[2]),
    ("broken", lambda sid: {"version": "v0.9", "updateComponents": {"surfaceId": sid, "components": [
        {"id": "root", "component": "Card", "child": "gone"}]}}),
    ("invalid", lambda sid: {"version": "v0.9", "updateDataModel": {"surfaceId": sid, "bad": 1}}),
    ("delete", lambda sid: {"version": "v0.9", "deleteSurface": {"surfaceId": sid}}),
]  # fmt: skip


@settings(
    max_examples=examples(25),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(range(len(POOL))), st.sampled_from(["x", "y"])),
        min_size=1,
        max_size=6,
    )
)
def test_a_batch_folds_as_its_entries_one_by_one(db, steps):
    agent = Agent.objects.create(name="h", base_url=f"http://127.0.0.1:1/{uuid.uuid4().hex}")
    batch, single = (RemoteTask.objects.create(agent=agent, title=t) for t in ("b", "s"))
    events = [reply([part(POOL[i][1](sid))], mid=f"m-{n}") for n, (i, sid) in enumerate(steps)]
    record_many(batch, events, "stream")
    for event in events:
        record(single, event, "stream")

    def log(task: RemoteTask) -> list[tuple[str, str]]:
        return list(task.events.order_by("seq").values_list("kind", "note"))

    assert log(batch) == log(single)
    assert surfaces_view(batch) == surfaces_view(single)

    def seqs(task: RemoteTask) -> dict[str, int]:
        return dict(Surface.objects.filter(task=task).values_list("surface_id", "updated_seq"))

    assert seqs(batch) == seqs(single)
    assert replay(batch).ok


@pytest.mark.parametrize("shape", ["v0.9 tabs", "v0.8 tabItems", "v0.8 options", "v0.8 context"])
def test_a_list_property_given_as_a_number_is_folded_not_an_error(task, shape, caplog):
    """``"tabs": 5`` raised TypeError in the fold: a traceback, one 'could not be folded'
    row, and the row's valid createSurface lost with it."""
    from tasks_app.models import Surface

    if shape == "v0.9 tabs":
        messages = [
            {"version": "v0.9", "createSurface": {"surfaceId": "x", "catalogId": "urn:custom"}},
            {"version": "v0.9", "updateComponents": {"surfaceId": "x", "components": [
                {"id": "root", "component": "Tabs", "tabs": 5}]}},
        ]  # fmt: skip
        media = NEW
    else:
        prop = {"v0.8 tabItems": {"Tabs": {"tabItems": 5}},
                "v0.8 options": {"MultipleChoice": {"options": 5}},
                "v0.8 context": {"Button": {"child": "t", "action": {"name": "go", "context": 5}}},
                }[shape]  # fmt: skip
        messages = [
            {"beginRendering": {"surfaceId": "x", "root": "root", "catalogId": "urn:custom"}},
            {"surfaceUpdate": {"surfaceId": "x", "components": [
                {"id": "root", "component": prop}]}},
        ]  # fmt: skip
        media = OLD
    record(task, status([part(messages, media)], mid="m-1"), "stream")
    assert Surface.objects.filter(task=task, surface_id="x").exists()
    assert not any("could not be folded" in note for note in errors(task))
    assert "Traceback" not in caplog.text
