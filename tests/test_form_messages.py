"""What the forms and filter pages say, as a tester found them on the running dashboard.

- The agent page counted message-only replies as "unknown" (the overview says "message
  reply").
- A NUL character in a form was a bare plain-text 400: no layout, the form and the typed
  message lost.
- A message too long also said "Write a message"; a “To” date of 9999-12-31 was "not a
  date"; the task list under an invalid filter listed every task, as if filtered.
"""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse

from tasks_app.forms import NUL_REMOVED, AnswerForm
from tasks_app.middleware import RefuseNulCharactersMiddleware
from tasks_app.models import Agent, Membership, OperatorAction, Project, RemoteTask
from tests.people import member

pytestmark = pytest.mark.django_db

HTML = {"HTTP_ACCEPT": "text/html,application/xhtml+xml,*/*;q=0.8"}  # as a browser asks


@pytest.fixture
def client_in(django_user_model) -> Client:
    client = Client()
    client.force_login(member(django_user_model.objects.create_user("forms")))
    return client


@pytest.fixture
def agent_row() -> Agent:
    return Agent.objects.create(name="forms agent", base_url="http://127.0.0.1:9/forms")


def errors_of(body: str, field_id: str) -> str:
    found = re.search(rf'id="{field_id}_error"[^>]*>(.*?)</div>', body, re.S)
    return found.group(1) if found else ""


# 1. The agent page's task summary ------------------------------------------------------------


def test_the_agent_page_counts_message_replies_as_the_overview_names_them(client_in, agent_row):
    for i in range(6):
        RemoteTask.objects.create(
            agent=agent_row, title=f"m{i}", phase=RemoteTask.Phase.MESSAGE, state=""
        )
    RemoteTask.objects.create(
        agent=agent_row, title="done", phase=RemoteTask.Phase.TASK, state="TASK_STATE_COMPLETED"
    )
    body = client_in.get(reverse("agent-detail", args=[agent_row.pk])).content.decode()
    assert "unknown: 6" not in body
    assert "message reply: 6" in body
    # The chip lists those six, not every task of the agent (an empty state= filter).
    assert f"?agent={agent_row.pk}&amp;phase=message" in body
    overview = client_in.get(reverse("overview")).content.decode()
    assert "message reply" in overview  # the name the overview uses
    listed = client_in.get(f"/tasks/?agent={agent_row.pk}&phase=message").content.decode()
    assert listed.count('id="task-row-') == 6


# 2. A NUL character in a form ------------------------------------------------------------------


def test_a_nul_in_the_start_task_form_shows_the_form_again_without_it(client_in, agent_row):
    typed = "Summarize the report\x00 for Monday, please."
    answer = client_in.post(
        reverse("task-new"), {"agent": agent_row.pk, "text": typed, "mode": "auto"}, **HTML
    )
    assert answer.status_code == 400
    body = answer.content.decode()
    assert 'id="task-new-form"' in body and "<nav" in body  # the form, in the site's layout
    assert "Summarize the report for Monday, please.</textarea>" in body  # kept, minus the NUL
    assert "\x00" not in body
    assert "NUL character" in errors_of(body, "id_text")
    assert "Write a message" not in body
    assert not RemoteTask.objects.exists()  # nothing sent, nothing stored


def test_a_nul_in_the_start_task_form_never_starts_a_task_whatever_the_field(client_in, agent_row):
    for field, value in (("text", "\x00"), ("skill", "s\x00"), ("agent", f"{agent_row.pk}\x00")):
        data = {"agent": agent_row.pk, "text": "hello", "mode": "auto", field: value}
        answer = client_in.post(reverse("task-new"), data)
        assert answer.status_code == 400, field
        assert NUL_REMOVED in answer.content.decode(), field
    assert not RemoteTask.objects.exists()
    # A NUL in a field's name is no field's: refused before the view, as before.
    answer = client_in.post(reverse("task-new"), {"agent": agent_row.pk, "te\x00xt": "hello"})
    assert answer.status_code == 400
    assert answer.content.decode() == RefuseNulCharactersMiddleware.MESSAGE


def test_a_nul_in_another_form_gets_the_site_400_page_naming_the_field(django_user_model):
    agent = Agent.objects.create(
        project=Project.objects.get_or_create(name="nul")[0], name="moved",
        base_url="http://127.0.0.1:9/m", pending_origin="http://127.0.0.1:9",
    )  # fmt: skip
    admin = django_user_model.objects.create_superuser("root", "", "pw-12345678")
    client = Client()
    client.force_login(admin)
    url = reverse("agent-approve-origin", args=[agent.pk])
    answer = client.post(url, {"origin": "http://127.0.0.1:9\x00"}, **HTML)
    assert answer.status_code == 400
    body = answer.content.decode()
    assert answer["Content-Type"].startswith("text/html")
    assert 'id="bad-request"' in body and "<html" in body.lower()  # the site's 400 page
    assert "NUL character" in body and "“origin”" in body and "Go back" in body
    assert "Back button keeps what you typed" in body
    agent.refresh_from_db()
    assert agent.credential_origins == [] and not OperatorAction.objects.exists()
    # A client that does not ask for a page gets the plain answer it had.
    plain = client.post(url, {"origin": "http://127.0.0.1:9\x00"})
    assert plain.status_code == 400
    assert plain.content.decode() == RefuseNulCharactersMiddleware.MESSAGE


def test_a_nul_in_a_filter_gets_the_site_400_page_for_a_browser(client_in):
    answer = client_in.get("/tasks/?q=a%00b", **HTML)
    assert answer.status_code == 400
    body = answer.content.decode()
    assert 'id="bad-request"' in body and "“q”" in body and "The address" in body
    assert "Accept" in answer["Vary"]
    assert (
        client_in.get("/tasks/?q=a%00b").content.decode() == RefuseNulCharactersMiddleware.MESSAGE
    )


# 3a. A message too long ------------------------------------------------------------------------


def test_a_message_too_long_says_only_that_it_is_too_long(client_in, agent_row):
    answer = client_in.post(
        reverse("task-new"), {"agent": agent_row.pk, "text": "x" * 200_000, "mode": "auto"}
    )
    assert answer.status_code == 400
    errors = errors_of(answer.content.decode(), "id_text")
    assert "at most 100000 characters" in errors
    assert "Write a message" not in errors
    # Nothing written at all still asks for something.
    empty = client_in.post(reverse("task-new"), {"agent": agent_row.pk, "text": "", "mode": "auto"})
    assert "Write a message, add JSON data or attach a file." in errors_of(
        empty.content.decode(), "id_text"
    )


def test_an_answer_too_long_says_only_that_it_is_too_long():
    form = AnswerForm({"text": "x" * 100_001, "question": "1"})
    assert not form.is_valid()
    assert len(form.errors["text"]) == 1 and "at most 100000" in form.errors["text"][0]
    empty = AnswerForm({"text": "", "question": "1"})
    assert not empty.is_valid() and "Write an answer" in empty.errors["text"][0]


# 3b. The last day as a "To" date -------------------------------------------------------------


def test_the_last_day_as_a_to_date_is_not_called_no_date(django_user_model, agent_row):
    auditor = member(django_user_model.objects.create_user("aud"), Membership.Role.AUDITOR)
    action = OperatorAction.objects.create(agent=agent_row, actor=auditor, action="start")
    client = Client()
    client.force_login(auditor)
    # Its whole day is up to the end of time: the next midnight, which the filter used, does
    # not exist, and the date was called "not a date" (400).
    for last, listed in (("until=9999-12-31", True), ("until=9999-12-31T23:59:59", True),
                         ("since=9999-12-31", False)):  # fmt: skip
        response = client.get(reverse("audit") + "?" + last)
        body = response.content.decode()
        assert response.status_code == 200, (last, body[:2000])
        assert 'id="id_until_error"' not in body
        assert (f'data-action="{action.pk}"' in body) is listed, last
    csv = client.get(reverse("audit-csv") + "?until=9999-12-31")
    assert csv.status_code == 200
    assert b"start" in b"".join(csv.streaming_content)
    # Text that is no date is still called so.
    bad = client.get(reverse("audit") + "?until=2026-13-45").content.decode()
    assert "“2026-13-45” is not a date" in bad


# 3c. An invalid task-list filter -----------------------------------------------------------------


@pytest.mark.parametrize("query", ["agent=999", "state=bogus", "sort=sideways"])
def test_an_invalid_task_filter_lists_nothing_as_the_audit_page_does(client_in, agent_row, query):
    RemoteTask.objects.create(agent=agent_row, title="listed", state="TASK_STATE_WORKING")
    answer = client_in.get("/tasks/?" + query)
    assert answer.status_code == 400  # as the audit page answers an invalid filter
    body = answer.content.decode()
    assert "Select a valid choice" in body
    assert 'id="task-row-' not in body  # no list that would look like the filtered result
    assert 'id="task-bad-filter"' in body and "Nothing is shown until" in body
    assert '"prepend": false' in body  # nor do new tasks appear live under it
    assert 'id="task-row-' in client_in.get("/tasks/").content.decode()


# A refused answer shows the page again, the chain sentence as on any load --------------------


def test_a_refused_answer_shows_the_chain_sentence_as_the_page_does(client_in, agent_row):
    """The page shown again with a refused answer had no chain in its context, and the
    template said a three-entry log was "too large to check on every load"."""
    from tasks_app.services.record import record

    task = RemoteTask.objects.create(agent=agent_row, title="asks")
    asking = {"id": "r-1", "contextId": "c-1", "status": {"state": "TASK_STATE_INPUT_REQUIRED"}}
    record(task.pk, {"task": asking}, "poll")
    loaded = client_in.get(reverse("task-detail", args=[task.pk])).content.decode()
    refused = client_in.post(reverse("task-answer", args=[task.pk]), {"text": "   "})
    assert refused.status_code == 400
    body = refused.content.decode()
    assert "Write an answer" in body
    assert "Hash chain verifies" in loaded and "Hash chain verifies" in body
    assert "too large to check" not in body


# "Watch again" refused: the reason, as the task is ----------------------------------------


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"phase": "task", "state": "TASK_STATE_COMPLETED"}, "This task has ended"),
        ({"phase": "message"}, "answered with a message, not a task"),
        ({"phase": "failed"}, "The send failed: retry it"),
        ({"phase": "task", "state": "TASK_STATE_WORKING", "watcher_status": "polling"},
         "being watched already (it is not parked"),
    ],
)  # fmt: skip
def test_watch_again_refused_says_why_as_the_task_is(agent_row, fields, reason):
    """One sentence ("being watched already, or cannot be watched (gone or abandoned)") was
    the answer for a completed task, a message reply and a failed send too (found by
    driving the command line)."""
    from tasks_app.services import tasks as task_services

    task = RemoteTask.objects.create(agent=agent_row, title="t", remote_id="r-w", **fields)
    with pytest.raises(task_services.TaskActionError, match=re.escape(reason)):
        task_services.watch_again(task)


# The audit command's refusals, in its own words ---------------------------------------------


def test_the_audit_commands_refusals_name_its_flags_and_what_is_missing(agent_row):
    """``audit verify 999`` said "use the local id" of a local id that does not exist, and
    ``audit actions`` answered with the web form's words ("“To” must be after “From”",
    "choose one from the list") where no form or list is shown."""
    from io import StringIO

    from django.core.management import CommandError, call_command

    for args in (["verify", "999999"], ["export", "999999"]):
        with pytest.raises(CommandError, match="No task '999999': neither a local id nor a"):
            call_command("audit", *args, stdout=StringIO())
    with pytest.raises(CommandError, match="--until: --until must be after --since"):
        call_command("audit", "actions", "--since", "2026-12-04", "--until", "2026-12-01",
                     stdout=StringIO())  # fmt: skip
    with pytest.raises(CommandError, match=r"known actions: .*add-agent.*start") as refused:
        call_command("audit", "actions", "--action", "bogus", stdout=StringIO())
    assert "from the list" not in str(refused.value)
