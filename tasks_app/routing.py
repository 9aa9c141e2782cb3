"""Websocket routes, and the origin check every websocket passes first.

A browser sends the page's origin with every websocket handshake, and cookies go along
whatever page opened it. So a page served from anywhere else, even the same host at
another port, opened by a logged-in operator, would read live task data if we accepted
it. The check compares scheme, host *and* port with the site's own origin: the origin
the request itself was made to (its ``Host`` header, which must be an allowed host, and
its scheme), plus the origins listed in ``CSRF_TRUSTED_ORIGINS``. Anything else is
closed with ``CLOSE_FORBIDDEN_ORIGIN`` before the consumer runs, so no data is ever sent.

The socket is accepted before that close: a close before the accept becomes an HTTP 403
on the handshake, which a browser reports as 1006 (no code), the same as a network cut,
so a page on a misconfigured site (a TLS proxy without ``SECURE_PROXY_SSL_HEADER``, a
public origin missing from ``CSRF_TRUSTED_ORIGINS``) reconnected for ever instead of
saying it was refused. Accepted and closed at once, it learns 4403 and nothing else.
"""

from __future__ import annotations

from typing import Any

from channels.auth import AuthMiddlewareStack
from channels.routing import URLRouter
from django.conf import settings
from django.http.request import is_same_domain, split_domain_port, validate_host
from django.urls import path, re_path

from . import consumers
from .a2a.origins import split_http_url

CLOSE_FORBIDDEN_ORIGIN = 4403

websocket_urlpatterns = [
    path("ws/tasks/<int:task_id>/", consumers.TaskConsumer.as_asgi()),
    path("ws/tasks/", consumers.TaskListConsumer.as_asgi()),
    re_path(r"", consumers.NoSuchSocket.as_asgi()),  # anything else: refused, not an error
]

Origin = tuple[str, str, int]  # scheme, lower-case host, port


def parse_origin(value: str) -> Origin | None:
    """``scheme://host[:port]`` as a comparable triple; None for anything else."""
    split = split_http_url(value)
    if split is None:
        return None
    parts = split.parts
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        return None
    return split.scheme, split.host, split.port


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin1")
    return None


def _request_scheme(scope: dict[str, Any]) -> str:
    """http or https: how the browser reached us (a proxy's header when one is configured)."""
    proxy = getattr(settings, "SECURE_PROXY_SSL_HEADER", None)
    if proxy:
        name, secure_value = proxy
        header = name.removeprefix("HTTP_").lower().replace("_", "-").encode()
        value = _header(scope, header)
        if value is not None:
            return "https" if value.split(",")[0].strip() == secure_value else "http"
    return "https" if scope.get("scheme") in ("wss", "https") else "http"


def own_origin(scope: dict[str, Any]) -> Origin | None:
    """The origin this request was made to, if its Host is one we serve."""
    host = _header(scope, b"host")
    if not host:
        return None
    domain, _port = split_domain_port(host)
    if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return None
    return parse_origin(f"{_request_scheme(scope)}://{host}")


def _trusted(origin: Origin) -> bool:
    """Listed in CSRF_TRUSTED_ORIGINS (exact, or ``scheme://*.domain`` as Django allows)."""
    scheme, host, port = origin
    for entry in getattr(settings, "CSRF_TRUSTED_ORIGINS", []):
        wildcard = "://*." in entry
        trusted = parse_origin(entry.replace("://*.", "://", 1) if wildcard else entry)
        if trusted is None or trusted[0] != scheme or trusted[2] != port:
            continue
        if host == trusted[1] or (wildcard and is_same_domain(host, "." + trusted[1])):
            return True
    return False


def origin_allowed(scope: dict[str, Any]) -> bool:
    """The handshake's Origin is the site's own (scheme, host, port) or a trusted one."""
    raw = _header(scope, b"origin")
    origin = parse_origin(raw) if raw else None
    if origin is None:
        return False
    return origin == own_origin(scope) or _trusted(origin)


class SiteOriginValidator:
    """ASGI middleware: refuses a websocket from any other origin with a close code."""

    def __init__(self, application: Any) -> None:
        self.application = application

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        if scope["type"] == "websocket" and not origin_allowed(scope):
            await receive()  # the websocket.connect message
            # Accepted so that the browser sees the code (see the module's docstring).
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close", "code": CLOSE_FORBIDDEN_ORIGIN})
            return None
        return await self.application(scope, receive, send)


def websocket_application() -> Any:
    """The whole websocket stack: origin check, then session login, then the routes."""
    return SiteOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))
