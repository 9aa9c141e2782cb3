"""Ways a secret could leak, or a stored secret fail badly, found by an audit of secrets.

Each test names what happened before its fix.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.test import Client
from django.urls import reverse

from tasks_app import eventloop, kept_uploads, outbound, watchers
from tasks_app.models import Agent, PushConfig, RemoteTask, TaskEvent
from tasks_app.services import push
from tasks_app.services import tasks as task_services
from tests.people import member
from tests.serving import serve_in_thread, stop_serving

SECRET = "tok-SEKRIT-1234"


def test_a_cookie_one_agent_sets_is_never_sent_to_another() -> None:
    """The worker's HTTP clients serve every agent of every project, and kept cookies: a
    session cookie agent A set went to agent B on the same host (cookies ignore the port)."""
    seen: list[str | None] = []

    class SetsCookie(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Cookie"))
            self.send_response(200)
            self.send_header("Set-Cookie", "sid=SESSION-FOR-AGENT-A; Path=/")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), SetsCookie) for _ in range(2)]
    for server in servers:
        serve_in_thread(server)

    async def calls() -> None:
        async with outbound.new_http_client() as http:
            for server in (*servers, servers[0]):
                response = await http.get(f"http://127.0.0.1:{server.server_address[1]}/")
                assert response.status_code == 200
            assert not http.cookies

    try:
        asyncio.run(calls())
    finally:
        for server in servers:
            stop_serving(server)
    assert seen == [None, None, None]


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:1/0?password=hun-ter2",
        "postgres://u@127.0.0.1:1/db?sslmode=require&password=hun-ter2",
        "redis://:pw@127.0.0.1:1/0?password=hun-ter2",
    ],
)
def test_a_password_in_a_urls_query_is_not_printed(url: str) -> None:
    """redis-py and psycopg take ``?password=``: `up` printed such a REDIS_URL whole."""
    from tasks_app.runtime.net import redact_url

    shown = redact_url(url)
    assert "ter2" not in shown and "password=***" in shown and "127.0.0.1:1" in shown


@pytest.mark.django_db
@pytest.mark.parametrize(("kind", "field"), [("bearer", "token"), ("api-key", "api_key")])
def test_credentials_no_header_can_carry_are_a_form_error_not_a_500(
    django_user_model, kind: str, field: str
) -> None:
    """The service refused the token, the view did not catch it: a 500 (with DEBUG on, an
    error page that showed the posted token)."""
    user = member(django_user_model.objects.create_user(username="keys", password="pw-12345678"))
    client = Client()
    client.force_login(user)
    agent = Agent.objects.create(name="a", base_url="http://127.0.0.1:9/")
    url = reverse("agent-credentials", args=[agent.pk])
    answer = client.post(url, {"kind": kind, field: "tök-" + SECRET})
    body = answer.content.decode()
    assert answer.status_code == 400
    assert "cannot carry" in body and "SEKRIT" not in body
    agent.refresh_from_db()
    assert agent.credentials_encrypted == ""


@pytest.mark.django_db
def test_a_forged_kept_file_token_with_non_ascii_is_refused_not_raised(redis_url) -> None:
    """``hmac.compare_digest`` raises TypeError on text with non-ASCII characters: a posted
    ``kept_file=é`` was a 500 for anyone with a file kept."""
    person = 10_000_000 + uuid.uuid4().int % 1_000_000
    token = kept_uploads.keep(person, {"raw": "", "filename": "f.txt", "mediaType": "text/plain"})
    try:
        assert kept_uploads.take(person, "é") is None
        assert kept_uploads.take(person, token) is not None
    finally:
        kept_uploads.drop(person)


# A push config whose secrets cannot be decrypted (a key rotated away) ------------------------


@pytest.fixture
def locked_config(settings, redis_url) -> PushConfig:
    settings.PUBLIC_URL = "http://127.0.0.1:8000"
    agent = Agent.objects.create(
        name="pushy", base_url=f"http://127.0.0.1:1/{uuid.uuid4().hex}/", push=True
    )
    task = RemoteTask.objects.create(
        agent=agent, title="t", phase=RemoteTask.Phase.SENDING, watch=RemoteTask.Watch.PUSH,
        outbox={"message": {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": "hi"}]}},
    )  # fmt: skip
    config = push.new_config(task)
    config.secrets_encrypted = "gAAAAA-not-readable"
    config.save(update_fields=["secrets_encrypted"])
    return config


@pytest.mark.django_db(transaction=True)
def test_a_first_send_with_unreadable_push_secrets_parks_before_sending(
    locked_config, shared_loop
) -> None:
    """The bare SecretError came after the send was marked attempted: a traceback, a
    protocol error counted against the agent, and a next turn that said "the worker stopped
    while sending" and went looking for a send that never happened."""
    pk = locked_config.task_id
    token = task_services.acquire_lease(pk, watchers.OWNER)
    assert token is not None

    async def first_send() -> watchers.Turn | None:
        holder = watchers.Holder(pk, token, http=None)
        task = await eventloop.db(RemoteTask.objects.select_related("agent").get, pk=pk)
        holder._take(task)  # as _hold does
        holder.streaming = False
        return await holder._send(task, client=None)  # type: ignore[arg-type]

    turn = eventloop.submit(first_send()).result(timeout=30)
    assert turn is not None and "needs attention" in turn.note
    assert "cannot be decrypted" in turn.note
    task = RemoteTask.objects.get(pk=pk)
    assert task.send_attempted_at is None and task.outbox is not None
    kinds = list(TaskEvent.objects.filter(task_id=pk).values_list("kind", flat=True))
    assert kinds == ["system"]  # the one "parked" entry; no protocol error


@pytest.mark.django_db
@pytest.mark.usefixtures("empty_push_queue")
def test_a_delivery_to_a_config_with_unreadable_secrets_is_refused_saying_why(
    locked_config, caplog
) -> None:
    """Its secrets were read as empty: every delivery logged as a caller's wrong token."""
    with caplog.at_level(logging.WARNING, logger="tasks_app.security"):
        answer = Client().post(
            f"/push/{locked_config.config_id}/",
            data=b'{"statusUpdate": {}}',
            content_type="application/a2a+json",
            HTTP_X_A2A_NOTIFICATION_TOKEN="anything",
            REMOTE_ADDR="10.9.8.7",
        )
    assert answer.status_code == 401
    said = " ".join(r.getMessage() for r in caplog.records if r.name == "tasks_app.security")
    assert "cannot be decrypted" in said and "wrong notification token" not in said


def test_error_pages_hide_settings_that_carry_secrets_in_urls(settings) -> None:
    """Django hides settings named like secrets; REDIS_URL, the broker's and the channel
    layer's addresses (each with its password) were shown on DEBUG error pages."""
    from django.views.debug import get_default_exception_reporter_filter

    url = "redis://:hun-ter2@127.0.0.1:6379/0"
    settings.REDIS_URL = settings.CELERY_BROKER_URL = url
    settings.CHANNEL_LAYERS = {"default": {"CONFIG": {"hosts": [{"address": url}]}}}
    shown = get_default_exception_reporter_filter().get_safe_settings()
    assert "ter2" not in repr(shown)
    assert shown["TIME_ZONE"] == settings.TIME_ZONE  # the rest is still shown
