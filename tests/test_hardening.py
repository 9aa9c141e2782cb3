"""Hardening (issue 11, a subset): websocket origins, private files, no secrets in argv,
key rotation and undecryptable credentials.

Everything real: the whole websocket stack of ``dashboard/asgi.py`` with a real session
cookie, ``manage.py`` run as a subprocess, real Fernet keys.
"""

from __future__ import annotations

import uuid

import pytest
from channels.testing import WebsocketCommunicator
from django.test import Client

from tasks_app.routing import CLOSE_FORBIDDEN_ORIGIN, websocket_application

# --- 1. websocket origin: scheme, host and port -------------------------------------------


@pytest.fixture
def private_layer(settings):
    layer = dict(settings.CHANNEL_LAYERS["default"])
    layer["CONFIG"] = {**layer["CONFIG"], "prefix": f"hardening-{uuid.uuid4().hex[:8]}"}
    settings.CHANNEL_LAYERS = {"default": layer}


@pytest.fixture
def session_cookie(django_user_model) -> str:
    user = django_user_model.objects.create_user(username="op", password="pw-12345678")
    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


async def handshake(
    cookie: str, host: str | None, origin: str | None, scheme: str = "ws"
) -> tuple[bool, int | None, WebsocketCommunicator]:
    headers = [(b"cookie", f"sessionid={cookie}".encode())]
    if host is not None:
        headers.append((b"host", host.encode()))
    if origin is not None:
        headers.append((b"origin", origin.encode()))
    comm = WebsocketCommunicator(websocket_application(), "/ws/tasks/", headers=headers)
    comm.scope["scheme"] = scheme
    connected, code = await comm.connect(timeout=10)
    return connected, code, comm


ALLOWED = [
    # (scheme of the request, Host header, Origin header)
    ("ws", "localhost:8000", "http://localhost:8000"),
    ("ws", "LOCALHOST:8000", "http://localhost:8000"),
    ("ws", "127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("ws", "[::1]:8000", "http://[::1]:8000"),
    ("ws", "localhost", "http://localhost:80"),
    ("wss", "localhost", "https://localhost"),
    ("wss", "localhost:443", "https://localhost"),
]

REFUSED = [
    ("ws", "localhost:8000", "http://localhost:8001"),  # same host, another port
    ("ws", "localhost:8000", "http://localhost"),  # default port is 80, not 8000
    ("ws", "localhost:8000", "https://localhost:8000"),  # another scheme
    ("wss", "localhost:8000", "http://localhost:8000"),  # page over http, socket over TLS
    ("ws", "localhost:8000", "http://127.0.0.1:8000"),  # another host name
    ("ws", "localhost:8000", "http://evil.example"),
    ("ws", "localhost:8000", "null"),  # sandboxed iframes and file: pages
    ("ws", "localhost:8000", "http://localhost:8000/path"),
    ("ws", "localhost:8000", ""),
    ("ws", "localhost:8000", None),  # no Origin header at all
    ("ws", None, "http://localhost:8000"),  # no Host header
    ("ws", "evil.example:8000", "http://evil.example:8000"),  # a host we do not serve
]


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("scheme", "host", "origin"), ALLOWED)
async def test_websocket_accepts_own_origin(private_layer, session_cookie, scheme, host, origin):
    connected, _code, comm = await handshake(session_cookie, host, origin, scheme)
    assert connected
    await comm.send_json_to({"type": "sync", "since": "2000-01-01T00:00:00+00:00"})
    reply = await comm.receive_json_from(timeout=10)
    assert reply["type"] == "version"
    await comm.disconnect()


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("scheme", "host", "origin"), REFUSED)
async def test_websocket_refuses_other_origins(private_layer, session_cookie, scheme, host, origin):
    connected, code, comm = await handshake(session_cookie, host, origin, scheme)
    assert not connected
    assert code == CLOSE_FORBIDDEN_ORIGIN
    assert await comm.receive_nothing(timeout=0.2)


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
async def test_websocket_trusts_csrf_trusted_origins(private_layer, session_cookie, settings):
    """A site behind a proxy names its public origin in CSRF_TRUSTED_ORIGINS."""
    settings.CSRF_TRUSTED_ORIGINS = ["https://dash.example.com", "https://*.corp.example"]
    for origin in ("https://dash.example.com", "https://dash.example.com:443", "https://a.corp.example"):
        connected, _code, comm = await handshake(session_cookie, "localhost:8000", origin)
        assert connected, origin
        await comm.disconnect()
    for origin in (
        "https://dash.example.com:8443",
        "http://dash.example.com",
        "https://evil.dash.example.com",
        "https://corp.example.evil",
    ):
        connected, code, _comm = await handshake(session_cookie, "localhost:8000", origin)
        assert (connected, code) == (False, CLOSE_FORBIDDEN_ORIGIN), origin


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
async def test_websocket_scheme_from_the_proxy_header(private_layer, session_cookie, settings):
    """Behind a TLS proxy the socket arrives as ws; the configured proxy header says https."""
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    headers = [
        (b"cookie", f"sessionid={session_cookie}".encode()),
        (b"host", b"localhost"),
        (b"origin", b"https://localhost"),
        (b"x-forwarded-proto", b"https"),
    ]
    comm = WebsocketCommunicator(websocket_application(), "/ws/tasks/", headers=headers)
    connected, _ = await comm.connect(timeout=10)
    assert connected
    await comm.disconnect()
    connected, code, _comm = await handshake(session_cookie, "localhost", "https://localhost")
    assert (connected, code) == (False, CLOSE_FORBIDDEN_ORIGIN)


def test_asgi_application_checks_origins():
    """The served application is the checked stack, not the bare routes."""
    from dashboard.asgi import application
    from tasks_app.routing import SiteOriginValidator

    assert isinstance(application.application_mapping["websocket"], SiteOriginValidator)
