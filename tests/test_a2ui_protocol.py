"""The pure A2UI layer (tasks_app/a2a/a2ui.py): negotiation, detection, validation, the fold.

Genuine messages come from the A2UI project's own Python SDK (``a2ui-core``); what we
send (capabilities, actions, the data model) is checked against the vendored schemas.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from a2ui.builder.v0_9 import (
    Action,
    ActionEvent,
    Button,
    Card,
    CheckBox,
    ChoicePicker,
    ChoicePickerOption,
    Column,
    DateTimeInput,
    Divider,
    Icon,
    Image,
    Modal,
    Row,
    Slider,
    Tabs,
    Text,
    TextField,
)
from a2ui.builder.v0_9.catalogs.basic import TabItem
from a2ui.core.schema.common_types import DataBinding
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tasks_app.a2a import a2ui
from tests.examples import examples

SCHEMAS = a2ui.SCHEMA_DIR


def schema(name: str) -> dict:
    return json.loads((SCHEMAS / name).read_text())


def create(sid: str = "s") -> dict:
    return {"version": "v0.9", "createSurface": {"surfaceId": sid, "catalogId": a2ui.V09_CATALOG}}


def components(items: list[dict], sid: str = "s") -> dict:
    return {"version": "v0.9", "updateComponents": {"surfaceId": sid, "components": items}}


# Negotiation -------------------------------------------------------------------------------


def test_declared_version_picks_the_newest_we_support():
    def card(*uris: str) -> dict:
        return {"capabilities": {"extensions": [{"uri": u} for u in uris]}}

    base = a2ui.EXTENSION_BASE
    assert a2ui.declared_version(card(base + "v0.8", base + "v0.9.1")) == "0.9.1"
    assert a2ui.declared_version(card(base + "v0.8")) == "0.8"
    assert a2ui.declared_version(card(base + "v0.9")) == "0.9"
    # drafts without a published schema, and other extensions: nothing
    assert a2ui.declared_version(card(base + "v0.10", base + "v1.0", "urn:x")) is None
    assert a2ui.declared_version({"capabilities": {"extensions": "no"}}) is None
    assert a2ui.declared_version(None) is None


@pytest.mark.parametrize(
    ("version", "schema_file"),
    [("0.8", "v0_8/a2ui_client_capabilities_schema.json"), ("0.9", "v0_9/client_capabilities.json"),
     ("0.9.1", "v0_9/client_capabilities.json")],
)  # fmt: skip
def test_capabilities_follow_each_versions_schema(version, schema_file):
    metadata = a2ui.client_capabilities_metadata(version)
    assert list(metadata) == ["a2uiClientCapabilities"]
    jsonschema.validate(metadata["a2uiClientCapabilities"], schema(schema_file))


# Detection ---------------------------------------------------------------------------------


@pytest.mark.parametrize("media", ["application/json+a2ui", "application/a2ui+json"])
def test_parts_are_detected_by_media_type_or_metadata(media):
    message = create()
    assert a2ui.is_a2ui_part({"data": message, "mediaType": media})
    assert a2ui.is_a2ui_part({"data": [message], "metadata": {"mimeType": media}})
    assert a2ui.is_a2ui_part({"data": message, "mediaType": media.upper() + "; charset=utf-8"})
    assert a2ui.messages_in_part({"data": message, "mediaType": media}) == [message]
    assert a2ui.messages_in_part({"data": [message, message], "mediaType": media}) == [message] * 2
    assert not a2ui.is_a2ui_part({"data": message, "mediaType": "application/json"})
    assert not a2ui.is_a2ui_part({"text": "x", "mediaType": media})
    assert a2ui.messages_in_part({"text": "x"}) == []


def test_message_version():
    assert a2ui.message_version(create(), "application/json+a2ui") == "0.9"
    assert a2ui.message_version(create(), "application/a2ui+json") == "0.9.1"
    assert a2ui.message_version({**create(), "version": "v0.9.1"}) == "0.9.1"
    assert a2ui.message_version({"beginRendering": {"surfaceId": "s", "root": "r"}}) == "0.8"
    assert a2ui.message_version({"version": "v0.8", "deleteSurface": {"surfaceId": "s"}}) == "0.8"
    assert a2ui.message_version({"version": "v0.10", "createSurface": {}}) is None
    assert a2ui.message_version("text") is None


# Validation --------------------------------------------------------------------------------


def every_basic_component() -> list[dict]:
    """One of each basic-catalog component, built with the A2UI SDK's builder."""
    name = DataBinding(path="/name")
    tree = Card(
        id="root",
        child=Column(
            children=[
                Text(text="Title", variant="h2"),
                Image(url="https://example.org/a.png"),
                Icon(name="check"),
                Divider(),
                Row(children=[TextField(label="Name", value=name), CheckBox(label="OK", value=True)]),
                ChoicePicker(options=[ChoicePickerOption(label="A", value="a")], value=["a"]),
                Slider(value=3, max=10),
                DateTimeInput(value="2026-01-01", enableDate=True),
                Tabs(tabs=[TabItem(title="T", child=Text(text="in tab"))]),
                Modal(trigger=Text(text="open"), content=Text(text="inside")),
                Button(child=Text(text="Go"), action=Action(event=ActionEvent(name="go", context={"n": name}))),
            ]
        ),
    )  # fmt: skip
    return tree.flatten()


def test_genuine_messages_validate_and_fold():
    items = every_basic_component()
    surfaces: dict = {}
    for message in (create(), components(items)):
        assert a2ui.validate("0.9.1", message) is None
        assert a2ui.apply(surfaces, "0.9.1", message).applied
    surface = surfaces["s"]
    assert surface["problem"] == "" and surface["ready"]
    assert {c["component"] for c in surface["components"].values()} >= {
        "Text", "Image", "Icon", "Divider", "Row", "Column", "Card", "Tabs", "Modal",
        "Button", "TextField", "CheckBox", "ChoicePicker", "DateTimeInput", "Slider",
    }  # fmt: skip


def test_schema_reason_names_the_place_and_the_schema_path():
    bad = components([{"id": "root", "component": "Button", "child": "x", "action": {"event": {}}}])
    reason = a2ui.validate("0.9.1", bad)
    assert reason is not None
    assert "at /updateComponents/components/0/action/event" in reason
    assert "'name' is a required property" in reason
    assert "(schema path /" in reason and reason.endswith("/required)")
    reason08 = a2ui.validate("0.8", {"beginRendering": {"surfaceId": "s"}})
    assert reason08 == (
        "schema: at /beginRendering: 'root' is a required property "
        "(schema path /properties/beginRendering/required)"
    )


def test_other_catalogs_are_checked_for_shape_only():
    custom = components([{"id": "root", "component": "Map", "lat": 1}])
    assert a2ui.validate("0.9.1", custom) is not None
    assert a2ui.validate("0.9.1", custom, catalog_id="example.com:maps") is None


def test_too_deep_message_is_refused_without_recursing():
    deep: dict = {"leaf": 1}
    for _ in range(5000):
        deep = {"x": deep}
    message = {"version": "v0.9", "updateDataModel": {"surfaceId": "s", "value": deep}}
    assert a2ui.validate("0.9", message) == (
        f"too deep: the message nests more than {a2ui.MAX_JSON_DEPTH} levels"
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
keys = st.sampled_from([*a2ui.V08_KEYS, *a2ui.V09_KEYS, "version", "surfaceId", "components"])


@settings(max_examples=examples(200), deadline=None)
@given(
    message=st.dictionaries(keys, json_values | st.dictionaries(keys, json_values), max_size=3),
    version=st.sampled_from(["0.8", "0.9", "0.9.1"]),
)
def test_any_json_gives_a_reason_or_a_fold_never_an_exception(message, version):
    reason = a2ui.validate(version, message)
    assert reason is None or isinstance(reason, str)
    surfaces: dict = {}
    outcome = a2ui.apply(surfaces, version, message)
    assert outcome.applied or outcome.problem
    json.dumps(surfaces)  # what is folded is storable JSON


# The fold ----------------------------------------------------------------------------------


tokens = st.text(alphabet="ab/~_1", min_size=1, max_size=5)


@settings(max_examples=examples(150), deadline=None)
@given(path=st.lists(tokens, min_size=1, max_size=4), value=json_values)
@example(path=["a", "b"], value=1)
@example(path=["a", "2"], value=1)
@example(path=["a", "1", "b"], value=None)
def test_data_model_updates_land_at_their_pointer(path, value):
    pointer = "/" + "/".join(t.replace("~", "~0").replace("/", "~1") for t in path)
    surfaces: dict = {}
    a2ui.apply(surfaces, "0.9.1", create())
    start = {"surfaceId": "s", "value": {"a": [1, {"b": 2}]}}
    a2ui.apply(surfaces, "0.9.1", {"version": "v0.9", "updateDataModel": start})
    before = surfaces["s"]
    before_json = json.dumps(before["data_model"], sort_keys=True)
    update = {
        "version": "v0.9",
        "updateDataModel": {"surfaceId": "s", "path": pointer, "value": value},
    }
    outcome = a2ui.apply(surfaces, "0.9.1", update)
    # Copy on write: the data model before is untouched, whatever the update did.
    assert json.dumps(before["data_model"], sort_keys=True) == before_json
    if not outcome.applied:  # e.g. /a/b with a list at /a
        assert outcome.problem.startswith("unresolvable data path: it goes through a list")
        assert surfaces["s"]["data_model"] == before["data_model"]
        return
    assert a2ui.lookup(surfaces["s"]["data_model"], pointer) == (True, value)
    assert a2ui.resolve({"path": pointer}, surfaces["s"]["data_model"]) == value
    remove = {"version": "v0.9", "updateDataModel": {"surfaceId": "s", "path": pointer}}
    a2ui.apply(surfaces, "0.9.1", remove)
    assert a2ui.lookup(surfaces["s"]["data_model"], pointer)[0] is False


@settings(max_examples=examples(100), deadline=None)
@given(text=st.text(max_size=40))
def test_strings_stay_strings(text):
    surfaces: dict = {}
    a2ui.apply(surfaces, "0.9.1", create())
    a2ui.apply(surfaces, "0.9.1", components([{"id": "root", "component": "Text", "text": text}]))
    assert surfaces["s"]["components"]["root"]["text"] == text
    v08 = {"surfaceUpdate": {"surfaceId": "o", "components": [
        {"id": "root", "component": {"Text": {"text": {"literalString": text}}}}]}}  # fmt: skip
    a2ui.apply(surfaces, "0.8", v08)
    assert surfaces["o"]["components"]["root"]["text"] == text


def every_v08_component() -> list[dict]:
    lit = {"literalString": "x"}
    specs = {
        "Text": {"text": {"path": "/t", "literalString": "init"}, "usageHint": "h1"},
        "Image": {"url": {"literalString": "https://example.org/i.png"}, "altText": lit, "fit": "scale-down", "usageHint": "icon"},
        "Icon": {"name": {"literalString": "check"}},
        "Video": {"url": {"literalString": "https://example.org/v.mp4"}},
        "AudioPlayer": {"url": {"literalString": "https://example.org/a.mp3"}, "description": lit},
        "Row": {"children": {"explicitList": ["c-Text"]}, "distribution": "spaceBetween", "alignment": "center"},
        "List": {"children": {"template": {"componentId": "c-Divider", "dataBinding": "/items"}}, "direction": "horizontal"},
        "Card": {"child": "c-Text"},
        "Tabs": {"tabItems": [{"title": lit, "child": "c-Text"}]},
        "Divider": {"axis": "vertical"},
        "Modal": {"entryPointChild": "c-Text", "contentChild": "c-Icon"},
        "Button": {"child": "c-Text", "primary": True, "action": {"name": "go", "context": [
            {"key": "a", "value": {"path": "/t"}}, {"key": "b", "value": {"literalNumber": 2}},
            {"key": "c", "value": {"literalBoolean": True}}]}},
        "CheckBox": {"label": lit, "value": {"literalBoolean": False}},
        "TextField": {"label": lit, "text": {"path": "/name"}, "textFieldType": "obscured", "validationRegexp": "^.+$"},
        "DateTimeInput": {"value": {"path": "/when"}, "enableDate": True, "enableTime": False},
        "MultipleChoice": {"selections": {"literalArray": ["a"]}, "options": [{"label": lit, "value": "a"}], "maxAllowedSelections": 2},
        "Slider": {"label": lit, "value": {"literalNumber": 1}, "minValue": 0, "maxValue": 5},
    }  # fmt: skip
    items = [{"id": f"c-{name}", "component": {name: props}} for name, props in specs.items()]
    children = [i["id"] for i in items]
    items.append({"id": "root", "component": {"Column": {"children": {"explicitList": children}}}})
    items.append(
        {"id": "date", "component": {"TextField": {"label": lit, "textFieldType": "date"}}}
    )
    return items


def test_every_v08_component_converts_to_valid_v091_form():
    update = {"surfaceUpdate": {"surfaceId": "s", "components": every_v08_component()}}
    assert a2ui.validate("0.8", update) is None
    surfaces: dict = {}
    assert a2ui.apply(surfaces, "0.8", update).applied
    data = {"dataModelUpdate": {"surfaceId": "s", "contents": [{"key": "items", "valueMap": []}]}}
    a2ui.apply(surfaces, "0.8", data)
    a2ui.apply(surfaces, "0.8", {"beginRendering": {"surfaceId": "s", "root": "root"}})
    surface = surfaces["s"]
    converted = list(surface["components"].values())
    # The converted components are what the v0.9.1 basic catalog accepts.
    assert a2ui.validate("0.9.1", components(converted)) is None
    comps = surface["components"]
    assert comps["c-Text"] == {
        "id": "c-Text",
        "component": "Text",
        "text": {"path": "/t"},
        "variant": "h1",
    }
    assert surface["data_model"]["t"] == "init"  # the v0.8 path-and-literal shorthand
    assert comps["c-Image"]["fit"] == "scaleDown" and comps["c-Image"]["description"] == "x"
    assert comps["c-Row"] | {} == {
        "id": "c-Row",
        "component": "Row",
        "children": ["c-Text"],
        "justify": "spaceBetween",
        "align": "center",
    }
    assert comps["c-List"]["children"] == {"componentId": "c-Divider", "path": "/items"}
    assert comps["c-Tabs"]["tabs"] == [{"title": "x", "child": "c-Text"}]
    assert (comps["c-Modal"]["trigger"], comps["c-Modal"]["content"]) == ("c-Text", "c-Icon")
    assert comps["c-Button"]["action"] == {
        "event": {"name": "go", "context": {"a": {"path": "/t"}, "b": 2, "c": True}}
    }
    assert comps["c-MultipleChoice"]["component"] == "ChoicePicker"
    assert comps["c-MultipleChoice"]["variant"] == "multipleSelection"
    assert comps["c-MultipleChoice"]["value"] == ["a"]
    assert (comps["c-Slider"]["min"], comps["c-Slider"]["max"]) == (0, 5)
    assert (
        comps["c-TextField"]["value"] == {"path": "/name"}
        and comps["c-TextField"]["variant"] == "obscured"
    )
    assert comps["date"]["component"] == "DateTimeInput" and comps["date"]["enableDate"] is True
    assert surface["problem"] == ""  # fmt: skip


def test_urls_outside_http_are_dropped_at_fold_time():
    surfaces: dict = {}
    a2ui.apply(surfaces, "0.9.1", create())
    items = [
        {"id": "root", "component": "Column", "children": ["a", "b"]},
        {"id": "a", "component": "Image", "url": "javascript:alert(1)"},
        {"id": "b", "component": "Image", "url": "https://example.org/ok.png"},
    ]
    a2ui.apply(surfaces, "0.9.1", components(items))
    comps = surfaces["s"]["components"]
    assert "url" not in comps["a"] and comps["b"]["url"] == "https://example.org/ok.png"
    for bad in (
        "data:image/png;base64,AA",
        "//example.org/x",
        "file:///etc/passwd",
        " javascript:x",
        "",
    ):
        assert a2ui.safe_url(bad) is None
    assert a2ui.safe_url("HTTP://Example.org/a") == "HTTP://Example.org/a"


def test_lifecycle_rules():
    surfaces: dict = {}
    early = components([{"id": "root", "component": "Text", "text": "x"}])
    outcome = a2ui.apply(surfaces, "0.9.1", early)
    assert outcome.problem == "updateComponents before createSurface for surface 's'"
    a2ui.apply(surfaces, "0.9.1", create())
    assert a2ui.apply(surfaces, "0.9.1", early).applied
    assert a2ui.apply(surfaces, "0.9.1", create()).applied  # the same create again: no reset
    assert "root" in surfaces["s"]["components"]
    mixed = a2ui.apply(surfaces, "0.8", {"deleteSurface": {"surfaceId": "s"}})
    assert mixed.problem.startswith("version mismatch")
    a2ui.apply(surfaces, "0.9.1", {"version": "v0.9", "deleteSurface": {"surfaceId": "s"}})
    assert surfaces["s"]["deleted"] and surfaces["s"]["components"] == {}
    cyclic = [
        {"id": "root", "component": "Card", "child": "a"},
        {"id": "a", "component": "Card", "child": "root"},
    ]
    a2ui.apply(surfaces, "0.9.1", create("c"))
    assert a2ui.apply(surfaces, "0.9.1", components(cyclic, "c")).problem == (
        "cycle: component 'root' contains itself"
    )


def test_too_deep_path_and_too_many_surfaces():
    surfaces: dict = {}
    a2ui.apply(surfaces, "0.9.1", create())
    deep = {"version": "v0.9", "updateDataModel": {"surfaceId": "s", "path": "/a" * 40, "value": 1}}
    outcome = a2ui.apply(surfaces, "0.9.1", deep)
    assert outcome.problem == f"too deep: a data path has more than {a2ui.MAX_JSON_DEPTH} levels"
    assert surfaces["s"]["data_model"] == {}
    for i in range(a2ui.MAX_SURFACES - 3):
        assert a2ui.apply(surfaces, "0.9.1", create(f"s{i}"), others=2).applied
    refused = a2ui.apply(surfaces, "0.9.1", create("one-too-many"), others=2)
    assert refused.problem == f"too many surfaces: at most {a2ui.MAX_SURFACES} per task"
    assert "one-too-many" not in surfaces


def test_ids_longer_than_their_columns_are_refused():
    surfaces: dict = {}
    long_id = "s" * (a2ui.MAX_ID_CHARS + 1)
    outcome = a2ui.apply(surfaces, "0.9.1", create(long_id))
    assert outcome.problem == f"too large: surfaceId is longer than {a2ui.MAX_ID_CHARS} characters"
    assert surfaces == {}  # no row that could not be stored
    catalog = {"version": "v0.9", "createSurface": {"surfaceId": "s", "catalogId": "c" * 501}}
    assert a2ui.apply(surfaces, "0.9.1", catalog).problem.startswith("too large: catalogId")
    root = {"beginRendering": {"surfaceId": "o", "root": "r" * 201}}
    assert a2ui.apply(surfaces, "0.8", root).problem.startswith("too large: root")


def test_too_many_components_is_refused():
    surfaces: dict = {}
    a2ui.apply(surfaces, "0.9.1", create())
    many = [{"id": f"t{i}", "component": "Divider"} for i in range(a2ui.MAX_COMPONENTS + 1)]
    outcome = a2ui.apply(surfaces, "0.9.1", components(many))
    assert not outcome.applied and outcome.problem.startswith("too large:")
    assert surfaces["s"]["components"] == {}


# Acting ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "schema_file"),
    [("0.8", "v0_8/client_to_server.json"), ("0.9", "v0_9/client_to_server.json"),
     ("0.9.1", "v0_9/client_to_server.json")],
)  # fmt: skip
def test_action_message_follows_the_schema(version, schema_file):
    model = {"form": {"name": "Ann"}}
    message = a2ui.action_message(
        version,
        name="submit",
        surface_id="s",
        source_component_id="ok",
        context={"who": {"path": "/form/name"}, "n": 2, "rel": {"path": "name"}},
        data_model=model,
        timestamp="2026-01-01T00:00:00.000Z",
        scope_path="/form",
    )
    jsonschema.validate(message, schema(schema_file))
    body = message["userAction"] if version == "0.8" else message["action"]
    assert body["context"] == {"who": "Ann", "n": 2, "rel": "Ann"}
    part = a2ui.action_part(version, message)
    assert a2ui.is_a2ui_part(part) and a2ui.messages_in_part(part) == [message]
    assert part["mediaType"] == (
        "application/a2ui+json" if version == "0.9.1" else "application/json+a2ui"
    )
    metadata = a2ui.action_metadata(version, "s", model)
    if version == "0.8":
        assert metadata == {}
    else:
        jsonschema.validate(metadata["a2uiClientDataModel"], schema("v0_9/client_data_model.json"))


# The bounds kept as a data model changes (a2ui._set) ---------------------------------------

_leaves = (
    st.none() | st.booleans() | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=4)
)  # fmt: skip
_keys = st.sampled_from(["a", "b", "x/y", "é", "~"])  # the paths' names: updates meet them
_values = st.recursive(
    _leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=3),
    max_leaves=10,
)
_paths = st.lists(st.sampled_from(["a", "b", "0", "1", "2", "x/y", "é", "~"]), max_size=5)
_updates = st.lists(st.tuples(_paths, _values | st.just(a2ui._MISSING)), max_size=8)


@settings(max_examples=examples(400), deadline=None)
@given(model=st.dictionaries(_keys, _values, max_size=4), updates=_updates)
def test_a_data_models_kept_size_and_depth_are_what_the_whole_model_has(model, updates) -> None:
    """Each update's new model gets its size from the size before and what the update
    changed, and its depth is checked on the new value alone: after any updates, both are
    what writing out and walking the whole model give (an agent's updates to a large model
    each walked and wrote it all: 5 s for one event of 200 updates)."""
    limit, saved = 4, a2ui.MAX_JSON_DEPTH
    a2ui.MAX_JSON_DEPTH = limit  # deep enough to be reached by these values
    try:
        data = model if not a2ui._depth(model, limit) else {}
        for path, value in updates:
            pointer = a2ui._pointer(path)
            try:
                new = a2ui._set(data, pointer, value)
            except (a2ui._NoFit, a2ui._TooDeep):
                continue
            except a2ui._ModelTooDeep:
                a2ui.MAX_JSON_DEPTH = 100
                try:
                    assert a2ui._depth(a2ui._set(data, pointer, value), limit)
                finally:
                    a2ui.MAX_JSON_DEPTH = limit
                continue
            assert not a2ui._depth(new, limit)
            assert a2ui.known_size(new) == a2ui._size(new)
            data = new
    finally:
        a2ui.MAX_JSON_DEPTH = saved


def test_components_keep_their_size_as_they_are_put_in() -> None:
    before = {"root": {"id": "root", "component": "Column", "children": ["t"]}}
    after = a2ui._with_components(
        before,
        [{"id": "t", "component": "Text", "text": "é"}, {"id": "root", "component": "Text", "text": "x"},
         {"id": "t", "component": "Text", "text": "longer"}],
    )  # fmt: skip
    assert a2ui.known_size(after) == a2ui._size(after) and after is not before
    assert a2ui._size(before) == len(json.dumps(before, separators=(",", ":")))  # unchanged
