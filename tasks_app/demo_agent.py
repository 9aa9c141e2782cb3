"""A scripted A2A 1.0 agent built on the official a2a-sdk server.

Used by the test-suite (as a real, spec-following peer) and by
``manage.py up --demo`` (something to watch without a real agent).

It serves both bindings from one Starlette app:

* card:      ``GET {base}/.well-known/agent-card.json`` (ETag, Cache-Control)
* JSON-RPC:  ``POST {base}/jsonrpc``   (listed first in ``supportedInterfaces``)
* HTTP+JSON: ``{base}/rest/...``

Behaviour is chosen by the first word of the user's text:

=====================  =====================================================
``hello ...`` / other   a plain **Message** reply, no task
``quick``               task completes at once with a small text artifact
``slow [N] [interval]`` WORKING with "step i/N" status messages, an artifact
                        streamed in N chunks (``append`` after the first,
                        ``lastChunk`` on the last), then COMPLETED
                        (defaults N=5, interval = ``--delay``, 0.2 s)
``ask``                 INPUT_REQUIRED with a question; a follow-up message
                        on the same task completes it with an artifact
                        echoing the answer
``form``                INPUT_REQUIRED with a question carrying the JSON Schema
                        of the answer (a data part, ``application/schema+json``:
                        name, guests 1-10, date, meal); the answer's data part
                        completes it with an artifact echoing the values (a
                        text-only answer is echoed as text)
``auth [seconds]``      AUTH_REQUIRED with an explanation, then resumes *on
                        its own* (out-of-band model: the executor keeps
                        running) after ``seconds`` (default 1) -> WORKING ->
                        COMPLETED. A follow-up message while it waits is
                        queued by the SDK until then.
``fail``                FAILED with a status message
``reject``              REJECTED with a status message
``long [seconds]``      WORKING with periodic progress until canceled
                        (-> CANCELED) or until the time runs out (default
                        300 s) -> COMPLETED
``data``                completes with a JSON data-part artifact and a file
                        artifact (raw bytes, ``hello.txt``)
``markdown``            a text/markdown artifact containing ``<script>`` and a
                        ``javascript:`` link (for sanitizer tests)
``booking [N] [interval]`` INPUT_REQUIRED with an A2UI v0.9.1 surface (a booking form:
                        name, date, party size, seating, a reminder checkbox,
                        a Book button). With N, the form is first shown while
                        WORKING and the tables left change N times (an A2UI
                        ``updateDataModel`` in an artifact, every ``interval``
                        s) before it asks. The form's action (the A2UI
                        ``action`` data part) completes it with a confirmation
                        card on the same surface
``big [KB] [wait]``     WORKING, then after ``wait`` s (default 3) one artifact chunk
                        of ``KB`` text parts of a kilobyte (default 100) after one
                        saying ``BIG-START``, then COMPLETED (for pages that must
                        not get a long event whole)
``batch [N] [interval]`` long batch work meant to be followed by push: WORKING,
                        then N steps (a "batch i/N" status and one artifact row
                        each, every ``interval`` s; defaults 30 and 2 s), then
                        COMPLETED. Every event goes to the task's push configs.
=====================  =====================================================

The card declares the A2UI extension (v0.9.1, basic catalog), so the dashboard sends its
renderer capabilities; only ``booking`` answers with A2UI.

Push delivery: the SDK's sender posts each event to every push config of the task.
With ``--sign-push`` the agent signs each notification instead: an ES256 JWT in
``Authorization: Bearer`` (claims ``iss`` = its base URL, ``aud`` = the config id,
``iat``/``exp``, ``jti`` and ``request_body_sha256`` of the exact body sent), with its
public key at ``/.well-known/jwks.json``, announced in the card by the extension
``urn:a2a-dashboard:push-signing:v1`` (params ``jwksUri``, ``issuer``).

Options: ``--no-streaming`` / ``--no-push`` switch the capabilities off (the
SDK then answers -32004 / -32003 itself); ``--token T`` requires
``Authorization: Bearer T`` on the A2A endpoints (the card stays public, and
declares the bearer scheme). The extended card (``capabilities.
extendedAgentCard``) adds an ``admin`` skill. Push URLs are not screened, so
loopback webhooks work for local development.

Run: ``python -m tasks_app.demo_agent --host 127.0.0.1 --port 9999``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jwt
from a2a.helpers.proto_helpers import (
    get_data_parts,
    new_data_part,
    new_raw_part,
    new_task_from_user_message,
    new_text_message,
    new_text_part,
)
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes, create_rest_routes
from a2a.server.tasks import (
    BasePushNotificationSender,
    InMemoryPushNotificationConfigStore,
    InMemoryTaskStore,
    TaskUpdater,
)
from a2a.types import a2a_pb2 as pb
from a2a.utils.proto_utils import to_stream_response
from cryptography.hazmat.primitives.asymmetric import ec
from google.protobuf.json_format import MessageToDict
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from tasks_app.a2a import a2ui

log = logging.getLogger("tasks_app.demo_agent")

TASK_WORDS = frozenset(
    {
        "quick",
        "slow",
        "ask",
        "form",
        "auth",
        "fail",
        "reject",
        "long",
        "data",
        "markdown",
        "batch",
        "booking",
        "big",
    }
)
# The answer the ``form`` script asks for (docs/answers.md says which spellings are read).
BOOKING_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "Table booking",
    "properties": {
        # propertyOrder: the order survives protobuf's Struct, which keeps no key order.
        "name": {
            "type": "string",
            "title": "Name",
            "description": "Who the table is for.",
            "minLength": 1,
            "propertyOrder": 1,
        },
        "guests": {
            "type": "integer",
            "title": "Guests",
            "minimum": 1,
            "maximum": 10,
            "default": 2,
            "propertyOrder": 2,
        },
        "date": {"type": "string", "format": "date", "title": "Date", "propertyOrder": 3},
        "meal": {
            "type": "string",
            "title": "Meal",
            "enum": ["meat", "fish", "vegetarian"],
            "propertyOrder": 4,
        },
    },
    "required": ["name", "guests", "date"],
}
# The A2UI scenario (``booking``): a surface in the v0.9.1 basic catalog.
A2UI_VERSION = "0.9.1"
A2UI_MEDIA_TYPE = a2ui.MEDIA_TYPE_OF[A2UI_VERSION]
BOOKING_SURFACE = "booking"


def _a2ui_part(messages: list[dict[str, Any]]) -> pb.Part:
    return new_data_part(messages, A2UI_MEDIA_TYPE)


def booking_form(tables_left: int = 9) -> list[dict[str, Any]]:
    """createSurface, updateComponents and updateDataModel of the booking form."""

    def path(p: str) -> dict[str, str]:
        return {"path": p}

    def required(p: str) -> dict[str, Any]:
        return {"call": "required", "args": {"value": path(p)}, "returnType": "boolean"}

    components = [
        {"id": "root", "component": "Column",
         "children": ["title", "left", "name", "date", "size", "guests", "seating", "reminder", "book"]},
        {"id": "title", "component": "Text", "text": "Book a table", "variant": "h2"},
        {"id": "left", "component": "Row", "children": ["left-label", "left-value"]},
        {"id": "left-label", "component": "Text", "text": "Tables left tonight:"},
        {"id": "left-value", "component": "Text", "text": path("/tablesLeft")},
        {"id": "name", "component": "TextField", "label": "Name", "value": path("/booking/name"),
         "checks": [{"condition": required("/booking/name"), "message": "Please give a name."}]},
        {"id": "date", "component": "DateTimeInput", "label": "Date", "enableDate": True,
         "value": path("/booking/date"),
         "checks": [{"condition": required("/booking/date"), "message": "Please pick a date."}]},
        {"id": "size", "component": "Slider", "label": "Party size", "min": 1, "max": 12,
         "value": path("/booking/size")},
        {"id": "guests", "component": "Row", "children": ["guests-label", "guests-value"]},
        {"id": "guests-label", "component": "Text", "text": "Guests:"},
        {"id": "guests-value", "component": "Text", "text": path("/booking/size")},
        {"id": "seating", "component": "ChoicePicker", "label": "Seating",
         "variant": "mutuallyExclusive", "value": path("/booking/seating"),
         "options": [{"label": "Inside", "value": "inside"}, {"label": "Terrace", "value": "terrace"},
                     {"label": "Bar", "value": "bar"}]},
        {"id": "reminder", "component": "CheckBox", "label": "Send me a reminder",
         "value": path("/booking/reminder")},
        {"id": "book", "component": "Button", "child": "book-label", "variant": "primary",
         "action": {"event": {"name": "book", "context": {
             key: path(f"/booking/{key}") for key in ("name", "date", "size", "seating", "reminder")}}},
         "checks": [{"condition": {"call": "and", "args": {"values": [
             required("/booking/name"), required("/booking/date")]}, "returnType": "boolean"},
             "message": "Name and date are needed."}]},
        {"id": "book-label", "component": "Text", "text": "Book"},
    ]  # fmt: skip
    model = {
        "booking": {"name": "", "date": "", "size": 2, "seating": ["inside"], "reminder": False},
        "tablesLeft": tables_left,
    }
    return [
        {"version": "v0.9", "createSurface": {"surfaceId": BOOKING_SURFACE,
                                              "catalogId": a2ui.V091_CATALOG}},
        {"version": "v0.9", "updateComponents": {"surfaceId": BOOKING_SURFACE,
                                                 "components": components}},
        {"version": "v0.9", "updateDataModel": {"surfaceId": BOOKING_SURFACE, "value": model}},
    ]  # fmt: skip


def tables_left(n: int) -> list[dict[str, Any]]:
    """A live update of the form's data model."""
    update = {"surfaceId": BOOKING_SURFACE, "path": "/tablesLeft", "value": n}
    return [{"version": "v0.9", "updateDataModel": update}]


def booking_confirmation(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The same surface redrawn as a confirmation card, with the booked values."""
    summary = {
        "call": "formatString",
        "args": {"value": "Table for ${/booking/size} on ${/booking/date}, ${/booking/name}."},
        "returnType": "string",
    }
    components = [
        {"id": "root", "component": "Card", "child": "done"},
        {"id": "done", "component": "Column", "children": ["done-head", "done-text"]},
        {"id": "done-head", "component": "Row", "children": ["done-icon", "done-title"],
         "align": "center"},
        {"id": "done-icon", "component": "Icon", "name": "check"},
        {"id": "done-title", "component": "Text", "text": "Booked", "variant": "h3"},
        {"id": "done-text", "component": "Text", "text": summary},
    ]  # fmt: skip
    return [
        {"version": "v0.9", "updateComponents": {"surfaceId": BOOKING_SURFACE,
                                                 "components": components}},
        {"version": "v0.9", "updateDataModel": {"surfaceId": BOOKING_SURFACE,
                                                "path": "/booking", "value": values}},
    ]  # fmt: skip


def a2ui_action(parts: Any) -> dict[str, Any] | None:
    """The A2UI action (v0.9+ ``action``, v0.8 ``userAction``) among a message's data parts."""
    for data in get_data_parts(parts):
        for item in data if isinstance(data, list) else [data]:
            if isinstance(item, dict):
                found = item.get("action") or item.get("userAction")
                if isinstance(found, dict):
                    return found
    return None


# The card extension announcing signed push notifications (tasks_app/services/push.py reads it).
SIGNING_EXTENSION = "urn:a2a-dashboard:push-signing:v1"
MARKDOWN_SAMPLE = (
    "# Demo report\n\n"
    "Some **bold** text and a [safe link](https://example.org/).\n\n"
    "<script>alert('xss')</script>\n\n"
    "[click me](javascript:alert('xss'))\n\n"
    '<img src="x" onerror="alert(1)">\n'
)


def _number(words: list[str], index: int, default: float) -> float:
    try:
        return float(words[index])
    except (IndexError, ValueError):
        return default


class DemoExecutor(AgentExecutor):
    """Plays the scripts described in the module docstring."""

    def __init__(self, *, step_delay: float = 0.2, auth_delay: float = 1.0) -> None:
        self.step_delay = step_delay
        self.auth_delay = auth_delay
        self._scripts: dict[str, str] = {}  # task id -> script word (for follow-ups)

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        text = context.get_user_input().strip()
        words = text.split()
        word = words[0].lower() if words else ""
        task = context.current_task

        if task is None:
            if word not in TASK_WORDS:
                reply = f"Hello! You said: {text}" if text else "Hello!"
                await event_queue.enqueue_event(
                    new_text_message(reply, context_id=context.context_id)
                )
                return
            assert context.message is not None
            task = new_task_from_user_message(context.message)
            await event_queue.enqueue_event(task)
            self._scripts[task.id] = word
        else:
            word = self._scripts.get(task.id, "")

        up = TaskUpdater(event_queue, task.id, task.context_id)

        def say(msg: str) -> pb.Message:
            return up.new_agent_message([new_text_part(msg)])

        if context.current_task is not None:  # a follow-up on an existing task
            if word == "form":
                await self._booked(up, context, text, say)
            elif word == "booking":
                await self._booked_a2ui(up, context, text, say)
            elif word == "ask" or task.status.state == pb.TASK_STATE_INPUT_REQUIRED:
                await up.start_work(say("Thanks, working on it."))
                await up.add_artifact(
                    [new_text_part(f"You answered: {text}")], name="answer", last_chunk=True
                )
                await up.complete(say("Done."))
            else:
                await up.start_work(say(f"Follow-up received: {text}"))
                await up.complete(say("Done."))
            return

        if word == "quick":
            await up.add_artifact([new_text_part("quick result")], name="result", last_chunk=True)
            await up.complete(say("Done."))
        elif word == "slow":
            n = max(1, int(_number(words, 1, 5)))
            interval = _number(words, 2, self.step_delay)
            art_id = f"{task.id}-report"
            await up.start_work(say(f"starting {n} steps"))
            for i in range(1, n + 1):
                await asyncio.sleep(interval)
                await up.update_status(pb.TASK_STATE_WORKING, say(f"step {i}/{n}"))
                await up.add_artifact(
                    [new_text_part(f"chunk {i}\n")],
                    artifact_id=art_id,
                    name="report.txt",
                    append=i > 1,
                    last_chunk=i == n,
                )
            await up.complete(say(f"finished {n} steps"))
        elif word == "ask":
            await up.start_work()
            await up.requires_input(say("What is your name?"))
        elif word == "form":
            await up.start_work()
            await up.requires_input(
                up.new_agent_message(
                    [
                        new_text_part("Please fill in the booking form."),
                        new_data_part(BOOKING_SCHEMA, "application/schema+json"),
                    ]
                )
            )
        elif word == "booking":
            # With updates, the form is shown while working and its data model changes live
            # (an interrupted task's stream ends, so the updates come before the question).
            updates = min(max(0, int(_number(words, 1, 0))), 20)
            interval = _number(words, 2, 1.0)
            left = 9
            ask = [new_text_part("Please fill in the booking form.")]
            if updates:
                await up.start_work(
                    up.new_agent_message(
                        [new_text_part("Checking availability."), _a2ui_part(booking_form(left))]
                    )
                )
                for _ in range(updates):
                    await asyncio.sleep(interval)
                    left = max(0, left - 1)
                    await up.add_artifact(
                        [new_text_part(f"Tables left: {left}\n"), _a2ui_part(tables_left(left))],
                        artifact_id=f"{task.id}-availability",
                        name="availability",
                    )
            else:
                await up.start_work()
                ask.append(_a2ui_part(booking_form(left)))
            await up.requires_input(up.new_agent_message(ask))
        elif word == "auth":
            wait = _number(words, 1, self.auth_delay)
            await up.requires_auth(
                say("Authorization needed: an operator must approve access to the demo vault.")
            )
            await asyncio.sleep(wait)
            await up.start_work(say("Authorization received out of band."))
            await up.add_artifact([new_text_part("vault opened")], name="vault", last_chunk=True)
            await up.complete(say("Done."))
        elif word == "fail":
            await up.start_work()
            await up.failed(say("Simulated failure: the demo backend is down."))
        elif word == "reject":
            await up.reject(say("I will not do that."))
        elif word == "long":
            total = _number(words, 1, 300.0)
            interval = max(self.step_delay, 0.1)
            await up.start_work(say(f"working for up to {total:g} s"))
            loop = asyncio.get_running_loop()
            start = loop.time()
            i = 0
            while loop.time() - start < total:
                await asyncio.sleep(min(interval, max(0.0, total - (loop.time() - start))))
                i += 1
                await up.update_status(pb.TASK_STATE_WORKING, say(f"still working ({i})"))
            await up.complete(say("Time is up."))
        elif word == "data":
            await up.add_artifact(
                [
                    new_data_part(
                        {"answer": 42, "items": ["a", "b"], "ok": True}, "application/json"
                    )
                ],
                name="data.json",
                last_chunk=True,
            )
            await up.add_artifact(
                [new_raw_part(b"hello, file\n", media_type="text/plain", filename="hello.txt")],
                name="hello.txt",
                last_chunk=True,
            )
            await up.complete(say("Done."))
        elif word == "big":
            kilobytes = _number(words, 1, 100)  # within 1 KB and 10 MB (nan or inf: 100)
            size = int(min(max(kilobytes, 1), 10_240)) if math.isfinite(kilobytes) else 100
            await up.start_work(say(f"a chunk of {size} KB follows"))
            await asyncio.sleep(_number(words, 2, 3.0))
            # Parts of 1 KB: a bigger part would be kept once, apart, and the entry only refer
            # to it (INLINE_CONTENT_BYTES); these make the entry itself that long.
            parts = [new_text_part("BIG-START\n")]
            parts += [new_text_part("0123456789abcde\n" * 64) for _ in range(size)]
            await up.add_artifact(parts, name="big.txt", last_chunk=True)
            await up.complete(say("Done."))
        elif word == "batch":
            n = max(1, int(_number(words, 1, 30)))
            interval = _number(words, 2, 2.0)
            art_id = f"{task.id}-rows"
            await up.start_work(say(f"batch of {n} steps started"))
            for i in range(1, n + 1):
                await asyncio.sleep(interval)
                await up.update_status(pb.TASK_STATE_WORKING, say(f"batch {i}/{n}"))
                await up.add_artifact(
                    [new_text_part(f"row {i}\n")],
                    artifact_id=art_id,
                    name="rows.txt",
                    append=i > 1,
                    last_chunk=i == n,
                )
            await up.complete(say(f"batch of {n} steps done"))
        elif word == "markdown":
            await up.add_artifact(
                [new_text_part(MARKDOWN_SAMPLE, media_type="text/markdown")],
                name="report.md",
                last_chunk=True,
            )
            await up.complete(say("Done."))

    async def _booked(self, up: TaskUpdater, context: RequestContext, text: str, say: Any) -> None:
        """The answer to ``form``: its data part's values, echoed (whole numbers as such)."""
        found = get_data_parts(context.message.parts) if context.message is not None else []
        answer = next((d for d in found if isinstance(d, dict)), None)
        await up.start_work(say("Thanks, booking."))
        if answer is None:
            await up.add_artifact(
                [new_text_part(f"You answered: {text}")], name="answer", last_chunk=True
            )
        else:
            values = {
                k: int(v) if isinstance(v, float) and v.is_integer() else v
                for k, v in answer.items()
            }
            lines = "\n".join(f"{k}: {v}" for k, v in values.items())
            await up.add_artifact(
                [new_text_part(f"Booked:\n{lines}\n"), new_data_part(values, "application/json")],
                name="booking",
                last_chunk=True,
            )
        await up.complete(say("Done."))

    async def _booked_a2ui(
        self, up: TaskUpdater, context: RequestContext, text: str, say: Any
    ) -> None:
        """The answer to ``booking``: the form's action, confirmed on the same surface."""
        action = a2ui_action(context.message.parts) if context.message is not None else None
        await up.start_work(say("Thanks, booking."))
        if action is None:
            await up.add_artifact(
                [new_text_part(f"You answered: {text}")], name="answer", last_chunk=True
            )
            await up.complete(say("Done."))
            return
        values = {
            k: int(v) if isinstance(v, float) and v.is_integer() else v
            for k, v in (action.get("context") or {}).items()
        }
        lines = "\n".join(f"{k}: {v}" for k, v in values.items())
        await up.add_artifact(
            [new_text_part(f"Booked ({action.get('name')}):\n{lines}\n")],
            name="booking",
            last_chunk=True,
        )
        await up.complete(
            up.new_agent_message(
                [new_text_part("Booked."), _a2ui_part(booking_confirmation(values))]
            )
        )

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        task = context.current_task
        if task is None or not context.task_id:
            return
        up = TaskUpdater(event_queue, context.task_id, task.context_id)
        await up.cancel(up.new_agent_message([new_text_part("Canceled on request.")]))


def build_card(
    base_url: str,
    *,
    streaming: bool = True,
    push: bool = True,
    token: str | None = None,
    signed_push: bool = False,
) -> pb.AgentCard:
    base = base_url.rstrip("/")
    card = pb.AgentCard(
        name="Demo Agent",
        description="A scripted A2A 1.0 agent for tests and demos (first word picks the script).",
        version="1.0.0",
        supported_interfaces=[
            pb.AgentInterface(
                url=f"{base}/jsonrpc", protocol_binding="JSONRPC", protocol_version="1.0"
            ),
            pb.AgentInterface(
                url=f"{base}/rest", protocol_binding="HTTP+JSON", protocol_version="1.0"
            ),
        ],
        provider=pb.AgentProvider(organization="a2a-dashboard", url="https://example.org/"),
        capabilities=pb.AgentCapabilities(
            streaming=streaming,
            push_notifications=push,
            extended_agent_card=True,
            extensions=[
                pb.AgentExtension(
                    uri=a2ui.EXTENSION_URIS[A2UI_VERSION],
                    description="A2UI surfaces (the booking script), basic catalog.",
                )
            ],
        ),
        default_input_modes=["text/plain", "application/json"],
        default_output_modes=[
            "text/plain",
            "text/markdown",
            "application/json",
            "application/octet-stream",
        ],
        skills=[
            pb.AgentSkill(
                id="script",
                name="Scripted behaviours",
                description="hello, quick, slow, ask, form, booking, auth, fail, reject, long, data, markdown, batch",
                tags=["demo", "test"],
                examples=[
                    "hello",
                    "quick",
                    "slow 5 0.2",
                    "ask",
                    "form",
                    "booking",
                    "auth",
                    "long 30",
                    "data",
                    "batch 20 2",
                ],
            )
        ],
    )
    if signed_push:
        extension = pb.AgentExtension(
            uri=SIGNING_EXTENSION, description="Push notifications are signed (JWT, ES256)."
        )
        extension.params.update({"jwksUri": f"{base}/.well-known/jwks.json", "issuer": base})
        card.capabilities.extensions.append(extension)
    if token:
        card.security_schemes["bearer"].CopyFrom(
            pb.SecurityScheme(
                http_auth_security_scheme=pb.HTTPAuthSecurityScheme(
                    scheme="Bearer", bearer_format="opaque"
                )
            )
        )
        req = pb.SecurityRequirement()
        req.schemes["bearer"].CopyFrom(pb.StringList())
        card.security_requirements.append(req)
    return card


class SignedPushSender(BasePushNotificationSender):
    """Posts each notification with a signed token (see the module docstring)."""

    def __init__(self, http: httpx.AsyncClient, store: Any, *, issuer: str) -> None:
        super().__init__(http, store)
        self.issuer = issuer
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.kid = uuid.uuid4().hex[:16]

    def jwks(self) -> dict[str, Any]:
        public = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(self.key.public_key()))
        return {"keys": [{**public, "kid": self.kid, "use": "sig", "alg": "ES256"}]}

    async def _dispatch_notification(
        self, event: Any, push_info: pb.TaskPushNotificationConfig, task_id: str
    ) -> bool:
        body = json.dumps(MessageToDict(to_stream_response(event)), separators=(",", ":")).encode()
        now = int(time.time())
        claims = {
            "iss": self.issuer,
            "aud": push_info.id,
            "iat": now,
            "exp": now + 60,
            "jti": uuid.uuid4().hex,
            "request_body_sha256": hashlib.sha256(body).hexdigest(),
        }
        signed = jwt.encode(claims, self.key, algorithm="ES256", headers={"kid": self.kid})
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {signed}"}
        if push_info.token:
            headers["X-A2A-Notification-Token"] = push_info.token
        try:
            response = await self._client.post(push_info.url, content=body, headers=headers)
            response.raise_for_status()
        except Exception:
            log.warning("signed push notification for task %s to %s failed", task_id, push_info.url)
            return False
        return True


class _BearerGuard:
    """Plain ASGI middleware: 401 on A2A endpoints without the right bearer token."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope["path"].startswith("/.well-known/"):
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            if auth != self.expected:
                response = JSONResponse(
                    {"error": "unauthorized"},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    base_url: str,
    *,
    streaming: bool = True,
    push: bool = True,
    step_delay: float = 0.2,
    auth_delay: float = 1.0,
    token: str | None = None,
    signed_push: bool = False,
) -> ASGIApp:
    """The demo agent as an ASGI app; ``base_url`` is where it will be reachable."""
    card = build_card(
        base_url, streaming=streaming, push=push, token=token, signed_push=signed_push
    )
    extended = pb.AgentCard()
    extended.CopyFrom(card)
    extended.skills.append(
        pb.AgentSkill(
            id="admin", name="Admin", description="Only in the extended card.", tags=["admin"]
        )
    )
    push_http = httpx.AsyncClient(timeout=10.0)
    push_store = InMemoryPushNotificationConfigStore() if push else None
    sender: BasePushNotificationSender | None = None
    if push_store is not None:
        sender = (
            SignedPushSender(push_http, push_store, issuer=base_url.rstrip("/"))
            if signed_push
            else BasePushNotificationSender(push_http, push_store)
        )
    handler = DefaultRequestHandler(
        agent_executor=DemoExecutor(step_delay=step_delay, auth_delay=auth_delay),
        task_store=InMemoryTaskStore(),
        agent_card=card,
        push_config_store=push_store,
        push_sender=sender,
        extended_agent_card=extended,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                await handler.aclose()
            await push_http.aclose()

    routes: list[Any] = []
    routes += create_agent_card_routes(card, cache_control="max-age=60")
    if isinstance(sender, SignedPushSender):
        keys = sender.jwks()

        async def jwks(request: Any) -> JSONResponse:
            return JSONResponse(keys)

        routes.append(Route("/.well-known/jwks.json", jwks))
    routes += create_jsonrpc_routes(handler, "/jsonrpc")
    routes += create_rest_routes(handler, path_prefix="/rest")
    app: ASGIApp = Starlette(routes=routes, lifespan=lifespan)
    if token:
        app = _BearerGuard(app, token)
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="Scripted A2A 1.0 demo agent (a2a-sdk).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9999)
    parser.add_argument("--public-url", default=None, help="base URL to advertise in the card")
    parser.add_argument("--no-streaming", action="store_true")
    parser.add_argument("--no-push", action="store_true")
    parser.add_argument("--delay", type=float, default=0.2, help="default step interval (s)")
    parser.add_argument("--auth-delay", type=float, default=1.0, help="auth-required wait (s)")
    parser.add_argument("--token", default=None, help="require this bearer token")
    parser.add_argument("--sign-push", action="store_true", help="sign push notifications (JWT)")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    base = args.public_url or f"http://{args.host}:{args.port}"
    app = build_app(
        base,
        streaming=not args.no_streaming,
        push=not args.no_push,
        step_delay=args.delay,
        auth_delay=args.auth_delay,
        token=args.token,
        signed_push=args.sign_push,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
