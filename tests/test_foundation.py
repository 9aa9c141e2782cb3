"""The foundation every other test stands on: health checks, settings errors, and the
process fixtures (a real worker, a real daphne, one shared test database)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from django.contrib.auth import get_user_model

from tests.infra import REPO_ROOT, WorkerProcess, wait_for_healthz

CHECKS = {"database", "redis", "channel_layer", "worker"}


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -c code`` in the project with these environment variables set."""
    full_env = {
        k: v for k, v in os.environ.items() if k not in {"DASHBOARD_PRODUCTION", "SECRET_KEY"}
    }
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


SETUP = "import os, django; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'dashboard.settings'); django.setup()"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_healthz_is_ok_while_a_worker_runs(
    celery_worker: WorkerProcess, live_server_daphne: str
) -> None:
    response = wait_for_healthz(live_server_daphne)
    assert (response.status_code, response.json()) == (200, {"ok": True}), response.text
    body = staff_client(live_server_daphne).get("/healthz").json()
    assert set(body["checks"]) == CHECKS
    assert all(check["ok"] for check in body["checks"].values()), body


@pytest.mark.django_db(transaction=True)
def test_the_worker_check_counts_only_workers_of_this_dashboards_queue(
    celery_worker: WorkerProcess, settings
) -> None:
    """A ping was answered by any worker on the same Redis: a dashboard sharing it
    (another CELERY_QUEUE) was reported healthy with no worker of its own."""
    from tasks_app import health

    health.check_worker(1.0)  # the test worker consumes this queue
    settings.CELERY_TASK_DEFAULT_QUEUE = "another-dashboard"
    with pytest.raises(health.CheckFailed, match="consumes this dashboard's queue"):
        health.check_worker(1.0)


@contextlib.contextmanager
def pidbox_table() -> Iterator[tuple[Any, str]]:
    """The broker's channel and the key of its control exchange's bindings (kombu's Redis)."""
    from dashboard.celery import app

    with app.connection_for_write() as conn:
        channel = conn.default_channel
        yield channel, channel.keyprefix_queue % app.control.mailbox.exchange.name


@pytest.mark.django_db(transaction=True)
def test_the_worker_check_is_done_when_every_bound_worker_has_answered(
    celery_worker: WorkerProcess,
) -> None:
    """It waited its whole timeout for replies that might still come; it knows how many can."""
    from tasks_app import health

    ours = f"{celery_worker.hostname}.celery.pidbox"
    with pidbox_table() as (channel, key):
        # Workers this session killed earlier left their bindings (the next test's case).
        for member in channel.client.smembers(key):
            if member.decode().split(channel.sep)[-1] != ours:
                channel.client.srem(key, member)
    started = time.monotonic()
    health.check_worker(10.0)
    assert time.monotonic() - started < 5.0  # the one worker answered; 10 s before


@contextlib.contextmanager
def leftover_binding() -> Iterator[None]:
    """A binding as a SIGKILLed worker leaves it: nobody will answer for it."""
    leftover = "killed@host.celery.pidbox"
    with pidbox_table() as (channel, key):
        member = channel.sep.join(["", "", leftover])
        channel.client.sadd(key, member)
        try:
            yield
        finally:
            channel.client.srem(key, member)


@pytest.mark.django_db(transaction=True)
def test_a_killed_workers_leftover_binding_costs_nothing_while_ours_answers(
    celery_worker: WorkerProcess,
) -> None:
    """After a worker was SIGKILLed every /healthz waited its whole second for its reply."""
    from tasks_app import health

    with leftover_binding():
        started = time.monotonic()
        health.check_worker(10.0)
        assert time.monotonic() - started < 5.0  # ours answered: done (10 s before)


@pytest.mark.django_db(transaction=True)
def test_without_a_worker_of_ours_a_leftover_binding_is_waited_for_up_to_the_timeout(
    celery_worker: WorkerProcess, settings
) -> None:
    from tasks_app import health

    settings.CELERY_TASK_DEFAULT_QUEUE = "another-dashboard"  # the worker answers, not ours
    with leftover_binding():
        started = time.monotonic()
        with pytest.raises(health.CheckFailed, match="consumes this dashboard's queue"):
            health.check_worker(1.5)
        assert time.monotonic() - started >= 1.4  # the killed one might still have answered


def test_the_worker_check_fails_at_once_when_no_worker_is_bound() -> None:
    from tasks_app import health

    with pidbox_table() as (channel, key):
        channel.client.delete(key)  # no worker of this session runs: a killed one's leftovers
    started = time.monotonic()
    with pytest.raises(health.CheckFailed, match="no Celery worker answered"):
        health.check_worker(10.0)
    assert time.monotonic() - started < 5.0


def staff_client(base_url: str) -> httpx.Client:
    """An httpx client with a staff user's session (the session row is in the shared test DB)."""
    from django.test import Client

    staff = get_user_model().objects.create_user("health-staff", password="x" * 12, is_staff=True)
    django_client = Client()
    django_client.force_login(staff)
    cookies = {"sessionid": django_client.cookies["sessionid"].value}
    return httpx.Client(base_url=base_url, cookies=cookies, timeout=10)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_healthz_names_the_worker_when_none_runs(live_server_daphne: str) -> None:
    response = httpx.get(f"{live_server_daphne}/healthz", timeout=10)
    assert (response.status_code, response.json()) == (503, {"ok": False})
    body = staff_client(live_server_daphne).get("/healthz").json()
    assert body["checks"]["worker"] == {**body["checks"]["worker"], "ok": False,
                                        "message": "no Celery worker answered"}  # fmt: skip
    assert {name for name, check in body["checks"].items() if not check["ok"]} == {"worker"}


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_subprocesses_see_the_test_database(live_server_daphne: str) -> None:
    """A user created here can log in through daphne: both use the same test database."""
    get_user_model().objects.create_user("alice", password="s3cret-pass")
    with httpx.Client(base_url=live_server_daphne, timeout=10) as browser:
        page = browser.get("/accounts/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
        assert token, page.text
        response = browser.post(
            "/accounts/login/",
            data={
                "username": "alice",
                "password": "s3cret-pass",
                "csrfmiddlewaretoken": token.group(1),
            },
            headers={"Referer": f"{live_server_daphne}/accounts/login/"},
        )
    assert response.status_code == 302, response.text
    assert "sessionid" in response.cookies


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_second_worker_survives_the_first_being_killed(start_celery_worker) -> None:
    first = start_celery_worker(WATCH_LEASE_SECONDS="3")
    second = start_celery_worker(WATCH_LEASE_SECONDS="3")
    assert first.pid != second.pid
    first.kill()
    assert not first.alive()
    assert second.ping()


@pytest.mark.subprocess
def test_unparseable_database_url_names_the_setting() -> None:
    result = run_python(SETUP, DATABASE_URL="not a url")
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert "DATABASE_URL" in result.stderr


@pytest.mark.subprocess
@pytest.mark.parametrize("value", ["0", "many", "-2"])
def test_a_bad_database_thread_count_names_the_setting(value: str) -> None:
    result = run_python(SETUP, WATCH_DB_THREADS=value)
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert "WATCH_DB_THREADS must be a whole number of at least 1" in result.stderr


@pytest.mark.subprocess
def test_production_needs_a_secret_key() -> None:
    result = run_python(SETUP, DASHBOARD_PRODUCTION="1", ALLOWED_HOSTS="example.org")
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert "SECRET_KEY" in result.stderr


@pytest.mark.subprocess
def test_production_needs_allowed_hosts() -> None:
    result = run_python(SETUP, DASHBOARD_PRODUCTION="1", SECRET_KEY="x" * 50, ALLOWED_HOSTS="")
    assert result.returncode != 0
    assert "ALLOWED_HOSTS" in result.stderr


@pytest.mark.subprocess
def test_manage_py_reports_a_settings_error_in_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=REPO_ROOT,
        env={**os.environ, "DASHBOARD_PRODUCTION": "1", "SECRET_KEY": "", "ALLOWED_HOSTS": "x"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "Configuration error: SECRET_KEY must be set when DASHBOARD_PRODUCTION is on."
    ]
