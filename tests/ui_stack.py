"""The stack browser tests drive: daphne, a Celery worker (and beat, when asked) as
subprocesses on a private SQLite file, migrated here, with one operator of the default
project to log in as. The module's tests need no pytest-django database.

And the browser itself: :func:`chromium` imports Playwright only when a test asks for a
browser, so the browser modules are collected (and deselected with ``-m "not browser"`` or
``--fast``) on a machine without Playwright or Chromium."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agents import REPO_ROOT, free_port
from tests.people import MEMBER_SOURCE

CHROMIUM = "/usr/bin/chromium"  # Debian's chromium; .ci/run installs it
# The Python connect hook (tests/loopback_only) does not reach Chromium: these flags keep it on
# loopback. Every name but localhost resolves to nothing, and so does every IP literal but the
# loopback ones the tests use (Chromium maps literals too: without "EXCLUDE ::1", [::1] fails).
# No DNS prefetch, no background requests (updates, safe browsing, ...).
LOOPBACK_RESOLVER_RULES = "MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE ::1, EXCLUDE localhost"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    f"--host-resolver-rules={LOOPBACK_RESOLVER_RULES}", "--dns-prefetch-disable",
]  # fmt: skip


def playwright_timeout() -> type[Exception]:
    """Playwright's ``TimeoutError``, imported when an ``except`` clause asks for it.

    ``except playwright_timeout():`` is evaluated only when an exception reaches it, so a
    module that names it is collected without importing Playwright.
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    return PlaywrightTimeout


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium (a Playwright ``Browser``), closed on exit.

    A browser test that runs without Chromium or Playwright fails with a sentence saying what
    to install, never a skip; a run that leaves the browser tests out never imports either.
    """
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"Chromium is not installed at {CHROMIUM} (apt-get install chromium), "
            'and this test drives it; leave browser tests out with -m "not browser"',
            pytrace=False,
        )
    try:
        from playwright import sync_api
    except ImportError as error:
        problem = f"Playwright is not importable ({error}); ./dash installs it with the test extra"
    else:
        problem = ""
    if problem:  # failed outside the except block: one sentence, not a chained traceback
        pytest.fail(problem, pytrace=False)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


class Stack:
    def __init__(
        self, base_url: str, db_path: Path, procs: list[subprocess.Popen], logs: Path
    ) -> None:
        self.base_url = base_url
        self.db_path = db_path
        self.procs = procs
        self.logs = logs

    def query(self, sql: str, *params: object) -> list[tuple]:
        with contextlib.closing(sqlite3.connect(self.db_path, timeout=20)) as conn:
            return conn.execute(sql, params).fetchall()

    def seqs(self, task_pk: int) -> list[int]:
        return [
            r[0]
            for r in self.query(
                "SELECT seq FROM tasks_app_taskevent WHERE task_id=? ORDER BY seq", task_pk
            )
        ]

    def state(self, task_pk: int) -> str:
        return self.query("SELECT state FROM tasks_app_remotetask WHERE id=?", task_pk)[0][0]

    def settled_seqs(self, task_pk: int, timeout: float = 20) -> list[int]:
        """The log once the task is settled: nothing is appended after that."""
        deadline = time.monotonic() + timeout
        while not self.query("SELECT settled_at FROM tasks_app_remotetask WHERE id=?", task_pk)[0][
            0
        ]:
            assert time.monotonic() < deadline, "the task was never settled"
            time.sleep(0.1)
        return self.seqs(task_pk)


def stack_env(tmp: Path, redis_url: str, name: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="dashboard.settings",
        DATABASE_URL=f"sqlite:///{tmp / f'{name}.sqlite3'}",
        DATA_DIR=str(tmp),
        REDIS_URL=redis_url,  # the session's own Redis database (tests.infra)
        CELERY_QUEUE=f"{name}test-{uuid.uuid4().hex[:8]}",
        ALLOWED_HOSTS="127.0.0.1,localhost",
        WATCH_LEASE_SECONDS="10",
        PYTHONUNBUFFERED="1",
        # Prepended: the loopback-only hook's folder (tests/conftest.py) stays on the path.
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        **extra,
    )
    env.pop("DASHBOARD_TEST_DB_FILE", None)
    return env


def migrate_and_add_member(env: dict[str, str], username: str, password: str) -> None:
    """Migrate the database ``env`` names and add ``username`` as a member of a project."""
    py = sys.executable
    subprocess.run(
        [py, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=REPO_ROOT, env=env, check=True
    )
    subprocess.run(
        [py, "-c", "import django; django.setup(); from django.contrib.auth.models import User; "
         f"User.objects.create_user({username!r}, password={password!r}); "
         + MEMBER_SOURCE.format(username=username)],
        cwd=REPO_ROOT, env=env, check=True,
    )  # fmt: skip


@contextlib.contextmanager
def running_stack(
    tmp: Path,
    redis_url: str,
    *,
    name: str,
    username: str,
    password: str,
    beat: bool = False,
    **extra: str,
) -> Iterator[Stack]:
    """1. migrate and make the login; 2. start worker (and beat) and daphne; 3. wait for the
    login page; 4. yield; 5. stop every process (SIGTERM, then SIGKILL after 10 s)."""
    env = stack_env(tmp, redis_url, name, **extra)
    py = sys.executable
    migrate_and_add_member(env, username, password)
    port = free_port()
    logs = tmp / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen] = []

    def start(process: str, cmd: list[str]) -> None:
        out = open(logs / f"{process}.log", "wb")  # noqa: SIM115 - owned by the child
        procs.append(
            subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        )
        out.close()

    try:
        start("worker", [py, "-m", "celery", "-A", "dashboard", "worker", "--pool", "threads",
                         "--concurrency", "8", "-Q", env["CELERY_QUEUE"], "--loglevel", "INFO",
                         "-n", f"{name}-{uuid.uuid4().hex[:6]}@%h"])  # fmt: skip
        if beat:
            start("beat", [py, "-m", "celery", "-A", "dashboard", "beat", "--loglevel", "INFO",
                           "--schedule", str(tmp / "beat-schedule")])  # fmt: skip
        start(
            "web",
            [py, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "dashboard.asgi:application"],
        )
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
        yield Stack(base, tmp / f"{name}.sqlite3", procs, logs)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
