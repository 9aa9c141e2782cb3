"""A2UI negotiation against real a2a-sdk agents on 127.0.0.1.

An agent whose card declares the A2UI extension gets it activated on every request (the
``A2A-Extensions`` header, which the SDK hands the executor as ``requested_extensions``)
and our renderer's capabilities in the metadata of every message (the start and the
answer); an agent that does not declare it gets neither. The declaring agents answer
with A2UI surfaces built by the A2UI project's own SDK models, and the dashboard folds
them through the real watcher and record().
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from a2a.helpers.proto_helpers import new_data_part, new_task_from_user_message, new_text_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types import a2a_pb2 as pb
from a2ui.core.schema.v0_8 import server_to_client as s08
from a2ui.core.schema.v0_9 import server_to_client as s09
from google.protobuf.json_format import MessageToDict

from tasks_app import eventloop, relay, watchers
from tasks_app.a2a import a2ui
from tasks_app.models import RemoteTask, Surface
from tasks_app.services import tasks as task_services
from tasks_app.services.agents import add_agent
from tests.a2ui_agents import served
from tests.agents import free_port
from tests.test_mirror import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def dump(model: Any) -> dict:
    return model.model_dump(by_alias=True, exclude_none=True, mode="json")


def surface_091() -> tuple[list[dict], str]:
    comps = [
        {"id": "root", "component": "Column", "children": ["q", "name", "ok"]},
        {"id": "q", "component": "Text", "text": {"path": "/question"}},
        {"id": "name", "component": "TextField", "label": "Name", "value": {"path": "/name"}},
        {"id": "ok", "component": "Button", "child": "ok-label",
         "action": {"event": {"name": "submit", "context": {"name": {"path": "/name"}}}}},
        {"id": "ok-label", "component": "Text", "text": "Send"},
    ]  # fmt: skip
    messages = [
        dump(s09.CreateSurfaceMessage(createSurface=s09.CreateSurface(surfaceId="form", catalogId=a2ui.V091_CATALOG))),
        dump(s09.UpdateComponentsMessage(updateComponents=s09.UpdateComponents(surfaceId="form", components=comps))),
        dump(s09.UpdateDataModelMessage(updateDataModel=s09.UpdateDataModel(surfaceId="form", value={"question": "Who?"}))),
    ]  # fmt: skip
    return messages, "application/a2ui+json"


def surface_08() -> tuple[list[dict], str]:
    comps = [
        {"id": "root", "component": {"Column": {"children": {"explicitList": ["q", "ok"]}}}},
        {"id": "q", "component": {"Text": {"text": {"literalString": "Who?"}}}},
        {"id": "ok", "component": {"Button": {"child": "q", "action": {"name": "submit"}}}},
    ]
    messages = [
        dump(s08.SurfaceUpdateMessage(surfaceUpdate=s08.SurfaceUpdate(surfaceId="form", components=comps))),
        dump(s08.BeginRenderingMessage(beginRendering=s08.BeginRendering(surfaceId="form", root="root"))),
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
def serve_agent(
    version: str | None, surface: tuple[list[dict], str] | None
) -> Iterator[tuple[str, RecordingExecutor]]:
    """An a2a-sdk agent on 127.0.0.1 whose card declares A2UI ``version`` (or nothing)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    extensions = []
    if version is not None:
        ext = pb.AgentExtension(uri=a2ui.EXTENSION_URIS[version], description="A2UI")
        ext.params.update({"supportedCatalogIds": list(a2ui.BASIC_CATALOG_IDS[version])})
        extensions.append(ext)
    card = pb.AgentCard(
        name=f"a2ui-{version or 'none'}",
        description="A2UI negotiation test agent",
        version="1.0.0",
        supported_interfaces=[
            pb.AgentInterface(
                url=f"{base}/jsonrpc", protocol_binding="JSONRPC", protocol_version="1.0"
            )
        ],
        capabilities=pb.AgentCapabilities(streaming=True, extensions=extensions),
        default_input_modes=["text/plain", "application/json"],
        default_output_modes=["text/plain", "application/json"],
        skills=[pb.AgentSkill(id="ask", name="ask", description="asks", tags=["test"])],
    )
    executor = RecordingExecutor(surface)
    with served(card, executor, port):
        yield base, executor


@pytest.fixture
def in_process_holders(monkeypatch) -> Iterator[None]:
    """Watchers run on this process's shared loop (instead of a Celery worker) and stop after."""
    monkeypatch.setattr(task_services, "dispatch", lambda pk: watchers.watch(pk))
    yield
    if eventloop.running():
        eventloop.submit(watchers.registry.shutdown()).result(timeout=15)
        eventloop.stop()
    relay.use_loop(None)


def ask_and_answer(base: str, name: str) -> RemoteTask:
    agent = add_agent(base, name=name)
    task = task_services.start_task(agent, "hello", mode="stream")
    # The question is recorded and its holder has let the task go: the answer's dispatch
    # then starts a holder here (no reconciler runs in this test to catch a later one).
    wait_for(
        lambda: RemoteTask.objects.filter(
            pk=task.pk, state="TASK_STATE_INPUT_REQUIRED", lease_token=""
        ).exists(),
        timeout=60,
        what="the question",
    )
    task.refresh_from_db()
    task_services.answer_task(task, "Ann")
    try:
        wait_for(
            lambda: RemoteTask.objects.get(pk=task.pk).state == "TASK_STATE_COMPLETED",
            timeout=60,
            what="the end",
        )
    except AssertionError:
        task.refresh_from_db()
        rows = list(task.events.order_by("seq").values_list("kind", "channel", "note"))
        raise AssertionError(
            f"{task.state} {task.watcher_status} {task.watcher_note}: {rows}"
        ) from None
    return task


@pytest.mark.parametrize(
    ("version", "surface", "capabilities"),
    [
        ("0.9.1", surface_091, {"v0.9": {"supportedCatalogIds": [a2ui.V091_CATALOG, a2ui.V09_CATALOG]}}),
        ("0.8", surface_08, {"supportedCatalogIds": [a2ui.V08_CATALOG]}),
    ],
)  # fmt: skip
def test_only_the_declaring_agent_gets_the_extension(
    version, surface, capabilities, in_process_holders
):
    uri = a2ui.EXTENSION_URIS[version]
    with (
        serve_agent(version, surface()) as (ui_base, ui),
        serve_agent(None, None) as (plain_base, plain),
    ):
        ui_task = ask_and_answer(ui_base, "ui")
        plain_task = ask_and_answer(plain_base, "plain")

    assert len(ui.seen) == 2 and len(plain.seen) == 2  # the start and the answer
    for seen in ui.seen:
        assert seen["extensions"] == {uri}
        assert seen["message"]["metadata"]["a2uiClientCapabilities"] == capabilities
        assert uri in seen["message"]["extensions"]
    for seen in plain.seen:
        assert seen["extensions"] == set()
        assert "a2uiClientCapabilities" not in seen["message"].get("metadata", {})
        assert "extensions" not in seen["message"]

    surface_row = Surface.objects.get(task=ui_task, surface_id="form")
    assert (surface_row.version, surface_row.ready, surface_row.problem) == (version, True, "")
    assert surface_row.components["root"]["component"] == "Column"
    assert not Surface.objects.filter(task=plain_task).exists()
