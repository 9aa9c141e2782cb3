"""Alerts in headless Chromium against the real stack: an alert appears on an open overview
for a task silent past its threshold, and clears itself when the task moves.

As in ``tests/test_ui_browser.py``: daphne, a Celery worker and celery beat run as
subprocesses on a private SQLite file, the session's Redis database and a private queue;
the demo A2A agent is the real peer. The thresholds are small, through the environment of
the processes started here: a task silent in ``working`` for 3 s is alerted, the rules are
evaluated every second by beat, and the page checks its alerts every second.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.agents import REPO_ROOT, free_port
from tests.people import MEMBER_SOURCE

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(240)]

CHROMIUM = "/usr/bin/chromium"
SHOTS = REPO_ROOT / "test-artifacts" / "screenshots"
USERNAME, PASSWORD = "alert-operator", "op-password-123"
SILENT_SECONDS = 3

assert Path(CHROMIUM).exists(), f"Chromium is not installed at {CHROMIUM} (apt-get install chromium)"
from playwright import sync_api  # noqa: E402


class Stack:
    def __init__(self, base_url: str, db_path: Path, logs: Path) -> None:
        self.base_url = base_url
        self.db_path = db_path
        self.logs = logs

    def query(self, sql: str, *params: object) -> list[tuple]:
        with contextlib.closing(sqlite3.connect(self.db_path, timeout=20)) as conn:
            return conn.execute(sql, params).fetchall()


def _env(tmp: Path, redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="dashboard.settings",
        DATABASE_URL=f"sqlite:///{tmp / 'alerts.sqlite3'}",
        DATA_DIR=str(tmp),
        REDIS_URL=redis_url,  # the session's own Redis database (tests.infra)
        CELERY_QUEUE=f"alertstest-{uuid.uuid4().hex[:8]}",
        ALLOWED_HOSTS="127.0.0.1,localhost",
        WATCH_LEASE_SECONDS="10",
        ALERT_SILENT_WORKING_SECONDS=str(SILENT_SECONDS),
        ALERT_EVERY_SECONDS="1",
        ALERT_REFRESH_SECONDS="1",
        PYTHONUNBUFFERED="1",
        # Prepended: the loopback-only hook's folder (tests/conftest.py) stays on the path.
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    )
    env.pop("DASHBOARD_TEST_DB_FILE", None)
    return env


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("alerts-ui")
    env = _env(tmp, redis_url)
    py = sys.executable
    subprocess.run([py, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=REPO_ROOT, env=env, check=True)
    subprocess.run(
        [py, "-c", "import django; django.setup(); from django.contrib.auth.models import User; "
         f"User.objects.create_user({USERNAME!r}, password={PASSWORD!r}); "
         + MEMBER_SOURCE.format(username=USERNAME)],
        cwd=REPO_ROOT, env=env, check=True,
    )  # fmt: skip
    port = free_port()
    logs = tmp / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen] = []

    def start(name: str, cmd: list[str]) -> None:
        out = open(logs / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child
        procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
        out.close()

    start("worker", [py, "-m", "celery", "-A", "dashboard", "worker", "--pool", "threads",
                     "--concurrency", "8", "-Q", env["CELERY_QUEUE"], "--loglevel", "INFO",
                     "-n", f"alerts-{uuid.uuid4().hex[:6]}@%h"])  # fmt: skip
    start("beat", [py, "-m", "celery", "-A", "dashboard", "beat", "--loglevel", "INFO",
                   "--schedule", str(tmp / "beat-schedule")])  # fmt: skip
    start("web", [py, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "dashboard.asgi:application"])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(base + "/accounts/login/", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, (logs / "web.log").read_text()[-3000:]
        assert all(p.poll() is None for p in procs), "a server process died"
        time.sleep(0.1)
    try:
        yield Stack(base, tmp / "alerts.sqlite3", logs)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def context(stack):
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        ctx = chromium.new_context(base_url=stack.base_url, viewport={"width": 1280, "height": 900})
        ctx.set_default_timeout(15_000)
        page = ctx.new_page()
        page.goto("/accounts/login/")
        page.fill("#id_username", USERNAME)
        page.fill("#id_password", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url(re.compile(r"/$"))
        page.close()
        try:
            yield ctx
        finally:
            ctx.close()
            chromium.close()


def test_an_alert_appears_for_a_silent_task_and_clears_when_it_moves(context, stack, agent):
    # The demo agent, added through the UI.
    page = context.new_page()
    page.goto("/agents/add/")
    page.fill("#id_url", agent.base_url)
    page.click("button[value=preview]")
    page.wait_for_selector("#card-preview")
    page.click("#save-agent")
    page.wait_for_url(re.compile(r"/agents/\d+/$"))

    # The overview is open before anything is wrong, and stays open.
    overview = context.new_page()
    problems: list[str] = []
    overview.on("console", lambda msg: problems.append(msg.text) if msg.type == "error" else None)
    overview.goto("/")
    assert overview.locator("#alerts").is_hidden()  # no alert: the (empty) section is hidden

    # One step after 10 s of silence, then done: silent in working past the 3 s threshold.
    page.goto("/tasks/new")
    page.fill("#id_text", "slow 1 10")
    page.click("#start-task")
    page.wait_for_url(re.compile(r"/tasks/\d+/$"))
    pk = int(re.search(r"/tasks/(\d+)/", page.url).group(1))
    page.wait_for_selector("#state-badge .badge:text-is('working')")
    started = time.monotonic()

    item = f"#alerts li[data-task='{pk}'][data-rule='silent-working']"
    overview.wait_for_selector(item, timeout=15_000)  # live: the page was not reloaded
    seen_after = time.monotonic() - started
    assert overview.locator("#alerts").is_visible()
    text = overview.inner_text(item)
    assert "silent while working" in text.lower() and "no news" in text
    assert overview.get_attribute(f"{item} a", "href") == f"/tasks/{pk}/"
    assert stack.query(
        "SELECT count(*) FROM tasks_app_alert WHERE task_id=? AND rule='silent-working' AND resolved_at IS NULL", pk
    ) == [(1,)]
    SHOTS.mkdir(parents=True, exist_ok=True)
    overview.screenshot(path=str(SHOTS / "overview-alert.png"), full_page=True)

    # The task moves (its step arrives, then it completes): the alert clears itself.
    overview.wait_for_selector(item, state="detached", timeout=25_000)
    assert time.monotonic() - started > 8, "the alert cleared before the task moved"
    assert stack.query("SELECT state FROM tasks_app_remotetask WHERE id=?", pk)[0][0] in (
        "TASK_STATE_WORKING", "TASK_STATE_COMPLETED",
    )  # fmt: skip
    resolved = stack.query("SELECT resolved_at FROM tasks_app_alert WHERE task_id=? AND rule='silent-working'", pk)
    assert resolved and all(r[0] is not None for r in resolved)
    overview.wait_for_selector("#alerts", state="hidden")
    assert not problems, problems
    assert seen_after < 10, f"the alert took {seen_after:.1f} s to appear"

    # The alerts page lists it among the resolved ones.
    page.goto("/alerts/")
    assert page.locator("#resolved-alerts tr[data-alert]").count() >= 1
    assert page.locator("#no-open-alerts").is_visible()
    page.close()
    overview.close()
