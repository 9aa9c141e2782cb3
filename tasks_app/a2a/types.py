"""Constants and small value types shared by the A2A client layer.

Everything here is plain data: the wire stays ProtoJSON dicts (``dict[str, Any]``),
and these dataclasses only carry what the client needs to address an agent
(:class:`Interface`), authenticate (:class:`Credentials`) and hand events to
callers (:class:`StreamEvent`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# The protocol version we speak; sent as the ``A2A-Version`` header on every request.
A2A_VERSION = "1.0"
VERSION_HEADER = "A2A-Version"
EXTENSIONS_HEADER = "A2A-Extensions"

BINDING_JSONRPC = "JSONRPC"
BINDING_HTTP_JSON = "HTTP+JSON"
SUPPORTED_BINDINGS = (BINDING_JSONRPC, BINDING_HTTP_JSON)

WELL_KNOWN_CARD_PATH = "/.well-known/agent-card.json"
LEGACY_CARD_PATH = "/.well-known/agent.json"

# Task states (ProtoJSON enum names).
STATE_UNSPECIFIED = "TASK_STATE_UNSPECIFIED"
STATE_SUBMITTED = "TASK_STATE_SUBMITTED"
STATE_WORKING = "TASK_STATE_WORKING"
STATE_INPUT_REQUIRED = "TASK_STATE_INPUT_REQUIRED"
STATE_AUTH_REQUIRED = "TASK_STATE_AUTH_REQUIRED"
STATE_COMPLETED = "TASK_STATE_COMPLETED"
STATE_FAILED = "TASK_STATE_FAILED"
STATE_CANCELED = "TASK_STATE_CANCELED"
STATE_REJECTED = "TASK_STATE_REJECTED"

ALL_STATES = frozenset(
    {
        STATE_UNSPECIFIED,
        STATE_SUBMITTED,
        STATE_WORKING,
        STATE_INPUT_REQUIRED,
        STATE_AUTH_REQUIRED,
        STATE_COMPLETED,
        STATE_FAILED,
        STATE_CANCELED,
        STATE_REJECTED,
    }
)

ROLE_USER = "ROLE_USER"
ROLE_AGENT = "ROLE_AGENT"
ALL_ROLES = frozenset({"ROLE_UNSPECIFIED", ROLE_USER, ROLE_AGENT})

# The four members of the StreamResponse oneof, in proto order.
EventKind = Literal["task", "message", "statusUpdate", "artifactUpdate"]
EVENT_KINDS: tuple[str, ...] = ("task", "message", "statusUpdate", "artifactUpdate")

Binding = Literal["JSONRPC", "HTTP+JSON"]


@dataclass(frozen=True, slots=True)
class Interface:
    """One usable entry of a card's ``supportedInterfaces`` (§8.3.2).

    ``url`` is the JSON-RPC endpoint, or the HTTP+JSON base to which the REST
    routes are appended. ``tenant`` (when set) must go into every request.
    """

    url: str
    binding: Binding
    protocol_version: str = A2A_VERSION
    tenant: str = ""

    @classmethod
    def jsonrpc(cls, url: str, tenant: str = "") -> Interface:
        return cls(url=url, binding="JSONRPC", tenant=tenant)

    @classmethod
    def rest(cls, url: str, tenant: str = "") -> Interface:
        return cls(url=url, binding="HTTP+JSON", tenant=tenant)


@dataclass(frozen=True, slots=True)
class Credentials:
    """Secrets the client may present; *how* they are sent follows the card.

    ``token`` is a bearer/access token (HTTP bearer, OAuth2 and OpenID Connect
    schemes all end up as ``Authorization: Bearer``). ``api_key`` is sent where
    the card's ``apiKeySecurityScheme`` says (header, query or cookie); without
    a card scheme, ``api_key_name``/``api_key_location`` decide (defaults:
    header ``X-API-Key``). ``headers`` are added verbatim (escape hatch for
    gateways).
    """

    token: str | None = None
    api_key: str | None = None
    api_key_name: str | None = None
    api_key_location: Literal["header", "query", "cookie"] | None = None
    headers: tuple[tuple[str, str], ...] = ()

    def __repr__(self) -> str:  # never print secrets
        return (
            f"Credentials(token={'***' if self.token else None}, "
            f"api_key={'***' if self.api_key else None})"
        )


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One ``StreamResponse`` received from an agent (stream, send reply or push).

    ``kind`` names the oneof member, ``payload`` is that member's object and
    ``raw`` is the whole StreamResponse dict (``{"task": {...}}``), i.e. the
    transport envelope is already stripped.
    """

    kind: EventKind
    payload: dict[str, Any]
    raw: dict[str, Any] = field(repr=False)

    @property
    def task_id(self) -> str | None:
        """The task this event is about (``None`` for a task-less Message)."""
        if self.kind == "task":
            return self.payload.get("id") or None
        return self.payload.get("taskId") or None

    @property
    def context_id(self) -> str | None:
        return self.payload.get("contextId") or None

    @property
    def state(self) -> str | None:
        """Task state carried by a ``task`` or ``statusUpdate`` event."""
        if self.kind in ("task", "statusUpdate"):
            status = self.payload.get("status") or {}
            return status.get("state") or STATE_UNSPECIFIED
        return None

    @property
    def status_message(self) -> dict[str, Any] | None:
        if self.kind in ("task", "statusUpdate"):
            return (self.payload.get("status") or {}).get("message")
        return None

    @property
    def is_task(self) -> bool:
        return self.kind == "task"

    @property
    def is_message(self) -> bool:
        return self.kind == "message"


@dataclass(frozen=True, slots=True)
class CardProblem:
    """One thing wrong with an agent card: a JSON path and a message."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


@dataclass(frozen=True, slots=True)
class CardResult:
    """Outcome of :func:`fetch_card`.

    When the server answered 304 to our ``If-None-Match``, ``not_modified`` is
    true and ``card`` is ``None``: keep using the cached card.
    """

    url: str
    card: dict[str, Any] | None
    etag: str | None = None
    not_modified: bool = False
    cache_control: str | None = None
