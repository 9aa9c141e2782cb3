"""A2UI surfaces and actions: gaps found by an audit (the agent's surface is untrusted)."""

from __future__ import annotations

import time

import pytest
from django.urls import reverse

from tasks_app import a2ui_render
from tasks_app.models import OperatorAction, RemoteTask
from tests import test_a2ui_render as render_tests
from tests.test_a2ui_render import surface_of, waiting

agent, people = render_tests.agent, render_tests.people  # their fixtures

pytestmark = pytest.mark.django_db


def act_post(client, task: RemoteTask, page: str, **post: str):
    """Post the surface's form as the page drew it (its hidden fields), plus ``post``."""
    hidden = dict(
        a2ui_render.re.findall(
            r'<input type="hidden" name="(surface|seq|inputs)" value="([^"]*)"', page
        )
    )
    return client.post(reverse("task-surface-act", args=[task.pk]), {**hidden, **post}, follow=True)


def test_an_input_the_drawing_cut_off_keeps_the_agents_value(
    agent,
    people,
    no_dispatch,
    django_capture_on_commit_callbacks,
) -> None:
    """Repeated child ids make a drawing stop at its byte budget; the submit's walk, which
    draws nothing, still found the checkbox after the cut and sent it unchecked (the agent's
    ``true`` became ``false``) though the person never saw it."""
    task = waiting(agent)
    components = {
        "root": {"id": "root", "component": "Column", "children": ["go", "big", "agree"]},
        "big": {"id": "big", "component": "Column", "children": ["m"] * 3},
        "m": {"id": "m", "component": "Column", "children": ["t"] * 200},
        "t": {"id": "t", "component": "Text", "text": "x" * 10_000},
        "agree": {"id": "agree", "component": "CheckBox", "label": "ok", "value": {"path": "/ok"}},
        "go": {"id": "go", "component": "Button", "child": "gl", "action": {"event": {"name": "go"}}},
        "gl": {"id": "gl", "component": "Text", "text": "Go"},
    }  # fmt: skip
    surface_of(task, surface_id="cut", components=components, data_model={"ok": True})
    page = people["ann"].get(reverse("task-detail", args=[task.pk])).content.decode()
    assert (
        'name="source" value="b0"' in page and 'name="v0"' not in page
    )  # the checkbox was never shown
    with django_capture_on_commit_callbacks(execute=True):
        resp = act_post(people["ann"], task, page, source="b0")
    assert "Sent to the agent" in resp.content.decode()
    task.refresh_from_db()
    sent = task.outbox["message"]["metadata"]["a2uiClientDataModel"]["surfaces"]["cut"]
    assert sent == {"ok": True}
    assert OperatorAction.objects.filter(action="a2ui-action").count() == 1


def test_a_check_of_an_input_the_drawing_cut_off_does_not_refuse_the_form(
    agent,
    people,
    no_dispatch,
    django_capture_on_commit_callbacks,
) -> None:
    """An input the page never drew kept the agent's value, but its checks still ran on it:
    a failing one refused the form, next to an input the person could not see or fix."""
    task = waiting(agent)
    required = {"condition": {"call": "required", "args": {"value": {"path": "/name"}}},
                "message": "A name is needed."}  # fmt: skip
    components = {
        "root": {"id": "root", "component": "Column", "children": ["go", "big", "name"]},
        "big": {"id": "big", "component": "Column", "children": ["m"] * 3},
        "m": {"id": "m", "component": "Column", "children": ["t"] * 200},
        "t": {"id": "t", "component": "Text", "text": "x" * 10_000},
        "name": {"id": "name", "component": "TextField", "label": "Name",
                 "value": {"path": "/name"}, "checks": [required]},
        "go": {"id": "go", "component": "Button", "child": "gl", "action": {"event": {"name": "go"}}},
        "gl": {"id": "gl", "component": "Text", "text": "Go"},
    }  # fmt: skip
    surface_of(task, surface_id="cut", components=components, data_model={"name": ""})
    page = people["ann"].get(reverse("task-detail", args=[task.pk])).content.decode()
    assert 'name="source" value="b0"' in page and 'name="v0"' not in page
    with django_capture_on_commit_callbacks(execute=True):
        resp = act_post(people["ann"], task, page, source="b0")
    body = resp.content.decode()
    assert "Sent to the agent" in body and "A name is needed." not in body
    task.refresh_from_db()
    assert task.outbox["message"]["metadata"]["a2uiClientDataModel"]["surfaces"]["cut"] == {
        "name": ""
    }


def nested_and(levels: int) -> dict:
    """A check of 2**levels ``required`` calls (levels=12: 393 KB, within a surface's bound)."""
    node: dict = {"call": "required", "args": {"value": {"path": "/x"}}}
    for _ in range(levels):
        node = {"call": "and", "args": {"values": [node, node]}}
    return node


# Calls of ``evaluate`` for one request at most: two budgeted walks (a submit checks the form,
# then the page it leads to draws it; ``a2ui_render.MAX_EVALUATIONS`` each), and the calls made
# after a budget ran out, which return at once (measured: 21,408 calls for the page, 29,393 for
# the submit). Without the budget these surfaces took 11 million.
EVALUATIONS_PER_PAGE = 3 * a2ui_render.MAX_EVALUATIONS


def count_evaluations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of ``a2ui_render.evaluate`` from now on (the module's own calls look it
    up by name, so they are counted too): the work a budget bounds, on any machine."""
    count = [0]
    evaluate = a2ui_render.evaluate

    def counted(*args, **kwargs):
        count[0] += 1
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(a2ui_render, "evaluate", counted)
    return count


def test_a_function_drawn_at_many_repeated_ids_is_evaluated_within_a_budget(
    agent,
    people,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One Text whose text is 8,191 nested calls, drawn at 1,400 repeated ids: the task page
    took 22 s (the inbox and each live refresh too); now the drawing stops evaluating."""
    task = waiting(agent)
    components = {
        "root": {"id": "root", "component": "Column", "children": ["m"] * 7},
        "m": {"id": "m", "component": "Column", "children": ["t"] * 200},
        "t": {"id": "t", "component": "Text", "text": nested_and(12)},
    }
    surface_of(task, surface_id="heavy", components=components, data_model={"x": "a"})
    evaluated = count_evaluations(monkeypatch)
    # The server's CPU (in this process), not the wall clock: under a loaded CI machine the
    # same request took 13 s of wall time for 2.4 s of work.
    start = time.process_time()
    page = people["ann"].get(reverse("task-detail", args=[task.pk])).content.decode()
    took = time.process_time() - start
    # The work itself, the same on any machine: 11 million evaluations without the budget.
    assert 0 < evaluated[0] <= EVALUATIONS_PER_PAGE, evaluated
    assert took < 5
    assert "values and functions evaluated" in page  # said to be drawn in part


def test_checks_of_a_posted_form_are_evaluated_within_a_budget(
    agent,
    people,
    no_dispatch,
    django_capture_on_commit_callbacks,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same nested check on a TextField drawn 1,400 times: one submit took 22 s of the
    server's time. Past the budget a check counts as met (the agent checks what it gets)."""
    task = waiting(agent)
    check = [{"condition": nested_and(12), "message": "no"}]
    components = {
        "root": {"id": "root", "component": "Column", "children": ["go"] + ["m"] * 7},
        "m": {"id": "m", "component": "Column", "children": ["f"] * 200},
        "f": {"id": "f", "component": "TextField", "label": "x", "value": {"path": "/y"},
              "checks": check},
        "go": {"id": "go", "component": "Button", "child": "gl", "action": {"event": {"name": "go"}}},
        "gl": {"id": "gl", "component": "Text", "text": "Go"},
    }  # fmt: skip
    surface = surface_of(task, surface_id="heavy", components=components, data_model={"x": "a"})
    evaluated = count_evaluations(monkeypatch)
    start = time.process_time()  # the server's CPU, as above
    with django_capture_on_commit_callbacks(execute=True):
        resp = people["ann"].post(
            reverse("task-surface-act", args=[task.pk]),
            {"surface": "heavy", "seq": str(surface.updated_seq), "source": "b0"},
            follow=True,
        )
    took = time.process_time() - start
    assert 0 < evaluated[0] <= EVALUATIONS_PER_PAGE, evaluated
    assert took < 5
    assert "Sent to the agent" in resp.content.decode()


def test_a_check_within_the_budget_still_refuses() -> None:
    """The budget does not weaken a real form's checks: a failing one still fails."""
    check = [{"condition": nested_and(4), "message": "Required."}]
    with a2ui_render.evaluation_budget():
        assert a2ui_render.check_failures(check, {"x": ""}) == ["Required."]
        assert a2ui_render.check_failures(check, {"x": "a"}) == []
