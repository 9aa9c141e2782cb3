"""A2UI surfaces drawn by the server (tasks_app/a2ui_render.py) and acted on
(services/a2ui_actions.py), through the pages and Django's test client.

Surfaces here are rows as the fold writes them (v0.9.1 basic-catalog form); the fold itself
and real agents are in the protocol tests and tests/test_a2ui_browser.py. The watcher
dispatch is stubbed: "sent" is read from the task's outbox and the log.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from typing import Any

import pytest
from django.http import QueryDict
from django.test import Client
from django.urls import reverse

from tasks_app import a2ui_render
from tasks_app.a2a import a2ui
from tasks_app.models import Agent, Membership, OperatorAction, Project, RemoteTask, Surface
from tasks_app.redaction import HIDDEN
from tasks_app.services import a2ui_actions
from tasks_app.services.record import record
from tests.people import member

pytestmark = pytest.mark.django_db

XSS = '<script>window.__xss=1</script><img src=x onerror="window.__xss=1">"\'><svg onload=alert(1)>'


def booking_components(s: str = "") -> dict[str, dict]:
    """Every component of the basic catalog, in a booking form; ``s`` goes into every string."""
    comps = [
        {"id": "root", "component": "Column", "children": ["title", "row", "tabs", "card", "go"]},
        {"id": "title", "component": "Text", "text": f"# Book a table {s}", "variant": "h2"},
        {"id": "row", "component": "Row", "children": ["icon", "img", "div", "vid", "aud"],
         "justify": "spaceBetween", "align": "center"},
        {"id": "icon", "component": "Icon", "name": "calendarToday"},
        {"id": "img", "component": "Image", "url": "https://example.org/a.png", "description": f"A picture {s}"},
        {"id": "div", "component": "Divider", "axis": "vertical"},
        {"id": "vid", "component": "Video", "url": "https://example.org/v.mp4"},
        {"id": "aud", "component": "AudioPlayer", "url": "https://example.org/a.mp3", "description": f"Sound {s}"},
        {"id": "tabs", "component": "Tabs", "tabs": [
            {"title": f"Details {s}", "child": "form"},
            {"title": "Menu", "child": "menu"},
        ]},
        {"id": "form", "component": "Column", "children": ["name", "date", "size", "seat", "terms"]},
        {"id": "name", "component": "TextField", "label": f"Name {s}", "value": {"path": "/booking/name"},
         "checks": [{"condition": {"call": "required", "args": {"value": {"path": "/booking/name"}}},
                     "message": f"Name is required {s}"}]},
        {"id": "date", "component": "DateTimeInput", "label": "Date", "enableDate": True,
         "value": {"path": "/booking/date"}},
        {"id": "size", "component": "Slider", "label": "Party size", "min": 1, "max": 12,
         "value": {"path": "/booking/size"}},
        {"id": "seat", "component": "ChoicePicker", "label": f"Seating {s}", "value": {"path": "/booking/seat"},
         "options": [{"label": f"Inside {s}", "value": "inside"}, {"label": "Terrace", "value": "terrace"}]},
        {"id": "terms", "component": "CheckBox", "label": f"I accept {s}", "value": {"path": "/booking/terms"}},
        {"id": "menu", "component": "List", "children": {"componentId": "dish", "path": "/menu"}},
        {"id": "dish", "component": "Text", "text": {"path": "name"}},
        {"id": "card", "component": "Card", "child": "modal"},
        {"id": "modal", "component": "Modal", "trigger": "more", "content": "more_text"},
        {"id": "more", "component": "Button", "child": "more_label", "action": {"event": {"name": "noop"}}},
        {"id": "more_label", "component": "Text", "text": f"More {s}"},
        {"id": "more_text", "component": "Text", "text": {"path": "/booking/name"}},
        {"id": "go", "component": "Button", "child": "go_label", "variant": "primary",
         "action": {"event": {"name": "book", "context": {
             "who": {"path": "/booking/name"}, "size": {"path": "/booking/size"}, "fixed": s or "x"}}}},
        {"id": "go_label", "component": "Text", "text": f"Book {s}"},
    ]  # fmt: skip
    return {c["id"]: c for c in comps}


def booking_model(s: str = "") -> dict:
    return {
        "booking": {"name": f"Ada {s}", "date": "2026-12-24", "size": 4, "seat": ["terrace"]},
        "menu": [{"name": f"Soup {s}"}, {"name": "Pie"}],
    }


@pytest.fixture
def agent(db) -> Agent:
    return Agent.objects.create(
        project=Project.objects.get_or_create(name="alpha")[0], name="alpha agent",
        base_url="http://127.0.0.1:9/alpha", interface_url="http://127.0.0.1:9/alpha/rpc",
        binding="JSONRPC",
    )  # fmt: skip


def waiting(agent: Agent, title: str = "booking") -> RemoteTask:
    task = RemoteTask.objects.create(agent=agent, title=title)
    record(task, {"task": {"id": f"t-{title}", "contextId": "c", "status": {"state": "TASK_STATE_WORKING"}}}, "poll")  # fmt: skip
    record(
        task,
        {"statusUpdate": {"taskId": f"t-{title}", "contextId": "c", "status": {
            "state": "TASK_STATE_INPUT_REQUIRED",
            "message": {"messageId": f"q-{title}", "role": "ROLE_AGENT", "parts": [{"text": "Book?"}]},
        }}},
        "poll",
    )  # fmt: skip
    task.refresh_from_db()
    return task


def surface_of(task: RemoteTask, s: str = "", **fields: Any) -> Surface:
    surface_id = fields.pop("surface_id", "booking")
    values = {
        "version": "0.9.1",
        "components": booking_components(s),
        "data_model": booking_model(s),
        "ready": True,
        "root_id": "root",
        "updated_seq": task.last_seq,
        **fields,
    }
    return Surface.objects.create(task=task, surface_id=surface_id, **values)


@pytest.fixture
def people(django_user_model, agent) -> dict[str, Client]:
    out = {}
    for name, role in (("ann", Membership.Role.OPERATOR), ("bob", Membership.Role.OPERATOR),
                       ("vic", Membership.Role.VIEWER)):  # fmt: skip
        user = member(
            django_user_model.objects.create_user(name, password="pw-12345678"), role, "alpha"
        )
        out[name] = Client()
        out[name].force_login(user)
    return out


class Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parse(html: str) -> Tags:
    p = Tags()
    p.feed(html)
    return p


def assert_inert(html: str) -> None:
    """No script but our static files, no handlers, no images or frames, no javascript: URL."""
    for tag, attrs in parse(html).tags:
        if tag == "script":
            assert (attrs.get("src") or "").startswith("/static/"), attrs
        assert tag not in ("img", "iframe", "object", "embed", "style", "video", "audio"), tag
        for name, value in attrs.items():
            assert not name.startswith("on"), (tag, name, value)
            if name in ("href", "src", "action", "formaction"):
                assert not (value or "").strip().lower().startswith(("javascript:", "data:"))


def draw(surface: Surface, **kw: Any) -> str:
    return str(a2ui_render.render_surface(surface, task=surface.task, **kw))


# Drawing --------------------------------------------------------------------------------------


def test_every_basic_catalog_component_is_drawn_with_its_bindings(agent) -> None:
    task = waiting(agent)
    html = draw(surface_of(task))
    tags = parse(html)
    ids = {a.get("data-a2ui-id") for _, a in tags.tags}
    drawn_kinds = {c["component"] for c in booking_components().values() if c["id"] in ids}
    # every component of the catalog is in the fixture; all are drawn (the Modal's Button
    # trigger is drawn as the modal's opener, its label inside)
    assert drawn_kinds >= set(a2ui_render.KNOWN) - {"Button"} | {"Button"}
    assert "placeholder" not in html
    by_name = {a.get("name"): (t, a) for t, a in tags.tags if a.get("name")}
    assert (
        by_name["v0"][1]["value"] == "Ada "
        and by_name["v0"][1]["data-a2ui-path"] == "/booking/name"
    )
    assert by_name["v1"][1]["type"] == "date" and by_name["v1"][1]["value"] == "2026-12-24"
    assert by_name["v2"][1]["type"] == "range" and by_name["v2"][1]["value"] == "4"
    radios = [a for t, a in tags.tags if a.get("name") == "v3"]
    assert [(r["value"], "checked" in r) for r in radios] == [("inside", False), ("terrace", True)]
    assert by_name["v4"][1]["type"] == "checkbox" and "checked" not in by_name["v4"][1]
    # a template over a list: relative paths resolve per item
    text = "".join(tags.text)
    assert "Soup" in text and "Pie" in text
    # a Text bound to a path is marked for the page's script; the markdown is rendered
    assert 'data-a2ui-bind="/booking/name"' in html and "<h1>Book a table" in html
    # media are links, not loaded; the send button names its instance
    assert '<a href="https://example.org/a.png"' in html
    assert by_name["source"][1]["value"] == "b0" and by_name["source"][0] == "button"
    # checks are handed to the script as JSON (escaped in the attribute)
    field = next(a for _, a in tags.tags if a.get("data-a2ui-id") == "name")
    assert json.loads(field["data-a2ui-checks"])[0]["message"] == "Name is required "


def test_unknown_missing_cyclic_and_too_deep_components_are_labelled(agent) -> None:
    task = waiting(agent)
    deep = {
        f"c{i}": {"id": f"c{i}", "component": "Column", "children": [f"c{i + 1}"]}
        for i in range(40)
    }
    comps = {
        "root": {"id": "root", "component": "Column", "children": ["odd", "gone", "loop", "c0"]},
        "odd": {"id": "odd", "component": "Chart", "series": "<b>x</b>"},
        "loop": {"id": "loop", "component": "Card", "child": "loop"},
        **deep,
    }
    html = draw(surface_of(task, components=comps))
    assert "Unknown component: Chart" in html and "&lt;b&gt;x&lt;/b&gt;" in html
    assert "Missing component: gone" in html
    assert "contains itself" in html
    assert f"nested deeper than {a2ui_render.MAX_DEPTH} levels" in html


def test_a_surface_with_a_problem_shows_the_notice_and_the_page_keeps_working(
    agent, people
) -> None:
    task = waiting(agent)
    raw = {"version": "v0.9", "updateComponents": {"surfaceId": "bad", "components": XSS}}
    surface_of(
        task, surface_id="bad", problem="/updateComponents/components: not an array", raw_json=raw
    )
    surface_of(task, surface_id="good")
    page = people["ann"].get(reverse("task-detail", args=[task.pk]))
    html = page.content.decode()
    assert page.status_code == 200
    assert "Could not render this surface:" in html and "not an array" in html
    assert "&lt;script&gt;window.__xss=1&lt;/script&gt;" in html  # the raw JSON, escaped
    assert 'data-a2ui-surface="good"' in html and 'id="answer-form"' in html
    assert_inert(html)


def test_xss_in_every_string_field_stays_text(agent, people) -> None:
    task = waiting(agent)
    comps = booking_components(XSS)
    comps["img"]["url"] = "javascript:alert(1)"
    comps["title"]["variant"] = XSS
    comps["icon"]["name"] = {"svgPath": '"><script>alert(1)</script>'}
    comps[XSS] = {"id": XSS, "component": XSS, "x": XSS}
    comps["root"]["children"].append(XSS)
    surface_of(task, s=XSS, components=comps, styles={"agentDisplayName": XSS}, surface_id=XSS)
    for url in (reverse("task-detail", args=[task.pk]), reverse("inbox"),
                reverse("task-surfaces", args=[task.pk]) + "?place=inbox"):  # fmt: skip
        html = people["ann"].get(url).content.decode()
        assert 'data-a2ui-surface="&lt;script&gt;' in html, url
        assert_inert(html)
        assert "<script>window.__xss" not in html and "<svg onload" not in html
    assert "Image not shown (not an http(s) link" in html


def test_functions_and_checks() -> None:
    model = {"a": {"n": 5, "s": "abc", "list": [{"x": "one"}, {"x": "two"}]}, "mail": "a@b.co"}
    ev = a2ui_render.evaluate
    assert (
        ev(
            {"call": "formatString", "args": {"value": "n=${/a/n} x=${x} \\${k}"}},
            model,
            "/a/list/1",
        )
        == "n=5 x=two ${k}"
    )
    assert (
        ev({"call": "numeric", "args": {"value": {"path": "/a/n"}, "min": 1, "max": 4}}, model)
        is False
    )
    assert ev({"call": "length", "args": {"value": {"path": "/a/s"}, "max": 3}}, model) is True
    assert ev({"call": "email", "args": {"value": {"path": "/mail"}}}, model) is True
    assert (
        ev(
            {"call": "and", "args": {"values": [True, {"call": "not", "args": {"value": False}}]}},
            model,
        )
        is True
    )
    assert (
        ev({"call": "formatNumber", "args": {"value": 1234.5, "decimals": 1}}, model) == "1,234.5"
    )
    assert (
        ev(
            {
                "call": "formatDate",
                "args": {"value": "2026-12-24T19:30:00Z", "format": "EEEE d MMM yyyy, HH:mm"},
            },
            model,
        )
        == "Thursday 24 Dec 2026, 19:30"
    )
    assert (
        ev({"call": "pluralize", "args": {"value": 1, "one": "guest", "other": "guests"}}, model)
        == "guest"
    )
    assert a2ui_render.regex_matches("12345", "^[0-9]{5}$") and not a2ui_render.regex_matches(
        "1234", "^[0-9]{5}$"
    )
    # patterns that could backtrack without end are not run here (they pass)
    assert a2ui_render.regex_matches("a" * 5000 + "!", "^(a+)+$")
    assert not a2ui_render.usable_pattern("\\d*\\d*\\d*x", 10)
    rules = [
        {"condition": {"call": "required", "args": {"value": {"path": "/none"}}}, "message": "need it"},
        {"call": "regex", "args": {"value": {"path": "/a/s"}, "pattern": "^z"}, "message": "z first"},
        {"condition": {"call": "somethingElse"}, "message": "unknown passes"},
    ]  # fmt: skip
    assert a2ui_render.check_failures(rules, model) == ["need it", "z first"]


# Acting ---------------------------------------------------------------------------------------


def post_values(surface: Surface, **extra: Any) -> dict:
    return {"surface": surface.surface_id, "seq": str(surface.updated_seq), "source": "b0",
            "v0": "Grace", "v1": "2026-12-31", "v2": "6", "v3": "inside", "v4": "on", **extra}  # fmt: skip


def posted(surface: Surface) -> QueryDict:
    """``post_values`` as the view hands them to the service."""
    post = QueryDict(mutable=True)
    post.update(post_values(surface))
    return post


def test_a_button_sends_the_action_with_the_entered_values(
    agent, people, no_dispatch, django_capture_on_commit_callbacks
) -> None:
    task = waiting(agent)
    surface = surface_of(task)
    with django_capture_on_commit_callbacks(execute=True):
        resp = people["ann"].post(reverse("task-surface-act", args=[task.pk]), post_values(surface))
    assert resp.status_code == 302
    task.refresh_from_db()
    message = task.outbox["message"]
    assert message["taskId"] == "t-booking" and message["contextId"] == "c"
    part = message["parts"][0]
    assert part["mediaType"] == "application/a2ui+json"
    action = part["data"][0]["action"]
    assert action["name"] == "book" and action["surfaceId"] == "booking"
    assert action["sourceComponentId"] == "go"
    assert action["context"] == {"who": "Grace", "size": 6, "fixed": "x"}
    entered = message["metadata"]["a2uiClientDataModel"]["surfaces"]["booking"]["booking"]
    assert entered == {
        "name": "Grace",
        "date": "2026-12-31",
        "size": 6,
        "seat": ["inside"],
        "terms": True,
    }
    surface.refresh_from_db()
    assert surface.action_by.username == "ann" and surface.action_name == "book"
    op = OperatorAction.objects.get(task=task, action="a2ui-action")
    assert op.actor.username == "ann" and op.payload["surface"] == "booking"
    assert no_dispatch == [task.pk]
    html = people["bob"].get(reverse("task-detail", args=[task.pk])).content.decode()
    assert "Submitted</b> (book) by ann" in html
    # the second person is told who won; nothing else is sent
    resp = people["bob"].post(
        reverse("task-surface-act", args=[task.pk]), post_values(surface), follow=True
    )
    assert "Already submitted by ann" in resp.content.decode()
    assert OperatorAction.objects.filter(action="a2ui-action").count() == 1


def test_checks_stale_forms_and_roles_are_refused(agent, people, no_dispatch) -> None:
    task = waiting(agent)
    surface = surface_of(task)
    url = reverse("task-surface-act", args=[task.pk])
    resp = people["ann"].post(url, post_values(surface, v0="", v1="2027-01-02"))
    html = resp.content.decode()
    assert resp.status_code == 400  # the page again: what was typed, the failing check by its input
    errors = re.search(r'data-a2ui-errors-for="v0" role="alert">([^<]*)<', html)
    assert errors and "Name is required" in errors.group(1)
    assert 'name="v1" type="date" value="2027-01-02"' in html
    resp = people["ann"].post(
        url, post_values(surface, seq=str(surface.updated_seq - 1)), follow=True
    )
    assert "changed this form since" in resp.content.decode()
    assert people["vic"].post(url, post_values(surface)).status_code == 403
    task.refresh_from_db()
    assert not task.outbox and no_dispatch == []
    # a value outside the options is not taken
    people["ann"].post(url, post_values(surface, v3="<evil>"))
    task.refresh_from_db()
    model = task.outbox["message"]["metadata"]["a2uiClientDataModel"]["surfaces"]["booking"]
    assert model["booking"]["seat"] == []


def test_a_refused_form_sent_from_the_inbox_keeps_what_was_typed(
    agent, people, no_dispatch
) -> None:
    """The inbox's form posts with next=/inbox/: a failing check drew the form again there
    only for the task page, and from the inbox a redirect lost what had been typed."""
    task = waiting(agent)
    surface = surface_of(task)
    url = reverse("task-surface-act", args=[task.pk])
    inbox = reverse("inbox")
    resp = people["ann"].post(url, post_values(surface, v0="", v1="2027-01-02", next=inbox))
    html = resp.content.decode()
    assert resp.status_code == 400
    errors = re.search(r'data-a2ui-errors-for="v0" role="alert">([^<]*)<', html)
    assert errors and "Name is required" in errors.group(1)
    assert 'name="v1" type="date" value="2027-01-02"' in html
    assert f'name="next" value="{inbox}"' in html  # corrected, it goes back to the inbox
    task.refresh_from_db()
    assert not task.outbox and no_dispatch == []
    resp = people["ann"].post(url, post_values(surface, next=inbox))
    assert resp.status_code == 302 and resp["Location"] == inbox


def test_a_surface_drawn_while_working_is_replaced_once_the_task_asks(agent, people) -> None:
    """The page's script keeps a surface whose key did not change. A surface that arrived while
    the task was still working was drawn read-only; when the task then asked for input, the same
    key kept the read-only drawing, and nobody could fill the form until a reload (seen in CI)."""
    task = waiting(agent)
    surface_of(task)
    RemoteTask.objects.filter(pk=task.pk).update(state="TASK_STATE_WORKING")
    url = reverse("task-surfaces", args=[task.pk])
    working = people["ann"].get(url).content.decode()
    RemoteTask.objects.filter(pk=task.pk).update(state="TASK_STATE_INPUT_REQUIRED")
    asking = people["ann"].get(url).content.decode()

    def key(html: str) -> str:
        found = re.search(r'data-a2ui-key="([^"]*)"', html)
        assert found, html[:500]
        return found.group(1)

    assert 'name="v0"' in working and 'name="v0"' in asking
    assert re.search(r'name="v0"[^>]* disabled', working)
    assert not re.search(r'name="v0"[^>]* disabled', asking)
    assert key(working) != key(asking)


def test_one_action_per_surface_state_in_the_service(agent, django_user_model, no_dispatch) -> None:
    task = waiting(agent)
    surface = surface_of(task)
    ann = member(django_user_model.objects.create_user("ann2"), Membership.Role.OPERATOR, "alpha")
    bob = member(django_user_model.objects.create_user("bob2"), Membership.Role.OPERATOR, "alpha")

    post = posted(surface)
    with pytest.raises(a2ui_actions.ActionRefused, match="does not send"):
        a2ui_actions.act(bob, task, "booking", surface.updated_seq, "b9", post)
    a2ui_actions.act(ann, task, "booking", surface.updated_seq, "b0", post)
    with pytest.raises(a2ui_actions.AlreadySubmitted, match=r"Already submitted by ann2"):
        a2ui_actions.act(bob, task, "booking", surface.updated_seq, "b0", post)
    # a new state of the surface (the agent drew it again) takes a new action
    Surface.objects.filter(pk=surface.pk).update(updated_seq=surface.updated_seq + 5)
    RemoteTask.objects.filter(pk=task.pk).update(
        asked_seq=task.asked_seq + 5, state="TASK_STATE_INPUT_REQUIRED"
    )
    task.refresh_from_db()
    a2ui_actions.act(bob, task, "booking", surface.updated_seq + 5, "b0", post)
    surface.refresh_from_db()
    assert surface.action_by == bob and surface.action_seq == surface.updated_seq


def test_an_anonymous_user_cannot_act_as_the_system(agent, no_dispatch) -> None:
    """The services' check takes a missing actor for the system: an anonymous user's pk,
    None, passed it. Every view asks for a login first; the service refuses all the same."""
    from django.contrib.auth.models import AnonymousUser

    from tasks_app.access import Forbidden

    task = waiting(agent)
    surface = surface_of(task)
    post = posted(surface)
    with pytest.raises(Forbidden):
        a2ui_actions.act(AnonymousUser(), task, "booking", surface.updated_seq, "b0", post)
    assert not OperatorAction.objects.filter(task=task).exists() and no_dispatch == []


def test_an_action_that_loses_to_another_on_the_same_form_says_whose_won(
    agent, django_user_model, no_dispatch, monkeypatch
) -> None:
    """Two people submit the same form at once: both pass the first checks, then the
    winner's answer takes the task's row. Since the action takes the task's row before its
    claim on the form, the loser was told "Already answered by ..." as if someone had used
    the answer form; it is the other person's action on this form, and it says so."""
    task = waiting(agent)
    surface = surface_of(task)
    ann = member(django_user_model.objects.create_user("ann4"), Membership.Role.OPERATOR, "alpha")
    bob = member(django_user_model.objects.create_user("bob4"), Membership.Role.OPERATOR, "alpha")

    from tasks_app import a2ui_render

    post = posted(surface)
    real = a2ui_render.apply_post

    def ann_submits_meanwhile(*args: Any) -> Any:
        monkeypatch.setattr(a2ui_render, "apply_post", real)
        a2ui_actions.act(ann, RemoteTask.objects.get(pk=task.pk), "booking",
                         surface.updated_seq, "b0", post)  # fmt: skip
        return real(*args)

    monkeypatch.setattr(a2ui_render, "apply_post", ann_submits_meanwhile)
    with pytest.raises(a2ui_actions.AlreadySubmitted, match=r"^Already submitted by ann4 at "):
        a2ui_actions.act(bob, task, "booking", surface.updated_seq, "b0", post)
    assert OperatorAction.objects.filter(task=task, action="a2ui-action").count() == 1


@pytest.mark.django_db(transaction=True)
def test_an_action_racing_the_agents_change_of_its_form_is_refused_as_changed(
    agent, django_user_model, no_dispatch
) -> None:
    """The agent changes the form while a person submits it. On PostgreSQL the two took the
    task's and the surface's rows in opposite orders and waited for each other until one was
    aborted as a deadlock (an error page, or a watcher's batch not recorded); elsewhere the
    person read "Already submitted by a command-line user". The recorder here pauses holding
    the task's row until the action has written, or for half a second if it cannot."""
    import threading

    from django.db import connection

    from tests.a2ui_agents import form_091

    task = waiting(agent)
    media = a2ui.MEDIA_TYPE_OF["0.9.1"]
    status = {"state": "TASK_STATE_INPUT_REQUIRED", "message": {
        "messageId": "a2ui-form", "role": "ROLE_AGENT",
        "parts": [{"data": form_091(), "metadata": {"mimeType": media}}]}}  # fmt: skip
    record(
        task, {"statusUpdate": {"taskId": "t-booking", "contextId": "c", "status": status}}, "poll"
    )
    task.refresh_from_db()
    surface = Surface.objects.get(task=task, surface_id="form")
    ann = member(django_user_model.objects.create_user("ann3"), Membership.Role.OPERATOR, "alpha")
    post = QueryDict(mutable=True)
    post.update({"surface": "form", "seq": str(surface.updated_seq), "source": "b0",
                 "v0": "Lin", "v1": "3", "v2": "fish", "v3": "on"})  # fmt: skip
    change = form_091()[2]
    change["updateDataModel"]["value"]["question"] = "Who is coming, and when?"
    news = {"message": {"messageId": "a2ui-change", "role": "ROLE_AGENT", "contextId": "c",
                        "parts": [{"data": [change], "metadata": {"mimeType": media}}]}}  # fmt: skip
    holding, action_wrote = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def hold_the_task_row(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if sql.startswith('UPDATE "tasks_app_remotetask"') and "last_seq" in sql:
            holding.set()
            action_wrote.wait(0.5)
        return result

    def agent_changes_the_form() -> None:
        try:
            with connection.execute_wrapper(hold_the_task_row):
                outcome["recorded"] = record(task.pk, news, "stream")
        except Exception as exc:
            outcome["recorded"] = exc
        finally:
            connection.close()

    def note_the_first_write(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if sql.startswith("UPDATE"):
            action_wrote.set()
        return result

    recorder = threading.Thread(target=agent_changes_the_form)
    recorder.start()
    assert holding.wait(10)
    with (
        connection.execute_wrapper(note_the_first_write),
        pytest.raises(a2ui_actions.ActionRefused) as refused,
    ):
        a2ui_actions.act(ann, task, "form", surface.updated_seq, "b0", post)
    recorder.join(10)
    assert "The agent changed this form since it was shown" in str(refused.value)
    assert not isinstance(outcome["recorded"], Exception), outcome["recorded"]
    assert outcome["recorded"].seqs  # the agent's change is in the log
    surface.refresh_from_db()
    task.refresh_from_db()
    assert surface.updated_seq > int(post["seq"]) and surface.action_seq is None
    assert task.outbox is None and not OperatorAction.objects.filter(task=task).exists()


def test_the_conversation_shows_the_surface_its_message_carried(agent, people) -> None:
    task = waiting(agent)
    surface_of(task, surface_id="conv-form")
    msg = {"messageId": "m-a2ui", "role": "ROLE_AGENT", "parts": [
        {"data": [{"version": "v0.9", "createSurface": {"surfaceId": "conv-form", "catalogId": "x"}}],
         "mediaType": "application/a2ui+json"}]}  # fmt: skip
    record(task, {"message": {**msg, "taskId": "t-booking", "contextId": "c"}}, "poll")
    html = people["ann"].get(reverse("task-detail", args=[task.pk])).content.decode()
    conv = html[html.index('id="conversation"') :]
    assert re.search(r'class="a2ui-surface" id="a2ui-conv\d+-', conv)
    assert "a2ui-readonly" in conv


def test_the_conversation_draws_the_latest_named_surfaces_up_to_the_page_limit(
    agent, people, monkeypatch
) -> None:
    """Fifty surfaces named in the conversation were all drawn (besides twenty in the
    progress section): a task page of 15 s. The most recently named are drawn, as many as
    SURFACES_ON_PAGE."""
    from tasks_app import views_a2ui

    monkeypatch.setattr(views_a2ui, "SURFACES_ON_PAGE", 3)
    task = waiting(agent)
    for n in range(6):
        surface_of(task, surface_id=f"s{n}")
        msg = {"messageId": f"m-{n}", "role": "ROLE_AGENT", "parts": [
            {"data": [{"version": "v0.9", "createSurface": {"surfaceId": f"s{n}", "catalogId": "x"}}],
             "mediaType": "application/a2ui+json"}]}  # fmt: skip
        record(task, {"message": {**msg, "taskId": "t-booking", "contextId": "c"}}, "poll")
    html = people["ann"].get(reverse("task-detail", args=[task.pk])).content.decode()
    conv = html[html.index('id="conversation"') :]
    drawn = re.findall(r'id="a2ui-conv\d+-[^"]*" data-a2ui-surface="([^"]+)"', conv)
    assert sorted(set(drawn)) == ["s3", "s4", "s5"], drawn


@pytest.mark.parametrize("version", ["0.8", "0.9.1"])
def test_a_folded_surface_of_each_version_is_drawn_and_acted_on(
    agent, people, no_dispatch, version
) -> None:
    """Surfaces built by the A2UI SDK models (tests/a2ui_agents.py), folded by record()."""
    from tests.a2ui_agents import form_08, form_091  # the SDKs: when the test runs

    task = waiting(agent)
    media = a2ui.MEDIA_TYPE_OF[version]
    messages = form_08() if version == "0.8" else form_091()
    part = {"data": messages, "metadata": {"mimeType": media}}
    record(
        task,
        {"statusUpdate": {"taskId": "t-booking", "contextId": "c", "status": {
            "state": "TASK_STATE_INPUT_REQUIRED",
            "message": {"messageId": f"a2ui-{version}", "role": "ROLE_AGENT",
                        "parts": [{"text": "Who?"}, part]}}}},
        "poll",
    )  # fmt: skip
    task.refresh_from_db()
    surface = Surface.objects.get(task=task, surface_id="form")
    assert surface.problem == "" and surface.ready
    html = people["ann"].get(reverse("task-detail", args=[task.pk])).content.decode()
    assert 'data-a2ui-path="/answer/name"' in html and "Who is coming?" in html
    post = {"surface": "form", "seq": str(surface.updated_seq), "source": "b0",
            "v0": "Lin", "v1": "3", "v2": "fish", "v3": "on"}  # fmt: skip
    people["ann"].post(reverse("task-surface-act", args=[task.pk]), post)
    task.refresh_from_db()
    sent = task.outbox["message"]["parts"][0]
    body = sent["data"]["userAction"] if version == "0.8" else sent["data"][0]["action"]
    assert body["context"] == {"name": "Lin", "guests": 3, "meal": ["fish"], "ok": True}
    assert sent["mediaType"] == media


# Numbers that str.isdigit() takes and int() does not -----------------------------------------


def test_a_pointer_with_a_digit_int_refuses_draws_as_missing_and_the_pages_keep_working(
    agent, people
) -> None:
    """ "²" is a digit to ``isdigit()``, not to ``int()``: it raised in the drawing, and the task
    page and everyone's inbox answered 500 while the task waited."""
    task = waiting(agent)
    components = {
        "root": {"id": "root", "component": "Column", "children": ["t1", "t2"]},
        "t1": {"id": "t1", "component": "Text",
               "text": {"call": "formatString", "args": {"value": "first: ${/a/²} end"}}},
        "t2": {"id": "t2", "component": "Text", "text": {"path": "/a/" + "9" * 5000}},
    }  # fmt: skip
    surface_of(task, surface_id="digits", components=components, data_model={"a": [1]})
    page = people["ann"].get(reverse("task-detail", args=[task.pk]))
    assert page.status_code == 200
    html = page.content.decode()
    assert 'data-a2ui-surface="digits"' in html and "first:" in html and "end" in html
    assert people["ann"].get(reverse("inbox")).status_code == 200
    assert a2ui.lookup({"a": [1]}, "/a/²") == (False, None)
    assert a2ui.lookup({"a": [1]}, "/a/0") == (True, 1)


def test_a_posted_seq_or_question_int_refuses_is_an_incomplete_form_not_a_500(
    agent, people, no_dispatch
) -> None:
    task = waiting(agent)
    surface = surface_of(task)
    for seq in ("²", "9" * 5000, "-1", ""):
        resp = people["ann"].post(
            reverse("task-surface-act", args=[task.pk]), post_values(surface, seq=seq), follow=True
        )
        assert resp.status_code == 200, seq
        assert "This form is incomplete; reload the page." in resp.content.decode(), seq
    prefix = f"t{task.pk}"
    for question in ("²", "9" * 5000):
        resp = people["ann"].post(
            reverse("task-answer", args=[task.pk]),
            {f"{prefix}-question": question, f"{prefix}-text": "yes"},
        )
        # The form drawn again with its error (400), as for any invalid answer.
        assert resp.status_code == 400, question
        assert 'id="answer-form"' in resp.content.decode(), question
    assert not OperatorAction.objects.filter(action="a2ui-action").exists()


@pytest.mark.parametrize("crafted", ["task-list", "-1", "https://elsewhere.example/", "//x"])
def test_a_next_that_is_no_path_of_this_site_goes_back_to_the_task(
    agent, people, no_dispatch, crafted
) -> None:
    """``next`` is text from the form: a view name ("task-list") or a word ("-1") made
    redirect() look it up and fail (500); another site is never where a button leads."""
    task = waiting(agent)
    surface = surface_of(task)
    url = reverse("task-surface-act", args=[task.pk])
    resp = people["ann"].post(url, post_values(surface, seq="", next=crafted))
    assert resp.status_code == 302 and resp["Location"] == reverse("task-detail", args=[task.pk])
    resp = people["ann"].post(url, post_values(surface, next=crafted))
    assert resp.status_code == 302 and resp["Location"] == reverse("task-detail", args=[task.pk])
    task.refresh_from_db()
    assert task.outbox  # the action itself went ahead


# What an agent's surface may make the server and the page do (found by a probe) -------------


@pytest.mark.parametrize(
    ("pattern", "usable"),
    [
        ("a?" * 30 + "a" * 30, False),  # exponential with ``?`` alone
        ("\\d*\\d*\\d*\\d*\\d*x", False),
        ("(?:ab)?c*d+", False),  # three quantifiers: ``(?`` itself is not one
        ("^[A-Z]{2}[0-9]+$", True),
        ("(?:ab)c+", True),
    ],
)
def test_only_patterns_that_cannot_backtrack_for_long_are_run(pattern, usable) -> None:
    assert a2ui_render.usable_pattern(pattern, 30) is usable


@pytest.mark.timeout(60)
def test_a_pattern_that_hides_its_repeat_is_still_checked_within_a_time_bound() -> None:
    """Verbose mode (``(?x)``) hides a group's quantifier behind a comment: ``(a|aa)#\\n+$`` is
    ``(a|aa)+$``, exponential, and passed the shape checks (34 characters: 4.6 s a check, on
    every post of the surface, 1.6 times as long a character more)."""
    import time

    pattern = "(?x)(a|aa)#\n+$"
    assert a2ui_render.usable_pattern(pattern, 40)  # the shape checks do not see it
    started = time.monotonic()
    assert a2ui_render.regex_matches("a" * 40 + "!", pattern) is True  # not known: not a failure
    assert time.monotonic() - started < 2
    assert a2ui_render.regex_matches("abc", "^[0-9]+$") is False
    assert a2ui_render.regex_matches("123", "^[0-9]+$") is True


@pytest.mark.timeout(30)
def test_a_surface_whose_pattern_backtracks_is_drawn_without_running_it(agent, people) -> None:
    """``a?``*n ``a``*n on n ``a``: the repeat count ignored ``?``, and each draw ran it (n=27
    took 3.7 s, n=33 four minutes), on the task page and the inbox of every viewer. The page's
    script is not given such a pattern either (it hung a viewer's tab on the agent's value)."""
    task = waiting(agent)
    n = 40
    components = {
        "root": {"id": "root", "component": "Column", "children": ["t", "f"]},
        "t": {"id": "t", "component": "Text", "text": {"call": "regex", "args": {
            "value": {"path": "/v"}, "pattern": "a?" * n + "a" * n}}},
        "f": {"id": "f", "component": "TextField", "label": "code", "value": {"path": "/d"},
              "validationRegexp": "\\d*\\d*\\d*\\d*\\d*x"},
    }  # fmt: skip
    surface_of(
        task, surface_id="r", components=components, data_model={"v": "a" * n, "d": "1" * 300}
    )
    page = people["vic"].get(reverse("task-surfaces", args=[task.pk])).content.decode()
    assert 'data-a2ui-id="t"' in page and 'data-a2ui-id="f"' in page
    assert "data-a2ui-pattern" not in page
    assert people["vic"].get(reverse("inbox")).status_code == 200


def test_an_action_on_an_abandoned_task_is_refused_and_claims_nothing(
    agent, people, no_dispatch, django_user_model
) -> None:
    """The form was not drawn, but a post was taken: the outbox set (no watcher would ever
    send it), the surface shown as submitted, an a2ui-action logged."""
    from tasks_app.services import tasks as task_services

    task = waiting(agent)
    surface = surface_of(task)
    ann = django_user_model.objects.get(username="ann")
    task_services.abandon_task(task, actor_id=ann.pk, actor_name="ann")
    resp = people["ann"].post(reverse("task-surface-act", args=[task.pk]), post_values(surface))
    assert resp.status_code in (200, 302, 400, 409)
    task.refresh_from_db()
    surface.refresh_from_db()
    assert task.outbox is None and surface.action_seq is None
    assert not OperatorAction.objects.filter(task=task, action="a2ui-action").exists()


def test_a_modal_whose_trigger_is_no_id_is_drawn_and_a_post_on_it_is_refused(
    agent, people, no_dispatch, caplog
) -> None:
    """A list as a Modal's trigger raised TypeError on every draw (a traceback each time),
    and a post on that surface answered 500."""
    task = waiting(agent)
    components = {
        "root": {"id": "root", "component": "Column", "children": ["mod", "b"]},
        "mod": {"id": "mod", "component": "Modal", "trigger": ["x"], "content": "t"},
        "t": {"id": "t", "component": "Text", "text": "inside"},
        "b": {"id": "b", "component": "Button", "child": "bt", "action": {"event": {"name": "go"}}},
        "bt": {"id": "bt", "component": "Text", "text": "Go"},
    }  # fmt: skip
    surface = surface_of(task, surface_id="m", components=components, data_model={})
    html = draw(surface)
    assert "inside" in html and "could not be drawn" not in html
    resp = people["ann"].post(
        reverse("task-surface-act", args=[task.pk]),
        {"surface": "m", "seq": str(surface.updated_seq), "source": "b0"},
    )
    assert resp.status_code < 500
    assert "Traceback" not in caplog.text


def test_one_surface_draws_at_most_its_byte_budget(agent) -> None:
    """Child ids may repeat, so one component can be drawn 1,500 times: with 10,000
    characters of text each, a 41 KB surface drew 15 MB (and a long path in each, 60 MB)."""
    task = waiting(agent)
    components = {
        "root": {"id": "root", "component": "Column", "children": ["m"] * 8},
        "m": {"id": "m", "component": "Column", "children": ["t"] * 200},
        "t": {"id": "t", "component": "Text", "text": "x" * 10_000},
    }
    html = draw(surface_of(task, surface_id="big", components=components, data_model={}))
    assert a2ui_render.MAX_HTML_BYTES <= len(html) < a2ui_render.MAX_HTML_BYTES + 100_000
    assert "bytes of drawing" in html


def test_a_column_of_more_children_than_are_drawn_says_it_is_drawn_in_part(agent) -> None:
    """A Column of 300 TextFields drew 200 inputs and no "Drawn in part" note: the person
    could send the form without knowing 100 of its fields were never shown."""
    task = waiting(agent)
    components = {
        "root": {"id": "root", "component": "Column", "children": ["f"] * 300},
        "f": {"id": "f", "component": "TextField", "label": "x", "value": {"path": "/x"}},
    }
    html = draw(surface_of(task, surface_id="wide", components=components, data_model={}))
    fields = [a for tag, a in parse(html).tags if tag == "input" and a.get("type") == "text"]
    assert len(fields) == a2ui_render.MAX_TEMPLATE_ITEMS == 200
    limit = a2ui_render.MAX_TEMPLATE_ITEMS
    assert f"Drawn in part: more than {limit} children in one component." in html


@pytest.mark.parametrize(
    ("component", "data_model", "marker", "drawn", "cut"),
    [
        ({"component": "Tabs", "tabs": [{"title": f"T{i}", "child": "t"} for i in range(60)]},
         {}, 'role="tabpanel"', a2ui_render.MAX_TABS,
         f"more than {a2ui_render.MAX_TABS} tabs in one Tabs component"),
        ({"component": "ChoicePicker", "label": "Pick", "value": {"path": "/p"},
          "options": [{"label": f"O{i}", "value": f"o{i}"} for i in range(250)]},
         {}, 'class="a2ui-option"', a2ui_render.MAX_OPTIONS,
         f"more than {a2ui_render.MAX_OPTIONS} options in one ChoicePicker"),
        ({"component": "List", "children": {"componentId": "t", "path": "/rows"}},
         {"rows": list(range(250))}, "an item", a2ui_render.MAX_TEMPLATE_ITEMS,
         f"more than {a2ui_render.MAX_TEMPLATE_ITEMS} items in one template"),
    ],
    ids=["tabs", "options", "template"],
)  # fmt: skip
def test_tabs_options_and_template_items_beyond_their_cap_say_the_drawing_is_cut(
    agent, component: dict, data_model: dict, marker: str, drawn: int, cut: str
) -> None:
    """Tabs past 50, ChoicePicker options past 200 and template items past 200 were dropped
    without the "Drawn in part" note (``Walk.cut`` stayed empty)."""
    task = waiting(agent)
    components = {
        "root": {"id": "root", **component},
        "t": {"id": "t", "component": "Text", "text": "an item"},
    }
    surface = surface_of(task, surface_id="many", components=components, data_model=data_model)
    walk = a2ui_render.Walk(components=components, model=data_model)
    walk.run("root")
    assert walk.cut == cut
    html = draw(surface)
    assert html.count(marker) == drawn
    assert f"Drawn in part: {cut}." in html


def test_a_data_path_too_long_to_write_into_a_page_is_a_problem(agent) -> None:
    from tasks_app.a2a import a2ui

    components = {
        "root": {"id": "root", "component": "Text", "text": {"path": "/" + "a" * 1_000}},
    }
    surface = {"components": components, "root_id": "root", "ready": True, "deleted": False,
               "data_model": {}}  # fmt: skip
    assert "a data path longer than 1000 characters" in a2ui.problem_of(surface)
    shorter = {"root": {**components["root"], "text": {"path": "/" + "a" * 999}}}
    assert a2ui.problem_of({**surface, "components": shorter}) == ""


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("v2", "-99999999", "Choose a value from 1 to 12."),
        ("v2", "13", "Choose a value from 1 to 12."),
        ("v2", "many", "Choose a value from 1 to 12."),
        ("v1", "<script>not a date</script>", "This is not a date or time in the form asked."),
        ("v1", "2026-13", "This is not a date or time in the form asked."),
    ],
)
def test_a_value_its_input_would_never_give_is_refused_next_to_it(
    agent, people, no_dispatch, field, value, message
) -> None:
    """Any field can be posted with anything: the agent got a slider's -99999999 and
    ``<script>`` as a date. Each input's own kind is checked with the form's checks."""
    task = waiting(agent)
    surface = surface_of(task)
    resp = people["ann"].post(
        reverse("task-surface-act", args=[task.pk]), post_values(surface, **{field: value})
    )
    assert message in resp.content.decode()
    task.refresh_from_db()
    assert task.outbox is None


def test_a_long_option_can_be_chosen_and_each_option_is_sent_once(
    agent, people, no_dispatch, django_capture_on_commit_callbacks
) -> None:
    """An option's value is drawn cut to 500 characters, and was compared uncut: it could
    never be chosen. The same option posted twice was sent twice."""
    task = waiting(agent)
    components = booking_components()
    long_value = "x" * 700
    components["seat"] = {
        **components["seat"], "variant": "multipleSelection",
        "options": [{"label": "Long", "value": long_value}, {"label": "Terrace", "value": "terrace"}],
    }  # fmt: skip
    surface = surface_of(task, components=components)
    post = post_values(surface)
    post["v3"] = [long_value[:500], "terrace", "terrace"]
    with django_capture_on_commit_callbacks(execute=True):
        resp = people["ann"].post(reverse("task-surface-act", args=[task.pk]), post)
    assert resp.status_code == 302
    task.refresh_from_db()
    model = json.dumps(task.outbox["message"])  # the data model goes with the action
    assert long_value in model and model.count('"terrace"') == 1


def login_surface(task: RemoteTask) -> Surface:
    comps = [
        {"id": "root", "component": "Column", "children": ["name", "pw", "go"]},
        {"id": "name", "component": "TextField", "label": "User", "value": {"path": "/login/name"},
         "checks": [{"condition": {"call": "required", "args": {"value": {"path": "/login/name"}}},
                     "message": "User is required"}]},
        {"id": "pw", "component": "TextField", "label": "Password", "variant": "obscured",
         "value": {"path": "/login/pw"}},
        {"id": "go", "component": "Button", "child": "go_label", "action": {"event": {
            "name": "login", "context": {"who": {"path": "/login/name"}, "pw": {"path": "/login/pw"},
                                         "line": {"call": "formatString", "args": {
                                             "value": "${/login/name}:${/login/pw}"}}}}}},
        {"id": "go_label", "component": "Text", "text": "Log in"},
    ]  # fmt: skip
    return Surface.objects.create(
        task=task, surface_id="login", version="0.9.1", components={c["id"]: c for c in comps},
        data_model={"login": {"name": "", "pw": ""}}, ready=True, root_id="root",
        updated_seq=task.last_seq,
    )  # fmt: skip


def test_a_password_field_goes_to_the_agent_only(
    agent, people, no_dispatch, django_capture_on_commit_callbacks
) -> None:
    """What a person typed into a password field was kept in the log, the audit row and the
    task page for every reader (the log cannot be edited), and a form drawn again after a
    failed check carried it back in the page's data model."""
    from tasks_app.models import ConversationMessage, TaskEvent

    task = waiting(agent, "login")
    surface = login_surface(task)
    url = reverse("task-surface-act", args=[task.pk])
    base = {"surface": "login", "seq": str(surface.updated_seq), "source": "b0"}
    refused = people["ann"].post(url, {**base, "v0": "", "v1": "S3CRET-PW-1"})
    assert refused.status_code == 400 and "User is required" in refused.content.decode()
    assert "S3CRET-PW-1" not in refused.content.decode()
    with django_capture_on_commit_callbacks(execute=True):
        sent = people["ann"].post(url, {**base, "v0": "ada", "v1": "S3CRET-PW-2"})
    assert sent.status_code == 302
    task.refresh_from_db()
    # The agent gets it: the outbox holds the message as it is sent.
    message = task.outbox["message"]
    action = message["parts"][0]["data"][0]["action"]
    assert action["context"] == {"who": "ada", "pw": "S3CRET-PW-2", "line": "ada:S3CRET-PW-2"}
    model = message["metadata"]["a2uiClientDataModel"]["surfaces"]["login"]
    assert model["login"]["pw"] == "S3CRET-PW-2"
    # Nothing we keep has it.
    kept = [
        json.dumps(list(TaskEvent.objects.filter(task=task).values_list("raw", flat=True))),
        json.dumps(list(ConversationMessage.objects.filter(task=task).values_list("message", flat=True))),
        json.dumps(list(OperatorAction.objects.filter(task=task).values_list("payload", flat=True))),
        people["vic"].get(reverse("task-detail", args=[task.pk])).content.decode(),
    ]  # fmt: skip
    for text in kept:
        assert "S3CRET-PW" not in text
    entry = TaskEvent.objects.filter(task=task, kind="operator").last().raw["operator"]
    logged = entry["message"]["parts"][0]["data"][0]["action"]["context"]
    assert logged == {"who": "ada", "pw": HIDDEN, "line": f"ada:{HIDDEN}"}
    assert "password fields" in entry["hidden"]
    # The agent's snapshot carries the message back in its history: kept as the conversation
    # holds it, not as the agent repeats it.
    reply = {"task": {"id": "t-login", "contextId": "c", "history": [message],
                      "status": {"state": "TASK_STATE_WORKING"}}}  # fmt: skip
    (seq,) = record(task, reply, "send").seqs
    echoed = TaskEvent.objects.get(task=task, seq=seq)
    assert "S3CRET-PW" not in json.dumps(echoed.raw) and "password fields hidden" in echoed.note
