"""The task page where its live view and its forms said more than was true.

- The hash chain's sentence is computed at load; rows that arrive live after it were not
  checked, and the sentence went on saying "verifies (1 entry)" over a log of many.
- The push panel's "follow by streaming/polling instead" stayed offered after the task
  ended live (the server then refused them); the other actions went away.
- Waiting for input, the cancel and the abandon forms both rendered ``id_reason``: the
  abandon form's label pointed at the cancel form's field.

In the browser, on the daphne and the logged-in Chromium of ``tests.test_ui_resync``; rows
are written by a child process with the server's settings (relayed as usual).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests import test_ui_resync
from tests.agents import REPO_ROOT
from tests.test_live_view_fixes import in_browser
from tests.test_ui_resync import Server

# Their fixtures: a daphne of its own for this module and a logged-in Chromium on it.
server = test_ui_resync.server
context = test_ui_resync.context

# Runs in a child process with the server's settings (as tests.test_ui_resync.WRITER).
WRITER = """
import json, sys
import django
django.setup()
from tasks_app.models import Agent, RemoteTask
from tasks_app.services.record import record, record_many

op, arg = sys.argv[1], json.loads(sys.argv[2])

def status(state, text):
    return {"statusUpdate": {"taskId": "tp-1", "contextId": "tc-1", "status": {
        "state": state, "message": {"messageId": text, "role": "ROLE_AGENT", "parts": [{"text": text}]}}}}

if op == "task":  # arg: {"state": ..., "watch": ...}; a task with one row in that state
    n = RemoteTask.objects.count()  # several tests share the server: an agent each
    agent = Agent.objects.create(
        name=f"page {n}", base_url=f"http://127.0.0.1:1/tp-{n}/", streaming=True, push=True)
    task = RemoteTask.objects.create(agent=agent, title="watched", watch=arg["watch"])
    record(task.pk, {"task": {"id": "tp-1", "contextId": "tc-1", "status": {"state": arg["state"]}}}, "poll")
    print(task.pk)
elif op == "more":  # arg[1] rows more
    record_many(arg[0], [status("TASK_STATE_WORKING", f"more {i}") for i in range(arg[1])], "push")
    print("null")
elif op == "end":
    record(arg, status("TASK_STATE_COMPLETED", "all done"), "push")
    print("null")
"""


def write(web: Server, op: str, arg: object = None) -> Any:
    done = subprocess.run(
        [sys.executable, "-c", WRITER, op, json.dumps(arg)],
        cwd=REPO_ROOT, env=web.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def open_task(context: Any, pk: int) -> Any:
    page = context.new_page()
    page.goto(f"/tasks/{pk}/")
    page.wait_for_function("() => window.__taskPage.synced && window.__taskPage.lastSeq === 1")
    return page


@in_browser
def test_the_chain_sentence_does_not_claim_rows_that_arrived_after_the_check(context, server):
    """Checked at load with one entry; 14 more arrive live: the sentence says one entry was
    checked and 14 arrived since, not "verifies (1 entry)" over a log of 15."""
    pk = write(server, "task", {"state": "TASK_STATE_WORKING", "watch": "poll"})
    page = open_task(context, pk)
    assert page.inner_text("#chain-status").strip() == "Hash chain verifies (1 entry)."

    write(server, "more", [pk, 14])
    page.bring_to_front()  # log rows are drawn per animation frame: a hidden tab has none
    page.wait_for_selector("#event-rows tr[data-seq='15']", timeout=20_000)
    assert page.locator("#event-rows tr[data-seq]").count() == 15
    page.wait_for_function("() => document.getElementById('chain-status').dataset.newer === '14'")
    sentence = " ".join(page.inner_text("#chain-status").split())
    assert "(1 entry)" not in sentence
    assert sentence.startswith("Hash chain verifies for the 1 entry checked when the page loaded")
    assert "14 entries have arrived since and are not checked" in sentence
    assert page.get_attribute("#chain-status a", "href") == f"/tasks/{pk}/"

    # Reloaded, all of them are checked.
    page.reload()
    page.wait_for_function("() => window.__taskPage.synced && window.__taskPage.lastSeq === 15")
    assert page.inner_text("#chain-status").strip() == "Hash chain verifies (15 entries)."
    page.close()


@in_browser
def test_the_push_panel_stops_offering_a_switch_once_the_task_ends_live(context, server):
    """A task followed by push offers to follow it by streaming or polling instead; it
    completes while the page is open: those buttons go with the other actions, as a reload
    would show (a click would only be refused)."""
    pk = write(server, "task", {"state": "TASK_STATE_WORKING", "watch": "push"})
    page = open_task(context, pk)
    for button in ("#switch-stream", "#switch-poll", "#cancel-open", "#abandon-open"):
        assert page.locator(button).count() == 1, button

    write(server, "end", pk)
    page.wait_for_selector("#state-badge .badge:text-is('completed')", timeout=20_000)
    page.wait_for_selector("#cancel-open", state="detached")
    page.wait_for_selector("#switch-poll", state="detached")
    assert page.locator("#switch-stream").count() == 0
    assert page.locator("#push-section").count() == 1  # the panel itself stays

    page.reload()
    page.wait_for_function("() => window.__taskPage.synced && window.__taskPage.lastSeq === 2")
    assert page.locator("#switch-stream, #switch-poll").count() == 0
    page.close()


@in_browser
def test_the_cancel_and_abandon_forms_each_label_their_own_reason(context, server):
    """Waiting for input, both forms ask for a reason: every id on the page is unique and
    each form's label points at the field inside that same form."""
    pk = write(server, "task", {"state": "TASK_STATE_INPUT_REQUIRED", "watch": "poll"})
    page = open_task(context, pk)
    assert page.locator("#cancel-form").count() == 1
    assert page.locator("#abandon-form").count() == 1
    duplicates = page.evaluate(
        """() => {
          const seen = {};
          document.querySelectorAll("[id]").forEach((el) => { seen[el.id] = (seen[el.id] || 0) + 1; });
          return Object.keys(seen).filter((id) => seen[id] > 1);
        }"""
    )
    assert duplicates == []
    for form in ("#cancel-form", "#abandon-form"):
        labelled = page.evaluate(
            """(form) => Array.from(document.querySelectorAll(form + " label")).map((label) => {
              const target = document.getElementById(label.htmlFor);
              return {label: label.textContent.trim(), inside: !!target && !!target.closest(form),
                      name: target && target.name};
            })""",
            form,
        )
        assert labelled == [{"label": "Reason (optional)", "inside": True, "name": "reason"}], form

    # The abandon form's field is the one it posts.
    page.click("#abandon-open")
    page.click("label[for=abandon-reason]")
    page.keyboard.type("not needed")
    page.click("#abandon-confirm")
    page.wait_for_selector("#task-watch:has-text('abandoned by resync: not needed')")
    page.close()
