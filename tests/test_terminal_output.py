"""What an agent's text may do to an operator's terminal and an auditor's spreadsheet.

Found by an audit of where agents' text goes: command output wrote card names, task ids and
titles as they came (escape sequences and forged lines), and CSV cells starting with a
newline or a fullwidth "=" were not guarded as the ASCII ones were.
"""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command

from tasks_app import exports
from tasks_app.models import Agent, RemoteTask

pytestmark = pytest.mark.django_db


def test_an_agents_text_cannot_drive_the_operators_terminal():
    """An agent's card name, task id and title went to `tasks list`, `tasks show` and
    `agents list` as they came: escape sequences set the terminal's title and cleared its
    screen, and a newline forged a line ("all tasks verified OK"). Escaped now, as log
    lines are; the command's own lines and columns are kept."""
    from tasks_app.services.record import record

    esc = "\x1b]0;owned\x07\x1b[2J\x1b[31m\u202e"
    forged = "\r\n2026-01-01 00:00:00 INFO fake: all tasks verified OK\n"
    agent = Agent.objects.create(name="card-name" + esc, base_url="http://127.0.0.1:1/")
    task = RemoteTask.objects.create(agent=agent, title="title\tcolumn" + esc)
    snapshot = {
        "id": "t1" + esc + forged,
        "contextId": "c",
        "status": {"state": "TASK_STATE_WORKING"},
    }
    record(task, {"task": snapshot}, "stream")
    outputs = {}
    for args in (("tasks", "list"), ("tasks", "show", str(task.pk)), ("agents", "list")):
        out, err = io.StringIO(), io.StringIO()
        call_command(*args, stdout=out, stderr=err)
        outputs[args] = out.getvalue() + err.getvalue()
    for text in outputs.values():
        assert "\x1b" not in text and "\x07" not in text and "\r" not in text
        assert "\u202e" not in text and "\nfake" not in text and "\n2026-01-01" not in text
        assert "card-name\\x1b]0;owned\\x07" in text
    listed = outputs[("tasks", "list")].splitlines()
    assert len(listed) == 1 and listed[0].count("\t") == 4  # one line, five columns
    assert "title\\tcolumn" in listed[0] and "verified OK\\n" in listed[0]
    shown = outputs[("tasks", "show", str(task.pk))].splitlines()
    assert shown[0].startswith(f"task {task.pk} (t1\\x1b]0;owned")


@pytest.mark.parametrize(
    "start", ["=", "+", "-", "@", "\t", "\r", "\n", "\uff1d", "\uff0b", "\uff0d", "\uff20"]
)
def test_a_csv_cell_that_could_start_a_formula_is_kept_as_text(start):
    assert exports._cell(start + 'HYPERLINK("x")') == "'" + start + 'HYPERLINK("x")'
    assert exports._cell("plain " + start) == "plain " + start


def test_a_commands_json_output_stays_json_with_controls_escaped():
    from tasks_app.management.commands._stopping import TerminalSafeOutput

    value = {"name": "a\x1b[2J\x7f\x9b\u202eb", "lines": "one\ntwo\tthree"}
    out = io.StringIO()
    TerminalSafeOutput(out).write(json.dumps(value, ensure_ascii=False))
    text = out.getvalue()
    assert json.loads(text) == value
    assert not any(char in text for char in "\x1b\x7f\x9b\u202e")
