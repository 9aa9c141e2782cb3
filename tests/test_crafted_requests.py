"""Query strings and command arguments a person can craft: a clear answer, never a 500.

A paging cursor or a date is text from the URL. One whose moment has no UTC equivalent
(the year 1 at +05:00) parsed, then overflowed where the database compared it on SQLite.
"""

from __future__ import annotations

import base64

import httpx
import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from tasks_app import cursors
from tests.people import member

pytestmark = pytest.mark.django_db

EARLY = "0001-01-01T00:00:00+05:00"
LATE = "9999-12-31T23:59:59-05:00"


def crafted_cursor(stamp: str) -> str:
    return base64.urlsafe_b64encode(f"{stamp}|1".encode()).decode().rstrip("=")


@pytest.fixture
def person(django_user_model) -> Client:
    from tasks_app.models import Membership

    user = member(django_user_model.objects.create_user("pat"), Membership.Role.AUDITOR)
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.parametrize("stamp", [EARLY, LATE])
def test_a_cursor_with_no_utc_moment_is_no_cursor(person, stamp):
    assert cursors.decode(crafted_cursor(stamp)) is None
    cursor = crafted_cursor(stamp)
    for page, sentence in [("/tasks/", "task-bad-cursor"), ("/inbox/", "inbox-bad-cursor"),
                           ("/audit/", "audit-bad-cursor")]:  # fmt: skip
        broken = person.get(f"{page}?cursor={cursor}")
        # A broken page link, as the docs say: 400 and one sentence, never a 500.
        assert broken.status_code == 400 and f'id="{sentence}"' in broken.content.decode()
    # A cursor the pages wrote still reads.
    assert cursors.decode(cursors.encode(cursors_moment(), 7)) == (cursors_moment(), 7)


def cursors_moment():
    from datetime import UTC, datetime

    return datetime(2026, 12, 2, 7, 0, tzinfo=UTC)


@pytest.mark.parametrize("stamp", [EARLY, LATE])
@pytest.mark.parametrize("page", ["/audit/", "/audit/actions.csv"])
def test_a_date_filter_with_no_utc_moment_is_a_message_next_to_the_field(person, stamp, page):
    for field in ("since", "until"):
        answer = person.get(page, {field: stamp})
        assert answer.status_code == 400, (page, field)
        if page == "/audit/":
            assert f"“{stamp[:40]}” is not a date" in answer.content.decode()


@pytest.mark.parametrize("ref", ["²", "9" * 5000])
def test_a_task_or_agent_reference_int_refuses_is_not_found(ref):
    with pytest.raises(CommandError, match="No task"):
        call_command("tasks", "show", ref)


@pytest.mark.parametrize(
    "command",
    [
        ("tasks", "show", ""),
        ("tasks", "cancel", ""),
        ("tasks", "abandon", " "),
        ("audit", "export", ""),
        ("tasks", "start", "", "hi"),
        ("tasks", "import", " "),
    ],
)
def test_an_empty_reference_names_nothing(command, no_dispatch):
    """An empty task reference matched the one task with no remote id yet (a send not
    answered): ``tasks cancel ''`` canceled it and ``tasks abandon ''`` abandoned it."""
    from tasks_app.models import Agent, RemoteTask

    agent = Agent.objects.create(name="a", base_url="http://127.0.0.1:9/a")
    unsent = RemoteTask.objects.create(agent=agent, title="t", remote_id="", phase="sending")
    with pytest.raises(CommandError, match="an empty reference names none"):
        call_command(*command)
    unsent.refresh_from_db()
    assert unsent.phase == "sending" and unsent.abandoned_at is None


@pytest.mark.parametrize(
    "command",
    [
        ("tasks", "start", "http://u:s3cret@127.0.0.1:9/", "hi"),
        ("tasks", "import", "http://u:s3cret@127.0.0.1:9/"),
        ("audit", "actions", "--agent", "http://u:s3cret@127.0.0.1:9/"),
    ],
)
def test_a_reference_that_names_nothing_is_not_echoed_with_its_password(command):
    with pytest.raises(CommandError) as err:
        call_command(*command)
    assert "s3cret" not in str(err.value) and "127.0.0.1:9" in str(err.value)


def test_prune_says_when_the_export_folder_name_is_refused(tmp_path):
    """A name past the system's limit raised OSError from ``exists()``, a traceback."""
    with pytest.raises(CommandError, match="--export-to cannot be used: File name too long"):
        call_command("prune", "--older-than", "1", "--export-to", str(tmp_path / ("z" * 300)))


def test_an_agent_url_with_a_password_is_refused_and_not_shown_back(django_user_model):
    from tasks_app.models import Agent, Membership, OperatorAction

    admin = member(django_user_model.objects.create_user("ada"), Membership.Role.AGENT_ADMIN)
    client = Client()
    client.force_login(admin)
    url = "https://someone:s3cret-pass@127.0.0.1:9/agent"
    for action in ("preview", "save"):
        answer = client.post("/agents/add/", {"url": url, "action": action})
        html = answer.content.decode()
        assert answer.status_code == 200
        assert "must not hold a user name or password" in html
        assert "s3cret-pass" not in html and "someone" not in html
    with pytest.raises(CommandError, match="must not hold a user name or password") as err:
        call_command("agents", "add", url)
    assert "s3cret-pass" not in str(err.value)
    assert not Agent.objects.exists()
    assert not any("s3cret" in str(a.payload) for a in OperatorAction.objects.all())


@pytest.mark.parametrize(
    "url",
    [
        "https://someone:s3cret pass@127.0.0.1:9/agent",  # a space: Django's URL check first
        "https://someone:s3cret/pass@127.0.0.1:9/agent",  # a "/" ends the host part early
        "https://someone:s3cret-pass@127.0.0.1:9/" + "a" * 1000,  # past the field's length
    ],
)
def test_a_password_that_hides_from_the_url_parser_is_not_shown_back(django_user_model, url):
    """Refused by Django's own URL or length check, the field was drawn back whole; a "/" in
    the password hid it from the parser, and the refusal quoted the URL."""
    from tasks_app.models import Membership

    admin = member(django_user_model.objects.create_user("ada"), Membership.Role.AGENT_ADMIN)
    client = Client()
    client.force_login(admin)
    answer = client.post("/agents/add/", {"url": url, "action": "preview"})
    assert answer.status_code == 200 and "s3cret" not in answer.content.decode()
    assert "Enter a valid URL" in answer.content.decode() or "at most" in answer.content.decode()
    with pytest.raises(CommandError) as err:
        call_command("agents", "add", url)
    assert "s3cret" not in str(err.value)


def test_an_agent_url_whose_host_is_no_domain_is_an_error_on_the_form(django_user_model):
    """A host name that does not encode as IDNA (a right-to-left override): Django's URL field
    takes it, and httpx refused it with ``InvalidURL``, which is not an ``httpx.HTTPError``:
    the card preview answered 500. Nothing is looked up or connected to (the name cannot be
    written on the wire)."""
    from tasks_app.models import Agent, Membership

    admin = member(django_user_model.objects.create_user("ada"), Membership.Role.AGENT_ADMIN)
    client = Client()
    client.force_login(admin)
    refused = {
        "\u202egnp.exe": "not a valid (internationalized) domain name",
        "http://\u202egnp.exe/agent": "not a valid (internationalized) domain name",
        "http://a\u0301.test/": "not a valid (internationalized) domain name",
        "http://xn--a.test/": "not a valid (internationalized) domain name",
        "http://localhost:99999/": "the port must be a number from 0 to 65535",
        "https://agent.test:70000/": "the port must be a number from 0 to 65535",
    }
    for url, says in refused.items():
        for action in ("preview", "save"):
            answer = client.post("/agents/add/", {"url": url, "action": action})
            assert answer.status_code == 200, (url, action)
            assert says in answer.content.decode(), (url, action)
    assert not Agent.objects.exists()


@pytest.mark.parametrize(
    "url", ["http://xn--a.test/", "http://a\u0301.test/", "http://127.0.0.1:99999/"]
)
def test_a_card_url_no_request_can_carry_is_a_protocol_error_before_any_fetch(url):
    """The protocol layer's own check (a redirect's target and a card's interface URLs pass
    through it too): httpx raised ``idna``'s ``UnicodeError`` as it built the request, and
    reading the port raised ``ValueError``, past ``map_transport_error``."""
    import asyncio

    from tasks_app.a2a import ProtocolError
    from tasks_app.a2a.card import fetch_card, http_url_problem

    assert http_url_problem(url)

    async def fetch() -> None:
        async with httpx.AsyncClient() as http:
            await fetch_card(url, http=http)

    with pytest.raises(ProtocolError):
        asyncio.run(fetch())


def test_a_large_file_kept_after_a_form_error_goes_with_the_next_try(
    django_user_model, no_dispatch, django_capture_on_commit_callbacks
):
    """A 3 MB file: sent back in the form (base64), it made the next try a form Django
    refused (over DATA_UPLOAD_MAX_MEMORY_SIZE), and the file and the message were lost."""
    import re

    from django.core.files.uploadedfile import SimpleUploadedFile

    from tasks_app.models import Agent, Membership, RemoteTask

    agent = Agent.objects.create(
        name="files", base_url="http://127.0.0.1:9/files", interface_url="http://127.0.0.1:9/rpc",
        binding="JSONRPC", streaming=True,
    )  # fmt: skip
    content = bytes(range(256)) * (3 * 1024 * 4)  # 3 MB
    people = {}
    for name in ("ann", "bob"):
        user = member(django_user_model.objects.create_user(name), Membership.Role.OPERATOR)
        people[name] = Client()
        people[name].force_login(user)
    form = {"agent": agent.pk, "text": "please read", "mode": "auto"}
    first = people["ann"].post(
        "/tasks/new",
        {
            **form,
            "data": "{bad",
            "file": SimpleUploadedFile("big.bin", content, "application/x-big"),
        },
    )
    html = first.content.decode()
    assert first.status_code == 400 and "Not valid JSON" in html
    assert "Kept from before: <b>big.bin</b>" in html
    token = re.search(r'name="kept_file" value="([^"]+)"', html).group(1)
    assert len(token) < 100  # a token, not the file
    # Someone else's form cannot carry it.
    other = people["bob"].post("/tasks/new", {**form, "data": "{}", "kept_file": token})
    assert other.status_code == 400 and "no longer kept" in other.content.decode()
    with django_capture_on_commit_callbacks(execute=True):
        fixed = people["ann"].post(
            "/tasks/new",
            {**form, "data": '{"a": 1}', "kept_file": token, "kept_file_name": "big.bin"},
        )
    assert fixed.status_code == 302
    task = RemoteTask.objects.get()
    part = task.request["message"]["parts"][2]
    assert (part["filename"], part["mediaType"]) == ("big.bin", "application/x-big")
    assert base64.b64decode(part["raw"]) == content
    assert no_dispatch == [task.pk]
    # Used: gone from Redis, so the token carries nothing any more.
    again = people["ann"].post("/tasks/new", {**form, "data": "{}", "kept_file": token})
    assert again.status_code == 400 and "no longer kept" in again.content.decode()


@pytest.mark.parametrize("ref", ["²", "9" * 5000])
def test_audit_commands_take_a_reference_int_refuses_as_a_name(ref):
    with pytest.raises(CommandError, match="no agent matches"):
        call_command("audit", "actions", "--agent", ref)
    with pytest.raises(CommandError):
        call_command("audit", "verify", ref)


@pytest.mark.parametrize("action", ["refresh", "cancel"])
def test_refresh_or_cancel_of_an_unnamed_task_with_credentials_withheld_says_why(
    django_user_model, action
):
    """The task was never named and the agent's credentials wait for an approval: the lookup
    by contextId cannot be made. That was a 500; it is the sentence saying why."""
    from tasks_app.crypto import encrypt_json
    from tasks_app.models import Agent, Membership, RemoteTask

    row = Agent.objects.create(
        name="moved", base_url="http://127.0.0.1:9/moved", interface_url="http://127.0.0.1:9/rpc",
        binding="JSONRPC", credentials_encrypted=encrypt_json({"token": "planted-secret-6"}),
        credential_origins=["http://127.0.0.1:1"], pending_origin="http://127.0.0.1:9",
    )  # fmt: skip
    message = {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": "x"}], "contextId": "c"}
    task = RemoteTask.objects.create(agent=row, title="t", phase="sending",
                                     request={"message": message})  # fmt: skip
    operator = member(django_user_model.objects.create_user("op"), Membership.Role.OPERATOR)
    client = Client()
    client.force_login(operator)
    answer = client.post(f"/tasks/{task.pk}/{action}/", follow=True)
    html = answer.content.decode()
    assert answer.status_code == 200
    assert "Credentials withheld" in html and "approve the new origin" in html
    assert "planted-secret-6" not in html


def test_watch_again_takes_a_lost_task_whose_dead_worker_still_names_it(
    no_dispatch, django_capture_on_commit_callbacks
):
    """The reconciler marks a task lost but leaves the dead worker's token; a task that is not
    watchable (waiting for an answer) kept it, and "Watch again" said it was being watched."""
    from datetime import timedelta

    from django.utils import timezone

    from tasks_app.models import Agent, RemoteTask
    from tasks_app.services import tasks as task_services

    row = Agent.objects.create(name="w", base_url="http://127.0.0.1:9/w")
    task = RemoteTask.objects.create(
        agent=row, title="t", phase="task", remote_id="r-1", state="TASK_STATE_INPUT_REQUIRED",
        watch="poll", watcher_status="lost", lease_token="dead-worker", lease_owner="w1",
        lease_expires_at=timezone.now() - timedelta(minutes=5),
    )  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        task_services.watch_again(task)
    task.refresh_from_db()
    assert (task.watcher_status, task.lease_token, task.lease_owner) == ("idle", "", "")
    assert no_dispatch == [task.pk]
    # A lease that still runs is someone's: refused as before.
    RemoteTask.objects.filter(pk=task.pk).update(
        watcher_status="lost", lease_token="alive", lease_expires_at=timezone.now() + timedelta(minutes=5)
    )  # fmt: skip
    with pytest.raises(task_services.TaskActionError, match="being watched already"):
        task_services.watch_again(task)


def test_an_abandoned_task_stays_abandoned_when_the_agent_forgot_it():
    from django.utils import timezone

    from tasks_app.models import Agent, RemoteTask
    from tasks_app.services import tasks as task_services

    row = Agent.objects.create(name="g", base_url="http://127.0.0.1:9/g")
    task = RemoteTask.objects.create(
        agent=row, title="t", phase="task", remote_id="r-1", state="TASK_STATE_WORKING",
        watcher_status="abandoned", abandoned_at=timezone.now(),
    )  # fmt: skip
    assert not task_services.mark_gone(task.pk, None, "TaskNotFound")
    task.refresh_from_db()
    assert task.watcher_status == "abandoned" and task.gone_at is None


def test_a_nul_in_a_query_string_or_form_is_refused_before_any_view(person, django_user_model):
    """PostgreSQL refuses a NUL in a query: a view looking such a value up answered 500
    there (an audit filter, an origin to approve). Now no view sees one."""
    from django.urls import reverse

    from tasks_app.middleware import RefuseNulCharactersMiddleware
    from tasks_app.models import Agent, OperatorAction, Project

    for url in ("/tasks/?q=a%00b", "/audit/?action=x%00", "/tasks/?a%00=1"):
        answer = person.get(url)
        assert answer.status_code == 400, url
        assert answer.content.decode() == RefuseNulCharactersMiddleware.MESSAGE
    agent = Agent.objects.create(
        project=Project.objects.get_or_create(name="nul")[0], name="moved", base_url="http://127.0.0.1:9/m",
        pending_origin="http://127.0.0.1:9",
    )  # fmt: skip
    admin = django_user_model.objects.create_superuser("root", "", "pw-12345678")
    client = Client()
    client.force_login(admin)
    url = reverse("agent-approve-origin", args=[agent.pk])
    answer = client.post(url, {"origin": "http://127.0.0.1:9\x00"})
    assert answer.status_code == 400
    agent.refresh_from_db()
    assert agent.pending_origin == "http://127.0.0.1:9" and agent.credential_origins == []
    assert not OperatorAction.objects.filter(action="approve-origin").exists()
    # A JSON body is its view's to read: the webhook answers as for any unknown config.
    answer = Client().post(
        reverse("push-webhook", args=["0" * 32]), '{"statusUpdate": {"taskId": "a\\u0000"}}',
        content_type="application/a2a+json",
    )  # fmt: skip
    assert answer.status_code == 404


def test_abandoning_with_the_longest_name_and_a_long_reason_keeps_what_fits(django_user_model):
    """The note is "abandoned by <name>: <reason>": the reason alone was cut, and a
    150-character username with a long reason overran the column (500 on PostgreSQL)."""
    from django.urls import reverse

    from tasks_app.models import Agent, Membership, OperatorAction, Project, RemoteTask

    agent = Agent.objects.create(
        project=Project.objects.get_or_create(name="long")[0], name="g",
        base_url="http://127.0.0.1:9/long",
    )  # fmt: skip
    task = RemoteTask.objects.create(
        agent=agent, title="t", phase="task", remote_id="r-1", state="TASK_STATE_WORKING"
    )
    name = "n" * 150
    operator = member(django_user_model.objects.create_user(name), Membership.Role.OPERATOR, "long")
    client = Client()
    client.force_login(operator)
    reason = ("because " * 60).strip()  # 479 characters: the form takes up to 500
    answer = client.post(reverse("task-abandon", args=[task.pk]), {"reason": reason})
    assert answer.status_code == 302
    task.refresh_from_db()
    assert task.abandoned_at is not None
    assert task.watcher_note == f"abandoned by {name}: {reason}"[:500]
    assert OperatorAction.objects.get(action="abandon").payload["reason"] == reason
