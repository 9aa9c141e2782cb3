"""A2A agents (the official a2a-sdk server) that ask with A2UI surfaces, for the page tests.

The surfaces are built with the A2UI project's own SDK models (``a2ui-core``), v0.8 and
v0.9.1, so what the dashboard draws is what a real A2UI agent sends. Each agent runs in a
thread of the test process on 127.0.0.1 and keeps every message it received, so a test
reads the action a person sent from the agent itself.

Scripts (the first word of the message that starts the task):

* ``form``: INPUT_REQUIRED with a small form (name, guests, a choice, a checkbox, a button);
  the action completes the task, echoing the action's context.
* ``xss``: INPUT_REQUIRED with a v0.9.1 surface carrying ``PAYLOAD`` in every string field
  (v0.9.1 agents only).

The negotiation tests' agents (``negotiating_agent``) ask once, with one surface or none, and
complete on the answer. Test modules import this one inside their tests: the SDKs it loads
cost each process about half a second, and every run collects every module.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from a2a.helpers.proto_helpers import (
    get_data_parts,
    new_data_part,
    new_task_from_user_message,
    new_text_part,
)
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import a2a_pb2 as pb
from a2ui.core.schema.v0_8 import server_to_client as s08
from a2ui.core.schema.v0_9 import server_to_client as s09
from google.protobuf.json_format import MessageToDict
from starlette.applications import Starlette

from tasks_app.a2a import a2ui
from tests.agents import free_port

# Script, markup, an event handler, a javascript: URL, quotes that would close an attribute.
PAYLOAD = (
    '<script>window.__xss=1</script><img src=x onerror="window.__xss=1">'
    "'\"><svg/onload=window.__xss=1>javascript:window.__xss=1"
)


def _dump(model: Any) -> dict:
    return model.model_dump(by_alias=True, exclude_none=True, mode="json")


def form_091(surface_id: str = "form") -> list[dict]:
    comps = [
        {"id": "root", "component": "Column", "children": ["q", "name", "guests", "meal", "ok-box", "send"]},
        {"id": "q", "component": "Text", "text": {"path": "/question"}},
        {"id": "name", "component": "TextField", "label": "Name", "value": {"path": "/answer/name"},
         "checks": [{"condition": {"call": "required", "args": {"value": {"path": "/answer/name"}}},
                     "message": "A name, please."}]},
        {"id": "guests", "component": "Slider", "label": "Guests", "min": 1, "max": 8,
         "value": {"path": "/answer/guests"}},
        {"id": "meal", "component": "ChoicePicker", "label": "Meal", "value": {"path": "/answer/meal"},
         "options": [{"label": "Fish", "value": "fish"}, {"label": "Meat", "value": "meat"}]},
        {"id": "ok-box", "component": "CheckBox", "label": "Confirm", "value": {"path": "/answer/ok"}},
        {"id": "send", "component": "Button", "child": "send-label", "variant": "primary",
         "action": {"event": {"name": "submit", "context": {
             "name": {"path": "/answer/name"}, "guests": {"path": "/answer/guests"},
             "meal": {"path": "/answer/meal"}, "ok": {"path": "/answer/ok"}}}}},
        {"id": "send-label", "component": "Text", "text": "Send"},
    ]  # fmt: skip
    model = {
        "question": "Who is coming?",
        "answer": {"name": "", "guests": 2, "meal": [], "ok": False},
    }
    return [
        _dump(s09.CreateSurfaceMessage(createSurface=s09.CreateSurface(surfaceId=surface_id, catalogId=a2ui.V091_CATALOG))),
        _dump(s09.UpdateComponentsMessage(updateComponents=s09.UpdateComponents(surfaceId=surface_id, components=comps))),
        _dump(s09.UpdateDataModelMessage(updateDataModel=s09.UpdateDataModel(surfaceId=surface_id, value=model))),
    ]  # fmt: skip


def form_08(surface_id: str = "form") -> list[dict]:
    def lit(text: str) -> dict:
        return {"literalString": text}

    comps = [
        {"id": "root", "component": {"Column": {"children": {"explicitList": ["q", "name", "guests", "meal", "ok-box", "send"]}}}},
        {"id": "q", "component": {"Text": {"text": {"path": "/question"}}}},
        {"id": "name", "component": {"TextField": {"label": lit("Name"), "text": {"path": "/answer/name"}}}},
        {"id": "guests", "component": {"Slider": {"value": {"path": "/answer/guests"}, "minValue": 1, "maxValue": 8}}},
        {"id": "meal", "component": {"MultipleChoice": {"selections": {"path": "/answer/meal"}, "maxAllowedSelections": 1,
                                                         "options": [{"label": lit("Fish"), "value": "fish"},
                                                                     {"label": lit("Meat"), "value": "meat"}]}}},
        {"id": "ok-box", "component": {"CheckBox": {"label": lit("Confirm"), "value": {"path": "/answer/ok"}}}},
        {"id": "send", "component": {"Button": {"child": "send-label", "primary": True, "action": {
            "name": "submit", "context": [
                {"key": "name", "value": {"path": "/answer/name"}},
                {"key": "guests", "value": {"path": "/answer/guests"}},
                {"key": "meal", "value": {"path": "/answer/meal"}},
                {"key": "ok", "value": {"path": "/answer/ok"}}]}}}},
        {"id": "send-label", "component": {"Text": {"text": lit("Send")}}},
    ]  # fmt: skip
    contents = [
        {"key": "question", "valueString": "Who is coming?"},
        {"key": "answer", "valueMap": [
            {"key": "name", "valueString": ""}, {"key": "guests", "valueNumber": 2},
            {"key": "ok", "valueBoolean": False}]},
    ]  # fmt: skip
    return [
        _dump(s08.SurfaceUpdateMessage(surfaceUpdate=s08.SurfaceUpdate(surfaceId=surface_id, components=comps))),
        _dump(s08.DataModelUpdateMessage(dataModelUpdate=s08.DataModelUpdate(surfaceId=surface_id, contents=contents))),
        _dump(s08.BeginRenderingMessage(beginRendering=s08.BeginRendering(surfaceId=surface_id, root="root"))),
    ]  # fmt: skip


def xss_091(surface_id: str = "xss") -> list[dict]:
    """Every component of the basic catalog with ``PAYLOAD`` in every string field it has."""
    p = PAYLOAD
    comps = [
        {"id": "root", "component": "Column", "children": ["t", "img", "icon", "vid", "aud", "div", "row", "card", "tabs", "modal", "list", "send"],
         "accessibility": {"label": p, "description": p}},
        {"id": "t", "component": "Text", "text": p, "variant": "h1"},
        {"id": "img", "component": "Image", "url": "https://example.org/x.png?" + p, "description": p},
        {"id": "icon", "component": "Icon", "name": {"path": "/p"}},
        {"id": "vid", "component": "Video", "url": "https://example.org/v.mp4#" + p},
        {"id": "aud", "component": "AudioPlayer", "url": "https://example.org/a.mp3", "description": p},
        {"id": "div", "component": "Divider"},
        {"id": "row", "component": "Row", "children": ["tf", "cb"]},
        {"id": "tf", "component": "TextField", "label": p, "value": {"path": "/p"}, "validationRegexp": p,
         "checks": [{"condition": {"call": "regex", "args": {"value": {"path": "/p"}, "pattern": p}}, "message": p}]},
        {"id": "cb", "component": "CheckBox", "label": p, "value": {"path": "/b"}},
        {"id": "card", "component": "Card", "child": "cp"},
        {"id": "cp", "component": "ChoicePicker", "label": p, "value": {"path": "/choice"},
         "options": [{"label": p, "value": p}]},
        {"id": "tabs", "component": "Tabs", "tabs": [{"title": p, "child": "dt"}, {"title": {"path": "/p"}, "child": "sl"}]},
        {"id": "dt", "component": "DateTimeInput", "label": p, "enableDate": True, "value": {"path": "/p"}},
        {"id": "sl", "component": "Slider", "label": p, "max": 10, "value": {"path": "/n"}},
        {"id": "modal", "component": "Modal", "trigger": "mt", "content": "mc"},
        {"id": "mt", "component": "Text", "text": p},
        {"id": "mc", "component": "Text", "text": {"call": "formatString", "args": {"value": "${/p}"}, "returnType": "string"}},
        {"id": "list", "component": "List", "children": {"componentId": "item", "path": "/items"}},
        {"id": "item", "component": "Text", "text": {"path": "name"}},
        {"id": "send", "component": "Button", "child": "send-label",
         "action": {"event": {"name": p, "context": {p: {"path": "/p"}}}}},
        {"id": "send-label", "component": "Text", "text": p},
    ]  # fmt: skip
    model = {"p": p, "b": False, "n": 3, "choice": [p], "items": [{"name": p}, {"name": p}]}
    return [
        _dump(s09.CreateSurfaceMessage(createSurface=s09.CreateSurface(surfaceId=surface_id, catalogId=a2ui.V091_CATALOG))),
        _dump(s09.UpdateComponentsMessage(updateComponents=s09.UpdateComponents(surfaceId=surface_id, components=comps))),
        _dump(s09.UpdateDataModelMessage(updateDataModel=s09.UpdateDataModel(surfaceId=surface_id, value=model))),
    ]  # fmt: skip


class FormExecutor(AgentExecutor):
    """Plays the module's scripts; ``received`` keeps every message (as A2A JSON)."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.received: list[dict[str, Any]] = []

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.message is not None
        self.received.append(MessageToDict(context.message))
        task = context.current_task
        if task is None:
            task = new_task_from_user_message(context.message)
            await event_queue.enqueue_event(task)
        up = TaskUpdater(event_queue, task.id, task.context_id)
        if context.current_task is not None:
            found = [d for d in get_data_parts(context.message.parts)]
            await up.complete(up.new_agent_message([new_text_part(f"Thanks: {found}")]))
            return
        word = context.get_user_input().strip().split(" ")[0]
        messages = (
            xss_091() if word == "xss" else form_08() if self.version == "0.8" else form_091()
        )
        media = a2ui.MEDIA_TYPE_OF[self.version]
        part = new_data_part(messages, media)
        if self.version == "0.8":  # as the A2UI Python SDK marks v0.8 parts: metadata.mimeType
            part.metadata.update({"mimeType": media})
            part.media_type = ""
        await up.requires_input(
            up.new_agent_message([new_text_part("Please answer the form."), part])
        )

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None

    def actions(self) -> list[dict[str, Any]]:
        """The A2UI actions received (v0.9 ``action`` / v0.8 ``userAction`` bodies)."""
        out = []
        for message in self.received:
            for part in message.get("parts", []):
                data = part.get("data")
                for item in data if isinstance(data, list) else [data]:
                    if isinstance(item, dict) and ("action" in item or "userAction" in item):
                        out.append(item.get("action") or item.get("userAction"))
        return out


@contextlib.contextmanager
def a2ui_agent(version: str) -> Iterator[tuple[str, FormExecutor]]:
    """An a2a-sdk agent on 127.0.0.1 declaring A2UI ``version``; yields (base URL, executor)."""
    executor = FormExecutor(version)
    extension = pb.AgentExtension(uri=a2ui.EXTENSION_URIS[version], description="A2UI")
    skill = pb.AgentSkill(id="form", name="form", description="asks with a form", tags=["test"])
    with on_loopback(
        f"A2UI {version} agent", "Asks with A2UI forms", [extension], skill, executor
    ) as base:
        yield base, executor


@contextlib.contextmanager
def on_loopback(
    name: str,
    description: str,
    extensions: list[pb.AgentExtension],
    skill: pb.AgentSkill,
    executor: AgentExecutor,
    handler: type[DefaultRequestHandler] = DefaultRequestHandler,
) -> Iterator[str]:
    """Serve ``executor`` on a free port of 127.0.0.1 behind a card (streaming, JSON-RPC at
    /jsonrpc, ``extensions`` declared), its requests taken by ``handler``; yields the base
    URL."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    card = pb.AgentCard(
        name=name,
        description=description,
        version="1.0.0",
        supported_interfaces=[
            pb.AgentInterface(
                url=f"{base}/jsonrpc", protocol_binding="JSONRPC", protocol_version="1.0"
            )
        ],
        capabilities=pb.AgentCapabilities(streaming=True, extensions=extensions),
        default_input_modes=["text/plain", "application/json"],
        default_output_modes=["text/plain", "application/json"],
        skills=[skill],
    )
    with served(card, executor, port, handler):
        yield base


@contextlib.contextmanager
def served(
    card: pb.AgentCard,
    executor: AgentExecutor,
    port: int,
    handler_type: type[DefaultRequestHandler] = DefaultRequestHandler,
) -> Iterator[None]:
    """Serve ``executor`` behind ``card`` (JSON-RPC at /jsonrpc) on 127.0.0.1:``port``, in a
    thread of the test process, until the block ends."""
    handler = handler_type(agent_executor=executor, task_store=InMemoryTaskStore(), agent_card=card)
    app = Starlette(
        routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, "/jsonrpc")]
    )
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert time.monotonic() < deadline, f"the test agent {card.name!r} did not start"
        time.sleep(0.02)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=15)


# The negotiation tests' agents (tests/test_a2ui_negotiation.py) ----------------------------
# One surface each, asked once; the executor keeps the extensions and the message of each call.


def question_091() -> tuple[list[dict], str]:
    comps = [
        {"id": "root", "component": "Column", "children": ["q", "name", "ok"]},
        {"id": "q", "component": "Text", "text": {"path": "/question"}},
        {"id": "name", "component": "TextField", "label": "Name", "value": {"path": "/name"}},
        {"id": "ok", "component": "Button", "child": "ok-label",
         "action": {"event": {"name": "submit", "context": {"name": {"path": "/name"}}}}},
        {"id": "ok-label", "component": "Text", "text": "Send"},
    ]  # fmt: skip
    messages = [
        _dump(s09.CreateSurfaceMessage(createSurface=s09.CreateSurface(surfaceId="form", catalogId=a2ui.V091_CATALOG))),
        _dump(s09.UpdateComponentsMessage(updateComponents=s09.UpdateComponents(surfaceId="form", components=comps))),
        _dump(s09.UpdateDataModelMessage(updateDataModel=s09.UpdateDataModel(surfaceId="form", value={"question": "Who?"}))),
    ]  # fmt: skip
    return messages, "application/a2ui+json"


def question_08() -> tuple[list[dict], str]:
    comps = [
        {"id": "root", "component": {"Column": {"children": {"explicitList": ["q", "ok"]}}}},
        {"id": "q", "component": {"Text": {"text": {"literalString": "Who?"}}}},
        {"id": "ok", "component": {"Button": {"child": "q", "action": {"name": "submit"}}}},
    ]
    messages = [
        _dump(s08.SurfaceUpdateMessage(surfaceUpdate=s08.SurfaceUpdate(surfaceId="form", components=comps))),
        _dump(s08.BeginRenderingMessage(beginRendering=s08.BeginRendering(surfaceId="form", root="root"))),
    ]  # fmt: skip
    return messages, "application/json+a2ui"


class RecordingExecutor(AgentExecutor):
    """Asks once (with an A2UI surface when it has one), completes on the answer; keeps what arrived."""

    def __init__(self, surface: tuple[list[dict], str] | None) -> None:
        self.surface = surface
        self.seen: list[dict[str, Any]] = []

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.message is not None
        self.seen.append(
            {
                "extensions": set(context.requested_extensions),
                "message": MessageToDict(context.message),
            }
        )
        task = context.current_task
        if task is None:
            task = new_task_from_user_message(context.message)
            await event_queue.enqueue_event(task)
        up = TaskUpdater(event_queue, task.id, task.context_id)
        if context.current_task is not None:
            await up.complete(up.new_agent_message([new_text_part("Thanks.")]))
            return
        parts = [new_text_part("Who are you?")]
        if self.surface is not None:
            messages, media = self.surface
            part = new_data_part(messages, media)
            if media == "application/json+a2ui":  # as the A2UI Python SDK marks v0.8/v0.9 parts
                part.metadata.update({"mimeType": media})
                part.media_type = ""
            parts.append(part)
        await up.requires_input(up.new_agent_message(parts))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        return None


@contextlib.contextmanager
def negotiating_agent(
    version: str | None, surface: tuple[list[dict], str] | None
) -> Iterator[tuple[str, RecordingExecutor]]:
    """An a2a-sdk agent on 127.0.0.1 whose card declares A2UI ``version`` (or nothing)."""
    extensions = []
    if version is not None:
        ext = pb.AgentExtension(uri=a2ui.EXTENSION_URIS[version], description="A2UI")
        ext.params.update({"supportedCatalogIds": list(a2ui.BASIC_CATALOG_IDS[version])})
        extensions.append(ext)
    executor = RecordingExecutor(surface)
    skill = pb.AgentSkill(id="ask", name="ask", description="asks", tags=["test"])
    name = f"a2ui-{version or 'none'}"
    with on_loopback(name, "A2UI negotiation test agent", extensions, skill, executor) as base:
        yield base, executor
