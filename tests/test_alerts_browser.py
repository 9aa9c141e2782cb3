"""Alerts in headless Chromium against the real stack: an alert appears on an open overview
for a task silent past its threshold, and clears itself when the task moves.

As in ``tests/test_ui_browser.py``: daphne, a Celery worker and celery beat run as
subprocesses on a private SQLite file, the session's Redis database and a private queue;
the demo A2A agent is the real peer. The thresholds are small, through the environment of
the processes started here: a task silent in ``working`` for 3 s is alerted, the rules are
evaluated every second by beat, and the page checks its alerts every second.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from tests.agents import REPO_ROOT
from tests.ui_stack import Stack, chromium, running_stack

# The stack (tests/ui_stack.py): migrate and a login made by commands, daphne, worker and beat.
pytestmark = [
    pytest.mark.browser, pytest.mark.server, pytest.mark.worker, pytest.mark.subprocess,
    pytest.mark.slow, pytest.mark.timeout(240),
]  # fmt: skip

SHOTS = REPO_ROOT / "test-artifacts" / "screenshots"
USERNAME, PASSWORD = "alert-operator", "op-password-123"
SILENT_SECONDS = 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url) -> Iterator[Stack]:
    with running_stack(
        tmp_path_factory.mktemp("alerts-ui"), redis_url, name="alerts", username=USERNAME, password=PASSWORD,
        beat=True, ALERT_SILENT_WORKING_SECONDS=str(SILENT_SECONDS), ALERT_EVERY_SECONDS="1", ALERT_REFRESH_SECONDS="1",
    ) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def context(stack):
    with chromium() as browser:
        ctx = browser.new_context(base_url=stack.base_url, viewport={"width": 1280, "height": 900})
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
        "SELECT count(*) FROM tasks_app_alert WHERE task_id=? AND rule='silent-working' AND resolved_at IS NULL",
        pk,
    ) == [(1,)]
    SHOTS.mkdir(parents=True, exist_ok=True)
    overview.screenshot(path=str(SHOTS / "overview-alert.png"), full_page=True)

    # The task moves (its step arrives, then it completes): the alert clears itself.
    overview.wait_for_selector(item, state="detached", timeout=25_000)
    assert time.monotonic() - started > 8, "the alert cleared before the task moved"
    assert stack.query("SELECT state FROM tasks_app_remotetask WHERE id=?", pk)[0][0] in (
        "TASK_STATE_WORKING", "TASK_STATE_COMPLETED",
    )  # fmt: skip
    resolved = stack.query(
        "SELECT resolved_at FROM tasks_app_alert WHERE task_id=? AND rule='silent-working'", pk
    )
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
