"""The async A2A 1.0 client: one API over the JSON-RPC and HTTP+JSON bindings.

The ``httpx.AsyncClient`` is injected, never created here: building one costs
tens of milliseconds of CPU (its SSL context) and the mirror holds hundreds of
streams on one event loop, so one client is shared by all of them. Give that
client ``httpx.Limits(max_connections=None)`` (or a limit above the number of
streams you hold): httpx allows 100 connections by default and every open
stream keeps one. All timeouts are set per request here; the injected client's
own defaults do not matter. ``stream_http``, when given, carries the streams
and ``http`` the other calls: httpcore walks every connection of a pool (a
system call for each idle one) whenever a request starts or ends, so calls made
beside hundreds of open streams cost more in that bookkeeping than in the call.

Results stay ProtoJSON dicts; replies that can be a Task *or* a Message come
back as a :class:`StreamEvent` so callers branch on ``event.kind``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from . import a2ui
from .bindings import BaseBinding, make_binding
from .card import choose_interface, fetch_card
from .errors import CredentialsWithheld, ProtocolError
from .origins import origin_of
from .streams import DEFAULT_MAX_EVENT_BYTES, check_task, parse_stream_response
from .types import (
    A2A_VERSION,
    EXTENSIONS_HEADER,
    ROLE_USER,
    VERSION_HEADER,
    Credentials,
    Interface,
    StreamEvent,
)

DEFAULT_MAX_RESPONSE_BYTES = 32 * 1024 * 1024
# Whole-call deadlines (seconds); the Django side passes its settings.
DEFAULT_CALL_DEADLINE = 60.0
DEFAULT_SEND_DEADLINE = 600.0
USER_AGENT = "a2a-dashboard/0.1"


def user_message(
    text: str | None = None,
    *,
    data: Any = None,
    files: Iterable[Mapping[str, Any]] = (),
    task_id: str | None = None,
    context_id: str | None = None,
    message_id: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    reference_task_ids: Sequence[str] = (),
) -> dict[str, Any]:
    """Build a ``ROLE_USER`` Message.

    A fresh UUID ``messageId`` is made unless one is given: pass the same id
    again when *retrying* a send, so a server that deduplicates on it does not
    create a second task. ``files`` are Part dicts (``{"raw": b64, ...}`` or
    ``{"url": ...}``, with ``mediaType``/``filename``); ``data`` becomes a data
    part with ``mediaType: application/json``.
    """
    parts: list[dict[str, Any]] = []
    if text is not None:
        parts.append({"text": text})
    if data is not None:
        parts.append({"data": data, "mediaType": "application/json"})
    parts.extend(dict(f) for f in files)
    if not parts:
        raise ValueError("a message needs at least one part (text, data or files)")
    msg: dict[str, Any] = {
        "messageId": message_id or str(uuid.uuid4()),
        "role": ROLE_USER,
        "parts": parts,
    }
    if task_id:
        msg["taskId"] = task_id
    if context_id:
        msg["contextId"] = context_id
    if metadata:
        msg["metadata"] = dict(metadata)
    if reference_task_ids:
        msg["referenceTaskIds"] = list(reference_task_ids)
    return msg


@dataclass(frozen=True, slots=True)
class AuthPlan:
    """Where credentials go for one agent: headers and query parameters."""

    # Not in its repr: both carry the secrets themselves.
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    query: dict[str, str] = field(default_factory=dict, repr=False)


def _card_scheme(card: Mapping[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """The card's first scheme of ``kind``, those its security requirements name first."""
    schemes = (card or {}).get("securitySchemes") or {}
    schemes = schemes if isinstance(schemes, dict) else {}
    preferred: list[str] = []
    requirements = (card or {}).get("securityRequirements") or []
    for req in requirements if isinstance(requirements, list) else []:
        if isinstance(req, dict) and isinstance(req.get("schemes"), dict):
            preferred.extend(req["schemes"])
    ordered = [n for n in preferred if n in schemes] + [n for n in schemes if n not in preferred]
    for name in ordered:
        scheme = schemes.get(name)
        if isinstance(scheme, dict) and isinstance(scheme.get(kind), dict):
            return scheme[kind]
    return None


def api_key_placement(
    card: Mapping[str, Any] | None, name: str | None = None, location: str | None = None
) -> tuple[str, str]:
    """(location, name) an API key goes to: the given ones, else the card's scheme, else a header.

    Saved credentials pin this when they are saved, so that a later card cannot move
    the key to another header, into the query or into a cookie.
    """
    api = _card_scheme(card, "apiKeySecurityScheme") or {}
    return (
        location or str(api.get("location") or "") or "header",
        name or str(api.get("name") or "") or "X-API-Key",
    )


def auth_plan(card: Mapping[str, Any] | None, credentials: Credentials | None) -> AuthPlan:
    """Place credentials as the card's security schemes say.

    A token goes into ``Authorization`` (``Bearer`` unless the card's HTTP
    scheme names another, e.g. ``Basic``); an API key goes where the credentials
    pin it, else to the location and name of the card's ``apiKeySecurityScheme``
    (header, query or cookie).
    """
    plan = AuthPlan()
    if credentials is None:
        return plan
    plan.headers.update(dict(credentials.headers))
    if credentials.token:
        http_scheme = _card_scheme(card, "httpAuthSecurityScheme")
        scheme = "Bearer"
        if http_scheme and isinstance(http_scheme.get("scheme"), str) and http_scheme["scheme"]:
            scheme = http_scheme["scheme"]
            scheme = "Bearer" if scheme.lower() == "bearer" else scheme
        plan.headers["Authorization"] = f"{scheme} {credentials.token}"
    if credentials.api_key:
        location, name = api_key_placement(
            card, credentials.api_key_name, credentials.api_key_location
        )
        if location == "query":
            plan.query[name] = credentials.api_key
        elif location == "cookie":
            cookie = plan.headers.get("Cookie")
            pair = f"{name}={credentials.api_key}"
            plan.headers["Cookie"] = f"{cookie}; {pair}" if cookie else pair
        else:
            plan.headers[name] = credentials.api_key
    return plan


def _timestamp(value: str | datetime) -> str:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("status_timestamp_after needs an aware datetime (UTC)")
        from datetime import UTC

        return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return value


class A2AClient:
    """Talk A2A 1.0 to one agent interface.

    Timeouts (per read): ``timeout`` bounds each read of ordinary calls; a
    *blocking* SendMessage waits up to ``send_timeout`` for the task to reach
    a terminal or interrupted state; a stream may stay silent (no event, no
    keep-alive) for at most ``stream_idle_timeout`` seconds before
    :class:`~tasks_app.a2a.errors.StreamIdleTimeout` (SDK servers ping about
    every 15 s).

    Deadlines (whole calls, however the bytes arrive): every unary call must
    complete within ``call_deadline`` seconds, a blocking SendMessage within
    ``send_deadline``, else :class:`~tasks_app.a2a.errors.DeadlineExceeded`
    ("no complete response after N s"). A stream must deliver its headers,
    and each event once started, within ``call_deadline``; complete events
    must come at most ``stream_event_gap`` seconds apart (default: the idle
    timeout), keep-alives or not, else ``StreamIdleTimeout``. ``None``
    disables a deadline.

    Streams are async generators: close them (``aclosing``) when you stop early.
    """

    def __init__(
        self,
        interface: Interface,
        *,
        http: httpx.AsyncClient,
        credentials: Credentials | None = None,
        extensions: Sequence[str] = (),
        card: Mapping[str, Any] | None = None,
        timeout: float = 30.0,
        send_timeout: float = 600.0,
        stream_idle_timeout: float = 60.0,
        connect_timeout: float = 10.0,
        call_deadline: float | None = DEFAULT_CALL_DEADLINE,
        send_deadline: float | None = DEFAULT_SEND_DEADLINE,
        stream_event_gap: float | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        stream_http: httpx.AsyncClient | None = None,
    ) -> None:
        self.interface = interface
        self.card = dict(card) if card is not None else None
        self.extensions = tuple(extensions)
        # A2UI: an agent whose card declares the extension has it activated on every
        # request (the A2A-Extensions header) and gets our renderer's capabilities in
        # every message we send (see _outgoing); any other agent gets nothing extra.
        self.a2ui_version = a2ui.declared_version(self.card)
        if self.a2ui_version is not None:
            uri = a2ui.EXTENSION_URIS[self.a2ui_version]
            self.extensions = tuple(dict.fromkeys((*self.extensions, uri)))
        self._timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._send_timeout = httpx.Timeout(send_timeout, connect=connect_timeout)
        self._stream_timeout = httpx.Timeout(
            connect=connect_timeout, read=stream_idle_timeout, write=timeout, pool=timeout
        )
        self._call_deadline = call_deadline
        self._send_deadline = send_deadline
        self._event_gap = stream_event_gap if stream_event_gap is not None else stream_idle_timeout
        plan = auth_plan(card, credentials)
        headers = {VERSION_HEADER: A2A_VERSION, "User-Agent": USER_AGENT, **plan.headers}
        if self.extensions:
            headers[EXTENSIONS_HEADER] = ",".join(self.extensions)
        self._binding: BaseBinding = make_binding(
            interface,
            http,
            headers=headers,
            query=plan.query,
            max_response_bytes=max_response_bytes,
            max_event_bytes=max_event_bytes,
            stream_http=stream_http,
        )

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        http: httpx.AsyncClient,
        binding: str | None = None,
        credentials: Credentials | None = None,
        credential_origins: Collection[str] = (),
        **kwargs: Any,
    ) -> A2AClient:
        """Fetch the card at ``url`` (base or card URL), choose an interface, build a client.

        ``credentials`` go only to an interface at the origin of ``url`` or one of
        ``credential_origins`` (``scheme://host:port``); another raises
        :class:`CredentialsWithheld` before anything is sent there.
        """
        result = await fetch_card(
            url, http=http, deadline=kwargs.get("call_deadline", DEFAULT_CALL_DEADLINE)
        )
        assert result.card is not None
        iface = choose_interface(result.card, binding=binding, card_url=result.url)
        allowed = {origin_of(url), *(origin_of(o) or o for o in credential_origins)}
        if credentials is not None and origin_of(iface.url) not in allowed:
            raise CredentialsWithheld(
                f"the card names its interface at {origin_of(iface.url)}, not at "
                f"{origin_of(url)}: the credentials are not sent there (name that origin as "
                "one they may go to, if it is the agent's)"
            )
        return cls(iface, http=http, credentials=credentials, card=result.card, **kwargs)

    @property
    def capabilities(self) -> dict[str, Any]:
        caps = (self.card or {}).get("capabilities")
        return caps if isinstance(caps, dict) else {}

    def _unary_bounds(self) -> dict[str, Any]:
        return {"timeout": self._timeout, "deadline": self._call_deadline}

    def _stream_bounds(self) -> dict[str, Any]:
        return {
            "timeout": self._stream_timeout,
            "deadline": self._call_deadline,
            "event_gap": self._event_gap,
        }

    # ------------------------------------------------------------------ messages

    def _outgoing(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """The message as sent: with the A2UI capabilities when the agent speaks A2UI."""
        return a2ui.with_capabilities(message, self.a2ui_version)

    def _send_params(
        self,
        message: Mapping[str, Any],
        *,
        return_immediately: bool,
        history_length: int | None,
        accepted_output_modes: Sequence[str] | None,
        push_config: Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        config: dict[str, Any] = {}
        if accepted_output_modes:
            config["acceptedOutputModes"] = list(accepted_output_modes)
        if history_length is not None:
            config["historyLength"] = history_length
        if return_immediately:
            config["returnImmediately"] = True
        if push_config:
            pc = dict(push_config)
            pc.pop("taskId", None)  # inline configs carry no taskId (§8)
            config["taskPushNotificationConfig"] = pc
        params: dict[str, Any] = {"message": self._outgoing(message)}
        if config:
            params["configuration"] = config
        if metadata:
            params["metadata"] = dict(metadata)
        return params

    async def send_message(
        self,
        message: Mapping[str, Any],
        *,
        return_immediately: bool = False,
        history_length: int | None = None,
        accepted_output_modes: Sequence[str] | None = None,
        push_config: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> StreamEvent:
        """SendMessage: the reply is a ``task`` or a ``message`` event.

        Blocking by default (the agent answers when the task is terminal or
        interrupted), so the read timeout is ``send_timeout`` and the whole call
        is bounded by ``send_deadline`` (``call_deadline`` with
        ``return_immediately``).
        """
        params = self._send_params(
            message,
            return_immediately=return_immediately,
            history_length=history_length,
            accepted_output_modes=accepted_output_modes,
            push_config=push_config,
            metadata=metadata,
        )
        if return_immediately:
            timeout, deadline = self._timeout, self._call_deadline
        else:
            timeout, deadline = self._send_timeout, self._send_deadline
        result = await self._binding.call("SendMessage", params, timeout=timeout, deadline=deadline)
        return parse_stream_response(
            result, where="SendMessage result", allowed=("task", "message")
        )

    async def send_streaming_message(
        self,
        message: Mapping[str, Any],
        *,
        history_length: int | None = None,
        accepted_output_modes: Sequence[str] | None = None,
        push_config: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """SendStreamingMessage: one ``message``, or a ``task`` then updates until it closes."""
        params = self._send_params(
            message,
            return_immediately=False,
            history_length=history_length,
            accepted_output_modes=accepted_output_modes,
            push_config=push_config,
            metadata=metadata,
        )
        async for event in self._binding.stream(
            "SendStreamingMessage", params, **self._stream_bounds()
        ):
            yield event

    # ------------------------------------------------------------------ tasks

    async def get_task(self, task_id: str, *, history_length: int | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"id": task_id}
        if history_length is not None:
            params["historyLength"] = history_length
        return check_task(
            await self._binding.call("GetTask", params, **self._unary_bounds()), "GetTask result"
        )

    async def list_tasks(
        self,
        *,
        context_id: str | None = None,
        status: str | None = None,
        page_size: int | None = None,
        page_token: str | None = None,
        history_length: int | None = None,
        status_timestamp_after: str | datetime | None = None,
        include_artifacts: bool = False,
        check: bool = True,
    ) -> dict[str, Any]:
        """ListTasks: ``{"tasks": [...], "nextPageToken": "", "pageSize", "totalSize"}``.

        ``check=False`` returns the listed tasks unchecked (``check_task`` each), for a
        caller that takes what it asked for and goes on past a bad task instead of losing
        the page to it.
        """
        params: dict[str, Any] = {}
        if context_id:
            params["contextId"] = context_id
        if status:
            params["status"] = status
        if page_size is not None:
            params["pageSize"] = page_size
        if page_token:
            params["pageToken"] = page_token
        if history_length is not None:
            params["historyLength"] = history_length
        if status_timestamp_after is not None:
            params["statusTimestampAfter"] = _timestamp(status_timestamp_after)
        if include_artifacts:
            params["includeArtifacts"] = True
        result = await self._binding.call("ListTasks", params, **self._unary_bounds())
        if not isinstance(result, dict):
            raise ProtocolError("ListTasks result must be an object", where="ListTasks")
        if result.get("tasks") is None:  # absent or null (ProtoJSON): no tasks
            result["tasks"] = []
        tasks = result["tasks"]
        if not isinstance(tasks, list):
            raise ProtocolError("'tasks' must be an array", where="ListTasks")
        if check:
            for i, task in enumerate(tasks):
                check_task(task, f"ListTasks.tasks[{i}]")
        result.setdefault("tasks", [])
        result.setdefault("nextPageToken", "")
        return result

    async def cancel_task(
        self, task_id: str, *, metadata: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """CancelTask: the updated Task (which may not be CANCELED yet)."""
        params: dict[str, Any] = {"id": task_id}
        if metadata:
            params["metadata"] = dict(metadata)
        return check_task(
            await self._binding.call("CancelTask", params, **self._unary_bounds()),
            "CancelTask result",
        )

    async def subscribe_to_task(self, task_id: str) -> AsyncIterator[StreamEvent]:
        """SubscribeToTask: a ``task`` snapshot first, then live updates only."""
        async for event in self._binding.stream(
            "SubscribeToTask", {"id": task_id}, **self._stream_bounds()
        ):
            yield event

    # ------------------------------------------------------------------ push configs

    async def create_push_config(
        self,
        task_id: str,
        url: str,
        *,
        config_id: str | None = None,
        token: str | None = None,
        auth_scheme: str | None = None,
        auth_credentials: str | None = None,
    ) -> dict[str, Any]:
        """CreateTaskPushNotificationConfig. Always sends an ``id`` (fresh UUID by default):

        servers store an id-less config under the task id, so a second one would
        silently overwrite the first.
        """
        config: dict[str, Any] = {
            "taskId": task_id,
            "id": config_id or str(uuid.uuid4()),
            "url": url,
        }
        if token:
            config["token"] = token
        if auth_scheme:
            config["authentication"] = {"scheme": auth_scheme}
            if auth_credentials:
                config["authentication"]["credentials"] = auth_credentials
        return self._config(
            await self._binding.call(
                "CreateTaskPushNotificationConfig", config, **self._unary_bounds()
            ),
            "CreateTaskPushNotificationConfig",
        )

    async def get_push_config(self, task_id: str, config_id: str) -> dict[str, Any]:
        return self._config(
            await self._binding.call(
                "GetTaskPushNotificationConfig",
                {"taskId": task_id, "id": config_id},
                **self._unary_bounds(),
            ),
            "GetTaskPushNotificationConfig",
        )

    async def list_push_configs(
        self, task_id: str, *, page_size: int | None = None, page_token: str | None = None
    ) -> dict[str, Any]:
        """``{"configs": [...], "nextPageToken": ""}``."""
        params: dict[str, Any] = {"taskId": task_id}
        if page_size is not None:
            params["pageSize"] = page_size
        if page_token:
            params["pageToken"] = page_token
        result = await self._binding.call(
            "ListTaskPushNotificationConfigs", params, **self._unary_bounds()
        )
        if result is None:
            result = {}
        if isinstance(result, dict) and result.get("configs") is None:
            result["configs"] = []  # absent or null (ProtoJSON): none
        if not isinstance(result, dict) or not isinstance(result.get("configs", []), list):
            raise ProtocolError(
                "malformed ListTaskPushNotificationConfigs result",
                where="ListTaskPushNotificationConfigs",
            )
        result.setdefault("configs", [])
        result.setdefault("nextPageToken", "")
        return result

    async def delete_push_config(self, task_id: str, config_id: str) -> None:
        await self._binding.call(
            "DeleteTaskPushNotificationConfig",
            {"taskId": task_id, "id": config_id},
            **self._unary_bounds(),
        )

    @staticmethod
    def _config(result: Any, where: str) -> dict[str, Any]:
        if not isinstance(result, dict) or not isinstance(result.get("url"), str):
            raise ProtocolError("expected a TaskPushNotificationConfig with 'url'", where=where)
        return result

    # ------------------------------------------------------------------ cards

    async def get_extended_agent_card(self) -> dict[str, Any]:
        """GetExtendedAgentCard (needs ``capabilities.extendedAgentCard`` and usually credentials)."""
        result = await self._binding.call("GetExtendedAgentCard", {}, **self._unary_bounds())
        if not isinstance(result, dict):
            raise ProtocolError(
                "extended agent card must be an object", where="GetExtendedAgentCard"
            )
        return result
