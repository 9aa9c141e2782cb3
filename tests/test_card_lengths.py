"""A card's text is the agent's, of any length; what is kept of it fits its column.

An interface URL over 1,000 characters, a tenant over 200 or an ETag over 300 made adding or
refreshing the agent fail on PostgreSQL with "value too long" (500 on the page, a traceback
from the command); SQLite kept them. Now an interface whose URL or tenant cannot be kept is
not chosen (the card's problems say why), and an ETag that cannot be kept is not kept.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tasks_app.models import Agent
from tasks_app.services import agents as agent_services
from tests.test_ssrf import CardServer, card

pytestmark = pytest.mark.django_db


@pytest.fixture
def server() -> Iterator[CardServer]:
    served = CardServer("127.0.0.1")
    yield served
    served.close()


def test_an_interface_url_too_long_to_keep_is_not_chosen(server: CardServer) -> None:
    long_url = f"{server.base}/rpc" + "/x" * 600
    server.card(card(long_url))
    with pytest.raises(agent_services.AgentError) as refused:
        agent_services.add_agent(server.base)
    assert "longer than 1000 characters" in str(refused.value)
    assert long_url not in str(refused.value)  # the problem names it cut short
    assert not Agent.objects.exists()
    # Another interface of the same card is chosen instead.
    server.card(card(long_url, f"{server.base}/rpc"))
    agent = agent_services.add_agent(server.base)
    assert agent.interface_url == f"{server.base}/rpc"
    assert any("longer than 1000 characters" in p for p in agent.card_problems)


def test_a_tenant_too_long_to_keep_leaves_no_interface(server: CardServer) -> None:
    served = card(f"{server.base}/rpc")
    served["supportedInterfaces"][0]["tenant"] = "t" * 201
    server.card(served)
    with pytest.raises(agent_services.AgentError, match="tenant is longer than 200 characters"):
        agent_services.add_agent(server.base)
    assert not Agent.objects.exists()


def test_an_etag_too_long_to_keep_is_not_kept(server: CardServer) -> None:
    server.card(card(f"{server.base}/rpc"))
    path = "/.well-known/agent-card.json"
    status, headers, body = server.routes[path]
    server.routes[path] = (status, {**headers, "ETag": '"' + "e" * 400 + '"'}, body)
    agent = agent_services.add_agent(server.base)
    assert agent.card_etag == "" and agent.interface_url == f"{server.base}/rpc"
    agent_services.refresh_card(agent)  # fetched whole again, and still nothing to keep
    agent.refresh_from_db()
    assert agent.card_etag == "" and agent.reachable


def test_an_agent_url_too_long_to_keep_is_refused_before_any_fetch(server: CardServer) -> None:
    server.card(card(f"{server.base}/rpc"))
    with pytest.raises(agent_services.AgentError, match="at most 1000 characters"):
        agent_services.add_agent(f"{server.base}/" + "a" * 1000)
    assert server.connections == 0 and not Agent.objects.exists()


def test_a_card_of_many_bad_skills_keeps_a_hundred_problems_and_pages_list_a_hundred(
    server: CardServer,
) -> None:
    """A 1 MB card of skills that are not objects made 524,090 problems (21 MB), stored with
    the agent and read on every watcher turn; its pages listed every skill."""
    from django.contrib.auth.models import User
    from django.test import Client

    from tasks_app.models import Membership
    from tests.people import member

    served = card(f"{server.base}/rpc")
    served["skills"] = [0] * 5_000 + [
        {"id": f"s{i}", "name": f"skill number {i}", "description": "d", "tags": ["t"]}
        for i in range(300)
    ]
    server.card(served)
    agent = agent_services.add_agent(server.base)
    assert len(agent.card_problems) == agent_services.PROBLEMS_KEPT + 1
    assert (
        agent.card_problems[-1].startswith("… and ") and "more problems" in agent.card_problems[-1]
    )

    admin = member(User.objects.create_user("admin"), Membership.Role.AGENT_ADMIN)
    agent.project = Membership.objects.get(user=admin).project
    agent.save()
    client = Client()
    client.force_login(admin)
    page = client.get(f"/agents/{agent.pk}/").content.decode()
    assert page.count('<article class="skill">') == 100 and "… and 200 more skills" in page
    new_task = client.get(f"/tasks/new?agent={agent.pk}").content.decode()
    assert new_task.count('data-agent="') == 100
