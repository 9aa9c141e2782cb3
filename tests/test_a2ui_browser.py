"""Agents' A2UI forms in headless Chromium, against the real stack.

The browser stack of tests/test_ui_browser.py (daphne, a Celery worker, the demo agent as a
real peer), on a stack of this module's own, plus a2a-sdk agents asking with A2UI v0.8 and
v0.9.1 forms (tests/a2ui_agents.py) in this process. What an agent received is read from
the agent itself.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from urllib.parse import parse_qs

import pytest

from tests import test_ui_browser as ui
from tests.agents import REPO_ROOT
from tests.people import MEMBER_SOURCE
from tests.test_ui_browser import shot, wait_state
from tests.ui_stack import playwright_timeout, stack_env

stack, browser, context, page, demo_agent_pk = (
    ui.stack,
    ui.browser,
    ui.context,
    ui.page,
    ui.demo_agent_pk,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(240)]

SECOND, SECOND_PASSWORD = "second", "second-password-123"


def add_agent_through_the_page(context, url: str) -> int:
    page = context.new_page()
    try:
        page.goto("/agents/add/")
        page.fill("#id_url", url)
        page.click("button[value=preview]")
        page.wait_for_selector("#card-preview")
        page.click("#save-agent")
        page.wait_for_url(re.compile(r"/agents/\d+/$"))
        return int(re.search(r"/agents/(\d+)/", page.url).group(1))
    finally:
        page.close()


@pytest.fixture(scope="module")
def a2ui_agents(context, stack, demo_agent_pk) -> Iterator[dict]:
    """The v0.8 and v0.9.1 agents, added through the page: {version: (agent pk, executor)}."""
    # Imported here: the a2a and A2UI servers cost a second to import, at every collection.
    from tests.a2ui_agents import a2ui_agent

    with a2ui_agent("0.8") as (base08, ex08), a2ui_agent("0.9.1") as (base091, ex091):
        yield {
            "0.8": (add_agent_through_the_page(context, base08), ex08),
            "0.9.1": (add_agent_through_the_page(context, base091), ex091),
        }


@pytest.fixture(scope="module")
def second_context(browser, stack, redis_url):
    """Another person (an operator of the default project), logged in in their own context."""
    env = stack_env(stack.db_path.parent, redis_url, "ui")
    subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); "
         "from django.contrib.auth.models import User; "
         f"User.objects.create_user({SECOND!r}, password={SECOND_PASSWORD!r}); "
         + MEMBER_SOURCE.format(username=SECOND)],
        cwd=REPO_ROOT, env=env, check=True,
    )  # fmt: skip
    ctx = browser.new_context(base_url=stack.base_url, viewport={"width": 1280, "height": 900})
    ctx.set_default_timeout(15_000)
    p = ctx.new_page()
    p.goto("/accounts/login/")
    p.fill("#id_username", SECOND)
    p.fill("#id_password", SECOND_PASSWORD)
    p.click("button[type=submit]")
    p.wait_for_url(re.compile(r"^(?!.*/accounts/login/).*$"))
    assert p.locator("#id_password").count() == 0, "the second person could not log in"
    p.close()
    yield ctx
    ctx.close()


def start(page, agent_pk: int, text: str) -> int:
    page.goto("/tasks/new")
    page.select_option("#id_agent", str(agent_pk))
    page.fill("#id_text", text)
    page.click("#start-task")
    page.wait_for_url(re.compile(r"/tasks/\d+/$"))
    return ui.task_pk_of(page)


def slide(locator, value: str) -> None:
    """Move a range input as a person does (its input event, which a2ui.js listens to)."""
    locator.evaluate(
        "(el, v) => { el.value = v; el.dispatchEvent(new Event('input', {bubbles: true})); }",
        value,
    )


def wait_until(predicate, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.parametrize("version", ["0.8", "0.9.1"])
def test_a_person_fills_the_agents_form_from_the_inbox(page, stack, a2ui_agents, version):
    agent_pk, executor = a2ui_agents[version]
    before = len(executor.actions())
    pk = start(page, agent_pk, "form")
    wait_state(page, "input required")
    page.goto("/inbox/")
    surface = page.wait_for_selector(f"#inbox-item-{pk} .a2ui-surface[data-a2ui-surface=form]")
    assert "Who is coming?" in surface.inner_text()
    row = page.locator(f"#inbox-item-{pk}")
    # The client-side check of the name (v0.9.1 declares one): shown once typed and cleared.
    row.locator("[data-a2ui-id=name] input").fill("Ada Lovelace")
    slide(row.locator("[data-a2ui-id=guests] input[type=range]"), "5")
    assert row.locator("[data-a2ui-id=guests] output").inner_text() == "5"
    row.locator("[data-a2ui-id=meal] input[value=fish]").check()
    row.locator("[data-a2ui-id=ok-box] input[type=checkbox]").check()
    shot(page, f"a2ui-inbox-{version}")
    row.locator("button.a2ui-button").click()
    page.wait_for_url(re.compile(r"/inbox/$"))
    assert "Sent to the agent" in page.inner_text(".flash")
    wait_until(lambda: len(executor.actions()) > before)
    action = executor.actions()[-1]
    assert action["name"] == "submit" and action["surfaceId"] == "form"
    assert action["sourceComponentId"] == "send"
    assert action["context"] == {"name": "Ada Lovelace", "guests": 5, "meal": ["fish"], "ok": True}
    wait_until(lambda: stack.state(pk) == "TASK_STATE_COMPLETED")
    # The action is in the audit trail with who did it.
    rows = stack.query(
        "SELECT u.username FROM tasks_app_operatoraction a JOIN auth_user u ON u.id = a.actor_id "
        "WHERE a.task_id=? AND a.action='a2ui-action'",
        pk,
    )
    assert rows == [(ui.USERNAME,)]


def test_a_data_model_update_redraws_bound_values_live(page, stack, demo_agent_pk):
    pk = start(page, demo_agent_pk, "booking 4 1.5")
    surface = "#a2ui-surfaces .a2ui-surface[data-a2ui-surface=booking]"
    left = f"{surface} [data-a2ui-id=left-value]"
    page.wait_for_selector(left)
    assert int(page.inner_text(left)) > 5
    page.evaluate("window.__sameDocument = true")
    # The agent's updates arrive over the task's websocket and redraw the bound value.
    page.wait_for_selector(f"{left} :text-is('5')", timeout=20_000)  # (markdown: a <p>)
    assert page.evaluate("window.__sameDocument === true")
    # Asked: the same surface becomes a form to fill in (still without a reload).
    wait_state(page, "input required")
    page.wait_for_selector(f"{surface} form.a2ui-form")
    assert page.evaluate("window.__sameDocument === true")
    # Bound values follow the person's input at once (client side).
    slide(page.locator(f"{surface} [data-a2ui-id=size] input"), "5")
    assert page.inner_text(f"{surface} [data-a2ui-id=guests-value]") == "5"
    page.fill(f"{surface} [data-a2ui-id=name] input", "Ada")
    # The Book button's checks (name and date) keep it disabled until both are given, and
    # the reason is said beside it (it was in its title only: a mouse's tooltip).
    button = f"{surface} button.a2ui-button"
    assert page.is_disabled(button)
    why = page.get_attribute(button, "aria-describedby")
    assert why and page.inner_text(f"#{why}").strip(), page.inner_text(surface)
    page.fill(f"{surface} [data-a2ui-id=date] input", "2030-05-01")
    page.locator(f"{surface} [data-a2ui-id=seating] input[value=terrace]").check()
    assert page.is_enabled(button)
    assert page.inner_text(f"#{why}").strip() == ""
    shot(page, "a2ui-booking-form")
    page.click(f"{surface} button.a2ui-button")
    page.wait_for_url(re.compile(rf"/tasks/{pk}/$"))
    wait_state(page, "completed")
    # The same surface, redrawn by the agent as a confirmation card.
    page.wait_for_selector(f"{surface} :text('Table for 5 on 2030-05-01, Ada.')")
    assert "An earlier state of this form was submitted (book) by operator" in page.inner_text(
        surface
    )
    booked = page.inner_text("#artifacts")
    assert "seating: ['terrace']" in booked and "size: 5" in booked
    shot(page, "a2ui-booking-confirmed")


@contextlib.contextmanager
def database_write_lock(stack) -> Iterator[None]:
    """Hold SQLite's write lock: every writer (both submits) waits at its first write."""
    conn = sqlite3.connect(stack.db_path, timeout=20, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def wait_flash(page, who: str, heard: list[str], stack, pk: int) -> None:
    """Wait for the page's flash; on timeout, say what the page and the database held (a
    flake seen under CI load is then diagnosable from its report)."""
    try:
        page.wait_for_selector(".flash")
    except playwright_timeout():
        form = page.evaluate(
            "(() => { const f = document.querySelector('#a2ui-surfaces form.a2ui-form');"
            " return f ? {sending: f.dataset.sending || null} : null; })()"
        )
        actions = stack.query(
            "SELECT actor_id, created_at FROM tasks_app_operatoraction"
            " WHERE task_id=? AND action='a2ui-action'",
            pk,
        )
        state = stack.query("SELECT state, last_seq FROM tasks_app_remotetask WHERE id=?", pk)
        responses = [h for h in heard if "/static/" not in h][-10:]
        raise AssertionError(
            f"no flash for {who}: url {page.url}, form {form}, responses {responses},"
            f" actions {actions}, task {state}"
        ) from None


def test_two_people_submitting_at_once_yield_one_action(page, second_context, stack, a2ui_agents):
    agent_pk, executor = a2ui_agents["0.9.1"]
    before = len(executor.actions())
    pk = start(page, agent_pk, "form")
    wait_state(page, "input required")
    other = second_context.new_page()
    try:
        other.goto(f"/tasks/{pk}/")
        pages = {ui.USERNAME: page, SECOND: other}
        for who, p in pages.items():
            p.wait_for_selector("#a2ui-surfaces .a2ui-surface form.a2ui-form")
            # Typed once a2ui.js has looked at the surfaces after the socket synced (see
            # test_typing_keeps_its_place_while_events_arrive for what a redraw must keep).
            p.wait_for_selector("#a2ui-surfaces[data-refreshed]", state="attached")
            name = p.locator("#a2ui-surfaces [data-a2ui-id=name] input")
            name.fill(who)
            assert name.get_attribute("data-a2ui-dirty") == "1"  # the script saw it typed
        # Both press at once: both requests pass every check and wait inside the window
        # (at the compare-and-set's transaction) until the lock is released.
        heard: dict[str, list[str]] = {who: [] for who in pages}
        for who, p in pages.items():  # for the report below, should a flash never come
            p.on(
                "response",
                lambda r, w=who: heard[w].append(f"{r.request.method} {r.url} {r.status}"),
            )
        act_url = f"{stack.base_url}/tasks/{pk}/surfaces/act/"

        def is_submit(request) -> bool:
            return request.method == "POST" and request.url == act_url

        answered: dict[str, list[int]] = {who: [] for who in pages}
        for who, p in pages.items():
            p.on(
                "response",
                lambda r, w=who: answered[w].append(r.status) if is_submit(r.request) else None,
            )
        submits = {}
        with database_write_lock(stack):
            for who, p in pages.items():
                with p.expect_request(is_submit) as submit:
                    p.click("#a2ui-surfaces button.a2ui-button", no_wait_after=True)
                form = parse_qs(submit.value.post_data or "")
                assert [who] in form.values(), form  # this person's form, with their name
                submits[who] = submit.value
            released = time.time()  # both submits are on their way; the lock goes now
        for who, p in pages.items():
            wait_flash(p, who, heard[who], stack, pk)
        assert answered == {who: [302] for who in pages}, answered  # each sent back to the task
        # Both were in flight together: each was sent while the lock was held (its request
        # was seen above) and answered only after the lock went (the browser's clock, the
        # machine's, as ours), so the two raced the window, not one after the other.
        for who, request in submits.items():
            timing = request.timing
            answered_at = (timing["startTime"] + timing["responseStart"]) / 1000
            assert timing["responseStart"] > 0 and answered_at > released, (who, timing, released)
        flashes = {who: p.inner_text(".flash") for who, p in pages.items()}
        winners = [who for who, text in flashes.items() if "Sent to the agent" in text]
        assert len(winners) == 1, flashes
        loser = next(who for who in pages if who not in winners)
        assert f"Already submitted by {winners[0]} at " in flashes[loser]
        wait_until(lambda: stack.state(pk) == "TASK_STATE_COMPLETED")
        actions = executor.actions()[before:]
        assert len(actions) == 1 and actions[0]["context"]["name"] == winners[0]
        assert stack.query(
            "SELECT count(*) FROM tasks_app_operatoraction WHERE task_id=? AND action='a2ui-action'",
            pk,
        ) == [(1,)]
    finally:
        other.close()


def test_typing_keeps_its_place_while_events_arrive(page, stack, a2ui_agents):
    """Every event on the task page makes a2ui.js ask the server for the surfaces again. It
    put the block back even when nothing had changed, which took the focus from the input
    being typed in: the rest of the word went nowhere (the two-people test lost a name so)."""
    agent_pk, _ = a2ui_agents["0.9.1"]
    start(page, agent_pk, "form")
    wait_state(page, "input required")
    box = page.locator("#a2ui-surfaces")
    page.wait_for_selector("#a2ui-surfaces[data-refreshed]", state="attached")
    name = page.locator("#a2ui-surfaces [data-a2ui-id=name] input")
    name.click()
    page.keyboard.type("Ada ")
    for _ in range(3):  # the surfaces looked at again, unchanged, as each event makes them
        seen = int(box.get_attribute("data-refreshed") or 0)
        page.evaluate("() => window.A2UI.refresh()")
        page.wait_for_function(
            f"() => Number(document.getElementById('a2ui-surfaces').dataset.refreshed) > {seen}"
        )
        assert name.evaluate("el => el === document.activeElement")
    page.keyboard.type("Lovelace")
    assert name.input_value() == "Ada Lovelace"
    # A surface drawn anew (the server's drawing changed) keeps what was typed, and the focus.
    page.evaluate(
        "() => { document.querySelector('#a2ui-surfaces .a2ui-surface').dataset.a2uiKey = 'old';"
        " window.A2UI.refresh(); }"
    )
    page.wait_for_function(
        "() => document.querySelector('#a2ui-surfaces .a2ui-surface').dataset.a2uiKey !== 'old'"
    )
    fresh = page.locator("#a2ui-surfaces [data-a2ui-id=name] input")
    assert fresh.input_value() == "Ada Lovelace"


def test_xss_payloads_in_a_surface_never_execute(page, stack, a2ui_agents):
    from tests.a2ui_agents import PAYLOAD

    agent_pk, executor = a2ui_agents["0.9.1"]
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    pk = start(page, agent_pk, "xss")
    wait_state(page, "input required")
    # The form to use, not the read-only drawing the page may have loaded with.
    surface = page.wait_for_selector("#a2ui-surfaces .a2ui-surface:has(form.a2ui-form)")
    text = surface.inner_text()
    assert "<script>window.__xss=1</script>" in text  # shown as text
    # Use every part of it: tabs, the modal, the inputs (their checks run the agent's pattern).
    page.locator("#a2ui-surfaces .a2ui-tab").nth(1).click()
    page.locator("#a2ui-surfaces .a2ui-modal summary").click()
    page.locator("#a2ui-surfaces .a2ui-modal-close").click()
    page.locator("#a2ui-surfaces .a2ui-tab").nth(0).click()
    page.fill("#a2ui-surfaces [data-a2ui-id=tf] input", PAYLOAD + "typed")
    page.locator("#a2ui-surfaces [data-a2ui-id=cb] input").check()
    for url in (f"/tasks/{pk}/", "/inbox/", f"/tasks/{pk}/events/"):
        page.goto(url)
        page.wait_for_load_state("load")
        assert page.evaluate("window.__xss === undefined"), url
    page.goto(f"/tasks/{pk}/")
    # The conversation shows the surface too (read-only), escaped.
    assert page.locator("#conversation .a2ui-surface .a2ui-readonly").count() == 1
    page.click("#a2ui-surfaces button.a2ui-button")
    page.wait_for_url(re.compile(rf"/tasks/{pk}/$"))
    wait_until(lambda: any(a.get("name") == PAYLOAD for a in executor.actions()))
    assert page.evaluate("window.__xss === undefined")
    assert dialogs == []
    shot(page, "a2ui-xss")


def test_a_redrawn_surface_keeps_the_open_modal_the_chosen_tab_and_the_typed_text(
    page, stack, a2ui_agents
):
    """The server draws the surface again (the agent changed it, or the task now asks): what
    the person opened, chose and typed stays as they left it."""
    agent_pk, _ = a2ui_agents["0.9.1"]
    start(page, agent_pk, "xss")
    wait_state(page, "input required")
    surfaces = "#a2ui-surfaces .a2ui-surface"
    page.wait_for_selector(f"{surfaces}:has(form.a2ui-form)")
    page.fill(f"{surfaces} [data-a2ui-id=tf] input", "typed by a person")
    page.locator(f"{surfaces} .a2ui-tab").nth(1).click()
    page.locator(f"{surfaces} .a2ui-modal summary").click()
    # As when the drawing changed on the server: the page's copy is out of date.
    page.evaluate(
        """() => {
            const s = document.querySelector('#a2ui-surfaces .a2ui-surface');
            s.dataset.a2uiKey = 'out-of-date';
            s.dataset.drawnBefore = '1';
            window.A2UI.refresh();
        }"""
    )
    page.wait_for_function(
        "() => { const s = document.querySelector('#a2ui-surfaces .a2ui-surface');"
        " return s && !s.dataset.drawnBefore; }"
    )
    assert page.locator(f"{surfaces} details.a2ui-modal").evaluate("d => d.open")
    page.locator(f"{surfaces} .a2ui-modal-close").click()  # visible: the Modal is open
    assert not page.locator(f"{surfaces} details.a2ui-modal").evaluate("d => d.open")
    tabs = page.locator(f"{surfaces} .a2ui-tab")
    assert [tabs.nth(i).get_attribute("aria-selected") for i in range(2)] == ["false", "true"]
    assert page.locator(f"{surfaces} [data-a2ui-id=sl]").is_visible()
    assert page.input_value(f"{surfaces} [data-a2ui-id=tf] input") == "typed by a person"
