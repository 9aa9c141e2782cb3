"""What one project's people can do to, or learn of, another project's tasks.

The per-user lookups keep every task and agent page inside the person's projects; these
are the paths where an id from the URL or a list across projects could still reach out.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator

import pytest
from django.contrib.auth.models import User
from django.test import Client

from tasks_app.crypto import decrypt_json
from tasks_app.models import (
    Agent,
    Alert,
    AlertDelivery,
    Membership,
    OperatorAction,
    Project,
    RemoteTask,
)
from tasks_app.services import push
from tests.people import member
from tests.serving import json_rpc_peer

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("empty_push_queue")]


@pytest.fixture
def agreeable_agent() -> Iterator[str]:
    """A JSON-RPC agent that answers every call with an empty success (as many stores answer
    a delete of an id they do not hold); its base URL."""
    with json_rpc_peer(lambda request: {}) as url:
        yield url


def project_task(project: str, base_url: str) -> RemoteTask:
    agent = Agent.objects.create(
        name=f"{project} agent", base_url=base_url, interface_url=f"{base_url}/jsonrpc",
        binding="JSONRPC", protocol_version="1.0", push=True,
        project=Project.objects.get_or_create(name=project)[0],
    )  # fmt: skip
    return RemoteTask.objects.create(
        agent=agent, title=f"{project} secret title", remote_id=f"{project}-1",
        phase=RemoteTask.Phase.TASK, state="TASK_STATE_WORKING", watch=RemoteTask.Watch.PUSH,
    )  # fmt: skip


def deliver(config, body: bytes) -> int:
    values = decrypt_json(config.secrets_encrypted)
    return Client().post(
        f"/push/{config.config_id}/", data=body, content_type="application/json",
        REMOTE_ADDR=f"10.9.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}",
        HTTP_X_A2A_NOTIFICATION_TOKEN=values["token"],
        HTTP_AUTHORIZATION=f"{values['scheme']} {values['credentials']}",
    ).status_code  # fmt: skip


def test_deleting_another_projects_config_through_ones_own_task_leaves_it_working(
    agreeable_agent,
):
    mine = project_task("mine", agreeable_agent)
    theirs = project_task("theirs", f"http://127.0.0.1:1/{uuid.uuid4().hex}")
    their_config = push.new_config(theirs)
    operator = member(User.objects.create_user("op"), Membership.Role.OPERATOR, "mine")
    client = Client()
    client.force_login(operator)

    def status(n: int) -> bytes:
        return json.dumps({"statusUpdate": {"taskId": "theirs-1", "status": {
            "state": "TASK_STATE_WORKING", "timestamp": f"2026-01-01T00:00:0{n}Z"}}}).encode()  # fmt: skip

    assert deliver(their_config, status(1)) == 202  # the webhook knows the config
    response = client.post(f"/tasks/{mine.pk}/push/{their_config.config_id}/delete/")
    assert response.status_code in (200, 302)
    their_config.refresh_from_db()
    assert their_config.deleted_at is None
    # Their deliveries are still taken: the webhook did not forget their config.
    assert deliver(their_config, status(2)) == 202


def test_the_alert_deliveries_a_tester_sees_are_of_their_own_projects(client):
    theirs = project_task("theirs", f"http://127.0.0.1:1/{uuid.uuid4().hex}")
    mine = project_task("mine", f"http://127.0.0.1:1/{uuid.uuid4().hex}")
    for task in (theirs, mine):
        alert = Alert.objects.create(
            rule=Alert.Rule.PARKED, task=task, agent=task.agent, key=f"parked:{task.pk}",
            message=f"The watcher parked task {task.title}",
        )  # fmt: skip
        AlertDelivery.objects.create(
            alert=alert, channel=AlertDelivery.Channel.EMAIL, event="opened",
            target="ops@example.test", outcome=AlertDelivery.Outcome.SENT,
        )  # fmt: skip
    test_alert = Alert.objects.create(rule=Alert.Rule.TEST, key="test:1", message="a test alert")
    AlertDelivery.objects.create(
        alert=test_alert, channel=AlertDelivery.Channel.EMAIL, event="test",
        target="ops@example.test", outcome=AlertDelivery.Outcome.SENT,
    )  # fmt: skip
    admin = member(User.objects.create_user("admin-of-mine"), Membership.Role.AGENT_ADMIN, "mine")
    client.force_login(admin)
    html = client.get("/alerts/").content.decode()
    assert "mine secret title" in html and "a test alert" in html
    assert "theirs secret title" not in html


def test_a_test_alert_sent_in_another_project_names_no_one_there(client):
    from tasks_app import alerts

    sender = member(User.objects.create_user("theirs-admin-name"), Membership.Role.AGENT_ADMIN,
                    "theirs")  # fmt: skip
    alert, _ = alerts.send_test(sender)
    AlertDelivery.objects.create(
        alert=alert, channel=AlertDelivery.Channel.EMAIL, event="test",
        target="ops@example.test", outcome=AlertDelivery.Outcome.SENT,
    )  # fmt: skip
    admin = member(User.objects.create_user("admin-of-mine"), Membership.Role.AGENT_ADMIN, "mine")
    client.force_login(admin)
    html = client.get("/alerts/").content.decode()
    assert alert.message in html  # the delivery is listed (test alerts name no task)...
    assert "theirs-admin-name" not in html  # ...and not who sent it
    # Who sent it stays in the audit log.
    assert OperatorAction.objects.get(action="alert-test").actor_id == sender.pk


def test_roles_given_or_taken_in_the_admin_are_in_the_action_log():
    """The README offers the admin or ``manage.py members`` to manage members; only the
    command wrote the change to the action log, so a role granted in the admin left no trace."""
    root = User.objects.create_superuser("root")
    vic = User.objects.create_user("vic")
    project = Project.objects.create(name="secret")
    client = Client()
    client.force_login(root)

    def logged() -> list[tuple[str, dict]]:
        rows = OperatorAction.objects.filter(action__startswith="member-").order_by("pk")
        return [(row.action, row.payload) for row in rows if row.actor_id == root.pk]

    when = {"created_at_0": "2026-12-05", "created_at_1": "10:00:00"}  # the admin's two inputs
    added = client.post(
        "/admin/tasks_app/membership/add/",
        {"user": vic.pk, "project": project.pk, "role": Membership.Role.AUDITOR, **when},
    )
    assert added.status_code == 302, re.findall(
        r"errorlist[^>]*>(.*?)</ul>", added.content.decode(), re.S
    )
    membership = Membership.objects.get(user=vic, project=project)
    changed = client.post(
        f"/admin/tasks_app/membership/{membership.pk}/change/",
        {"user": vic.pk, "project": project.pk, "role": Membership.Role.OPERATOR, **when},
    )
    assert changed.status_code == 302
    removed = client.post(f"/admin/tasks_app/membership/{membership.pk}/delete/", {"post": "yes"})
    assert removed.status_code == 302 and not Membership.objects.filter(user=vic).exists()
    # The project's page, its members inline: given, then taken away.
    inline = {"name": "secret", **when, "memberships-INITIAL_FORMS": "0", "memberships-TOTAL_FORMS": "1",
              "memberships-0-user": vic.pk, "memberships-0-role": Membership.Role.VIEWER,
              "memberships-0-created_at_0": "2026-12-05", "memberships-0-created_at_1": "10:00:00"}  # fmt: skip
    page = f"/admin/tasks_app/project/{project.pk}/change/"
    response = client.post(page, inline)
    assert response.status_code == 302, re.findall(
        r"errorlist[^>]*>(.*?)</ul>", response.content.decode(), re.S
    )
    membership = Membership.objects.get(user=vic, project=project)
    inline |= {"memberships-INITIAL_FORMS": "1", "memberships-0-id": membership.pk,
               "memberships-0-project": project.pk, "memberships-0-DELETE": "on"}  # fmt: skip
    assert client.post(page, inline).status_code == 302
    assert not Membership.objects.filter(user=vic).exists()
    said = {"user": "vic", "project": "secret"}
    assert logged() == [
        ("member-add", {**said, "role": Membership.Role.AUDITOR}),
        ("member-add", {**said, "role": Membership.Role.OPERATOR}),
        ("member-remove", said),
        ("member-add", {**said, "role": Membership.Role.VIEWER}),
        ("member-remove", said),
    ]


def test_roles_taken_away_in_the_admin_by_a_move_or_a_deletion_are_in_the_action_log():
    """A membership moved to another person or project, or a person deleted, takes a role
    away; the log said only what was given (a ``member-add`` for the new pair), so it went
    on saying the first person held the role. Superuser status opens every project."""
    root = User.objects.create_superuser("root")
    vic, val = User.objects.create_user("vic"), User.objects.create_user("val")
    secret, open_ = Project.objects.create(name="secret"), Project.objects.create(name="open")
    membership = Membership.objects.create(user=vic, project=secret, role=Membership.Role.VIEWER)
    client = Client()
    client.force_login(root)

    def logged() -> list[tuple[str, dict]]:
        rows = OperatorAction.objects.filter(actor_id=root.pk).order_by("pk")
        return [(row.action, row.payload) for row in rows]

    when = {"created_at_0": "2026-12-05", "created_at_1": "10:00:00"}
    page = f"/admin/tasks_app/membership/{membership.pk}/change/"
    viewer = Membership.Role.VIEWER
    moved = client.post(page, {"user": vic.pk, "project": open_.pk, "role": viewer, **when})
    assert moved.status_code == 302
    moved = client.post(page, {"user": val.pk, "project": open_.pk, "role": viewer, **when})
    assert moved.status_code == 302
    # In the project's inline, to another person again.
    inline = {"name": "open", **when, "memberships-INITIAL_FORMS": "1",
              "memberships-TOTAL_FORMS": "1", "memberships-0-id": membership.pk,
              "memberships-0-project": open_.pk, "memberships-0-user": vic.pk,
              "memberships-0-role": viewer, "memberships-0-created_at_0": "2026-12-05",
              "memberships-0-created_at_1": "10:00:00"}  # fmt: skip
    assert client.post(f"/admin/tasks_app/project/{open_.pk}/change/", inline).status_code == 302
    assert Membership.objects.get(pk=membership.pk).user == vic
    # Made a superuser, then deleted with the membership still held.
    person = {"username": "vic", "is_active": "on", "is_superuser": "on",
              "date_joined_0": "2026-12-05", "date_joined_1": "10:00:00"}  # fmt: skip
    made = client.post(f"/admin/auth/user/{vic.pk}/change/", person)
    assert made.status_code == 302, re.findall(
        r"errorlist[^>]*>(.*?)</ul>", made.content.decode(), re.S
    )
    assert client.post(f"/admin/auth/user/{vic.pk}/delete/", {"post": "yes"}).status_code == 302
    assert not User.objects.filter(username="vic").exists()
    assert logged() == [
        ("member-remove", {"user": "vic", "project": "secret"}),
        ("member-add", {"user": "vic", "project": "open", "role": viewer}),
        ("member-remove", {"user": "vic", "project": "open"}),
        ("member-add", {"user": "val", "project": "open", "role": viewer}),
        ("member-remove", {"user": "val", "project": "open"}),
        ("member-add", {"user": "vic", "project": "open", "role": viewer}),
        ("superuser-add", {"user": "vic"}),
        ("member-remove", {"user": "vic", "project": "open"}),
        ("superuser-remove", {"user": "vic"}),
    ]


def test_the_admin_opens_for_superusers_only():
    from django.contrib.auth.models import Permission

    staff = User.objects.create_user("staff", is_staff=True)
    staff.user_permissions.set(Permission.objects.all())  # every model permission there is
    client = Client()
    client.force_login(staff)
    assert client.get("/admin/").status_code == 302  # to the admin's login
    assert client.get("/admin/tasks_app/agent/").status_code == 302
    root = User.objects.create_superuser("root")
    client.force_login(root)
    assert client.get("/admin/").status_code == 200
    assert client.get("/admin/tasks_app/agent/").status_code == 200
