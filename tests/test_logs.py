"""Structured logs: ``LOG_FORMAT=json`` writes one JSON object per line, naming the task and
agent where the code works for one; a bad value is one sentence; text stays the default."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest

from tasks_app.services import tasks as task_services
from tests.test_foundation import SETUP as DJANGO_SETUP
from tests.test_foundation import run_python
from tests.test_mirror import wait_for

SETUP = DJANGO_SETUP + "; import logging; "


@pytest.mark.subprocess
def test_a_bad_log_format_is_one_sentence() -> None:
    result = run_python(
        "import sys, manage; sys.argv = ['manage.py', 'check']; manage.main()", LOG_FORMAT="xml"
    )
    assert result.returncode != 0
    assert "LOG_FORMAT must be one of text, json, not 'xml'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.subprocess
def test_json_lines_carry_the_bound_ids() -> None:
    code = SETUP + (
        "from tasks_app.runtime import logs; logs.bind(task=41, agent=7); "
        "logging.getLogger('probe').warning('hello %s', 'there')"
    )
    result = run_python(code, LOG_FORMAT="json")
    line = json.loads(result.stderr.strip().splitlines()[-1])
    assert (
        line["message"] == "hello there"
        and line["level"] == "WARNING"
        and line["logger"] == "probe"
    )
    assert line["task_id"] == 41 and line["agent_id"] == 7
    # ISO 8601 in UTC (it was local time, "2026-12-02 20:55:25,737", with no zone).
    assert datetime.fromisoformat(line["time"]).utcoffset() == timedelta(0)
    text = run_python(code, LOG_FORMAT="text")
    assert "WARNING probe: hello there" in text.stderr and "task_id" not in text.stderr


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_in_json_names_the_task_its_watcher_works_for(agent, start_celery_worker) -> None:
    from tasks_app.services.agents import add_agent

    demo = add_agent(agent.base_url, name="json logs")
    worker = start_celery_worker(LOG_FORMAT="json", LOG_LEVEL="DEBUG")
    task = task_services.start_task(demo, "quick", mode="stream")
    wait_for(
        lambda: task_services.RemoteTask.objects.get(pk=task.pk).settled_at is not None,
        what="the task to settle",
    )

    def about_the_task() -> list[dict]:
        found = []
        for raw in worker.log_tail(2000).splitlines():
            if raw.startswith("{"):
                entry = json.loads(raw)  # every structured line is one whole object
                if entry.get("task_id") == task.pk:
                    found.append(entry)
        return found

    wait_for(lambda: about_the_task(), what="a log line naming the task")
    assert all(entry["agent_id"] == demo.pk for entry in about_the_task())


@pytest.mark.django_db(transaction=True)
def test_a_watchers_database_calls_log_with_its_ids(shared_loop, caplog) -> None:
    """The database pool did not carry the holder's context: a line written inside
    ``eventloop.db`` (record, dispatch) named neither the task nor the agent."""
    import logging

    from tasks_app import eventloop
    from tasks_app.runtime import logs

    def inside() -> None:
        logging.getLogger("probe").warning("inside the database call")

    async def holder() -> None:
        logs.bind(task=42, agent=5)
        await eventloop.db(inside)

    handler = logging.StreamHandler()
    handler.addFilter(logs.ContextIds())
    seen: list[logging.LogRecord] = []
    handler.emit = seen.append  # type: ignore[method-assign]
    probe = logging.getLogger("probe")
    probe.addHandler(handler)
    try:
        eventloop.submit(holder()).result(timeout=10)
    finally:
        probe.removeHandler(handler)
    assert [(getattr(r, "task_id", None), getattr(r, "agent_id", None)) for r in seen] == [(42, 5)]
