"""The two HTTP bindings behind one small interface.

A binding knows how one A2A operation (named by its JSON-RPC method name,
e.g. ``"GetTask"``) travels on the wire: :meth:`call` for unary operations
and :meth:`stream` for the SSE ones. Both take the *proto request message*
as a dict (``params``) and give back plain ProtoJSON; everything above this
module is binding-agnostic.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AsyncExitStack
from typing import Any
from urllib.parse import quote

import httpx
from httpx_sse import aconnect_sse

from ._http import (
    HTTPX_ERRORS,
    SSE_MEDIA_TYPE,
    decode_json,
    error_for_status,
    is_json_media,
    large_body_scope,
    map_transport_error,
    media_type,
    read_bounded,
    snippet_of,
)
from ._http import deadline as deadline_scope  # ``deadline`` is a parameter name here
from .errors import (
    A2AError,
    ProtocolError,
    RemoteError,
    TaskNotFoundError,
    from_http_error,
    from_jsonrpc_error,
)
from .safejson import clean
from .streams import iter_sse_response, parse_stream_response
from .types import Interface, StreamEvent

REST_JSON_MEDIA = "application/a2a+json"

# Which verb answered SubscribeToTask per REST base URL (spec inconsistency §4.2).
_SUBSCRIBE_VERB: dict[str, str] = {}


class BaseBinding:
    """Shared plumbing: headers, bounded reads, error mapping."""

    name = ""

    def __init__(
        self,
        interface: Interface,
        http: httpx.AsyncClient,
        *,
        headers: Mapping[str, str],
        query: Mapping[str, str] | None = None,
        max_response_bytes: int,
        max_event_bytes: int,
        stream_http: httpx.AsyncClient | None = None,
    ) -> None:
        self.interface = interface
        self.http = http
        self.stream_http = stream_http or http
        self.headers = dict(headers)
        self.query = dict(query or {})
        self.max_response_bytes = max_response_bytes
        self.max_event_bytes = max_event_bytes

    async def call(
        self,
        method: str,
        params: dict[str, Any],
        *,
        timeout: httpx.Timeout,
        deadline: float | None = None,
    ) -> Any:
        """One unary operation; ``deadline`` bounds it as a whole (seconds)."""
        raise NotImplementedError

    def stream(
        self,
        method: str,
        params: dict[str, Any],
        *,
        timeout: httpx.Timeout,
        deadline: float | None = None,
        event_gap: float | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """One SSE operation.

        ``deadline`` bounds getting the response headers (or an error body) and
        each event once it has started; ``event_gap`` bounds the time between
        complete events even while keep-alives or partial data keep arriving.
        """
        raise NotImplementedError

    # -- helpers ----------------------------------------------------------------

    async def _unary(
        self,
        verb: str,
        url: str,
        *,
        json_body: Any,
        query: Mapping[str, Any] | None,
        content_type: str,
        timeout: httpx.Timeout,
        deadline: float | None,
        where: str,
        parse: Callable[[httpx.Response, bytes], Any],
    ) -> Any:
        """One request and its reply: an error status raises its typed error, else
        ``parse(response, body)``. A large reply's slot lasts through the parse
        (``large_body_scope``)."""
        headers = {**self.headers, "Accept": f"{content_type}, application/json"}
        kwargs: dict[str, Any] = {}
        if json_body is not None:
            kwargs["content"] = _dumps(json_body)
            headers["Content-Type"] = content_type
        params = {**self.query, **(query or {})}
        async with large_body_scope():
            try:
                async with (
                    deadline_scope(deadline, where),
                    self.http.stream(
                        verb, url, headers=headers, params=params or None, timeout=timeout, **kwargs
                    ) as resp,
                ):
                    body = await read_bounded(resp, self.max_response_bytes, where)
            except HTTPX_ERRORS as exc:
                raise map_transport_error(exc, where) from exc
            if resp.status_code >= 400:
                raise error_for_status(resp, body, where)
            return parse(resp, body)

    async def _sse(
        self,
        verb: str,
        url: str,
        *,
        json_body: Any,
        content_type: str,
        timeout: httpx.Timeout,
        deadline: float | None,
        event_gap: float | None,
        where: str,
        unwrap_json_reply: Any,
        unwrap_event: Any,
    ) -> AsyncIterator[StreamEvent]:
        headers = {**self.headers}
        kwargs: dict[str, Any] = {}
        if json_body is not None:
            kwargs["content"] = _dumps(json_body)
            headers["Content-Type"] = content_type
        try:
            async with AsyncExitStack() as stack:
                # Headers (or a whole error body) within the deadline; the
                # deadline's scope must close before the first ``yield``.
                async with deadline_scope(deadline, where):
                    source = await stack.enter_async_context(
                        aconnect_sse(
                            self.stream_http,
                            verb,
                            url,
                            headers=headers,
                            params=self.query or None,
                            timeout=timeout,
                            **kwargs,
                        )
                    )
                    resp = source.response
                    await self._check_sse_response(resp, where, unwrap_json_reply)
                async for msg in iter_sse_response(
                    resp,
                    max_event_bytes=self.max_event_bytes,
                    where=where,
                    event_deadline=deadline,
                    event_gap=event_gap,
                ):
                    obj = decode_json(msg.data.encode("utf-8"), f"{where} SSE event", mt="SSE data")
                    yield unwrap_event(obj, msg.event)
        except HTTPX_ERRORS as exc:
            raise map_transport_error(exc, where, streaming=True) from exc

    async def _check_sse_response(
        self, resp: httpx.Response, where: str, unwrap_json_reply: Any
    ) -> None:
        """Raise the typed error for a reply that is not an SSE stream."""
        mt = media_type(resp)
        if resp.status_code >= 400:
            body = await read_bounded(resp, self.max_response_bytes, where)
            raise error_for_status(resp, body, where)
        if mt != SSE_MEDIA_TYPE:
            # The SDK answers errors before the stream starts (e.g. -32004
            # streaming unsupported) as plain JSON, not SSE.
            body = await read_bounded(resp, self.max_response_bytes, where)
            if is_json_media(mt) or body[:1] in (b"{", b"["):
                unwrap_json_reply(decode_json(body, where, mt=mt), resp.status_code)
                raise ProtocolError(
                    f"expected {SSE_MEDIA_TYPE}, got a JSON reply",
                    where=where,
                    snippet=snippet_of(body, 500),
                )
            raise ProtocolError(
                f"expected {SSE_MEDIA_TYPE}, got {mt or 'no content type'}: "
                f"{snippet_of(body) or '(empty body)'}",
                where=where,
                snippet=snippet_of(body, 500),
            )


def _dumps(obj: Any) -> bytes:
    """A request body. Ids and tokens come from the agent and may hold lone
    surrogates (not encodable as UTF-8): then every non-ASCII character is
    escaped instead, which sends the agent back exactly what it gave us."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, separators=(",", ":")).encode("ascii")


class JsonRpcBinding(BaseBinding):
    """JSON-RPC 2.0 over HTTP POST (§9); streams are SSE of JSON-RPC responses."""

    name = "JSONRPC"

    def _envelope(self, method: str, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        if self.interface.tenant:
            params = {**params, "tenant": self.interface.tenant}
        rid = str(uuid.uuid4())
        return rid, {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}

    @staticmethod
    def _result(obj: Any, where: str, rid: str | None, http_status: int | None) -> Any:
        if not isinstance(obj, dict) or obj.get("jsonrpc") != "2.0":
            raise ProtocolError(
                "not a JSON-RPC 2.0 response object", where=where, snippet=str(obj)[:300]
            )
        if "error" in obj and obj["error"] is not None:
            raise from_jsonrpc_error(obj["error"], http_status=http_status)
        if "result" not in obj:
            raise ProtocolError("JSON-RPC response has neither 'result' nor 'error'", where=where)
        if rid is not None and obj.get("id") not in (rid, None):
            raise ProtocolError(
                f"JSON-RPC response id {obj.get('id')!r} does not match {rid!r}", where=where
            )
        return obj["result"]

    async def call(
        self,
        method: str,
        params: dict[str, Any],
        *,
        timeout: httpx.Timeout,
        deadline: float | None = None,
    ) -> Any:
        rid, body = self._envelope(method, params)
        where = f"{method} (JSON-RPC {self.interface.url})"

        def parse(resp: httpx.Response, raw: bytes) -> Any:
            obj = decode_json(raw, where, mt=media_type(resp))
            return self._result(obj, where, rid, resp.status_code)

        return await self._unary(
            "POST",
            self.interface.url,
            json_body=body,
            query=None,
            content_type="application/json",
            timeout=timeout,
            deadline=deadline,
            where=where,
            parse=parse,
        )

    def stream(
        self,
        method: str,
        params: dict[str, Any],
        *,
        timeout: httpx.Timeout,
        deadline: float | None = None,
        event_gap: float | None = None,
    ) -> AsyncIterator[StreamEvent]:
        rid, body = self._envelope(method, params)
        where = f"{method} (JSON-RPC {self.interface.url})"

        def unwrap_reply(obj: Any, status: int) -> None:
            self._result(obj, where, rid, status)

        def unwrap_event(obj: Any, event: str) -> StreamEvent:
            result = self._result(obj, f"{where} SSE event", rid, None)
            return parse_stream_response(result, where=f"{method} event")

        return self._sse(
            "POST",
            self.interface.url,
            json_body=body,
            content_type="application/json",
            timeout=timeout,
            deadline=deadline,
            event_gap=event_gap,
            where=where,
            unwrap_json_reply=unwrap_reply,
            unwrap_event=unwrap_event,
        )


def _q(segment: str) -> str:
    # surrogatepass: an agent-chosen id with a lone surrogate must not crash us.
    quoted = quote(str(segment), safe="", errors="surrogatepass")
    # An id "." or ".." would be a dot segment, removed by URL normalisation (httpx does it):
    # /tasks/.. would reach another path than the task's.
    return quoted.replace(".", "%2E") if quoted in (".", "..") else quoted


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return clean(str(value))[0]  # httpx cannot encode lone surrogates


class RestBinding(BaseBinding):
    """HTTP+JSON (§11): ProtoJSON bodies, google.rpc.Status errors, bare SSE events."""

    name = "HTTP+JSON"

    @property
    def base(self) -> str:
        base = self.interface.url.rstrip("/")
        if self.interface.tenant:
            base += "/" + _q(self.interface.tenant)
        return base

    def _route(
        self, method: str, params: dict[str, Any]
    ) -> tuple[str, str, Any, dict[str, Any] | None]:
        """(verb, path, body, query) for one operation."""
        p = dict(params)
        tenant = self.interface.tenant
        with_tenant = (lambda d: {**d, "tenant": tenant}) if tenant else (lambda d: d)
        if method == "SendMessage":
            return "POST", "/message:send", with_tenant(p), None
        if method == "SendStreamingMessage":
            return "POST", "/message:stream", with_tenant(p), None
        if method == "GetTask":
            tid = p.pop("id")
            return "GET", f"/tasks/{_q(tid)}", None, {k: _query_value(v) for k, v in p.items()}
        if method == "ListTasks":
            return "GET", "/tasks", None, {k: _query_value(v) for k, v in p.items()}
        if method == "CancelTask":
            tid = p.pop("id")
            return "POST", f"/tasks/{_q(tid)}:cancel", with_tenant(p), None
        if method == "SubscribeToTask":
            return "POST", f"/tasks/{_q(p['id'])}:subscribe", {}, None
        if method == "CreateTaskPushNotificationConfig":
            return "POST", f"/tasks/{_q(p['taskId'])}/pushNotificationConfigs", with_tenant(p), None
        if method == "GetTaskPushNotificationConfig":
            return (
                "GET",
                f"/tasks/{_q(p['taskId'])}/pushNotificationConfigs/{_q(p['id'])}",
                None,
                None,
            )
        if method == "ListTaskPushNotificationConfigs":
            tid = p.pop("taskId")
            return (
                "GET",
                f"/tasks/{_q(tid)}/pushNotificationConfigs",
                None,
                {k: _query_value(v) for k, v in p.items()},
            )
        if method == "DeleteTaskPushNotificationConfig":
            return (
                "DELETE",
                f"/tasks/{_q(p['taskId'])}/pushNotificationConfigs/{_q(p['id'])}",
                None,
                None,
            )
        if method == "GetExtendedAgentCard":
            return "GET", "/extendedAgentCard", None, None
        raise ValueError(f"unknown A2A method {method!r}")

    async def call(
        self,
        method: str,
        params: dict[str, Any],
        *,
        timeout: httpx.Timeout,
        deadline: float | None = None,
    ) -> Any:
        verb, path, body, query = self._route(method, params)
        url = self.base + path
        where = f"{method} ({verb} {url})"

        def parse(resp: httpx.Response, raw: bytes) -> Any:
            return decode_json(raw, where, mt=media_type(resp)) if raw.strip() else None

        return await self._unary(
            verb,
            url,
            json_body=body,
            query=query,
            content_type=REST_JSON_MEDIA,
            timeout=timeout,
            deadline=deadline,
            where=where,
            parse=parse,
        )

    @staticmethod
    def _raise_error_object(obj: Any, status: int | None) -> None:
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
            code = obj["error"].get("code")
            http_status = code if isinstance(code, int) and code >= 100 else (status or 500)
            raise from_http_error(http_status, obj)

    def stream(
        self,
        method: str,
        params: dict[str, Any],
        *,
        timeout: httpx.Timeout,
        deadline: float | None = None,
        event_gap: float | None = None,
    ) -> AsyncIterator[StreamEvent]:
        bounds = {"timeout": timeout, "deadline": deadline, "event_gap": event_gap}
        if method == "SubscribeToTask":
            return self._subscribe(params, **bounds)
        return self._stream_once(method, params, **bounds)

    def _stream_once(
        self,
        method: str,
        params: dict[str, Any],
        *,
        timeout: httpx.Timeout,
        deadline: float | None = None,
        event_gap: float | None = None,
        verb: str | None = None,
    ) -> AsyncIterator[StreamEvent]:
        route_verb, path, body, _ = self._route(method, params)
        verb = verb or route_verb
        if verb == "GET":
            body = None
        url = self.base + path
        where = f"{method} ({verb} {url})"

        def unwrap_reply(obj: Any, status: int) -> None:
            self._raise_error_object(obj, status)

        def unwrap_event(obj: Any, event: str) -> StreamEvent:
            if event == "error" or (isinstance(obj, dict) and "error" in obj and len(obj) == 1):
                self._raise_error_object(obj, None)
                raise ProtocolError("error event without a google.rpc.Status body", where=where)
            return parse_stream_response(obj, where=f"{method} event")

        return self._sse(
            verb,
            url,
            json_body=body,
            content_type=REST_JSON_MEDIA,
            timeout=timeout,
            deadline=deadline,
            event_gap=event_gap,
            where=where,
            unwrap_json_reply=unwrap_reply,
            unwrap_event=unwrap_event,
        )

    async def _subscribe(
        self,
        params: dict[str, Any],
        *,
        timeout: httpx.Timeout,
        deadline: float | None = None,
        event_gap: float | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """POST first; on 404/405 (or TaskNotFound naming "<id>:subscribe") retry once with GET."""
        key = self.base
        verb = _SUBSCRIBE_VERB.get(key, "POST")
        task_id = str(params.get("id", ""))
        started = False
        try:
            async for ev in self._stream_once(
                "SubscribeToTask",
                params,
                timeout=timeout,
                deadline=deadline,
                event_gap=event_gap,
                verb=verb,
            ):
                started = True
                yield ev
            return
        except A2AError as exc:
            if started or verb == "GET" or not _verb_mismatch(exc, task_id):
                raise
        async for ev in self._stream_once(
            "SubscribeToTask",
            params,
            timeout=timeout,
            deadline=deadline,
            event_gap=event_gap,
            verb="GET",
        ):
            _SUBSCRIBE_VERB[key] = "GET"  # remember only a verb that worked
            yield ev


def _verb_mismatch(exc: A2AError, task_id: str) -> bool:
    status = getattr(exc, "http_status", None)
    if isinstance(exc, TaskNotFoundError):
        text = f"{exc.message} {exc.metadata}"
        return f"{task_id}:subscribe" in text
    if status == 405:
        return True
    if status == 404:
        # A real A2A TaskNotFound means the route worked; anything else is routing.
        return not (isinstance(exc, RemoteError) and exc.reason == "TASK_NOT_FOUND")
    return False


def make_binding(
    interface: Interface,
    http: httpx.AsyncClient,
    *,
    headers: Mapping[str, str],
    query: Mapping[str, str] | None = None,
    max_response_bytes: int,
    max_event_bytes: int,
    stream_http: httpx.AsyncClient | None = None,
) -> BaseBinding:
    cls: type[BaseBinding] = JsonRpcBinding if interface.binding == "JSONRPC" else RestBinding
    return cls(
        interface,
        http,
        headers=headers,
        query=query,
        max_response_bytes=max_response_bytes,
        max_event_bytes=max_event_bytes,
        stream_http=stream_http,
    )
