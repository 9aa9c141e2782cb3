"""Renaming, retiring and restoring an agent.

An agent added by mistake stayed for ever: nothing could delete it (the cascade would take
its tasks, their logs and the action log with it), and its name could not be changed. Now an
agent admin renames it, or retires it: nothing is sent to it again, its credentials are
deleted, it leaves the agent list and the start form, its URL is free, and everything it
left behind stays readable. These tests check each promise, and the orders where they
would break: a start and a retire released at once, a pause inside the retire, a rename
from a stale page.
"""

from __future__ import annotations

import json
import threading
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from tasks_app import alerts, outbound
from tasks_app.crypto import encrypt_json
from tasks_app.models import Agent, Alert, ImportJob, Membership, OperatorAction, RemoteTask
from tasks_app.services import agents as agent_services
from tasks_app.services import imports
from tasks_app.services import tasks as task_services
from tests.people import member
from tests.races import release_together

pytestmark = pytest.mark.django_db


def _agent(name: str = "Helper", url: str = "http://127.0.0.1:9/helper") -> Agent:
    return Agent.objects.create(
        name=name, base_url=url, interface_url=url + "/rpc", binding="JSONRPC",
        credentials_encrypted=encrypt_json({"token": "s3cret-token"}),
        credential_origins=["http://127.0.0.1:9"],
    )  # fmt: skip


def _open_task(agent: Agent) -> RemoteTask:
    return RemoteTask.objects.create(
        agent=agent, remote_id="r-1", phase="task", state="TASK_STATE_WORKING", watch="poll"
    )


def _person(role: str, name: str = "ada") -> Client:
    client = Client()
    client.force_login(member(User.objects.create_user(name), role))
    return client


def test_an_agent_admin_renames_an_agent_and_the_log_says_from_what() -> None:
    agent = _agent()
    admin = _person(Membership.Role.AGENT_ADMIN)
    page = admin.get(f"/agents/{agent.pk}/").content.decode()
    assert 'id="rename-form"' in page and 'value="Helper"' in page
    response = admin.post(
        f"/agents/{agent.pk}/rename/", {"name": "  Billing   helper ", "was": "Helper"}
    )
    assert response.status_code == 302
    agent.refresh_from_db()
    assert agent.name == "Billing helper"
    row = OperatorAction.objects.get(action="rename-agent")
    assert row.agent_id == agent.pk and row.payload == {"from": "Helper", "to": "Billing helper"}
    assert "Billing helper" in admin.get("/agents/").content.decode()
    # Blank: refused next to the field, nothing written.
    refused = admin.post(f"/agents/{agent.pk}/rename/", {"name": "   "})
    assert refused.status_code == 400
    assert 'id="id_name_error"' in refused.content.decode()
    assert OperatorAction.objects.filter(action="rename-agent").count() == 1
    # An operator is not offered the form, and is refused it.
    operator = _person(Membership.Role.OPERATOR, "otto")
    assert 'id="rename-form"' not in operator.get(f"/agents/{agent.pk}/").content.decode()
    assert operator.post(f"/agents/{agent.pk}/rename/", {"name": "Mine"}).status_code == 403
    agent.refresh_from_db()
    assert agent.name == "Billing helper"


def test_a_rename_from_a_stale_page_does_not_undo_the_one_before_it() -> None:
    agent = _agent()
    stale = Agent.objects.get(pk=agent.pk)
    agent_services.rename_agent(agent, "First")
    with pytest.raises(agent_services.AgentError, match="renamed to 'First' meanwhile"):
        agent_services.rename_agent(stale, "Second")
    assert Agent.objects.get(pk=agent.pk).name == "First"
    assert OperatorAction.objects.filter(action="rename-agent").count() == 1
    # The same through the page: the form carries the name it showed.
    admin = _person(Membership.Role.AGENT_ADMIN)
    refused = admin.post(f"/agents/{agent.pk}/rename/", {"name": "Third", "was": "Helper"})
    assert refused.status_code == 400
    assert "renamed to &#x27;First&#x27; meanwhile" in refused.content.decode()
    assert Agent.objects.get(pk=agent.pk).name == "First"
    # The form that came back knows the name now: sent again, it renames.
    assert 'name="was" value="First"' in refused.content.decode()
    assert (
        admin.post(f"/agents/{agent.pk}/rename/", {"name": "Third", "was": "First"}).status_code
        == 302
    )
    assert Agent.objects.get(pk=agent.pk).name == "Third"


def test_an_agent_with_an_open_task_is_not_retired_until_the_task_is_ended() -> None:
    agent = _agent()
    task = _open_task(agent)
    admin = _person(Membership.Role.AGENT_ADMIN)
    page = admin.get(f"/agents/{agent.pk}/").content.decode()
    assert 'id="retire-blocked"' in page and "1 open task" in page
    assert 'id="retire-confirm"' not in page  # not offered while it cannot work
    response = admin.post(f"/agents/{agent.pk}/retire/", follow=True)
    assert "has 1 open task" in response.content.decode()
    agent.refresh_from_db()
    assert agent.retired_at is None and agent.credentials_encrypted  # nothing changed
    assert not OperatorAction.objects.filter(action="retire-agent").exists()
    # The way out the sentence names: abandon it, then retire.
    task_services.abandon_task(task, reason="added by mistake")
    page = admin.get(f"/agents/{agent.pk}/").content.decode()
    assert 'id="retire-confirm"' in page
    assert admin.post(f"/agents/{agent.pk}/retire/").status_code == 302
    agent.refresh_from_db()
    assert agent.retired_at is not None and agent.retired_by.username == "ada"


def test_an_import_under_way_keeps_the_agent_in_service() -> None:
    agent = _agent()
    ImportJob.objects.create(agent=agent, status=ImportJob.Status.RUNNING)
    with pytest.raises(agent_services.AgentError, match="import"):
        agent_services.retire_agent(agent)
    assert Agent.objects.get(pk=agent.pk).retired_at is None


def test_a_retired_agent_is_inert_and_what_it_left_stays_readable(no_dispatch) -> None:
    agent = _agent()
    ended = RemoteTask.objects.create(
        agent=agent, remote_id="r-9", phase="task", state="TASK_STATE_COMPLETED", title="old work"
    )
    Alert.objects.create(
        rule=Alert.Rule.AGENT_UNREACHABLE, agent=agent, key=f"agent-unreachable:agent:{agent.pk}",
        message="unreachable", opened_at=agent.created_at,
    )  # fmt: skip
    Agent.objects.filter(pk=agent.pk).update(reachable=False)
    admin = _person(Membership.Role.AGENT_ADMIN)
    assert admin.post(f"/agents/{agent.pk}/retire/").status_code == 302
    agent.refresh_from_db()
    # 1. Its secrets are gone; the action log says who retired what.
    assert agent.credentials_encrypted == "" and agent.credential_origins == []
    row = OperatorAction.objects.get(action="retire-agent")
    assert row.payload["url"] == agent.base_url and row.actor.username == "ada"
    # 2. Nothing is sent to it, by any path.
    with pytest.raises(outbound.AgentRetired):
        outbound.client_for(agent, None)  # type: ignore[arg-type]
    with pytest.raises(task_services.TaskActionError, match="retired"):
        task_services.start_task(agent, "hello")
    with pytest.raises(task_services.TaskActionError, match="retired"):
        imports.start_import(agent)
    with pytest.raises(agent_services.AgentError, match="retired"):
        agent_services.refresh_card(agent)
    with pytest.raises(agent_services.AgentError, match="retired"):
        agent_services.set_credentials(agent, {"token": "new"})
    refreshed = admin.post(f"/tasks/{ended.pk}/refresh/", follow=True).content.decode()
    assert "is retired: nothing is sent to it" in refreshed
    assert no_dispatch == [] and RemoteTask.objects.count() == 1
    # 3. It leaves the agent list's table and the start form; the page says what it is.
    listing = admin.get("/agents/").content.decode()
    table, retired = listing.split('id="retired-agents"')
    assert "Helper" not in table and "Helper" in retired
    other = _agent("Other", "http://127.0.0.1:9/other")
    start_form = admin.get("/tasks/new").content.decode()
    assert f'<option value="{other.pk}"' in start_form
    assert f'<option value="{agent.pk}"' not in start_form
    # A link made while it was in service says so, rather than preselect another agent.
    linked = admin.get(f"/tasks/new?agent={agent.pk}").content.decode()
    assert "Helper is retired: choose another agent." in linked
    assert "not one you can start tasks on" in admin.get("/tasks/new?agent=x9").content.decode()
    page = admin.get(f"/agents/{agent.pk}/").content.decode()
    assert 'id="retired-note"' in page and "by ada" in page
    assert "Start a task" not in page and 'id="credentials-form"' not in page
    # 4. Its tasks stay readable, and filterable by it.
    assert "old work" in admin.get(f"/tasks/?agent={agent.pk}").content.decode()
    task_page = admin.get(f"/tasks/{ended.pk}/").content.decode()
    assert 'id="agent-retired-note"' in task_page and 'id="refresh-button"' not in task_page
    assert "Helper (retired)" in admin.get("/tasks/").content.decode()
    # 5. Its being unreachable is nobody's concern: the open alert ends, none opens again.
    alerts.evaluate(deliver=False)
    assert not Alert.objects.filter(resolved_at__isnull=True, agent=agent).exists()


def test_a_retired_url_is_free_and_restoring_it_then_is_refused() -> None:
    agent = _agent()
    admin = _person(Membership.Role.AGENT_ADMIN)
    agent_services.retire_agent(agent)
    # What add_agent stores after its card fetch: the same URL in the same project.
    again = Agent.objects.create(name="Helper v2", base_url=agent.base_url)
    response = admin.post(f"/agents/{agent.pk}/restore/", follow=True).content.decode()
    assert "registered again in project default, as &#x27;Helper v2&#x27;" in response
    assert Agent.objects.get(pk=agent.pk).retired_at is not None
    agent_services.retire_agent(again)
    assert admin.post(f"/agents/{agent.pk}/restore/").status_code == 302
    agent.refresh_from_db()
    assert agent.retired_at is None and agent.retired_by is None
    assert agent.credentials_encrypted == ""  # retiring deleted them for good
    assert OperatorAction.objects.filter(action="restore-agent", agent=agent).count() == 1
    with pytest.raises(agent_services.AgentError, match="not retired"):
        agent_services.restore_agent(agent)


@pytest.mark.django_db(transaction=True)
def test_a_start_and_a_retire_released_together_never_both_win(no_dispatch) -> None:
    """Never a retired agent with an open task: it could not be reached, not even canceled."""
    for round_ in range(6):
        agent = _agent(url=f"http://127.0.0.1:9/race-{round_}")
        start, retire = release_together(
            lambda agent=agent: task_services.start_task(agent, "hello"),
            lambda agent=agent: agent_services.retire_agent(agent),
        )
        retired = Agent.objects.get(pk=agent.pk).retired_at is not None
        tasks = RemoteTask.objects.filter(agent=agent).count()
        assert retired != bool(tasks), (start, retire)
        assert isinstance(start, RemoteTask) == bool(tasks)
        assert isinstance(retire, Agent) == retired


@pytest.mark.django_db(transaction=True)
def test_a_start_inside_the_retires_window_waits_for_it_and_is_refused(
    monkeypatch, no_dispatch
) -> None:
    """A pause between the retire's mark and its look for open tasks: the start that comes
    in the pause must not slip a task past the look."""
    agent = _agent()
    marked, release = threading.Event(), threading.Event()
    real_open_tasks = agent_services.open_tasks

    def paused(agent_pk: int):
        marked.set()
        release.wait(10)
        return real_open_tasks(agent_pk)

    monkeypatch.setattr(agent_services, "open_tasks", paused)

    def start_in_the_pause():
        marked.wait(10)
        threading.Timer(0.5, release.set).start()
        return task_services.start_task(agent, "hello")

    retire, start = release_together(lambda: agent_services.retire_agent(agent), start_in_the_pause)
    assert isinstance(retire, Agent), retire
    assert isinstance(start, task_services.TaskActionError) and "retired" in str(start)
    assert not RemoteTask.objects.filter(agent=agent).exists()


def test_the_command_line_renames_retires_and_restores(no_dispatch) -> None:
    agent = _agent()
    out = StringIO()
    call_command("agents", "rename", str(agent.pk), "Ledger", stdout=out)
    assert "renamed 'Helper' to 'Ledger'" in out.getvalue()
    task = _open_task(agent)
    with pytest.raises(CommandError, match="open task"):
        call_command("agents", "retire", "Ledger")
    RemoteTask.objects.filter(pk=task.pk).update(state="TASK_STATE_COMPLETED")
    out = StringIO()
    call_command("agents", "retire", "Ledger", stdout=out)
    assert "retired" in out.getvalue()
    out = StringIO()
    call_command("agents", "list", stdout=out)
    assert out.getvalue().rstrip().endswith("retired")
    out = StringIO()
    call_command("agents", "list", "--json", stdout=out)
    assert json.loads(out.getvalue())["retired_at"]
    with pytest.raises(CommandError, match="retired: no task can be started"):
        call_command("tasks", "start", str(agent.pk), "hello")
    out = StringIO()
    call_command("agents", "restore", str(agent.pk), stdout=out)
    assert "back in service" in out.getvalue()
    assert [row.action for row in OperatorAction.objects.order_by("id")] == [
        "rename-agent", "retire-agent", "restore-agent",
    ]  # fmt: skip


def test_the_action_log_names_the_new_actions() -> None:
    agent = _agent()
    agent_services.rename_agent(agent, "Ledger")
    auditor = _person(Membership.Role.AUDITOR, "audrey")
    page = auditor.get("/audit/?action=rename-agent").content.decode()
    assert "renamed an agent" in page and "Ledger" in page


# What the first audit of the feature found ---------------------------------------------------


def test_a_start_form_drawn_before_the_retire_preselects_no_other_agent() -> None:
    """Posted after the retire, the form came back with another agent selected and Django's
    "Select a valid choice": a second click sent the task to that agent."""
    agent, other = _agent(), _agent("Other", "http://127.0.0.1:9/other")
    admin = _person(Membership.Role.AGENT_ADMIN)
    agent_services.retire_agent(agent)
    answer = admin.post("/tasks/new", {"agent": agent.pk, "text": "quick", "mode": "auto"})
    html = answer.content.decode()
    assert answer.status_code == 400 and "Helper is retired: choose another agent." in html
    assert '<option value="" selected>Choose an agent</option>' in html
    assert f'<option value="{other.pk}" selected' not in html
    assert not RemoteTask.objects.exists()


def test_names_are_tidied_and_invisible_or_control_characters_refused() -> None:
    """A bidi override reversed the rest of an audit line; a zero-width space alone made an
    unclickable link; ESC began a terminal sequence on the command line."""
    agent = _agent()
    for bad in ("Evil\u202egnp.exe", "\u200b", "red\x1b[31m", "a\u2066b"):
        with pytest.raises(agent_services.AgentError, match=r"invisible formatting|at least one"):
            agent_services.rename_agent(agent, bad)
    admin = _person(Membership.Role.AGENT_ADMIN)
    answer = admin.post(f"/agents/{agent.pk}/rename/", {"name": "x\u202ey", "was": "Helper"})
    assert (
        answer.status_code == 400 and "invisible formatting characters" in answer.content.decode()
    )
    assert Agent.objects.get(pk=agent.pk).name == "Helper"
    assert not OperatorAction.objects.filter(action="rename-agent").exists()
    # Tabs and line ends are spaces; a card's name (the agent's text) is cleaned, not refused.
    assert agent_services.typed_name(" Card\tname \n") == "Card name"
    assert agent_services.shown_name("Pay\u202eroll\u200b\x07 bot ") == "Payroll bot"
    assert agent_services.shown_name("Weather\tAgent\n") == "Weather Agent"  # a space, as typed
    for blank in ("\u3164", "\u115f\u1160", "\u2800", "\uffa0"):  # letters that draw nothing
        with pytest.raises(agent_services.AgentError):
            agent_services.typed_name(blank)
    # A card's name is shown cleaned on the agent page (a bidi override reversed it).
    Agent.objects.filter(pk=agent.pk).update(card={"name": "\u202eEvil\u200b Card"})
    page = admin.get(f"/agents/{agent.pk}/").content.decode()
    assert "<dt>Card name</dt><dd>Evil Card</dd>" in page
    with pytest.raises(CommandError, match="invisible formatting"):
        call_command("agents", "add", "http://127.0.0.1:9/x", "--name", "a\u200bb")


def test_an_agent_stored_with_outer_spaces_can_be_renamed_from_its_page() -> None:
    """The form's hidden name was stripped, so the compare-and-set never matched it."""
    agent = _agent(" Padded\tname ")
    admin = _person(Membership.Role.AGENT_ADMIN)
    page = admin.get(f"/agents/{agent.pk}/").content.decode()
    assert 'name="was" value=" Padded\tname "' in page
    answer = admin.post(f"/agents/{agent.pk}/rename/", {"name": "Tidy", "was": " Padded\tname "})
    assert answer.status_code == 302
    assert Agent.objects.get(pk=agent.pk).name == "Tidy"
    # The same rename sent again is done, not refused as someone else's.
    again = admin.post(f"/agents/{agent.pk}/rename/", {"name": "Tidy", "was": " Padded\tname "})
    assert again.status_code == 302
    assert OperatorAction.objects.filter(action="rename-agent").count() == 1


def test_the_page_offers_only_what_can_work_and_says_what_retiring_leaves_behind(
    no_dispatch,
) -> None:
    agent = _agent()
    admin = _person(Membership.Role.AGENT_ADMIN)
    # An import under way: retiring is not offered, and the page says why.
    job = ImportJob.objects.create(agent=agent, status=ImportJob.Status.RUNNING)
    page = admin.get(f"/agents/{agent.pk}/").content.decode()
    assert "An import of its tasks is under way" in page and 'id="retire-confirm"' not in page
    job.delete()  # (a job that ended would be shown as it ended)
    # Open tasks: the link lists exactly them (not a message reply, not an abandoned task).
    working = _open_task(agent)
    RemoteTask.objects.create(agent=agent, phase="message", title="a plain reply")
    gone_on = RemoteTask.objects.create(
        agent=agent, remote_id="r-2", phase="task", state="TASK_STATE_WORKING", title="left",
        abandoned_at=timezone.now(),
    )  # fmt: skip
    page = admin.get(f"/agents/{agent.pk}/").content.decode()
    assert f"/tasks/?agent={agent.pk}&amp;state=open" in page and "1 open task" in page
    listed = admin.get(f"/tasks/?agent={agent.pk}&state=open").content.decode()
    assert f'id="task-row-{working.pk}"' in listed
    assert "a plain reply" not in listed and f'id="task-row-{gone_on.pk}"' not in listed
    # An abandoned task the agent may still run: said before retiring, which ends any cancel.
    assert "1 abandoned task of it may still be running at the agent" in page
    with pytest.raises(agent_services.AgentError, match="Cancel asks the agent to stop one"):
        agent_services.retire_agent(agent)
    # The way out the sentence names for the running one: canceled at the agent.
    RemoteTask.objects.filter(pk=working.pk).update(state="TASK_STATE_CANCELED")
    agent_services.retire_agent(agent)
    # Retired: the import card does not point at a button that is gone.
    page = admin.get(f"/agents/{agent.pk}/").content.decode()
    assert "Import its tasks" not in page and "No import: the agent is retired." in page
    # Its URL registered again: no Restore button, the page names the agent holding it.
    again = Agent.objects.create(name="Helper v2", base_url=agent.base_url)
    page = admin.get(f"/agents/{agent.pk}/").content.decode()
    assert 'id="restore-agent"' not in page
    assert f'href="/agents/{again.pk}/" id="url-taken-by"' in page


def test_a_stale_page_of_a_retired_agent_says_why_nothing_happened() -> None:
    agent = _agent()
    admin = _person(Membership.Role.AGENT_ADMIN)
    agent_services.retire_agent(agent)
    saved = admin.post(
        f"/agents/{agent.pk}/credentials/", {"kind": "bearer", "token": "t0k"}, follow=True
    ).content.decode()
    assert "Nothing was saved. Helper is retired" in saved
    assert Agent.objects.get(pk=agent.pk).credentials_encrypted == ""
    approved = admin.post(
        f"/agents/{agent.pk}/approve-origin/", {"origin": "http://127.0.0.1:9"}, follow=True
    ).content.decode()
    assert "Nothing to approve. Helper is retired" in approved


def test_the_command_line_finds_the_agent_in_service_by_its_url_or_name(no_dispatch) -> None:
    old = _agent()
    agent_services.retire_agent(old)
    new = Agent.objects.create(
        name="Helper", base_url=old.base_url, interface_url=old.interface_url, binding="JSONRPC"
    )
    out = StringIO()
    call_command("tasks", "start", old.base_url, "quick", stdout=out)
    assert RemoteTask.objects.get().agent_id == new.pk
    out = StringIO()
    call_command("agents", "rename", "Helper", "Helper", stdout=out)
    assert out.getvalue().strip() == f"{new.pk}\tHelper\talready named 'Helper'"
    with pytest.raises(CommandError, match="registered again"):  # restore looks at the retired
        call_command("agents", "restore", old.base_url, stdout=StringIO())


def test_the_audit_filter_tells_a_retired_agent_from_its_successor() -> None:
    old = _agent()
    agent_services.retire_agent(old)
    Agent.objects.create(name="Helper", base_url=old.base_url)
    auditor = _person(Membership.Role.AUDITOR, "audrey")
    page = auditor.get("/audit/").content.decode()
    assert f'<option value="{old.pk}">Helper (retired)</option>' in page


def test_words_around_it_say_what_they_mean(no_dispatch) -> None:
    """From the second audit: a failed send read "failed" like a task the agent failed; a
    name with a quote came back backslashed; a page of no one project blamed "your role in
    this project"."""
    agent = _agent()
    RemoteTask.objects.create(agent=agent, phase="failed", title="never reached it")
    admin = _person(Membership.Role.AGENT_ADMIN)
    listing = admin.get(f"/tasks/?agent={agent.pk}").content.decode()
    assert 'data-state="">send failed</span>' in listing
    assert '"failed": "send failed"' in listing  # the live list draws new rows alike
    stale = Agent.objects.get(pk=agent.pk)
    agent_services.rename_agent(agent, 'It\'s "B" agent')
    with pytest.raises(agent_services.AgentError) as refused:
        agent_services.rename_agent(stale, "Other")
    assert "renamed to 'It's \"B\" agent' meanwhile" in str(refused.value)
    with pytest.raises(CommandError, match="No agent 'It's nothing'"):
        call_command("tasks", "start", "It's nothing", "hi")
    viewer = _person(Membership.Role.VIEWER, "vic")
    refused_page = viewer.get("/tasks/new")
    assert refused_page.status_code == 403
    assert "None of your projects allows this (operate)." in refused_page.content.decode()
