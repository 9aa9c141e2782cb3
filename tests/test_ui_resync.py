"""Browsers never stay stale: a final state whose relay message was lost still shows.

A live daphne server runs as a subprocess on a private SQLite file and the session's
Redis database (``redis_url`` from ``tests.infra``); headless Chromium opens the task
page and the task list. Another process records the task's last event through
``record()`` with ``relay.publish`` made a no-op for that one call (a lost relay
message: the row is in the log, no browser is told). The pages must show it through
their idle re-sync, without a reload.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.agents import REPO_ROOT, free_port
from tests.ui_stack import chromium, migrate_and_add_member

# A daphne of its own, and migrate, the login and the writer run as commands.
pytestmark = [
    pytest.mark.browser, pytest.mark.server, pytest.mark.subprocess,
    pytest.mark.slow, pytest.mark.timeout(180),
]  # fmt: skip

USERNAME, PASSWORD = "resync", "resync-password-123"

# Runs in a child process with the server's settings: "create" makes a working task
# (relayed as usual); "finish" completes it with the relay dropped.
WRITER = """
import json, sys
from unittest import mock
import django
django.setup()
from tasks_app.models import Agent, RemoteTask
from tasks_app.services.record import record

op, arg = sys.argv[1], json.loads(sys.argv[2])

def status(state, text):
    return {"statusUpdate": {"taskId": "rs-1", "contextId": "rc-1", "status": {
        "state": state, "message": {"messageId": text, "role": "ROLE_AGENT", "parts": [{"text": text}]}}}}

if op == "create":
    agent = Agent.objects.create(name="resync agent", base_url="http://127.0.0.1:1/")
    task = RemoteTask.objects.create(agent=agent, title="resync check")
    record(task.pk, {"task": {"id": "rs-1", "contextId": "rc-1", "status": {"state": "TASK_STATE_WORKING"}}}, "poll")
    print(task.pk)
else:
    with mock.patch("tasks_app.relay.publish", lambda messages: None):
        done = record(arg, status("TASK_STATE_COMPLETED", "all done, relay lost"), "poll")
    print(json.dumps(done.seqs))
"""


class Server:
    def __init__(self, base_url: str, env: dict[str, str]) -> None:
        self.base_url = base_url
        self.env = env

    def write(self, op: str, arg: object = None) -> str:
        """Run WRITER in a child process against the server's database."""
        done = subprocess.run(
            [sys.executable, "-c", WRITER, op, json.dumps(arg)],
            cwd=REPO_ROOT, env=self.env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, redis_url) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("resync")
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="dashboard.settings",
        DATABASE_URL=f"sqlite:///{tmp / 'ui.sqlite3'}",
        DATA_DIR=str(tmp),
        REDIS_URL=redis_url,
        ALLOWED_HOSTS="127.0.0.1,localhost",
        PYTHONUNBUFFERED="1",
        # Prepended: the loopback-only hook's folder (tests/conftest.py) stays on the path.
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    )
    env.pop("DASHBOARD_TEST_DB_FILE", None)
    py = sys.executable
    migrate_and_add_member(env, USERNAME, PASSWORD)
    port = free_port()
    log_path = tmp / "web.log"
    with open(log_path, "wb") as out:
        web = subprocess.Popen(
            [py, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "dashboard.asgi:application"],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/accounts/login/", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            assert web.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.1)
        yield Server(base, env)
    finally:
        web.terminate()
        try:
            web.wait(timeout=10)
        except subprocess.TimeoutExpired:
            web.kill()
            web.wait()


@pytest.fixture(scope="module")
def context(server) -> Iterator[Any]:
    """A logged-in Playwright ``BrowserContext`` on the server."""
    with chromium() as browser:
        ctx = browser.new_context(base_url=server.base_url)
        ctx.set_default_timeout(15_000)
        # Record what each page sends on its websockets (to see the re-sync asked).
        ctx.add_init_script(
            """(() => {
              window.__sent = [];
              const send = WebSocket.prototype.send;
              WebSocket.prototype.send = function (data) {
                try { window.__sent.push(JSON.parse(data)); } catch (e) {}
                return send.call(this, data);
              };
            })();"""
        )
        page = ctx.new_page()
        page.goto("/tasks/")
        page.fill("#id_username", USERNAME)
        page.fill("#id_password", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url(re.compile(r"/tasks/$"))
        page.close()
        yield ctx


def test_a_final_state_whose_relay_was_lost_reaches_the_task_page_and_the_list(context, server):
    pk = int(server.write("create"))
    task_page = context.new_page()
    task_page.goto(f"/tasks/{pk}/")
    task_page.wait_for_selector("#state-badge .badge:text-is('working')")
    task_page.wait_for_function("() => window.__taskPage.synced && window.__taskPage.lastSeq === 1")
    list_page = context.new_page()
    list_page.goto("/tasks/")
    list_page.wait_for_selector(f"#task-row-{pk} .badge:text-is('working')")
    list_page.wait_for_selector("#live-status[data-state=open]")
    for page in (task_page, list_page):
        page.evaluate("window.__notReloaded = true")

    seqs = json.loads(server.write("finish", pk))
    assert seqs == [2]
    started = time.monotonic()
    # Nothing is relayed: only the idle re-sync can bring the completed state (~5 s).
    task_page.wait_for_selector("#state-badge .badge:text-is('completed')", timeout=15_000)
    list_page.wait_for_selector(f"#task-row-{pk} .badge:text-is('completed')", timeout=15_000)
    assert time.monotonic() - started < 20  # a deadline, not a measurement

    # The task page got the row by seq, once, and nothing was reloaded.
    assert task_page.evaluate("window.__notReloaded") is True
    assert list_page.evaluate("window.__notReloaded") is True
    state = task_page.evaluate("({seqs: window.__taskPage.seqs, gaps: window.__taskPage.gaps})")
    assert state == {"seqs": [1, 2], "gaps": 0}
    task_page.bring_to_front()  # log rows are drawn per animation frame: a hidden tab has none
    task_page.wait_for_selector("#event-rows tr[data-seq='2']")
    rows = task_page.eval_on_selector_all(
        "#event-rows tr[data-seq]", "rs => rs.map(r => r.dataset.seq)"
    )
    assert rows == ["1", "2"]
    task_page.wait_for_function(
        "() => document.getElementById('task-status').textContent.includes('all done, relay lost')"
    )
    # The task socket's syncs (the page's inbox badge also keeps a task-list socket, whose
    # syncs carry "since" instead).
    syncs = task_page.evaluate("window.__sent.filter(m => m.type === 'sync' && 'after' in m)")
    assert syncs and all(m["after"] in (1, 2) for m in syncs)
    list_syncs = list_page.evaluate("window.__sent.filter(m => m.type === 'sync')")
    assert len(list_syncs) >= 2 and all(m["since"] for m in list_syncs)  # on open, then when idle
    assert list_page.get_attribute(f"#task-row-{pk}", "data-seq") == "2"
