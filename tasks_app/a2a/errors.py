"""One error hierarchy for everything that can go wrong talking to an agent.

Callers need to tell three situations apart, because each one leads to a
different decision:

* :class:`TransportError` -- we could not talk to the agent, or the
  connection broke (retry / resubscribe later, the task may well be fine);
* :class:`ProtocolError` -- the agent answered something we cannot
  understand (record it, do not retry blindly);
* :class:`RemoteError` -- the agent understood and said no (show the A2A
  code and reason; subclasses per A2A error code).

``str(err)`` is always one line with the code and reason when known, so it
can go straight into a log line or a CLI error.
"""

from __future__ import annotations

from typing import Any

ERROR_INFO_TYPE_SUFFIX = "google.rpc.ErrorInfo"
A2A_DOMAIN = "a2a-protocol.org"


def _one_line(text: str, limit: int = 300) -> str:
    """One line of at most ``limit`` characters that any database can store.

    Error texts come from agents, and end up in watcher notes, log rows and pages:
    lone surrogates and NUL (which neither database accepts) become U+FFFD.
    """
    from .safejson import clean_text  # here: safejson imports this module's ProtocolError

    text = clean_text(" ".join(str(text).split()))
    return text if len(text) <= limit else text[: limit - 1] + "…"


class A2AError(Exception):
    """Base class of every error raised by :mod:`tasks_app.a2a`."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return _one_line(self.message)


# --------------------------------------------------------------------------- transport


class TransportError(A2AError):
    """Connecting, sending or reading failed: the agent said nothing (more)."""


class ConnectError(TransportError):
    """The TCP/TLS connection could not be established."""


class OutboundRefused(ConnectError):
    """The outbound guard refused the address (SSRF): no connection was made.

    A ``ConnectError`` (nothing reached the agent, so a send is safe to retry once the
    address or ``OUTBOUND_ALLOW`` is fixed); the message names the rule that refused it
    and never holds anything received - nothing was.
    """


class RequestTimeout(TransportError):
    """The agent did not answer within the configured time."""


class StreamIdleTimeout(RequestTimeout):
    """An open stream stayed silent (not even a keep-alive) for too long."""


class DeadlineExceeded(RequestTimeout):
    """A whole call, or one SSE event, did not complete within its deadline.

    Unlike a read timeout this fires even while bytes keep arriving: an agent
    that trickles one byte a second never trips a per-read timeout.
    """


class ConnectionDropped(TransportError):
    """The connection broke while a response or stream was being read."""


# --------------------------------------------------------------------------- protocol


class ProtocolError(A2AError):
    """The agent sent something that is not valid A2A 1.0.

    ``where`` names the request/field that was wrong, ``snippet`` holds the
    beginning of the offending body (for the audit trail).
    """

    def __init__(self, message: str, *, where: str = "", snippet: str = "") -> None:
        super().__init__(message)
        self.where = where
        self.snippet = snippet

    def __str__(self) -> str:
        prefix = f"{self.where}: " if self.where else ""
        return _one_line(f"protocol error: {prefix}{self.message}")


class PayloadTooLarge(ProtocolError):
    """A response body or SSE event exceeded the configured size bound."""


class IncompatibleAgentError(A2AError):
    """The card offers no interface this client can speak (e.g. 0.3 only)."""

    def __init__(self, message: str, problems: list[Any] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems or [])


class CredentialsWithheld(A2AError):
    """The card names an interface at another origin than the URL given: credentials meant for
    one host are not sent to another the card chose (a card can name any URL)."""


# --------------------------------------------------------------------------- remote


class RemoteError(A2AError):
    """The agent answered with an error (JSON-RPC ``error`` or HTTP error status)."""

    code: int | None = None
    default_reason: str = ""

    def __init__(
        self,
        message: str = "",
        *,
        code: int | None = None,
        reason: str | None = None,
        http_status: int | None = None,
        details: list[dict[str, Any]] | None = None,
        data: Any = None,
    ) -> None:
        super().__init__(message or self.__class__.__name__)
        if code is not None:
            self.code = code
        # The agent's ErrorInfo reason: only a string is one (it is joined into str(err)).
        self.reason = (reason if isinstance(reason, str) else None) or self.default_reason or None
        self.http_status = http_status
        self.details = list(details or [])
        self.data = data

    @property
    def metadata(self) -> dict[str, str]:
        """``ErrorInfo.metadata`` of the first A2A ErrorInfo detail (e.g. taskId)."""
        info = _first_error_info(self.details)
        meta = (info or {}).get("metadata")
        return meta if isinstance(meta, dict) else {}

    def __str__(self) -> str:
        bits = []
        if self.code is not None:
            bits.append(str(self.code))
        if self.reason:
            bits.append(self.reason)
        if self.http_status is not None and self.http_status >= 300:
            bits.append(f"HTTP {self.http_status}")
        head = "A2A error " + " ".join(bits) if bits else "A2A error"
        return _one_line(f"{head}: {self.message}")


class JSONParseError(RemoteError):
    code = -32700
    default_reason = "PARSE_ERROR"


class InvalidRequestError(RemoteError):
    code = -32600
    default_reason = "INVALID_REQUEST"


class MethodNotFoundError(RemoteError):
    code = -32601
    default_reason = "METHOD_NOT_FOUND"


class InvalidParamsError(RemoteError):
    code = -32602
    default_reason = "INVALID_PARAMS"


class InternalError(RemoteError):
    code = -32603
    default_reason = "INTERNAL_ERROR"


class TaskNotFoundError(RemoteError):
    code = -32001
    default_reason = "TASK_NOT_FOUND"


class TaskNotCancelableError(RemoteError):
    code = -32002
    default_reason = "TASK_NOT_CANCELABLE"


class PushNotificationNotSupportedError(RemoteError):
    code = -32003
    default_reason = "PUSH_NOTIFICATION_NOT_SUPPORTED"


class UnsupportedOperationError(RemoteError):
    code = -32004
    default_reason = "UNSUPPORTED_OPERATION"


class ContentTypeNotSupportedError(RemoteError):
    code = -32005
    default_reason = "CONTENT_TYPE_NOT_SUPPORTED"


class InvalidAgentResponseError(RemoteError):
    code = -32006
    default_reason = "INVALID_AGENT_RESPONSE"


class ExtendedAgentCardNotConfiguredError(RemoteError):
    code = -32007
    default_reason = "EXTENDED_AGENT_CARD_NOT_CONFIGURED"


class ExtensionSupportRequiredError(RemoteError):
    code = -32008
    default_reason = "EXTENSION_SUPPORT_REQUIRED"


class VersionNotSupportedError(RemoteError):
    code = -32009
    default_reason = "VERSION_NOT_SUPPORTED"


class AuthError(RemoteError):
    """HTTP 401/403 (typically from a gateway, with no A2A body)."""

    default_reason = "UNAUTHENTICATED"


class HTTPStatusError(ProtocolError):
    """An HTTP error status whose body carried no A2A error (e.g. an HTML 500 page)."""

    def __init__(self, message: str, *, http_status: int, snippet: str = "") -> None:
        super().__init__(message, snippet=snippet)
        self.http_status = http_status


class ServiceUnavailable(TransportError):
    """HTTP 502/503/504 without an A2A body: a gateway or overloaded agent; retry later."""

    def __init__(self, message: str, *, http_status: int) -> None:
        super().__init__(message)
        self.http_status = http_status


_BY_CODE: dict[int, type[RemoteError]] = {
    cls.code: cls
    for cls in (
        JSONParseError,
        InvalidRequestError,
        MethodNotFoundError,
        InvalidParamsError,
        InternalError,
        TaskNotFoundError,
        TaskNotCancelableError,
        PushNotificationNotSupportedError,
        UnsupportedOperationError,
        ContentTypeNotSupportedError,
        InvalidAgentResponseError,
        ExtendedAgentCardNotConfiguredError,
        ExtensionSupportRequiredError,
        VersionNotSupportedError,
    )
    if cls.code is not None
}
_BY_REASON: dict[str, type[RemoteError]] = {cls.default_reason: cls for cls in _BY_CODE.values()}
# Reason spellings seen in the wild / in the 0.3 era.
_BY_REASON.update(
    {
        "AUTHENTICATED_EXTENDED_CARD_NOT_CONFIGURED": ExtendedAgentCardNotConfiguredError,
        "INVALID_ARGUMENT": InvalidParamsError,
        "INTERNAL": InternalError,
    }
)


def error_class_for(code: int | None = None, reason: str | None = None) -> type[RemoteError]:
    """Pick the most specific class: numeric code first, then ErrorInfo reason."""
    if code is not None and code in _BY_CODE:
        return _BY_CODE[code]
    if isinstance(reason, str) and reason.upper() in _BY_REASON:
        return _BY_REASON[reason.upper()]
    return RemoteError


def _first_error_info(details: Any) -> dict[str, Any] | None:
    if not isinstance(details, list):
        return None
    fallback = None
    for item in details:
        if not isinstance(item, dict):
            continue
        if str(item.get("@type", "")).endswith(ERROR_INFO_TYPE_SUFFIX) or "reason" in item:
            if item.get("domain") in (A2A_DOMAIN, None):
                return item
            fallback = fallback or item
    return fallback


def _details_from_data(data: Any) -> list[dict[str, Any]]:
    """``data`` may be a list of Any (1.0), an object (0.3), a string or null."""
    if isinstance(data, list):
        return [d for d in data if isinstance(d, dict)]
    if isinstance(data, dict):
        return [data]
    return []


def from_jsonrpc_error(error: Any, *, http_status: int | None = None) -> RemoteError:
    """Build the typed error for a JSON-RPC ``error`` member."""
    if not isinstance(error, dict):
        return RemoteError(f"malformed JSON-RPC error member: {error!r}", http_status=http_status)
    code = error.get("code")
    code = code if isinstance(code, int) and not isinstance(code, bool) else None
    data = error.get("data")
    details = _details_from_data(data)
    info = _first_error_info(details)
    reason = info.get("reason") if info else None
    message = error.get("message")
    if not isinstance(message, str) or not message:
        message = data if isinstance(data, str) and data else "(no message)"
    cls = error_class_for(code, reason)
    return cls(
        message,
        code=code,
        reason=reason if isinstance(reason, str) else None,
        http_status=http_status,
        details=details,
        data=data,
    )


def from_http_error(status: int, body: Any, *, text: str = "") -> A2AError:
    """Build the typed error for an HTTP error response.

    Understands ``google.rpc.Status`` (``{"error": {code, status, message,
    details}}``, or bare), a JSON-RPC error envelope, RFC 9457 problem+json and
    anything else (plain 401/403 → :class:`AuthError`).
    """
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and body.get("jsonrpc") == "2.0":
            return from_jsonrpc_error(err, http_status=status)
        if err is None and isinstance(body.get("details"), list) and "message" in body:
            err = body  # a bare google.rpc.Status (as gRPC-transcoding gateways send it)
        if isinstance(err, dict):
            details = err.get("details")
            details = (
                [d for d in details if isinstance(d, dict)] if isinstance(details, list) else []
            )
            info = _first_error_info(details)
            reason = info.get("reason") if info else None
            message = err.get("message") if isinstance(err.get("message"), str) else ""
            cls = error_class_for(None, reason)
            if cls is RemoteError and status in (401, 403):
                cls = AuthError
            return cls(
                message or f"HTTP {status}",
                reason=reason,
                http_status=status,
                details=details,
                data=err,
            )
        if isinstance(body.get("title"), str) or isinstance(body.get("type"), str):
            # RFC 9457 problem+json (0.3 drafts, spec §6.4 example).
            title = body.get("title") or ""
            detail = body.get("detail") or ""
            reason = None
            ptype = body.get("type")
            if isinstance(ptype, str) and ptype:
                reason = ptype.rstrip("/").rsplit("/", 1)[-1].replace("-", "_").upper()
            cls = error_class_for(None, reason)
            if cls is RemoteError:
                reason = None
                if status in (401, 403):
                    cls = AuthError
            message = ": ".join(str(x) for x in (title, detail) if x) or f"HTTP {status}"
            return cls(message, reason=reason, http_status=status, data=body)
    if status in (401, 403):
        reason = "UNAUTHENTICATED" if status == 401 else "PERMISSION_DENIED"
        return AuthError(
            f"HTTP {status} " + ("unauthorized" if status == 401 else "forbidden"),
            reason=reason,
            http_status=status,
            data=text[:500] or None,
        )
    snippet = _one_line(text, 80) if text else ""
    message = f"HTTP {status}" + (f" with a non-A2A body: {snippet}" if snippet else "")
    if status in (502, 503, 504):
        return ServiceUnavailable(message, http_status=status)
    return HTTPStatusError(message, http_status=status, snippet=text[:500])
