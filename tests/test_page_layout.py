"""What a person sees of the pages' layout, found by driving the running dashboard.

- The credential fields of the other kinds stayed visible whatever kind was chosen:
  ``agent.js`` set ``hidden``, but ``.field { display: flex }`` overrode it.
- Table cells broke inside short words ("defa/ult", "Upd/ate/d"): ``overflow-wrap:
  anywhere`` on every cell made a column's least width one letter, so a table gave its
  short columns less than a word.
- ``/accounts/logout/`` opened in the browser answered an empty 405 (Django's view takes
  only POST), which Chromium showed as its own error page.

The browser tests use the daphne server and logged-in Chromium of ``tests.test_ui_resync``.
"""

from __future__ import annotations

import pytest
from django.test import Client

from tests import test_ui_resync
from tests.test_live_view_fixes import in_browser, write_on

server = test_ui_resync.server
context = test_ui_resync.context

# The lines each header cell's text takes: a word broken in two takes two.
HEADER_LINES = """(selector) => [...document.querySelectorAll(selector + ' thead th')].map((th) => {
    const range = document.createRange();
    range.selectNodeContents(th);
    const tops = new Set([...range.getClientRects()].map((r) => Math.round(r.top)));
    return [th.textContent.trim(), tops.size];
})"""


@in_browser
def test_only_the_chosen_kinds_credential_fields_show(context, server):
    task_pk, _ = write_on(server, "tasks", 0)
    page = context.new_page()
    page.goto(f"/tasks/{task_pk}/")
    page.click("main a[href^='/agents/']:not([href='/agents/'])")  # the task's agent
    page.wait_for_selector("#id_kind")
    shown = {}
    for kind in ("bearer", "api-key", "clear"):
        page.select_option("#id_kind", kind)
        shown[kind] = (page.is_visible("#id_token"), page.is_visible("#id_api_key"))
    assert shown == {
        "bearer": (True, False),
        "api-key": (False, True),
        "clear": (False, False),
    }
    page.close()


@in_browser
@pytest.mark.parametrize("width", [1280, 390])
def test_table_headers_are_not_broken_inside_a_word(context, server, width):
    write_on(server, "tasks", 3)
    page = context.new_page()
    page.set_viewport_size({"width": width, "height": 900})
    page.goto("/tasks/")
    page.wait_for_selector("#task-table tbody tr")
    lines = page.evaluate(HEADER_LINES, "#task-table")
    # One word, one line (a header of several words may wrap between them at 390 px).
    broken = [(text, n) for text, n in lines if text and " " not in text and n > 1]
    assert not broken and lines, lines
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    page.close()


@pytest.mark.django_db
def test_the_logout_address_shows_a_page_and_only_its_post_logs_out(django_user_model):
    person = django_user_model.objects.create_user("leaving", password="pw-12345678")
    client = Client()
    client.force_login(person)
    shown = client.get("/accounts/logout/")
    assert shown.status_code == 200
    html = shown.content.decode()
    assert 'id="logout"' in html and "logged in as leaving" in html
    assert 'method="post" action="/accounts/logout/"' in html
    assert client.get("/").status_code == 200  # a GET logs nobody out
    done = client.post("/accounts/logout/")
    assert (done.status_code, done["Location"]) == (302, "/accounts/login/")
    assert client.get("/").status_code == 302  # logged out
    again = client.get("/accounts/logout/")
    assert again.status_code == 200 and "You are not logged in" in again.content.decode()
    assert client.put("/accounts/logout/").status_code == 405


# The lines each cell's text takes, for the cells of the task page's event log.
CELL_LINES = """() => [...document.querySelectorAll('#event-rows tr')].map((tr) =>
    [...tr.children].slice(0, 5).map((td) => {
        const range = document.createRange();
        range.selectNodeContents(td.firstChild || td);
        return [td.textContent.trim(), new Set([...range.getClientRects()].map((r) => Math.round(r.top))).size];
    }))"""


@in_browser
def test_the_event_log_keeps_its_words_whole_on_a_phone(context, server):
    """At 390 px the task page's event log broke seqs ("1/0") and words inside the cells."""
    task_pk, _ = write_on(server, "tasks", 0)
    write_on(server, "behind", [task_pk, 12])
    page = context.new_page()
    page.set_viewport_size({"width": 390, "height": 800})
    page.goto(f"/tasks/{task_pk}/")
    page.wait_for_selector("#event-rows tr[data-seq='13']")
    rows = page.evaluate(CELL_LINES)
    broken = [
        cell for row in rows for cell in row if cell[0] and " " not in cell[0] and cell[1] > 1
    ]
    assert len(rows) >= 13 and not broken, broken
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.close()
