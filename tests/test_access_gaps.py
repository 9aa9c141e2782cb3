"""Who may do what, on the paths tests/test_access_matrix.py and test_project_boundaries.py
do not walk: access lost between two requests, CSRF and GET on every state-changing route,
ids of another project's objects under one's own task or agent or in a form, and actions
the task page hides in a task's current state.

Agents here listen nowhere (127.0.0.1:9, the discard port): an allowed call ends in its
plain error message, never in a call that leaves this machine.
"""

from __future__ import annotations

import base64
import uuid

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from tasks_app.models import (
    Agent,
    Alert,
    Artifact,
    ArtifactPart,
    ConversationMessage,
    ImportJob,
    Membership,
    OperatorAction,
    Project,
    RemoteTask,
    Surface,
    TaskEvent,
)
from tests.people import member

pytestmark = pytest.mark.django_db

TASK_POSTS = (
    "task-cancel", "task-refresh", "task-retry", "task-abandon", "task-watch-again",
    "task-answer", "task-surface-act", "task-watch-mode", "inbox-answer",
)  # fmt: skip
AGENT_POSTS = (
    "agent-credentials", "agent-refresh", "agent-approve-origin", "agent-import",
    "agent-rename", "agent-retire", "agent-restore",
)  # fmt: skip


def _agent(project: Project, name: str) -> Agent:
    slug = name.replace(" ", "-")
    return Agent.objects.create(
        project=project, name=name, base_url=f"http://127.0.0.1:9/{slug}",
        interface_url=f"http://127.0.0.1:9/{slug}/rpc", binding="JSONRPC",
    )  # fmt: skip


def _task(agent: Agent, title: str) -> RemoteTask:
    task = RemoteTask.objects.create(
        agent=agent, title=title, remote_id=f"r-{uuid.uuid4().hex[:8]}", phase="task",
        state="TASK_STATE_INPUT_REQUIRED", last_seq=1, asked_seq=1,
    )  # fmt: skip
    TaskEvent.objects.create(task=task, seq=1, channel="poll", kind="task", raw={"task": {}})
    return task


def _client(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _written() -> tuple[int, int]:
    """What an action leaves behind: operator-action rows and log entries."""
    return OperatorAction.objects.count(), TaskEvent.objects.count()


@pytest.fixture
def world() -> dict:
    """Projects alpha and beta, an agent and a waiting task in each, beta's task with an
    artifact, a message and an import job; an operator of alpha, logged in."""
    alpha = Project.objects.create(name="alpha")
    beta = Project.objects.create(name="beta")
    a_agent, b_agent = _agent(alpha, "alpha agent"), _agent(beta, "beta agent")
    a_task, b_task = _task(a_agent, "alpha secret title"), _task(b_agent, "beta secret title")
    part = {"raw": base64.b64encode(b"beta bytes").decode(), "mediaType": "text/plain"}
    b_artifact = Artifact.objects.create(task=b_task, artifact_id="b-1", name="beta out")
    ArtifactPart.objects.create(artifact=b_artifact, index=0, part=part)
    b_message = ConversationMessage.objects.create(
        task=b_task, message_id="bm-1", role="ROLE_AGENT", message={"parts": [part]}
    )
    b_job = ImportJob.objects.create(agent=b_agent, status=ImportJob.Status.QUEUED)
    op = member(User.objects.create_user("op-alpha"), Membership.Role.OPERATOR, "alpha")
    return {
        "alpha": alpha, "beta": beta, "a_agent": a_agent, "b_agent": b_agent,
        "a_task": a_task, "b_task": b_task, "b_artifact": b_artifact, "b_message": b_message,
        "b_job": b_job, "op": op, "client": _client(op),
    }  # fmt: skip


# Access lost between two requests ---------------------------------------------------------


def test_a_person_made_inactive_is_logged_out_at_the_next_request(world) -> None:
    client, task = world["client"], world["a_task"]
    assert client.get(reverse("task-detail", args=[task.pk])).status_code == 200
    User.objects.filter(pk=world["op"].pk).update(is_active=False)
    assert client.get(reverse("task-detail", args=[task.pk])).status_code == 302
    before = _written()
    assert client.post(reverse("task-abandon", args=[task.pk])).status_code == 302
    task.refresh_from_db()
    assert task.abandoned_at is None and _written() == before


def test_a_person_removed_from_the_project_finds_nothing_at_the_next_request(world) -> None:
    client, task = world["client"], world["a_task"]
    assert "alpha secret title" in client.get(reverse("inbox")).content.decode()
    Membership.objects.filter(user=world["op"]).delete()
    assert client.get(reverse("task-detail", args=[task.pk])).status_code == 404
    before = _written()
    assert client.post(reverse("task-abandon", args=[task.pk])).status_code == 404
    task.refresh_from_db()
    assert task.abandoned_at is None and _written() == before  # not even a refusal row
    for name in ("overview", "task-list", "inbox", "alerts", "agent-list"):
        body = client.get(reverse(name)).content.decode()
        assert "alpha secret title" not in body and "alpha agent" not in body, name


def test_an_operator_made_viewer_is_refused_at_the_next_request(world) -> None:
    client, task = world["client"], world["a_task"]
    Membership.objects.filter(user=world["op"]).update(role=Membership.Role.VIEWER)
    assert client.post(reverse("task-abandon", args=[task.pk])).status_code == 403
    task.refresh_from_db()
    assert task.abandoned_at is None


def test_an_auditor_removed_from_the_project_exports_nothing_in_any_format(world) -> None:
    auditor = member(User.objects.create_user("aud"), Membership.Role.AUDITOR, "alpha")
    client, task = _client(auditor), world["a_task"]
    export = reverse("task-export", args=[task.pk])
    for fmt in ("json", "jsonl"):
        assert client.get(f"{export}?format={fmt}").status_code == 200
    assert client.get(reverse("audit-csv")).status_code == 200
    Membership.objects.filter(user=auditor).delete()
    # 404 whatever the format (a bad one too: its 400 would say the task exists).
    for fmt in ("json", "jsonl", "xml"):
        assert client.get(f"{export}?format={fmt}").status_code == 404
    assert client.get(reverse("audit-csv")).status_code == 403
    assert client.get(reverse("audit")).status_code == 403


# CSRF, and GET never changes anything ------------------------------------------------------


def _post_routes(world: dict) -> list[str]:
    task, agent = world["a_task"], world["a_agent"]
    return [
        *(reverse(name, args=[task.pk]) for name in TASK_POSTS),
        *(reverse(name, args=[agent.pk]) for name in AGENT_POSTS),
        reverse("task-push-config-delete", args=[task.pk, "x"]),
        reverse("agent-import-cancel", args=[agent.pk, world["b_job"].pk]),
        reverse("task-new"),
        reverse("agent-add"),
        reverse("alerts-test"),
    ]


def test_every_state_changing_route_needs_the_csrf_token(world) -> None:
    admin = member(User.objects.create_user("adm"), Membership.Role.AGENT_ADMIN, "alpha")
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin)
    before = _written()
    form = {"text": "x", "question": "1", "watch": "poll", "url": "http://127.0.0.1:9/n",
            "origin": "http://127.0.0.1:9", "kind": "clear", "action": "save"}  # fmt: skip
    for url in _post_routes(world):
        assert client.post(url, form).status_code == 403, url
    assert _written() == before
    assert RemoteTask.objects.count() == 2 and Agent.objects.count() == 2


def test_a_get_on_a_state_changing_route_changes_nothing(world) -> None:
    admin = member(User.objects.create_user("adm"), Membership.Role.AGENT_ADMIN, "alpha")
    client = _client(admin)
    before = _written()
    for url in _post_routes(world):
        query = "?watch=poll&text=go&origin=http://127.0.0.1:9&url=http://127.0.0.1:9/n"
        answer = client.get(url + query)
        # The two forms answer GET with the empty form; every other route refuses the method.
        assert answer.status_code == (200 if url in ("/tasks/new", "/agents/add/") else 405), url
    assert _written() == before
    assert RemoteTask.objects.count() == 2 and Agent.objects.count() == 2
    world["b_job"].refresh_from_db()
    assert world["b_job"].status == ImportJob.Status.QUEUED


# Another project's ids under one's own objects and in forms -------------------------------


def test_another_projects_artifact_message_and_import_job_under_ones_own_are_not_found(
    world,
) -> None:
    client, task, agent = world["client"], world["a_task"], world["a_agent"]
    artifact, message = world["b_artifact"], world["b_message"]
    for url in (
        reverse("artifact-download-all", args=[task.pk, artifact.pk]),
        reverse("artifact-download", args=[task.pk, artifact.pk, 0]),
        reverse("message-download", args=[task.pk, message.pk, 0]),
    ):
        assert client.get(url).status_code == 404, url
    before = _written()
    cancel = reverse("agent-import-cancel", args=[agent.pk, world["b_job"].pk])
    assert client.post(cancel).status_code == 404
    world["b_job"].refresh_from_db()
    assert world["b_job"].status == ImportJob.Status.QUEUED and _written() == before


def test_a_surface_id_of_another_projects_task_acts_on_nothing(world) -> None:
    theirs = Surface.objects.create(
        task=world["b_task"], surface_id="s-1", version="v0.9", ready=True, updated_seq=1
    )
    before = _written()
    answer = world["client"].post(
        reverse("task-surface-act", args=[world["a_task"].pk]),
        {"surface": "s-1", "seq": "1", "source": "b0"},
    )
    assert answer.status_code == 302
    theirs.refresh_from_db()
    assert theirs.action_seq is None and _written() == before
    assert "beta" not in world["client"].get(answer["Location"]).content.decode()


def test_a_task_is_not_started_on_another_projects_agent(world) -> None:
    answer = world["client"].post(
        reverse("task-new"), {"agent": world["b_agent"].pk, "text": "hi", "mode": "auto"}
    )
    assert answer.status_code == 400 and "beta agent" not in answer.content.decode()
    assert list(RemoteTask.objects.filter(agent=world["b_agent"])) == [world["b_task"]]


def test_an_agent_is_not_added_to_a_project_one_does_not_manage(world) -> None:
    admin = member(User.objects.create_user("adm"), Membership.Role.AGENT_ADMIN, "alpha")
    url = "http://127.0.0.1:9/new"
    answer = _client(admin).post(
        reverse("agent-add"), {"url": url, "project": world["beta"].pk, "action": "save"}
    )
    assert answer.status_code == 200 and "beta" not in answer.content.decode()
    assert not Agent.objects.filter(base_url=url).exists()


def test_the_task_list_filter_and_search_find_nothing_of_another_project(world) -> None:
    b_task = world["b_task"]
    for query in (f"?agent={world['b_agent'].pk}", "?q=beta", f"?q={b_task.remote_id}"):
        body = world["client"].get(reverse("task-list") + query).content.decode()
        assert "beta secret title" not in body and "beta agent" not in body, query


def test_another_projects_alerts_open_or_resolved_are_shown_nowhere(world) -> None:
    now = timezone.now()
    for key, resolved in (("parked:b1", now), ("parked:b2", None)):
        Alert.objects.create(
            rule=Alert.Rule.PARKED, task=world["b_task"], agent=world["b_agent"], key=key,
            message="The watcher parked task beta secret title", opened_at=now,
            resolved_at=resolved,
        )  # fmt: skip
    for name in ("alerts", "alerts-live", "overview", "inbox"):
        assert "beta secret title" not in world["client"].get(reverse(name)).content.decode()


# What the page hides in a task's state, the server refuses --------------------------------


@pytest.mark.parametrize(
    "state,phase,remote_id,name",
    [
        ("TASK_STATE_COMPLETED", "task", "r-done", "task-abandon"),
        ("TASK_STATE_COMPLETED", "task", "r-done", "task-cancel"),
        ("", "message", "", "task-abandon"),
        ("", "message", "", "task-refresh"),
        ("", "message", "", "task-cancel"),
    ],
)
def test_an_action_the_page_hides_in_this_state_is_refused_and_recorded_nowhere(
    world, state, phase, remote_id, name
) -> None:
    """Abandoning a completed task set its watcher status to "abandoned" and wrote an
    abandon entry into its log; refreshing a plain message reply wrote a refresh entry
    before failing; canceling either wrote an operator-action row. The page offers none."""
    task = world["a_task"]
    RemoteTask.objects.filter(pk=task.pk).update(state=state, phase=phase, remote_id=remote_id)
    page = world["client"].get(reverse("task-detail", args=[task.pk])).content.decode()
    shown = {"task-abandon": "abandon-form", "task-cancel": "cancel-form"}
    assert f'id="{shown.get(name, "refresh-button")}"' not in page  # not offered...
    before = _written()
    answer = world["client"].post(reverse(name, args=[task.pk]), follow=True)
    assert answer.status_code == 200 and 'class="flash-error"' in answer.content.decode()
    # ...and not taken: no log entry, no operator action, no change.
    assert _written() == before
    task.refresh_from_db()
    assert task.abandoned_at is None and task.watcher_status != "abandoned"


@pytest.mark.parametrize("action", ["abandon", "switch-watch"])
@pytest.mark.parametrize(("state", "phase"), [("TASK_STATE_COMPLETED", "task"), ("", "message")])
def test_a_task_that_ended_after_the_page_looked_is_not_abandoned_or_switched(
    world, action, state, phase
) -> None:
    """The services check again in their compare-and-set: the page (and the view) saw a
    running task, the agent's end was recorded before the operator's write."""
    from tasks_app.services import tasks as task_services

    task = world["a_task"]
    RemoteTask.objects.filter(pk=task.pk).update(watch="push")
    task.refresh_from_db()  # what the view read: unfinished, so offered
    RemoteTask.objects.filter(pk=task.pk).update(state=state, phase=phase)  # then it ended
    before = _written()
    with pytest.raises(task_services.TaskActionError, match=r"ended|unfinished"):
        if action == "abandon":
            task_services.abandon_task(task, actor_id=world["op"].pk)
        else:
            task_services.switch_watch(task, "poll", actor_id=world["op"].pk)
    assert _written() == before
    task.refresh_from_db()
    assert (task.abandoned_at, task.watch, task.watcher_status) == (None, "push", "idle")


def test_a_refusal_on_a_page_of_no_one_project_says_why_not_role_none(world) -> None:
    """Adding an agent belongs to no one project until the form names one: the refusal row
    said "role none may not manage_agents" of an operator who has a role."""
    client = world["client"]  # an operator of alpha
    assert client.post(reverse("agent-add"), {"url": "http://127.0.0.1:9/x"}).status_code == 403
    row = OperatorAction.objects.filter(action="forbidden").latest("id")
    assert row.outcome == "refused: no project of theirs lets them manage agents"
    assert "none" not in row.outcome
