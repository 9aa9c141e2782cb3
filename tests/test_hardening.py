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


# --- 2. private files in DATA_DIR -----------------------------------------------------------

CLEAN_ENV_DROP = {
    "REDIS_URL", "DATABASE_URL", "CELERY_BROKER_URL", "SECRET_KEY", "FIELD_ENCRYPTION_KEY",
    "FIELD_ENCRYPTION_OLD_KEYS", "DASHBOARD_PRODUCTION", "DASHBOARD_TEST_DB_FILE", "DATA_DIR",
}  # fmt: skip

# Runs in a fresh process: the bootstrap of ``manage.py up`` (first admin), then a write
# on an open connection, and the modes of every file while the WAL and shared memory exist.
HOLD_OPEN = """
import json, os, sys
import django
django.setup()
from pathlib import Path
from django.conf import settings
from django.db import connection
from tasks_app.runtime.admin import ensure_admin
ensure_admin(Path(settings.DATA_DIR))
with connection.cursor() as cursor:
    cursor.execute("CREATE TABLE IF NOT EXISTS harden_probe (x integer)")
    cursor.execute("INSERT INTO harden_probe VALUES (1)")
data = Path(settings.DATA_DIR)
print(json.dumps({p.name: p.stat().st_mode & 0o777 for p in data.iterdir()}))
"""


def clean_env(data_dir) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV_DROP}
    env.update(DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1", DJANGO_SETTINGS_MODULE="dashboard.settings")
    return env


def modes(folder) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}


@pytest.mark.timeout(180)
def test_fresh_data_dir_is_private(tmp_path):
    """A permissive umask (022, the usual) still gives 0600 files in a 0700 folder."""
    import json
    import subprocess
    import sys

    from tests.infra import REPO_ROOT

    data_dir = tmp_path / "data"
    run = {"cwd": REPO_ROOT, "env": clean_env(data_dir), "capture_output": True, "text": True,
           "timeout": 150, "umask": 0o022}  # fmt: skip
    migrate = subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], **run)
    assert migrate.returncode == 0, migrate.stderr
    assert data_dir.stat().st_mode & 0o777 == 0o700
    after_migrate = modes(data_dir)
    assert {"dashboard.sqlite3", "secret_key"} <= set(after_migrate)
    assert after_migrate == dict.fromkeys(after_migrate, 0o600)

    held = subprocess.run([sys.executable, "-c", HOLD_OPEN], **run)
    assert held.returncode == 0, held.stderr
    while_open = json.loads(held.stdout.strip().splitlines()[-1])
    # The WAL and shared-memory files exist while a connection is open; they are private too.
    assert {"dashboard.sqlite3", "dashboard.sqlite3-wal", "dashboard.sqlite3-shm",
            "secret_key", "admin_password"} <= set(while_open)  # fmt: skip
    assert while_open == dict.fromkeys(while_open, 0o600)
    after = modes(data_dir)
    assert after == dict.fromkeys(after, 0o600)


def test_private_write_narrows_an_older_file(tmp_path):
    """A file left world-readable by an older version never receives a secret as it is."""
    from tasks_app.runtime.files import create_private_once, ensure_private_file, write_private

    old = tmp_path / "admin_password"
    old.write_text("old")
    old.chmod(0o644)
    write_private(old, "new secret\n")
    assert (old.stat().st_mode & 0o777, old.read_text()) == (0o600, "new secret\n")

    key = tmp_path / "secret_key"
    assert create_private_once(key, "first")
    assert not create_private_once(key, "second")
    assert key.read_text() == "first" and key.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []

    database = tmp_path / "db.sqlite3"
    database.write_bytes(b"")
    database.chmod(0o644)
    (tmp_path / "db.sqlite3-wal").write_bytes(b"")
    (tmp_path / "db.sqlite3-wal").chmod(0o664)
    ensure_private_file(database)
    assert database.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "db.sqlite3-wal").stat().st_mode & 0o777 == 0o600
