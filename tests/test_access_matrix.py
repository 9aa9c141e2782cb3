"""Every URL and websocket route x every kind of person: the expected answer for each.

The routes come from the URL conf (and the websocket routes from ``tasks_app.routing``),
so a new view without a rule in ``RULES`` fails ``test_every_route_has_a_rule``. The
people: anonymous, a viewer, an operator, an agent admin and an auditor of project
``alpha`` (which holds every object the URLs name), and an operator of project ``beta``
(who must not learn that alpha's objects exist: 404, never 403).

A refused action is a 403 plus an operator-action row saying what was refused, and it
changes nothing. Agents here listen nowhere (127.0.0.1:9, the discard port, refused at
once), so the allowed actions end in their plain error message, never in a call that
leaves this machine.
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass

import pytest
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse

from tasks_app.access import Perm
from tasks_app.models import (
    Agent,
    Artifact,
    ArtifactPart,
    ConversationMessage,
    ImportJob,
    Membership,
    OperatorAction,
    Project,
    RemoteTask,
    TaskEvent,
)
from tasks_app.routing import websocket_urlpatterns
from tests.people import member, signed_in
from tests.test_consumers import refused_with

pytestmark = pytest.mark.django_db(transaction=True)

LOGIN = "login"  # any logged-in person (what they see is filtered, not refused)
PUBLIC = "public"
STAFF = "staff"


@dataclass(frozen=True)
class Rule:
    method: str
    need: Perm | str
    ok: int | frozenset[int]  # the answer to a person who may
    data: tuple[tuple[str, str], ...] = ()
    json: bool = False  # post the data as a JSON body

    @property
    def answers(self) -> set[int]:
        return {self.ok} if isinstance(self.ok, int) else set(self.ok)


R, OP, M = Perm.READ, Perm.OPERATE, Perm.MANAGE_AGENTS

RULES: dict[str, Rule] = {
    # ok or not ok (without a worker answering the ping), and nothing more to anyone.
    "healthz": Rule("GET", PUBLIC, frozenset({200, 503})),
    # Staff or the metrics token only; nobody here is staff, and nobody is redirected.
    "metrics": Rule("GET", STAFF, 200),
    "login": Rule("GET", PUBLIC, 200),
    "logout": Rule("POST", PUBLIC, 302),
    "overview": Rule("GET", LOGIN, 200),
    "agent-list": Rule("GET", LOGIN, 200),
    "task-list": Rule("GET", LOGIN, 200),
    "agent-add": Rule("GET", M, 200),
    "agent-detail": Rule("GET", R, 200),
    "agent-card": Rule("GET", R, 200),
    "agent-credentials": Rule("POST", M, 400),  # an empty form: refused with its errors
    "agent-refresh": Rule("POST", M, 302),
    "agent-rename": Rule("POST", M, 400),  # an empty name: refused next to the field
    "agent-retire": Rule("POST", M, 302),  # its open tasks: refused with a message
    "agent-restore": Rule("POST", M, 302),  # not retired: said so
    "agent-approve-origin": Rule("POST", M, 302),
    "agent-import": Rule("POST", OP, 302),
    "agent-import-status": Rule("GET", R, 200),
    "agent-import-cancel": Rule("POST", OP, 302),
    "task-new": Rule("GET", OP, 200),
    "task-new-slash": Rule("GET", PUBLIC, 302),  # to task-new, which asks what task-new asks
    "task-detail": Rule("GET", R, 200),
    "task-row": Rule("GET", R, 200),
    "task-live": Rule("GET", R, 200),
    "task-cancel": Rule("POST", OP, 302),
    "task-refresh": Rule("POST", OP, 302),
    "task-retry": Rule("POST", OP, 302),
    "task-abandon": Rule("POST", OP, 302),
    "task-watch-again": Rule("POST", OP, 302),
    "task-answer": Rule("POST", OP, 400),  # an empty answer: refused next to the field
    "task-events": Rule("GET", R, 200),
    # A2UI surfaces: the live fragment is reading; a Button's action is operating (an empty
    # form: told so and sent back to the task, 302).
    "task-surfaces": Rule("GET", R, 200),
    "task-surface-act": Rule("POST", OP, 302),
    "event-detail": Rule("GET", R, 200),
    "artifact-download-all": Rule("GET", R, 200),
    "artifact-download": Rule("GET", R, 200),
    "message-download": Rule("GET", R, 200),
    "task-push-configs": Rule("GET", R, 200),
    "task-push-config-delete": Rule("POST", OP, 302),
    "task-watch-mode": Rule("POST", OP, 302, (("watch", "poll"),)),
    # Public, authenticated per config: an unknown config is 404 for everyone.
    "push-webhook": Rule("POST", PUBLIC, 404, json=True),
    # The auditor's screen: the action log (and its CSV) for people who audit somewhere, and
    # a task's history export (read + audit: 403 for viewers, operators, agent admins).
    "audit": Rule("GET", Perm.AUDIT, 200),
    "audit-csv": Rule("GET", Perm.AUDIT, 200),
    "task-export": Rule("GET", Perm.AUDIT, 200),
    # The inbox: everyone sees the waiting tasks of the projects they read; a row is a task
    # (read); answering from it is operating (an empty form: refused next to the field, 400).
    "inbox": Rule("GET", LOGIN, 200),
    "inbox-row": Rule("GET", R, 200),
    "inbox-answer": Rule("POST", OP, 400),
    # Alerts: everyone sees those of the projects they read; the live section answers 204
    # when the version sent is current (here none is sent: 200). A test alert: staff and
    # agent admins (no channel is configured in tests: it says so and goes back, 302).
    "alerts": Rule("GET", LOGIN, 200),
    "alerts-live": Rule("GET", LOGIN, 200),
    "alerts-test": Rule("POST", M, 302),
    # The guides the pages link to: any logged-in person.
    "guide": Rule("GET", LOGIN, 200),
}
ADMIN = "admin:index"  # the admin as a whole: staff only (checked on its index)

ROLES = {
    "viewer": Membership.Role.VIEWER,
    "operator": Membership.Role.OPERATOR,
    "agent admin": Membership.Role.AGENT_ADMIN,
    "auditor": Membership.Role.AUDITOR,
}
PEOPLE = ["anonymous", *ROLES, "outsider"]


def app_routes() -> list[tuple[str, URLPattern]]:
    """(name, pattern) of every named route outside the admin, from the URL conf."""
    found: list[tuple[str, URLPattern]] = []

    def walk(patterns: list, namespace: str | None) -> None:
        for entry in patterns:
            if isinstance(entry, URLResolver):
                if entry.namespace == "admin":
                    continue
                walk(entry.url_patterns, entry.namespace or namespace)
            elif isinstance(entry, URLPattern):
                assert entry.name, f"route {entry.pattern} has no name, so it cannot have a rule"
                found.append((f"{namespace}:{entry.name}" if namespace else entry.name, entry))

    walk(get_resolver().url_patterns, None)
    return found


@pytest.fixture
def world(django_user_model) -> dict:
    alpha = Project.objects.create(name="alpha")
    beta = Project.objects.create(name="beta")
    agent = Agent.objects.create(
        project=alpha, name="alpha agent", base_url="http://127.0.0.1:9/alpha",
        interface_url="http://127.0.0.1:9/alpha/rpc", binding="JSONRPC", pending_origin="http://127.0.0.1:9",
    )  # fmt: skip
    Agent.objects.create(project=beta, name="beta agent", base_url="http://127.0.0.1:9/beta")
    task = RemoteTask.objects.create(
        agent=agent, title="alpha task", remote_id="t-alpha", phase="task",
        state="TASK_STATE_INPUT_REQUIRED", last_seq=1, asked_seq=1,
    )  # fmt: skip
    TaskEvent.objects.create(
        task=task, seq=1, channel="poll", kind="task", raw={"task": {"id": "t-alpha"}}
    )
    artifact = Artifact.objects.create(task=task, artifact_id="a-1", name="out")
    raw_part = {
        "raw": base64.b64encode(b"alpha bytes").decode(),
        "mediaType": "text/plain",
        "filename": "a.txt",
    }
    ArtifactPart.objects.create(artifact=artifact, index=0, part=raw_part)
    message = ConversationMessage.objects.create(
        task=task, message_id="m-1", role="ROLE_AGENT", message={"parts": [raw_part]}
    )
    job = ImportJob.objects.create(agent=agent, status=ImportJob.Status.DONE)
    people: dict[str, Client] = {"anonymous": Client()}
    for label, role in ROLES.items():
        user = member(
            django_user_model.objects.create_user(label.replace(" ", "-"), password="pw-12345678"),
            role,
            "alpha",
        )
        people[label] = Client()
        people[label].force_login(user)
    outsider = member(
        django_user_model.objects.create_user("outsider", password="pw-12345678"),
        Membership.Role.OPERATOR,
        "beta",
    )
    people["outsider"] = Client()
    people["outsider"].force_login(outsider)
    kwargs = {
        "pk": None, "job_pk": job.pk, "artifact_pk": artifact.pk, "index": 0,
        "message_pk": message.pk, "seq": 1, "config_id": uuid.uuid4().hex, "name": "exports",
    }  # fmt: skip
    return {"agent": agent, "task": task, "people": people, "kwargs": kwargs}


def url_for(name: str, pattern: URLPattern, world: dict) -> str:
    wanted = dict(world["kwargs"])
    wanted["pk"] = world["agent"].pk if name.startswith("agent-") else world["task"].pk
    args = {key: wanted[key] for key in pattern.pattern.converters}
    return reverse(name, kwargs=args)


def expected(rule: Rule, person: str) -> set[int]:
    if rule.need == PUBLIC:
        return rule.answers
    if rule.need == STAFF:
        return {403}
    if person == "anonymous":
        return {302}  # to the login page
    if rule.need == LOGIN:
        return rule.answers
    if person == "outsider":
        if not name_is_not_about_an_object(rule):
            return {404}  # another project's objects do not exist for them
        # Adding an agent or starting a task: as their own role (operator of beta) allows.
        person = "operator"
    allowed = {
        "viewer": {R}, "operator": {R, OP}, "agent admin": {R, OP, M}, "auditor": {R, Perm.AUDIT},
    }[person]  # fmt: skip
    return rule.answers if rule.need in allowed else {403}


def name_is_not_about_an_object(rule: Rule) -> bool:
    # By identity: rules are values, and two routes may share one (audit and task-export do).
    return any(
        rule is RULES[name]
        for name in ("agent-add", "task-new", "audit", "audit-csv", "alerts-test")
    )


def test_every_route_has_a_rule() -> None:
    names = {name for name, _ in app_routes()}
    missing = sorted(names - set(RULES))
    assert not missing, f"routes without an access rule in tests/test_access_matrix.py: {missing}"
    assert not set(RULES) - names, (
        f"rules for routes that no longer exist: {sorted(set(RULES) - names)}"
    )
    ws_missing = [str(p.pattern) for p in websocket_urlpatterns if str(p.pattern) not in WS_RULES]
    assert not ws_missing, f"websocket routes without a rule: {ws_missing}"


@pytest.mark.parametrize("person", PEOPLE)
def test_every_route_answers_as_the_role_allows(world, person) -> None:
    client = world["people"][person]
    wrong: list[str] = []
    for name, pattern in app_routes():
        if name in ("logout",):
            continue  # would end this person's session for the routes after it
        rule = RULES[name]
        url = url_for(name, pattern, world)
        refused_before = OperatorAction.objects.filter(action="forbidden").count()
        if rule.method == "GET":
            response = client.get(url)
        elif rule.json:
            response = client.post(url, dict(rule.data), content_type="application/json")
        else:
            response = client.post(url, dict(rule.data))
        want = expected(rule, person)
        if response.status_code not in want:
            wrong.append(
                f"{rule.method} {name} ({url}): {response.status_code}, expected {sorted(want)}"
            )
            continue
        if response.status_code == 403 and isinstance(rule.need, Perm):
            # Refusals are written down: who wanted what, and the role that did not allow it.
            assert (
                OperatorAction.objects.filter(action="forbidden").count() == refused_before + 1
            ), name
        if response.status_code == 302 and person == "anonymous" and rule.need != PUBLIC:
            assert response["Location"].startswith(reverse("login")), name
    assert not wrong, "\n".join(wrong)


def test_the_admin_is_for_staff_only(world, django_user_model) -> None:
    index = reverse(ADMIN)
    for person in PEOPLE:
        response = world["people"][person].get(index)
        assert response.status_code == 302 and "/admin/login/" in response["Location"], person
    root = Client()
    root.force_login(django_user_model.objects.create_superuser("root", "", "pw-12345678"))
    assert root.get(index).status_code == 200


def test_refused_actions_change_nothing(world) -> None:
    task = world["task"]
    before = (task.state, task.abandoned_at, task.last_seq)
    for person in ("viewer", "auditor"):
        client = world["people"][person]
        for name in ("task-cancel", "task-abandon", "task-retry", "task-refresh"):
            assert client.post(reverse(name, args=[task.pk])).status_code == 403
        assert (
            client.post(
                reverse("task-answer", args=[task.pk]), {"text": "yes", "question": "1"}
            ).status_code
            == 403
        )
    task.refresh_from_db()
    assert (task.state, task.abandoned_at, task.last_seq) == before
    assert not task.actions.exclude(action="forbidden").exists()
    row = OperatorAction.objects.filter(action="forbidden", task=task).first()
    assert row is not None and row.outcome.startswith("refused: role ") and row.actor is not None


def test_lists_and_counts_only_show_what_the_person_may_read(world) -> None:
    outsider = world["people"]["outsider"]
    for name in ("overview", "task-list", "agent-list"):
        body = outsider.get(reverse(name)).content.decode()
        assert "alpha agent" not in body and "alpha task" not in body, name
        assert "beta agent" in body or name == "task-list", name
    viewer = world["people"]["viewer"]
    body = viewer.get(reverse("task-list")).content.decode()
    assert "alpha task" in body and "beta agent" not in body
    # Buttons a viewer may not use are not shown.
    page = viewer.get(reverse("task-detail", args=[world["task"].pk])).content.decode()
    assert 'id="answer-form"' not in page and 'id="cancel-form"' not in page
    assert "Your role in this project cannot answer it." in page
    assert (
        'id="credentials-form"'
        not in viewer.get(reverse("agent-detail", args=[world["agent"].pk])).content.decode()
    )
    operator_page = (
        world["people"]["operator"]
        .get(reverse("task-detail", args=[world["task"].pk]))
        .content.decode()
    )
    assert 'id="answer-form"' in operator_page


# Websockets --------------------------------------------------------------------------------

CLOSE = {"anonymous": 4401, "outsider": 4404}
WS_RULES = {"ws/tasks/<int:task_id>/": "task", "ws/tasks/": "list", "": "no route"}


def _user_of(client: Client):
    from django.contrib.auth import get_user_model

    session = client.session
    pk = session.get("_auth_user_id")
    return get_user_model().objects.get(pk=pk) if pk else AnonymousUser()


@pytest.mark.parametrize("person", PEOPLE)
async def test_every_websocket_route_answers_as_the_role_allows(world, person, settings) -> None:
    from asgiref.sync import sync_to_async
    from channels.layers import get_channel_layer

    from tasks_app.relay import LIST_GROUP

    layer = dict(settings.CHANNEL_LAYERS["default"])
    layer["CONFIG"] = {**layer["CONFIG"], "prefix": f"matrix-{uuid.uuid4().hex[:8]}"}
    settings.CHANNEL_LAYERS = {"default": layer}
    user = await sync_to_async(_user_of)(world["people"][person])
    app = URLRouter(websocket_urlpatterns)
    for pattern in websocket_urlpatterns:
        kind = WS_RULES[str(pattern.pattern)]
        path = {"task": f"/ws/tasks/{world['task'].pk}/", "list": "/ws/tasks/"}.get(kind, "/ws/x/")
        comm = WebsocketCommunicator(app, path)
        await sync_to_async(signed_in)(comm.scope, user)
        code = await refused_with(comm)
        if kind == "no route":
            assert code == 4404, (person, path, code)  # whoever asks
            continue
        if person == "anonymous" or (person == "outsider" and kind == "task"):
            assert code == CLOSE[person], (person, path, code)
            continue
        assert code is None, (person, path, code)
        if kind == "list":
            # A summary of alpha's task reaches alpha's people, never the outsider.
            summary = {
                "type": "tasks.changed",
                "task": world["task"].pk,
                "agent": world["agent"].pk,
                "last_seq": 9,
            }
            await get_channel_layer().group_send(LIST_GROUP, summary)
            if person == "outsider":
                assert await comm.receive_nothing(timeout=1)
            else:
                got = await comm.receive_json_from(timeout=5)
                assert got["task"] == world["task"].pk
        await comm.disconnect()
