"""Planted secrets never come out (issue 11).

Known secrets are planted the way they really arrive: an agent's bearer token and another
agent's API key stored through the services and used by a real worker against real agents
that demand them, the keys the settings hold (``SECRET_KEY``, ``FIELD_ENCRYPTION_KEY``),
and a user's password typed into the login form (and a wrong one). Then everything that
shows data is searched for them: every page a superuser can GET (the app's URL conf and the
admin's registry walked by ``tests/pages.py``, so a new page is searched without editing this
test; every event's raw page; downloads; JSON), the log lines written meanwhile (this
process at DEBUG, the worker's log at DEBUG), and the outputs of ``audit verify``,
``audit replay``, ``agents list`` and ``a2a card --json``.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from io import StringIO

import pytest
from cryptography.fernet import Fernet
from django.core.management import call_command
from django.test import Client

from tasks_app.models import Agent, RemoteTask, TaskEvent
from tests import pages
from tests.agents import running_agent
from tests.test_mirror import settled, wait_for

# agent: a token-checking demo agent of the module (running_agent).
pytestmark = [pytest.mark.agent, pytest.mark.slow, pytest.mark.timeout(300)]

TOKEN = f"planted-bearer-{secrets.token_hex(12)}"
API_KEY = f"planted-apikey-{secrets.token_hex(12)}"
FIELD_KEY = Fernet.generate_key().decode()
SECRET_KEY = f"planted-secret-key-{secrets.token_hex(24)}"
PASSWORD = f"planted-password-{secrets.token_hex(8)}"
WRONG_PASSWORD = f"planted-wrong-password-{secrets.token_hex(8)}"

# Pages with another mode behind a query string.
VARIANTS = {
    "overview": ["?fragment=1"],
    "task-live": ["?all_artifacts=1"],
    "event-detail": ["?format=json"],
    "task-export": ["?format=json"],
}


def planted() -> dict[str, str]:
    # The Fernet key also without its padding: a careless log could strip it.
    return {"token": TOKEN, "api key": API_KEY, "field key": FIELD_KEY,
            "field key body": FIELD_KEY.rstrip("="), "secret key": SECRET_KEY,
            "password": PASSWORD, "wrong password": WRONG_PASSWORD}  # fmt: skip


def leaks(where: str, text: str) -> list[str]:
    return [f"{name} in {where}" for name, value in planted().items() if value in text]


@pytest.fixture(scope="module")
def token_agent():
    """A real agent that answers only with ``Authorization: Bearer TOKEN``."""
    with running_agent(token=TOKEN) as handle:
        yield handle


@pytest.fixture
def planted_settings(settings):
    settings.SECRET_KEY = SECRET_KEY
    settings.FIELD_ENCRYPTION_KEY = FIELD_KEY
    settings.FIELD_ENCRYPTION_OLD_KEYS = []
    return settings


def log_in(address: str, username: str, password: str) -> Client:
    client = Client(REMOTE_ADDR=address)
    answer = client.post("/accounts/login/", {"username": username, "password": password})
    assert answer.status_code in {200, 302}, answer.status_code
    return client


@pytest.mark.django_db(transaction=True)
def test_planted_secrets_never_come_out(
    planted_settings, caplog, tmp_path, django_user_model, token_agent, agent, start_celery_worker
) -> None:
    from tasks_app.services.agents import add_agent, set_credentials
    from tasks_app.services.tasks import start_task

    caplog.set_level(logging.DEBUG)
    worker = start_celery_worker(SECRET_KEY=SECRET_KEY, FIELD_ENCRYPTION_KEY=FIELD_KEY,
                                 FIELD_ENCRYPTION_OLD_KEYS="", LOG_LEVEL="DEBUG")  # fmt: skip

    root = django_user_model.objects.create_superuser("root", password=PASSWORD)
    log_in("127.0.0.5", "root", WRONG_PASSWORD)  # a failed login is recorded (django-axes)
    client = log_in("127.0.0.6", "root", PASSWORD)
    assert client.session.get("_auth_user_id") == str(root.pk)

    # Credentials through the services, then used by the worker against agents that need them.
    with_token = add_agent(token_agent.base_url, name="token agent",
                           credentials={"token": TOKEN}, actor_id=root.pk)  # fmt: skip
    with_key = add_agent(agent.base_url, name="key agent", actor_id=root.pk)
    set_credentials(with_key, {"api_key": API_KEY, "api_key_name": "X-API-Key",
                               "api_key_location": "header"}, actor_id=root.pk)  # fmt: skip
    with_key.refresh_from_db()
    tasks = [start_task(a, "quick hello", actor_id=root.pk) for a in (with_token, with_key)]
    for task in tasks:
        wait_for(lambda task=task: settled(task), timeout=60, what=f"task {task.pk} to settle")
        assert task.state == "TASK_STATE_COMPLETED", (task.state, task.send_error)

    site = pages.build_site(root, agent=with_token, text="an *answer*")
    urls = dict(pages.admin_urls(per_model=20))
    for task in RemoteTask.objects.all():
        for name, url in pages.app_urls(dataclasses.replace(site, task=task)).items():
            urls[f"{name}[{task.pk}]"] = url
            for variant in VARIANTS.get(name, []):
                urls[f"{name}{variant}[{task.pk}]"] = url + variant
        for seq in TaskEvent.objects.filter(task=task).values_list("seq", flat=True):
            for variant in ("", "?format=json"):
                urls[f"event {task.pk}/{seq}{variant}"] = f"/tasks/{task.pk}/events/{seq}/{variant}"
    assert Agent.objects.filter(credentials_encrypted__gt="").count() == 2

    found: list[str] = []
    answered = 0
    client.raise_request_exception = True
    for name, url in urls.items():
        answer = client.get(url)
        assert answer.status_code < 500, (name, url, answer.status_code)
        body = b"".join(answer.streaming_content) if answer.streaming else answer.content
        found += leaks(f"GET {url} ({name})", body.decode(errors="replace"))
        found += leaks(f"headers of {url}", str(dict(answer.headers)))
        answered += answer.status_code == 200
    assert answered >= 60, answered  # the crawl did reach the pages

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    for args in (
        ["audit", "verify", "--all"],
        ["audit", "replay", "--all"],
        ["agents", "list"],
        ["agents", "list", "--json"],
        ["a2a", "card", token_agent.base_url, "--json", "--token-file", str(token_file)],
    ):
        out, err = StringIO(), StringIO()
        try:
            call_command(*args, stdout=out, stderr=err)
        except SystemExit as exc:  # a command's own exit code; its output is still checked
            assert exc.code in (0, None), (args, exc.code, err.getvalue())
        assert out.getvalue().strip(), args  # each said something
        found += leaks(f"manage.py {' '.join(args[:2])}", out.getvalue() + err.getvalue())

    worker.stop()
    worker_log = worker.log_tail(100_000)
    assert "DEBUG" in worker_log and "tasks_app.watchers.watch" in worker_log  # the real log
    found += leaks("the worker's log", worker_log)
    found += leaks("this process's log", caplog.text)
    found += leaks("log record arguments", " ".join(repr(r.args) for r in caplog.records))
    assert found == []


def test_what_holds_secrets_leaves_them_out_of_its_repr() -> None:
    """A push config's secrets and an agent's auth plan (its headers and query) are dataclasses:
    their default repr, in a log line or a debug page's locals, showed the tokens."""
    from tasks_app.a2a.client import AuthPlan
    from tasks_app.services.push import _Config

    config = _Config(1, "cfg", 2, "remote", {"token": "push-S3CRET"}, "", "")
    plan = AuthPlan(headers={"Authorization": "Bearer agent-S3CRET"}, query={"key": "q-S3CRET"})
    assert "S3CRET" not in repr(config) + repr(plan) and "cfg" in repr(config)


def test_the_bench_does_not_print_its_postgresql_password(monkeypatch) -> None:
    from django.core.management.base import CommandError

    from bench import procs

    monkeypatch.setattr(procs, "PG_ADMIN_URL", "postgres://postgres:pg-S3CRET@127.0.0.1:1/postgres")
    with pytest.raises(CommandError, match="not reachable") as err:
        call_command("bench", "P3", "--db", "postgres")
    assert "S3CRET" not in str(err.value) and "127.0.0.1:1" in str(err.value)
