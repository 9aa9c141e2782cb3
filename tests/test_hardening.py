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
from tests.people import member

# --- 1. websocket origin: scheme, host and port -------------------------------------------


@pytest.fixture
def private_layer(settings):
    layer = dict(settings.CHANNEL_LAYERS["default"])
    layer["CONFIG"] = {**layer["CONFIG"], "prefix": f"hardening-{uuid.uuid4().hex[:8]}"}
    settings.CHANNEL_LAYERS = {"default": layer}


@pytest.fixture
def session_cookie(django_user_model) -> str:
    user = member(django_user_model.objects.create_user(username="op", password="pw-12345678"))
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
    # A refused origin is accepted and closed at once (so that a browser sees the code): it
    # counts as not connected, with the close's code. An accepted socket sends nothing first.
    if connected and not await comm.receive_nothing(timeout=0.3):
        first = await comm.receive_output(timeout=1)
        if first["type"] == "websocket.close":
            connected, code = False, first.get("code")
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
@pytest.mark.parametrize("ending", ["logout", "password changed"])
async def test_a_socket_closes_when_its_session_ends(private_layer, django_user_model, ending):
    """A socket opened on a session streamed on after that session's logout, or after the
    person changed their password (which voids their other sessions), while HTTP requests
    with the same cookie were refused at once. It is told, checks its session, and closes
    with 4401 before anything more is sent."""
    from asgiref.sync import sync_to_async
    from channels.layers import get_channel_layer

    from tasks_app.relay import LIST_GROUP

    def sign_in() -> tuple[Client, str]:
        user = member(django_user_model.objects.create_user(username="leaver", password="pw-1"))
        client = Client()
        assert (
            client.post("/accounts/login/", {"username": "leaver", "password": "pw-1"}).status_code
            == 302
        )
        return client, user.pk

    client, user_pk = await sync_to_async(sign_in)()
    connected, _code, comm = await handshake(
        client.cookies["sessionid"].value, "localhost:8000", "http://localhost:8000"
    )
    assert connected

    def end_the_session() -> None:
        if ending == "logout":
            assert client.post("/accounts/logout/").status_code == 302
        else:
            person = django_user_model.objects.get(pk=user_pk)
            person.set_password("pw-2")
            person.save()
        assert client.get("/tasks/").status_code == 302  # HTTP: refused at once

    await sync_to_async(end_the_session)()
    closed = await comm.receive_output(timeout=10)
    assert closed == {"type": "websocket.close", "code": 4401}
    # Nothing reaches it any more (a list summary sent now would have been forwarded).
    await get_channel_layer().group_send(LIST_GROUP, {"type": "tasks.changed", "task": 1})
    assert await comm.receive_nothing(timeout=0.3)


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
    for origin in (
        "https://dash.example.com",
        "https://dash.example.com:443",
        "https://a.corp.example",
    ):
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
    env.update(
        DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1", DJANGO_SETTINGS_MODULE="dashboard.settings"
    )
    return env


def modes(folder) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}


@pytest.mark.subprocess
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


# --- 4. key rotation and undecryptable credentials ------------------------------------------


def fernet_key() -> str:
    from cryptography.fernet import Fernet

    return Fernet.generate_key().decode()


def test_old_keys_decrypt_and_the_current_key_encrypts(settings):
    from tasks_app.crypto import SecretError, decrypt_json, encrypt_json, on_current_key

    old, new = fernet_key(), fernet_key()
    settings.FIELD_ENCRYPTION_KEY, settings.FIELD_ENCRYPTION_OLD_KEYS = old, []
    stored = encrypt_json({"token": "planted-secret-1"})
    settings.FIELD_ENCRYPTION_KEY = new
    with pytest.raises(SecretError, match="FIELD_ENCRYPTION_OLD_KEYS") as failed:
        decrypt_json(stored)
    assert "planted-secret-1" not in str(failed.value)
    settings.FIELD_ENCRYPTION_OLD_KEYS = f"{fernet_key()}, {old}"  # the environment's form
    assert decrypt_json(stored) == {"token": "planted-secret-1"}
    fresh = encrypt_json({"token": "planted-secret-1"})
    assert on_current_key(fresh) and not on_current_key(stored)


def test_an_old_secret_key_can_be_listed(settings):
    """With no FIELD_ENCRYPTION_KEY the key is derived from SECRET_KEY; the old SECRET_KEY opens it."""
    from tasks_app.crypto import SecretError, decrypt_json, encrypt_json

    settings.FIELD_ENCRYPTION_KEY, settings.FIELD_ENCRYPTION_OLD_KEYS = "", []
    settings.SECRET_KEY = "old-secret-key-" + "x" * 40
    stored = encrypt_json({"api_key": "planted-secret-2"})
    settings.SECRET_KEY = "new-secret-key-" + "y" * 40
    with pytest.raises(SecretError):
        decrypt_json(stored)
    settings.FIELD_ENCRYPTION_OLD_KEYS = ["old-secret-key-" + "x" * 40]
    assert decrypt_json(stored) == {"api_key": "planted-secret-2"}


@pytest.fixture
def operator_client(django_user_model) -> Client:
    user = member(django_user_model.objects.create_user(username="keys", password="pw-12345678"))
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.django_db
def test_agent_page_after_a_key_rotation(settings, operator_client):
    """A rotated key: the agent page answers 200 and says what to do; task actions say it too."""
    from django.urls import reverse

    from tasks_app.crypto import encrypt_json
    from tasks_app.models import Agent, RemoteTask

    old = fernet_key()
    settings.FIELD_ENCRYPTION_KEY, settings.FIELD_ENCRYPTION_OLD_KEYS = old, []
    agent = Agent.objects.create(
        name="rotated", base_url="http://127.0.0.1:9/", interface_url="http://127.0.0.1:9/",
        credentials_encrypted=encrypt_json({"token": "planted-secret-3"}), credential_origins=["http://127.0.0.1:9"],
    )  # fmt: skip
    task = RemoteTask.objects.create(agent=agent, title="t", phase="task", remote_id="r-1",
                                     state="TASK_STATE_WORKING")  # fmt: skip
    page = reverse("agent-detail", args=[agent.pk])
    message = "cannot be decrypted with the current key; re-enter them or list the old key in FIELD_ENCRYPTION_OLD_KEYS"

    answer = operator_client.get(page)
    assert answer.status_code == 200 and message not in answer.content.decode()

    settings.FIELD_ENCRYPTION_KEY = fernet_key()  # rotated, the old key not listed
    answer = operator_client.get(page)
    body = answer.content.decode()
    assert answer.status_code == 200
    assert message in body and "planted-secret-3" not in body
    # An action that needs the credentials is a clear error, not a 500.
    refreshed = operator_client.post(reverse("task-refresh", args=[task.pk]), follow=True)
    assert refreshed.status_code == 200
    assert message in refreshed.content.decode()

    settings.FIELD_ENCRYPTION_OLD_KEYS = [old]
    answer = operator_client.get(page)
    assert answer.status_code == 200 and message not in answer.content.decode()


@pytest.mark.django_db(transaction=True)
def test_rotate_keys_round_trip(settings):
    from io import StringIO

    from django.core.management import CommandError, call_command

    from tasks_app.crypto import decrypt_json, encrypt_json
    from tasks_app.models import Agent, OperatorAction

    old, lost, new = fernet_key(), fernet_key(), fernet_key()
    settings.FIELD_ENCRYPTION_OLD_KEYS = []
    settings.FIELD_ENCRYPTION_KEY = old
    on_old = Agent.objects.create(name="on-old", base_url="http://127.0.0.1:9/a",
                                  credentials_encrypted=encrypt_json({"token": "planted-old"}))  # fmt: skip
    settings.FIELD_ENCRYPTION_KEY = lost
    on_lost = Agent.objects.create(name="on-lost", base_url="http://127.0.0.1:9/b",
                                   credentials_encrypted=encrypt_json({"token": "planted-lost"}))  # fmt: skip
    settings.FIELD_ENCRYPTION_KEY = new
    on_new = Agent.objects.create(name="on-new", base_url="http://127.0.0.1:9/c",
                                  credentials_encrypted=encrypt_json({"api_key": "planted-new"}))  # fmt: skip
    Agent.objects.create(name="none", base_url="http://127.0.0.1:9/d")
    before = {a.pk: a.credentials_encrypted for a in Agent.objects.all()}

    settings.FIELD_ENCRYPTION_OLD_KEYS = [old]
    out = StringIO()
    with pytest.raises(CommandError, match="on-lost") as failed:
        call_command("rotate_keys", stdout=out)
    assert "FIELD_ENCRYPTION_OLD_KEYS" in str(failed.value)
    assert "1 re-encrypted with the current key, 1 already on it, 1 unreadable." in out.getvalue()
    assert "planted" not in out.getvalue() + str(failed.value)
    after = {a.pk: a.credentials_encrypted for a in Agent.objects.all()}
    assert after[on_old.pk] != before[on_old.pk]
    assert after[on_new.pk] == before[on_new.pk]  # already current: not rewritten
    assert after[on_lost.pk] == before[on_lost.pk]  # unreadable: left as it is
    assert OperatorAction.objects.filter(action="rotate-key").count() == 1

    # The old key can go now: everything readable is on the new key.
    settings.FIELD_ENCRYPTION_OLD_KEYS = []
    assert decrypt_json(Agent.objects.get(pk=on_old.pk).credentials_encrypted) == {
        "token": "planted-old"
    }
    assert decrypt_json(Agent.objects.get(pk=on_new.pk).credentials_encrypted) == {
        "api_key": "planted-new"
    }
    Agent.objects.filter(pk=on_lost.pk).update(credentials_encrypted="")
    out = StringIO()
    call_command("rotate_keys", stdout=out)
    assert "0 re-encrypted with the current key, 2 already on it, 0 unreadable." in out.getvalue()


@pytest.mark.django_db(transaction=True)
def test_rotate_keys_never_overwrites_credentials_saved_meanwhile(settings, monkeypatch):
    """Compare-and-set: an operator's save between our read and our write wins."""
    from io import StringIO

    from django.core.management import call_command

    from tasks_app.crypto import decrypt_json, encrypt_json
    from tasks_app.management.commands import rotate_keys
    from tasks_app.models import Agent
    from tasks_app.services.agents import set_credentials

    old, new = fernet_key(), fernet_key()
    settings.FIELD_ENCRYPTION_KEY, settings.FIELD_ENCRYPTION_OLD_KEYS = old, [old]
    agent = Agent.objects.create(name="raced", base_url="http://127.0.0.1:9/",
                                 credentials_encrypted=encrypt_json({"token": "planted-before"}))  # fmt: skip
    settings.FIELD_ENCRYPTION_KEY = new
    real_rotate = rotate_keys.rotate
    calls: list[str] = []

    def rotate_while_an_operator_saves(token: str) -> str:
        calls.append(token)
        if len(calls) == 1:
            set_credentials(agent, {"token": "planted-after"})
        return real_rotate(token)

    monkeypatch.setattr(rotate_keys, "rotate", rotate_while_an_operator_saves)
    out = StringIO()
    call_command("rotate_keys", stdout=out)
    assert len(calls) == 1  # the second read found the operator's value already current
    assert "0 re-encrypted with the current key, 1 already on it" in out.getvalue()
    settings.FIELD_ENCRYPTION_OLD_KEYS = []
    assert decrypt_json(Agent.objects.get(pk=agent.pk).credentials_encrypted) == {
        "token": "planted-after"
    }


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_watcher_parks_once_on_undecryptable_credentials(settings, agent, start_celery_worker):
    """A worker whose key cannot open the credentials parks the task with the sentence, once."""
    from tasks_app.a2a.origins import origin_of
    from tasks_app.crypto import encrypt_json
    from tasks_app.models import Agent, RemoteTask, TaskEvent
    from tasks_app.services import tasks as task_services
    from tests.test_mirror import wait_for

    settings.FIELD_ENCRYPTION_KEY = fernet_key()
    row = Agent.objects.create(
        name="locked", base_url=agent.base_url, interface_url=agent.base_url, binding="JSONRPC",
        credentials_encrypted=encrypt_json({"token": "planted-secret-4"}), credential_origins=[origin_of(agent.base_url)],
    )  # fmt: skip
    task = RemoteTask.objects.create(agent=row, title="t", phase="task", remote_id="r-locked",
                                     state="TASK_STATE_WORKING", watch="poll")  # fmt: skip
    worker = start_celery_worker(FIELD_ENCRYPTION_KEY=fernet_key(), FIELD_ENCRYPTION_OLD_KEYS="")
    task_services.dispatch(task.pk)

    def parked() -> bool:
        task.refresh_from_db()
        return task.watcher_status == "parked"

    wait_for(parked, timeout=60, what="the task to be parked")
    assert "FIELD_ENCRYPTION_OLD_KEYS" in task.watcher_note
    entries = list(TaskEvent.objects.filter(task=task, kind="system").values_list("raw", flat=True))
    parked_entries = [e for e in entries if "parked" in str(e)]
    assert len(parked_entries) == 1 and "cannot be decrypted" in str(parked_entries[0])
    # Parked with the long hold-off: further dispatches find the lease held; no second turn.
    events_before = TaskEvent.objects.filter(task=task).count()
    task_services.dispatch(task.pk)
    task_services.dispatch(task.pk)
    wait_for(lambda: worker.log_tail(400).count("held elsewhere") >= 2, what="the two dispatches")
    assert TaskEvent.objects.filter(task=task).count() == events_before
    task.refresh_from_db()
    assert task.watcher_status == "parked"
    log_text = worker.log_tail(400)
    assert "Traceback" not in log_text and "planted-secret-4" not in log_text


# --- 5. login throttling (django-axes) ------------------------------------------------------

LOGIN = "/accounts/login/"


def try_login(address: str, username: str, password: str, path: str = LOGIN):
    """One login through the real form view, from ``address`` (REMOTE_ADDR; no network)."""
    client = Client(REMOTE_ADDR=address)
    answer = client.post(path, {"username": username, "password": password})
    return answer, client


@pytest.mark.django_db
def test_a_username_and_address_are_locked_out_after_the_limit(settings, django_user_model):
    from datetime import timedelta

    from axes.models import AccessAttempt
    from django.utils import timezone

    django_user_model.objects.create_user("alice", password="alice-password-1", is_staff=True)
    django_user_model.objects.create_user("bob", password="bob-password-1")
    limit = settings.AXES_FAILURE_LIMIT
    assert limit == 10  # the default setting
    for attempt in range(1, limit + 1):
        answer, _ = try_login("127.0.0.2", "alice", f"wrong-{attempt}")
        if attempt < limit:
            assert (
                answer.status_code == 200
                and "Please enter a correct username" in answer.content.decode()
            )
    # The last failure already answers with the lockout page, in the site's style.
    body = answer.content.decode()
    assert answer.status_code == 429
    assert (
        "Too many failed logins for this username from your address; try again in 15 minutes."
        in body
    )
    assert (
        'id="lockout"' in body and 'value="alice"' in body and "no-store" in answer["Cache-Control"]
    )

    # The right password is refused too, here and in the admin's login; the session stays anonymous.
    for path in (LOGIN, "/admin/login/"):
        answer, client = try_login("127.0.0.2", "alice", "alice-password-1", path)
        assert answer.status_code == 429, path
        assert "Too many failed logins" in answer.content.decode()
        assert "_auth_user_id" not in client.session

    # Another user from that address, and the same user from another address, are unaffected.
    answer, client = try_login("127.0.0.2", "bob", "bob-password-1")
    assert answer.status_code == 302 and client.session["_auth_user_id"]
    answer, client = try_login("127.0.0.3", "alice", "alice-password-1")
    assert answer.status_code == 302 and client.session["_auth_user_id"]

    # After the cool-off the pair may log in again (the attempts aged as time would age them).
    AccessAttempt.objects.update(attempt_time=timezone.now() - timedelta(minutes=16))
    answer, client = try_login("127.0.0.2", "alice", "alice-password-1")
    assert answer.status_code == 302 and client.session["_auth_user_id"]


@pytest.mark.django_db
def test_a_good_login_resets_the_count(django_user_model, settings):
    django_user_model.objects.create_user("carol", password="carol-password-1")
    for _round in range(2):
        for attempt in range(settings.AXES_FAILURE_LIMIT - 1):
            answer, _ = try_login("127.0.0.4", "carol", f"typo-{attempt}")
            assert answer.status_code == 200
        answer, _ = try_login("127.0.0.4", "carol", "carol-password-1")
        assert answer.status_code == 302


@pytest.mark.django_db
def test_a_login_with_a_name_longer_than_any_is_a_wrong_login_and_is_counted(settings):
    """Django's form calls authenticate() whatever the name's length, and axes stored the
    name as it came: past 255 characters PostgreSQL refused the failure's row (500)."""
    from axes.models import AccessAttempt

    name = "m" * 1000
    for path in (LOGIN, "/admin/login/"):
        answer, client = try_login("127.0.0.5", name, "whatever-1", path)
        assert answer.status_code == 200, path
        assert "_auth_user_id" not in client.session
    attempt = AccessAttempt.objects.get(ip_address="127.0.0.5")
    assert attempt.username == "m" * 150 and attempt.failures_since_start == 2
    # The count goes on to the lockout as for any name.
    for attempt_number in range(settings.AXES_FAILURE_LIMIT - 2):
        answer, _ = try_login("127.0.0.5", name, f"whatever-{attempt_number}")
    assert answer.status_code == 429


# --- 2b. private files: beat's schedule and the private Redis -------------------------------


def file_modes(folder) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir() if p.is_file()}


@pytest.mark.slow
@pytest.mark.worker  # celery beat, started here
@pytest.mark.timeout(120)
def test_beat_schedule_is_private_under_a_permissive_umask(tmp_path, child_env):
    """A fresh schedule is 0600 from the first byte; one left 0644 by an older version is
    narrowed before beat opens it. Beat runs as a process, as ``up`` and production run it."""
    import shelve
    import subprocess
    import sys
    import time

    from tasks_app.runtime.net import wait_until
    from tests.infra import REPO_ROOT

    fresh, old = tmp_path / "fresh", tmp_path / "old"
    old.mkdir(mode=0o755)
    with shelve.open(str(old / "celerybeat-schedule")) as store:  # as an older beat left it
        store["entries"] = {}
    for path in old.iterdir():
        path.chmod(0o644)

    for folder in (fresh, old):
        log = tmp_path / f"{folder.name}.log"
        with open(log, "wb") as out:
            beat = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "dashboard", "beat", "--loglevel", "INFO",
                 "--schedule", str(folder / "celerybeat-schedule")],
                cwd=REPO_ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT, umask=0o022,
            )  # fmt: skip
        try:
            assert wait_until(lambda log=log: "beat: Starting" in log.read_text(), 60), (
                log.read_text()
            )
            # A few ticks (RECONCILE_EVERY_SECONDS, 2 s) write to the store while it is open.
            time.sleep(5)
            assert beat.poll() is None, log.read_text()
        finally:
            beat.terminate()
            beat.wait(timeout=30)
        modes = file_modes(folder)
        assert any(name.startswith("celerybeat-schedule") for name in modes), modes
        assert modes == dict.fromkeys(modes, 0o600), modes
    assert fresh.stat().st_mode & 0o777 == 0o700


@pytest.mark.subprocess  # redis-server
@pytest.mark.timeout(60)
def test_private_redis_keeps_its_folder_and_files_private(tmp_path):
    """The folder is made (or narrowed to) 0700; what the server writes (a dump on SAVE) is 0600."""
    import os

    import redis

    from tasks_app.runtime.net import free_port, wait_until
    from tasks_app.runtime.redis_server import find_redis_server, start_private_redis
    from tasks_app.runtime.supervisor import Supervisor

    workdir = tmp_path / "redis"
    workdir.mkdir(mode=0o755)
    workdir.chmod(0o755)
    port = free_port()
    previous = os.umask(0o022)
    try:
        with Supervisor() as supervisor:
            start_private_redis(supervisor, find_redis_server(), port, workdir)
            client = redis.Redis(port=port, socket_timeout=2)
            assert wait_until(lambda: _pings(client), 15)
            client.set("k", "v")
            client.save()  # the one way this server writes a file
            client.close()
    finally:
        os.umask(previous)
    assert workdir.stat().st_mode & 0o777 == 0o700
    assert file_modes(workdir) == {"dump.rdb": 0o600}


def _pings(client) -> bool:
    import redis

    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
