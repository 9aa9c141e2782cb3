"""The inbox and schema-driven answers in headless Chromium, against the real stack.

The stack of tests/test_ui_browser.py (a live daphne server, a real Celery worker, the demo
A2A agent as the real peer; its fixtures and helpers are reused here, on a stack of this
module's own). What the agent received is asked of the agent itself (GetTask over JSON-RPC).
"""

from __future__ import annotations

import re

import httpx
import pytest

from tasks_app.relay import LIST_GROUP
from tests import test_ui_browser as ui
from tests.test_ui_browser import shot, start_task, wait_state
from tests.ui_stack import playwright_timeout

# The browser stack's fixtures (module scope: this module gets a stack of its own).
stack, browser, context, page, demo_agent_pk = (
    ui.stack,
    ui.browser,
    ui.context,
    ui.page,
    ui.demo_agent_pk,
)

# The stack (tests/ui_stack.py): migrate and a login made by commands, daphne, a Celery worker.
pytestmark = [
    pytest.mark.browser, pytest.mark.server, pytest.mark.worker, pytest.mark.subprocess,
    pytest.mark.slow, pytest.mark.timeout(240),
]  # fmt: skip


def agent_history(agent, remote_id: str) -> list[dict]:
    """The task's history as the agent holds it (GetTask, JSON-RPC)."""
    response = httpx.post(
        f"{agent.base_url}/jsonrpc",
        json={
            "jsonrpc": "2.0",
            "id": 1,
            "method": "GetTask",
            "params": {"id": remote_id, "historyLength": 100},
        },
        headers={"A2A-Version": "1.0"},
        timeout=10,
    )
    response.raise_for_status()
    return response.json()["result"].get("history", [])


def user_messages(agent, remote_id: str) -> list[dict]:
    return [m for m in agent_history(agent, remote_id) if m.get("role") == "ROLE_USER"]


def badge_count(page) -> int:
    return int(page.get_attribute("#inbox-badge", "data-count"))


def wait_badge(page, count: int, stack, pk: int) -> None:
    """Wait for the badge to count ``count``; on timeout, say what the page and the
    database held (a flake under CI load is then diagnosable from its report)."""
    try:
        page.wait_for_selector(f"#inbox-badge[data-count='{count}']", state="attached")
    except playwright_timeout():
        badge = page.evaluate(
            "(() => { const b = document.getElementById('inbox-badge');"
            " return {count: b.dataset.count, socket: b.dataset.socket,"
            " version: window.InboxBadge && window.InboxBadge.version()}; })()"
        )
        row = stack.query(
            "SELECT state, watcher_status, last_seq, updated_at FROM tasks_app_remotetask"
            " WHERE id=?",
            pk,
        )
        raise AssertionError(f"the badge did not count {count}: page {badge}, task {row}") from None


def wait_badge_socket(page) -> None:
    # (Waits poll with selectors: a polled predicate string is an eval, which the CSP refuses.)
    page.wait_for_selector("#inbox-badge[data-socket=open]", state="attached")


def test_the_badge_changes_live_on_another_page_when_an_agent_asks(
    context, page, stack, demo_agent_pk
):
    page.goto("/agents/")
    wait_badge_socket(page)
    before = badge_count(page)
    page.evaluate("window.__sameDocument = true")
    other = context.new_page()
    try:
        pk = start_task(other, "ask")
        wait_state(other, "input required")
        # The open page, on another URL, counts the question without a reload.
        wait_badge(page, before + 1, stack, pk)
        assert page.is_visible("#inbox-badge") and page.inner_text("#inbox-badge") == str(
            before + 1
        )
        assert page.evaluate("window.__sameDocument === true")
        shot(page, "inbox-badge")
        # Answered (on the other page): the count goes back down, still without a reload.
        other.fill("#id_text", "Ada")
        other.click("#answer-form button[type=submit]")
        wait_state(other, "completed")
        wait_badge(page, before, stack, pk)
        assert page.evaluate("window.__sameDocument === true")
        assert stack.state(pk) == "TASK_STATE_COMPLETED"
    finally:
        other.close()


def test_a_question_whose_list_relay_was_lost_still_reaches_the_badge(
    context, page, stack, demo_agent_pk, redis_url
):
    """Lost list summaries are repaired by the badge socket's own re-sync (by version, when
    it has been silent), not by a reload and not by a reconnect.

    The loss: the list group's membership is deleted in Redis (a Redis restart loses
    groups the same way), and deleted again every 50 ms while the task runs, so the
    socket's re-joins at its syncs (``consumers._join``) do not let summaries through:
    what the badge learns, it learns from its re-syncs' answers.
    """
    import threading

    import redis
    from channels.layers import get_channel_layer

    page.goto("/agents/")
    wait_badge_socket(page)
    before = badge_count(page)
    page.evaluate("window.__sameDocument = true")
    store = redis.Redis.from_url(redis_url)
    group = get_channel_layer()._group_key(LIST_GROUP)  # the stack's key: same settings
    assert store.zcard(group), "the open page's list socket is a member of the list group"
    done = threading.Event()

    def keep_losing() -> None:
        while not done.is_set():
            store.delete(group)
            done.wait(0.05)

    loser = threading.Thread(target=keep_losing, daemon=True)
    loser.start()
    opened: list[str] = []  # websockets the open page opens from now on (a reconnect would)
    page.on("websocket", lambda ws: opened.append(ws.url))
    other = context.new_page()
    try:
        pk = start_task(other, "ask")
        wait_state(other, "input required")
        wait_badge(page, before + 1, stack, pk)
        other.fill("#id_text", "Ada")
        other.click("#answer-form button[type=submit]")
        wait_state(other, "completed")
        wait_badge(page, before, stack, pk)
        # Same document, and no new socket: the re-syncs did it.
        assert page.evaluate("window.__sameDocument === true")
        assert opened == []
    finally:
        done.set()
        loser.join(5)
        other.close()


def test_a_schema_question_becomes_a_form_that_refuses_an_invalid_answer(
    page, stack, demo_agent_pk, agent
):
    pk = start_task(page, "form")
    wait_state(page, "input required")
    page.wait_for_selector("#answer-form.schema-answer")
    # The schema's fields, with their types: text, number (1-10), date, an enum as radios.
    assert page.get_attribute("#id_a_0", "type") == "text"
    assert (
        page.get_attribute("#id_a_1", "type") == "number"
        and page.get_attribute("#id_a_1", "max") == "10"
    )
    assert page.input_value("#id_a_1") == "2"  # the schema's default
    assert page.get_attribute("#id_a_2", "type") == "date"
    assert page.locator("input[name=a_3][type=radio]").count() == 4  # none, meat, fish, vegetarian
    assert "Who the table is for." in page.inner_text("#answer-form")
    shot(page, "answer-schema-form")
    remote_id = stack.query("SELECT remote_id FROM tasks_app_remotetask WHERE id=?", pk)[0][0]
    assert len(user_messages(agent, remote_id)) == 1  # the message that started it

    page.fill("#id_a_0", "Ada")
    page.fill("#id_a_1", "42")
    page.fill("#id_a_2", "2030-05-01")
    page.check("input[name=a_3][value='\"fish\"']")
    page.click("#answer-form button[type=submit]")
    # Refused next to its field; what was typed is still there; nothing went to the agent.
    error = page.wait_for_selector(".field.has-error[data-field=a_1] .errors")
    assert error.inner_text().strip() == "At most 10."
    assert page.locator(".has-error").count() == 1
    assert page.input_value("#id_a_0") == "Ada" and page.input_value("#id_a_2") == "2030-05-01"
    assert page.is_checked("input[name=a_3][value='\"fish\"']")
    # The field in error has the focus (the page came back at its top before), and its
    # error is the description a screen reader gives it.
    assert page.evaluate("document.activeElement.id") == "id_a_1"
    described = (page.get_attribute("#id_a_1", "aria-describedby") or "").split()
    assert "id_a_1_error" in described
    assert all(page.locator(f"[id='{name}']").count() == 1 for name in described), described
    shot(page, "answer-schema-refused")
    assert stack.query("SELECT answered_seq, outbox FROM tasks_app_remotetask WHERE id=?", pk)[
        0
    ] == (0, None)
    assert len(user_messages(agent, remote_id)) == 1
    assert stack.state(pk) == "TASK_STATE_INPUT_REQUIRED"

    # A valid answer is sent, and the task resumes on the open page.
    page.fill("#id_a_1", "3")
    page.click("#answer-form button[type=submit]")
    page.wait_for_url(re.compile(rf"/tasks/{pk}/$"))
    wait_state(page, "completed")
    page.wait_for_selector("#artifacts :text('guests: 3')")
    booked = page.inner_text("#artifacts")
    assert "name: Ada" in booked and "date: 2030-05-01" in booked and "meal: fish" in booked
    sent = user_messages(agent, remote_id)[-1]
    assert sent["parts"][1]["data"] == {
        "name": "Ada",
        "guests": 3,
        "date": "2030-05-01",
        "meal": "fish",
    }
    assert sent["parts"][0]["text"].startswith("Answer: Name: Ada; Guests: 3")
    # The sent answer, read-only, with who and when.
    record = page.inner_text("#answer-record")
    assert "Answered by operator at " in record and "Ada" in record
    shot(page, "answer-schema-sent")


def test_the_inbox_page_is_live_and_answers_inline(context, page, stack, demo_agent_pk):
    page.goto("/inbox/")
    wait_badge_socket(page)
    page.wait_for_selector("#inbox-live[data-state=open]")
    page.evaluate("window.__sameDocument = true")
    other = context.new_page()
    try:
        pk = start_task(other, "form")
        wait_state(other, "input required")
    finally:
        other.close()
    # The new question appears without a reload, with its generated form.
    row = page.wait_for_selector(f"#inbox-item-{pk}")
    assert "Please fill in the booking form." in row.inner_text()
    page.wait_for_selector(f"#answer-form-{pk}.schema-answer")
    assert page.evaluate("window.__sameDocument === true")
    shot(page, "inbox")
    page.fill(f"#id_t{pk}-a_0", "Grace")
    page.fill(f"#id_t{pk}-a_2", "2031-01-02")
    # Refused: the page comes back with this row's field in error focused, so in view (it
    # opened at its top, the error maybe thousands of pixels below, unseen).
    page.fill(f"#id_t{pk}-a_1", "42")
    page.click(f"#answer-form-{pk} button[type=submit]")
    page.wait_for_selector(f"#inbox-item-{pk} .field.has-error[data-field='t{pk}-a_1']")
    assert page.url.endswith(f"/inbox/{pk}/answer/"), page.url
    assert page.evaluate("document.activeElement.id") == f"id_t{pk}-a_1"
    assert page.input_value(f"#id_t{pk}-a_0") == "Grace"
    page.fill(f"#id_t{pk}-a_1", "3")
    page.click(f"#answer-form-{pk} button[type=submit]")
    page.wait_for_url(re.compile(r"/inbox/$"))
    assert "Answer sent" in page.inner_text(".flash")
    # Once the agent takes the answer up, the row goes (live, on the inbox page it came back to).
    page.wait_for_selector(f"#inbox-item-{pk}", state="detached", timeout=20_000)
    assert stack.state(pk) == "TASK_STATE_COMPLETED"


def test_the_inbox_says_live_when_its_script_arrives_after_the_socket_opened(page, stack):
    """The inbox's script is fetched after the badge's socket is made; when it arrives after
    the socket opened (a loaded server, as a CI run found), it still shows the socket's state."""
    import time

    def late(route) -> None:
        time.sleep(1.5)  # the badge's socket opens meanwhile
        route.continue_()

    page.route("**/dashboard/inbox.js*", late)
    try:
        page.goto("/inbox/")
        wait_badge_socket(page)
        page.wait_for_selector("#inbox-live[data-state=open]", timeout=10_000)
        assert "live" in page.inner_text("#inbox-live")
    finally:
        page.unroute("**/dashboard/inbox.js*")


def test_an_answer_typed_while_another_tab_answers_stays_in_view(
    context, page, stack, demo_agent_pk
):
    """Two tabs on one question: the task page's form was replaced as soon as the other tab's
    answer landed, wiping what was typed; the inbox greyed its row but kept Send enabled,
    inviting a post that the server refused and whose text was then lost."""
    pk = start_task(page, "ask")
    wait_state(page, "input required")
    page.fill("#id_text", "Ada, typed here")
    inbox_page = context.new_page()
    other = context.new_page()
    try:
        inbox_page.goto("/inbox/")
        wait_badge_socket(inbox_page)
        inbox_page.fill(f"#id_t{pk}-text", "Ada, typed in the inbox")
        # Typed maybe before the inbox's script arrived (a loaded server serves it after the
        # badge's socket opened): it must still count as typed into. Its status line says
        # when it runs.
        inbox_page.wait_for_selector("#inbox-live[data-state=open]", timeout=20_000)
        other.goto(f"/tasks/{pk}/")
        other.fill("#id_text", "Grace")
        other.click("#answer-form button[type=submit]")
        other.wait_for_url(re.compile(rf"/tasks/{pk}/$"))
        # The task page keeps what was typed, read-only, and says it was not sent.
        page.wait_for_selector("#kept-answer", timeout=20_000)
        assert page.input_value("#kept-answer") == "Ada, typed here"
        assert "your answer was not sent" in page.inner_text(".kept-answer-box")
        assert page.locator("#answer-form").count() == 0
        # The inbox row, once the task stops waiting: text kept, Send disabled, one note.
        row = f"#inbox-item-{pk}"
        inbox_page.wait_for_selector(f"{row} .inbox-left", timeout=45_000)
        assert inbox_page.input_value(f"#id_t{pk}-text") == "Ada, typed in the inbox"
        assert inbox_page.is_disabled(f"{row} form button[type=submit]")
        assert inbox_page.locator(f"{row} .inbox-left").count() == 1
        shot(page, "answer-kept-after-another-answered")
    finally:
        inbox_page.close()
        other.close()
    assert stack.state(pk) == "TASK_STATE_COMPLETED"
