"""What an agent (or a webhook caller) can make our logs do: nothing it chooses starts a
line of its own or reaches a terminal as a control sequence, no line grows without bound,
and a flood of deliveries that cannot be checked writes one traceback, not one each."""

from __future__ import annotations

import json
import logging
import logging.config
import re

import pytest

from tasks_app import eventloop, outbound, webhooks
from tasks_app.models import Agent
from tasks_app.runtime import logs
from tasks_app.services import push
from tests.serving import RpcError, json_rpc_peer
from tests.test_foundation import SETUP as DJANGO_SETUP
from tests.test_foundation import run_python
from tests.test_push_route import call, config, credentials, run, update  # noqa: F401 (fixture)
from tests.test_race_fixes import push_task

# A line as ours start: "2026-12-03 07:47:11,124 LEVEL logger: ..."
OURS = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+: ")
FORGED = "2026-01-01 00:00:00,000 INFO tasks_app.watchers: task 7 settled, all fine"
# Cursor up, erase the line, back to its start: on a terminal the agent's text
# overwrites the line before it.
ANSI = "\x1b[1A\x1b[2K\r\x08"
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def text_formatter() -> logging.Formatter:
    """The formatter ``LOG_FORMAT=text`` configures (dashboard/settings.py's ``LOGGING``)."""
    return logging.config.DictConfigurator({}).configure_formatter(logs.formatter_config("text"))


@pytest.mark.django_db(transaction=True)
def test_an_agents_error_text_cannot_forge_a_line_nor_drive_the_terminal(
    shared_loop, caplog
) -> None:
    """A JSON-RPC error's message reached the text log as it was: the error text kept ESC,
    carriage return and backspace (only whitespace runs were folded), so an agent could
    move the cursor up, erase our line and write one of its own."""

    def answer(request: dict) -> dict:
        raise RpcError(-32001, f"Task not found{ANSI}{FORGED}\u202e")

    with json_rpc_peer(answer) as url:
        task = push_task()
        Agent.objects.filter(pk=task.agent_id).update(
            base_url=url, interface_url=f"{url}/rpc", binding="JSONRPC", protocol_version="1.0"
        )

        async def refresh() -> None:
            async with outbound.new_http_client() as http:
                await push.refresh_after_push(http, task.pk)

        with caplog.at_level(logging.INFO, logger="tasks_app.services.push"):
            eventloop.submit(refresh()).result(timeout=60)
    records = [r for r in caplog.records if "GetTask after a push" in r.getMessage()]
    assert len(records) == 1
    assert "\x1b" in records[0].getMessage()  # what the agent sent reached the record
    line = text_formatter().format(records[0])
    assert OURS.match(line) and "\n" not in line and not CONTROL.search(line), repr(line)
    assert "\\x1b[1A\\x1b[2K \\x08" + FORGED in line  # shown, escaped


@pytest.mark.subprocess
def test_the_text_format_keeps_each_record_to_its_lines() -> None:
    """Through the project's own logging setup (LOG_FORMAT=text): a message and an exception's
    text holding a newline started a line of the agent's that looked like ours."""
    code = DJANGO_SETUP + (
        "; import logging; log = logging.getLogger('tasks_app.watchers')\n"
        f"forged = {FORGED!r}\n"
        "log.warning('turn failed: %s', 'agent said no\\n' + forged + '\\r\\x1b[31m')\n"
        "try:\n"
        "    try:\n"
        "        raise KeyError('x\\n' + forged)\n"
        "    except KeyError as exc:\n"
        "        exc.add_note('note\\n' + forged)\n"
        "        raise ValueError('bad frame\\r\\n' + forged) from exc\n"
        "except ValueError:\n"
        "    log.exception('watcher of task 7 failed')\n"
    )
    result = run_python(code, LOG_FORMAT="text", LOG_LEVEL="INFO")
    lines = result.stderr.splitlines()
    ours = [line for line in lines if OURS.match(line)]
    assert [line.split(": ", 1)[1][:20] for line in ours] == [
        "turn failed: agent s",
        "watcher of task 7 fa",
    ], result.stderr
    assert not any(line.startswith(FORGED) for line in lines), result.stderr
    assert not any(CONTROL.search(line) for line in lines), result.stderr
    # Still a traceback, with each exception's text on its line, escaped.
    assert "Traceback (most recent call last):" in lines
    assert f"ValueError: bad frame\\r\\n{FORGED}" in lines
    assert f"KeyError: 'x\\n{FORGED}'" in lines  # (its text is a repr: escaped already)
    assert f"note\\n{FORGED}" in lines


HUGE = DJANGO_SETUP + (
    "; import logging; log = logging.getLogger('tasks_app.services.push')\n"
    "log.info('GetTask failed: %s', 'E' * 10_000_000)\n"
    "try:\n"
    "    raise ValueError('E' * 10_000_000)\n"
    "except ValueError:\n"
    "    log.exception('refresh failed')\n"
)
HUGE_CUT = len("GetTask failed: ") + 10_000_000 - logs.MESSAGE_LIMIT


@pytest.mark.subprocess
def test_a_huge_agent_string_is_cut_in_the_text_format() -> None:
    """A 10 MB error text made a 10 MB log line (and a 10 MB traceback)."""
    text = run_python(HUGE, LOG_FORMAT="text").stderr
    assert len(text) < 3 * logs.MESSAGE_LIMIT, len(text)
    assert "GetTask failed: EEE" in text and f"[{HUGE_CUT} more characters cut]" in text
    assert "ValueError: EEE" in text


@pytest.mark.subprocess
def test_a_huge_agent_string_is_cut_in_the_json_format() -> None:
    lines = run_python(HUGE, LOG_FORMAT="json").stderr.splitlines()
    entries = [json.loads(line) for line in lines if line.startswith("{")]
    assert [e["message"][:14] for e in entries] == ["GetTask failed", "refresh failed"]
    assert len(entries[0]["message"]) < logs.MESSAGE_LIMIT + 100
    assert entries[0]["message"].endswith(f"[{HUGE_CUT} more characters cut]")
    assert len(entries[1]["exc_info"]) < logs.EXCEPTION_LIMIT + 100
    assert entries[1]["exc_info"].rstrip().endswith("EEE")  # the tail names the error


@pytest.mark.django_db(transaction=True)
def test_deliveries_that_cannot_be_checked_log_one_traceback_then_a_count(
    config,  # noqa: F811 (the fixture)
    settings,
    caplog,
    empty_push_queue,
    monkeypatch,
) -> None:
    """With Redis unreachable every delivery logged a traceback: anyone on the network
    chose how many lines the webhook wrote (one per request)."""
    # No spell left over from another test.
    monkeypatch.setattr(webhooks._unchecked, "count", 0)
    monkeypatch.setattr(webhooks._unchecked, "since", None)
    path = f"/push/{config.config_id}/"
    good = credentials(config)
    working = settings.REDIS_URL
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    push._config_cache.clear()
    with caplog.at_level(logging.INFO, logger="tasks_app.webhooks"):
        statuses = [run(call(path, update(i), good))[0] for i in range(40)]
        assert statuses == [503] * 40
        settings.REDIS_URL = working
        assert run(call(path, update(41), good))[0] == 202
        assert run(call(path, update(42), good))[0] == 202
    lines = [r for r in caplog.records if r.name == "tasks_app.webhooks"]
    assert len(lines) == 2, [r.getMessage() for r in lines]
    assert lines[0].exc_info and "could not be checked" in lines[0].getMessage()
    assert "checked again: 40 could not be" in lines[1].getMessage()
    assert not lines[1].exc_info


def test_a_json_request_record_names_the_path_without_its_query() -> None:
    """Django's request log records carry the request: the JSON format wrote its repr, whose
    query string held whatever was in the URL (``?url=https://bob:secret@...``)."""
    from django.test import RequestFactory

    formatter = logging.config.DictConfigurator({}).configure_formatter(
        logs.formatter_config("json")
    )
    request = RequestFactory().get("/agents/add/", {"url": "https://bob:hunter2@a.example/"})
    record = logging.LogRecord("django.request", logging.WARNING, __file__, 1, "Not Found: %s",
                               (request.path,), None)  # fmt: skip
    record.request, record.status_code = request, 404
    line = json.loads(formatter.format(record))
    assert line["request"] == "GET /agents/add/" and line["status_code"] == 404
    assert "hunter2" not in json.dumps(line)
