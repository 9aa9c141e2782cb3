"""One agent URL, registered once per project: two teams can share one public agent.

The URL was unique across all projects: a person adding an agent another project held was
told so ("in a project you cannot see"), which said that the URL was in use elsewhere, and
the second team could not use the agent at all. Now each project registers the URL as a row
of its own (``one_agent_per_url_per_project``): these tests add it in two projects with the
real demo agent, check that each project sees only its own row and that no answer names
the other, that a second add in one project is still refused (naming that project's row),
and that push deliveries go to the project whose config they carry, even when both
projects mirror the same remote task.
"""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db import IntegrityError, transaction
from django.test import Client

from tasks_app import outbound
from tasks_app.a2a import user_message
from tasks_app.management.commands.tasks import find_agent
from tasks_app.models import Agent, Membership, Project, RemoteTask, TaskEvent
from tasks_app.services import imports, push
from tasks_app.services.agents import add_agent
from tests.agents import running_agent
from tests.people import member
from tests.test_push_webhook import deliver, drain_here, good, secrets_of

pytestmark = [pytest.mark.agent, pytest.mark.usefixtures("empty_push_queue")]


def admin_of(project: str) -> User:
    return member(
        User.objects.create_user(f"{project}-admin"), Membership.Role.AGENT_ADMIN, project
    )


def logged_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def add_through_the_form(client: Client, url: str, name: str, project: str):
    return client.post(
        "/agents/add/",
        {"url": url, "name": name, "project": Project.objects.get(name=project).pk,
         "action": "save"},
    )  # fmt: skip


@pytest.mark.django_db
def test_one_url_in_two_projects_is_two_agents_each_seen_only_in_its_own(agent) -> None:
    alpha, beta = logged_in(admin_of("alpha")), logged_in(admin_of("beta"))
    first = add_through_the_form(alpha, agent.base_url, "Alpha copy", "alpha")
    assert first.status_code == 302, first.content.decode()[-2000:]
    second = add_through_the_form(beta, agent.base_url, "Beta copy", "beta")
    # Before: 200, "This URL is already registered, in a project you cannot see."
    assert second.status_code == 302, second.content.decode()[-2000:]
    rows = {a.project.name: a for a in Agent.objects.select_related("project")}
    assert set(rows) == {"alpha", "beta"}
    assert rows["alpha"].base_url == rows["beta"].base_url == agent.base_url
    assert rows["alpha"].name == "Alpha copy" and rows["beta"].name == "Beta copy"
    assert second["Location"] == f"/agents/{rows['beta'].pk}/"

    # What beta's admin is shown after the add, and anywhere after: nothing of alpha's row.
    for page in (second["Location"], "/agents/", "/tasks/", "/"):
        html = beta.get(page, follow=True).content.decode()
        assert "Beta copy" in html or page in ("/tasks/", "/"), page
        for told in ("Alpha copy", "alpha", "already registered", "cannot see"):
            assert told not in html, (page, told)
    alpha_list = alpha.get("/agents/").content.decode()
    assert "Alpha copy" in alpha_list and "Beta copy" not in alpha_list
    # Each project's row is out of the other's reach (404: not even its existence).
    assert alpha.get(f"/agents/{rows['beta'].pk}/").status_code == 404
    assert beta.get(f"/agents/{rows['alpha'].pk}/").status_code == 404

    # The command line lists both rows, told apart by their project.
    out = StringIO()
    call_command("agents", "list", "--json", stdout=out)
    listed = [json.loads(line) for line in out.getvalue().splitlines()]
    assert sorted((row["project"], row["base_url"]) for row in listed) == [
        ("alpha", agent.base_url),
        ("beta", agent.base_url),
    ]


@pytest.mark.django_db
def test_the_same_url_twice_in_one_project_is_refused_naming_that_projects_agent(agent) -> None:
    # Another project registered the URL first: alpha may still add it, once.
    add_agent(agent.base_url, name="Beta copy", project=Project.objects.create(name="beta"))
    alpha = logged_in(admin_of("alpha"))
    assert add_through_the_form(alpha, agent.base_url, "Alpha copy", "alpha").status_code == 302
    again = add_through_the_form(alpha, agent.base_url, "Alpha again", "alpha")
    html = again.content.decode()
    assert again.status_code == 200
    assert "This URL is already registered in project alpha, as &#x27;Alpha copy&#x27;" in html
    assert "added once per project" in html
    assert "Beta copy" not in html and "project beta" not in html  # alpha's own row is named
    # The command line says the same, and adds nothing.
    with pytest.raises(CommandError, match="already registered in project alpha, as 'Alpha copy'"):
        call_command("agents", "add", agent.base_url, "--project", "alpha", stdout=StringIO())
    assert sorted(Agent.objects.values_list("project__name", "name")) == [
        ("alpha", "Alpha copy"),
        ("beta", "Beta copy"),
    ]
    # The database holds the rule too (two adds at once: the constraint decides).
    alpha_project = Project.objects.get(name="alpha")
    with pytest.raises(IntegrityError), transaction.atomic():
        Agent.objects.create(project=alpha_project, name="raced", base_url=agent.base_url)
    other = Project.objects.create(name="gamma")
    assert Agent.objects.create(project=other, name="gamma copy", base_url=agent.base_url).pk


@pytest.mark.django_db
def test_a_registered_url_is_refused_at_its_preview_and_free_again_once_retired(agent) -> None:
    """The preview of a URL the project holds showed the card and a Save that could only be
    refused; a retired agent's URL may be added again, as a new agent."""
    alpha = logged_in(admin_of("alpha"))
    assert add_through_the_form(alpha, agent.base_url, "Alpha copy", "alpha").status_code == 302
    first = Agent.objects.get(name="Alpha copy")
    preview = alpha.post(
        "/agents/add/",
        {"url": agent.base_url + "/.well-known/agent-card.json",
         "project": first.project_id, "action": "preview"},
    ).content.decode()  # fmt: skip
    assert "already registered in project alpha, as &#x27;Alpha copy&#x27;" in preview
    assert 'id="card-preview"' not in preview and 'value="save"' not in preview
    assert alpha.post(f"/agents/{first.pk}/retire/").status_code == 302
    # A name refused at Save keeps the preview and its Save (the card was gone from the page).
    refused = add_through_the_form(alpha, agent.base_url, "Alpha\u200bv2", "alpha")
    html = refused.content.decode()
    assert refused.status_code == 200 and "invisible formatting characters" in html
    assert 'id="card-preview"' in html and 'value="save"' in html
    assert add_through_the_form(alpha, agent.base_url, "Alpha v2", "alpha").status_code == 302
    second = Agent.objects.get(name="Alpha v2")
    assert second.pk != first.pk and second.retired_at is None
    assert Agent.objects.get(pk=first.pk).retired_at is not None


@pytest.mark.django_db(transaction=True)
def test_push_deliveries_go_to_the_project_whose_config_they_carry(monkeypatch) -> None:
    """Both projects mirror one remote task of the shared agent (each imported it): a
    notification on alpha's config is recorded on alpha's task alone, the same body on
    beta's config is beta's (not a repeat of alpha's), and one project's secrets open
    nothing of the other's."""
    monkeypatch.setattr(imports, "dispatch", lambda pk: None)  # no watcher: only the push
    alpha_admin, beta_admin = admin_of("alpha"), admin_of("beta")
    with running_agent(streaming=True, push=True) as shared:  # a fresh agent: its tasks are ours
        alpha_agent = add_agent(
            shared.base_url, name="Alpha copy", project=Project.objects.get(name="alpha"),
            actor_id=alpha_admin.pk,
        )  # fmt: skip
        beta_agent = add_agent(
            shared.base_url, name="Beta copy", project=Project.objects.get(name="beta"),
            actor_id=beta_admin.pk,
        )  # fmt: skip
        reply = outbound.run(
            lambda http: outbound.client_for(alpha_agent, http).send_message(user_message("ask"))
        )
        remote = reply.payload
        assert remote["status"]["state"] == "TASK_STATE_INPUT_REQUIRED", remote
        imports.import_tasks(alpha_agent, actor_id=alpha_admin.pk)
        imports.import_tasks(beta_agent, actor_id=beta_admin.pk)
    mine = RemoteTask.objects.get(agent=alpha_agent, remote_id=remote["id"])
    theirs = RemoteTask.objects.get(agent=beta_agent, remote_id=remote["id"])
    assert mine.pk != theirs.pk
    mine_config, their_config = push.new_config(mine), push.new_config(theirs)

    def pushed(task: RemoteTask) -> list[str]:
        return list(
            TaskEvent.objects.filter(task=task, channel="push").values_list("kind", flat=True)
        )

    body = json.dumps({"statusUpdate": {
        "taskId": remote["id"], "contextId": remote["contextId"],
        "status": {"state": "TASK_STATE_WORKING", "timestamp": "2030-01-01T00:00:01Z"},
    }}).encode()  # fmt: skip
    assert good(mine_config, body)[0] == 202
    assert set(drain_here()) == {mine.pk}
    assert pushed(mine) == ["statusUpdate"] and pushed(theirs) == []
    # The same bytes on beta's config: beta's own notification, not "already received".
    assert good(their_config, body) == (202, {"status": "accepted"})
    assert set(drain_here()) == {theirs.pk}
    assert pushed(mine) == ["statusUpdate"] and pushed(theirs) == ["statusUpdate"]
    # Beta's secrets on alpha's config (and the reverse) are refused, and change nothing.
    for config, other in ((mine_config, their_config), (their_config, mine_config)):
        values = secrets_of(other)
        later = body.replace(b"00:00:01", b"00:00:02")
        status, _ = deliver(
            config.config_id, later, token=values["token"],
            authorization=f"{values['scheme']} {values['credentials']}",
        )  # fmt: skip
        assert status == 401
    assert drain_here() == {}
    assert pushed(mine) == ["statusUpdate"] and pushed(theirs) == ["statusUpdate"]
    # Each project's people read their own mirror only.
    alpha = logged_in(alpha_admin)
    assert alpha.get(f"/tasks/{mine.pk}/").status_code == 200
    assert alpha.get(f"/tasks/{theirs.pk}/").status_code == 404


@pytest.mark.django_db
def test_the_command_line_refuses_a_url_or_remote_id_two_projects_share() -> None:
    """``tasks`` took the first row a URL (or a remote task id) matched: with one agent in two
    projects, an action could land on the other project's agent or task."""
    url = "http://127.0.0.1:1/"
    rows = [
        Agent.objects.create(name=f"shared-{name}", base_url=url,
                             project=Project.objects.get_or_create(name=name)[0])
        for name in ("alpha", "beta")
    ]  # fmt: skip
    for agent in rows:
        RemoteTask.objects.create(agent=agent, title="t", remote_id="r-1")
    for args in (["import", url], ["show", "r-1"]):
        with pytest.raises(CommandError, match="names more than one"):
            call_command("tasks", *args, stdout=StringIO())
    out = StringIO()
    call_command("tasks", "show", str(RemoteTask.objects.get(agent=rows[1]).pk), stdout=out)
    assert "r-1" in out.getvalue()


@pytest.mark.django_db
def test_a_person_in_both_projects_can_tell_the_two_rows_apart() -> None:
    """Two projects' rows of one agent share its card's name: the lists and the start and
    filter forms showed two identical entries to a person in both projects."""
    person = admin_of("alpha")
    member(person, Membership.Role.AGENT_ADMIN, "beta")
    for name in ("alpha", "beta"):
        Agent.objects.create(name="Shared", base_url="http://127.0.0.1:1/",
                             project=Project.objects.get(name=name))  # fmt: skip
    client = logged_in(person)
    listing = client.get("/agents/").content.decode()
    assert "<th>Project</th>" in listing and "<td>alpha</td>" in listing
    for page in ("/tasks/new", "/tasks/"):
        html = client.get(page).content.decode()
        assert "Shared (alpha)</option>" in html and "Shared (beta)</option>" in html, page
    # One project only: the names alone, as before.
    alone = logged_in(admin_of("gamma"))
    Agent.objects.create(name="Solo", base_url="http://127.0.0.1:2/",
                         project=Project.objects.get(name="gamma"))  # fmt: skip
    assert ">Solo</option>" in alone.get("/tasks/new").content.decode()


@pytest.mark.django_db
def test_one_agent_written_several_ways_is_one_agent_per_project(agent) -> None:
    """``http://h:p``, ``http://h:p/`` and ``HTTP://H:p/?x#y`` fetch the same card, and each
    was registered as an agent of its own in one project. The URL is stored in one form now,
    and a row stored before in another form is found all the same."""
    alpha = logged_in(admin_of("alpha"))
    base = agent.base_url.rstrip("/")
    assert add_through_the_form(alpha, base + "/", "Alpha copy", "alpha").status_code == 302
    assert Agent.objects.get().base_url == base
    shouted = base.replace("http://127.0.0.1", "HTTP://127.0.0.1", 1)
    # By its card's URL too: it was a second agent, its tasks imported a second time.
    card = base + "/.well-known/agent-card.json"
    for written in (base, base + "//", shouted + "/?x=1#top", f" {shouted} ", card):
        again = add_through_the_form(alpha, written, "Alpha again", "alpha")
        assert again.status_code == 200, written
        assert "This URL is already registered in project alpha" in again.content.decode()
        with pytest.raises(CommandError, match="already registered in project alpha"):
            call_command("agents", "add", written, "--project", "alpha", stdout=StringIO())
    assert Agent.objects.count() == 1
    # The command line finds the agent by any of its forms.
    row = Agent.objects.get()
    assert find_agent(base + "/") == row and find_agent(shouted) == row
    # A row stored before the one form (a trailing slash): still the same agent.
    Agent.objects.update(base_url=base + "/")
    with pytest.raises(CommandError, match="already registered in project alpha"):
        call_command("agents", "add", base, "--project", "alpha", stdout=StringIO())
    assert Agent.objects.count() == 1
