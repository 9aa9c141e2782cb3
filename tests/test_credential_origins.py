"""Stored credentials go only to the origin approved when they were saved.

A real a2a-sdk agent that requires a bearer token; its card is served by a small loopback
server of the test's own, so the test can make the card move the interface to another
origin (a TCP proxy in front of the same agent, which counts its connections). After the
refresh nothing at all reaches the new origin until an agent admin approves it; then the
token does, and the task is read through it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from django.test import Client
from django.urls import reverse

from tasks_app.a2a.origins import origin_of
from tasks_app.models import Agent, Membership, OperatorAction
from tasks_app.services import agents as agent_services
from tests.agents import AGENT_TOKEN, TcpProxy
from tests.people import member
from tests.serving import serve_in_thread, stop_serving

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


class CardServer:
    """Serves ``card`` (a dict the test may change) at /.well-known/agent-card.json."""

    def __init__(self, card: dict[str, Any]) -> None:
        self.card = card
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps(outer.card).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        serve_in_thread(self.server)

    def point_at(self, base: str) -> None:
        """Rewrite every interface URL of the card to ``base`` (same path)."""
        for iface in self.card["supportedInterfaces"]:
            path = httpx.URL(iface["url"]).raw_path.decode()
            iface["url"] = base + path

    def close(self) -> None:
        stop_serving(self.server)


@pytest.fixture
def moved_agent(agent_token) -> Iterator[tuple[CardServer, TcpProxy]]:
    card = httpx.get(agent_token.card_url, timeout=10).json()
    server = CardServer(card)
    proxy = TcpProxy("127.0.0.1", httpx.URL(agent_token.base_url).port).start()
    try:
        yield server, proxy
    finally:
        proxy.close()
        server.close()


def test_a_card_that_moves_the_interface_gets_no_credentials_until_approved(
    moved_agent, agent_token, django_user_model
):
    cards, proxy = moved_agent
    admin = member(
        django_user_model.objects.create_user("admin-a", password="pw-12345678"),
        Membership.Role.AGENT_ADMIN,
    )
    viewer = member(
        django_user_model.objects.create_user("viewer-a", password="pw-12345678"),
        Membership.Role.VIEWER,
    )

    agent = agent_services.add_agent(
        cards.url, name="moving", credentials={"token": AGENT_TOKEN}, actor_id=admin.pk
    )
    first_origin = origin_of(agent.interface_url)
    assert agent.credential_origins == [first_origin] and agent.pending_origin == ""
    # The token works where it was approved.
    assert _send_directly(agent) == "ok"

    # The card now names another origin (the proxy in front of the same agent).
    cards.point_at(proxy.url)
    agent_services.refresh_card(agent, actor_id=admin.pk)
    agent.refresh_from_db()
    assert agent.pending_origin == origin_of(proxy.url) != first_origin
    assert agent.credential_origins == [first_origin]

    # Nothing is sent to the new origin: every call stops before connecting.
    with pytest.raises(Exception) as refused:
        _send_directly(agent)
    assert "approve the new origin" in str(refused.value)
    assert proxy.connections == 0

    # The agent page says so, with both origins; only an agent admin sees the button.
    admin_client, viewer_client = Client(), Client()
    admin_client.force_login(admin)
    viewer_client.force_login(viewer)
    page = admin_client.get(reverse("agent-detail", args=[agent.pk])).content.decode()
    assert "Needs approval" in page and origin_of(proxy.url) in page and first_origin in page
    assert 'id="approve-origin"' in page
    viewer_page = viewer_client.get(reverse("agent-detail", args=[agent.pk])).content.decode()
    assert "Needs approval" in viewer_page and 'id="approve-origin"' not in viewer_page
    # Where people look first, the agent list and the overview mark it too, linking to the
    # notice (it was said on the agent page alone, easy to miss while tasks sat parked).
    for listing in ("/agents/", "/"):
        html = viewer_client.get(listing).content.decode()
        mark = f'href="/agents/{agent.pk}/#needs-approval" data-needs-approval'
        assert mark in html, listing
    forbidden = viewer_client.post(
        reverse("agent-approve-origin", args=[agent.pk]), {"origin": origin_of(proxy.url)}
    )
    assert forbidden.status_code == 403
    agent.refresh_from_db()
    assert agent.pending_origin == origin_of(proxy.url)

    # A stale approval (for an origin the card no longer names) changes nothing.
    stale = admin_client.post(
        reverse("agent-approve-origin", args=[agent.pk]), {"origin": "http://127.0.0.1:1"}
    )
    assert stale.status_code == 302
    agent.refresh_from_db()
    assert agent.credential_origins == [first_origin]

    approved = admin_client.post(
        reverse("agent-approve-origin", args=[agent.pk]), {"origin": origin_of(proxy.url)}
    )
    assert approved.status_code == 302
    agent.refresh_from_db()
    assert agent.credential_origins == [origin_of(proxy.url)] and agent.pending_origin == ""
    assert OperatorAction.objects.filter(agent=agent, action="approve-origin", actor=admin).exists()
    assert "data-needs-approval" not in viewer_client.get("/agents/").content.decode()
    assert _send_directly(agent) == "ok"
    assert proxy.connections >= 1


def _send_directly(agent: Agent) -> str:
    """One authenticated call to the agent through outbound (GetTask of an unknown id:
    the agent answers "not found" only after accepting the token)."""
    from tasks_app import outbound
    from tasks_app.a2a import TaskNotFoundError

    agent = Agent.objects.get(pk=agent.pk)

    async def call(http: httpx.AsyncClient) -> str:
        client = outbound.client_for(agent, http)
        try:
            await client.get_task("no-such-task")
        except TaskNotFoundError:
            return "ok"  # an AuthError (401) would have been raised instead without the token
        return "found?"

    return outbound.run(call)


def test_a_later_card_cannot_move_a_saved_api_key(django_user_model) -> None:
    """The key's placement is pinned when saved; a card that later says "query" is ignored."""
    from tasks_app.a2a import auth_plan
    from tasks_app.crypto import decrypt_json
    from tasks_app.outbound import credentials_for

    header_card = {
        "securitySchemes": {
            "k": {"apiKeySecurityScheme": {"location": "header", "name": "X-Team-Key"}}
        }
    }
    agent = Agent.objects.create(
        name="keyed",
        base_url="http://127.0.0.1:9/keyed",
        interface_url="http://127.0.0.1:9/keyed/rpc",
        card=header_card,
    )
    agent_services.set_credentials(agent, {"api_key": "k-123"})
    agent.refresh_from_db()
    assert decrypt_json(agent.credentials_encrypted) == {
        "api_key": "k-123", "api_key_location": "header", "api_key_name": "X-Team-Key",
    }  # fmt: skip
    moved_card = {
        "securitySchemes": {"k": {"apiKeySecurityScheme": {"location": "query", "name": "leak"}}}
    }
    plan = auth_plan(moved_card, credentials_for(agent))
    assert plan.headers.get("X-Team-Key") == "k-123" and plan.query == {}


@pytest.mark.timeout(120)
def test_a_watcher_parks_until_the_origin_is_approved(
    agent, start_celery_worker, django_user_model
) -> None:
    """Credentials withheld park the task once (no retry loop); approving watches it again."""
    from tasks_app.crypto import encrypt_json
    from tasks_app.models import RemoteTask, TaskEvent
    from tasks_app.services import tasks as task_services
    from tests.test_mirror import wait_for

    admin = member(
        django_user_model.objects.create_user("admin-w", password="pw-12345678"),
        Membership.Role.AGENT_ADMIN,
    )
    row = Agent.objects.create(
        name="moved", base_url=agent.base_url, interface_url=agent.base_url, binding="JSONRPC",
        credentials_encrypted=encrypt_json({"token": "planted-secret-5"}),
        credential_origins=["http://127.0.0.1:1"], pending_origin=origin_of(agent.base_url),
    )  # fmt: skip
    task = RemoteTask.objects.create(agent=row, title="t", phase="task", remote_id="r-moved",
                                     state="TASK_STATE_WORKING", watch="poll")  # fmt: skip
    worker = start_celery_worker()
    task_services.dispatch(task.pk)

    def status() -> str:
        task.refresh_from_db()
        return task.watcher_status

    wait_for(lambda: status() == "parked", timeout=60, what="the task to be parked")
    assert "approve the new origin" in task.watcher_note
    parked = [
        e
        for e in TaskEvent.objects.filter(task=task, kind="system").values_list("raw", flat=True)
        if "parked" in str(e)
    ]
    assert len(parked) == 1

    assert agent_services.approve_origin(row, origin_of(agent.base_url), actor_id=admin.pk)
    wait_for(lambda: status() != "parked", timeout=60, what="the task to be watched again")
    assert OperatorAction.objects.filter(task=task, action="watch", actor=admin).exists()
    assert "planted-secret-5" not in worker.log_tail(400)
