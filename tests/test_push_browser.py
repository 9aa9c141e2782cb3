"""A push-mode task's page in headless Chromium: it updates live as notifications arrive.

The real stack: daphne (which also serves the webhook), a Celery worker, Redis and the
demo agent delivering its notifications over loopback. The page is opened before the
notifications come, and is never reloaded.
"""

from __future__ import annotations

import pytest

from tasks_app.models import RemoteTask, TaskEvent
from tasks_app.services import tasks as task_services
from tasks_app.services.agents import add_agent
from tests.ui_stack import chromium

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.timeout(240),
]


def test_a_push_task_page_updates_live_as_notifications_arrive(
    agent, start_daphne, start_celery_worker, django_user_model, settings, screenshot_dir
):
    web = start_daphne()
    settings.PUBLIC_URL = web.url
    start_celery_worker(PUBLIC_URL=web.url, PUSH_SILENCE_SECONDS="120")
    django_user_model.objects.create_superuser("pushop", password="push-pass-123")
    stored = add_agent(agent.base_url)
    # (Database work stays outside the Playwright block, whose event loop Django refuses.)
    # 45 s of work: the page must load, see rows arrive and list the configs (deleted when the
    # task settles) before it ends; starting Chromium and logging in took over 8 s on a loaded
    # machine (four test processes beside this one), and with 30 s a CI run on a machine twice
    # as slow listed the configs only after the task had ended.
    task = task_services.start_task(stored, "batch 45 1.0", mode="push")
    with chromium() as browser:
        page = browser.new_page()
        page.goto(f"{web.url}/accounts/login/")
        page.fill("input[name=username]", "pushop")
        page.fill("input[name=password]", "push-pass-123")
        page.click("button[type=submit]")
        page.wait_for_url(lambda url: "/accounts/login/" not in url)
        page.goto(f"{web.url}/tasks/{task.pk}/")
        page.wait_for_selector("#push-section")
        loaded = page.locator("#event-rows tr").count()
        # Push rows appear without a reload, and the watcher says it awaits push.
        push_rows = page.locator("#event-rows tr", has_text="push")
        pushed_at_load = push_rows.count()
        push_rows.nth(pushed_at_load + 2).wait_for(timeout=30_000)
        assert page.locator("#event-rows tr").count() >= loaded + 3
        page.locator("#watcher-status", has_text="awaiting-push").wait_for(timeout=30_000)
        # The agent's list of configs, asked for from the page: ours is there.
        page.click("#push-configs-load")
        page.locator("tr.push-config", has_text="yes").wait_for(timeout=15_000)
        page.locator("#task-head", has_text="completed").wait_for(timeout=60_000)
        page.screenshot(path=str(screenshot_dir / "push-task.png"), full_page=True)
        shown = page.locator("#event-rows tr", has_text="push").count()
    task.refresh_from_db()
    assert task.state == "TASK_STATE_COMPLETED" and task.watch == RemoteTask.Watch.PUSH
    assert shown >= TaskEvent.objects.filter(task=task, channel="push").count() - 1
