"""Registering agents and keeping their cards fresh."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from tasks_app import outbound
from tasks_app.a2a import (
    A2AError,
    CardProblem,
    IncompatibleAgentError,
    choose_interface,
    fetch_card,
    validate_card,
)
from tasks_app.crypto import encrypt_json
from tasks_app.models import Agent, OperatorAction


class AgentError(Exception):
    """The agent cannot be added or refreshed; the message says why, in one sentence."""


@dataclass
class CardPreview:
    """What a card fetch found: shown before saving, stored on save."""

    url: str
    card: dict[str, Any]
    etag: str = ""
    problems: list[str] = field(default_factory=list)
    interface: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.card.get("name") or "")


def _problem_text(problem: CardProblem | Any) -> str:
    path = getattr(problem, "path", "")
    message = getattr(problem, "message", str(problem))
    return f"{path}: {message}" if path else str(message)


def preview_card(url: str) -> CardPreview:
    """Fetch and check a card without saving anything."""
    try:
        result = outbound.run(
            lambda http: fetch_card(url, http=http, deadline=settings.A2A_CALL_DEADLINE_SECONDS)
        )
    except A2AError as exc:
        raise AgentError(f"Could not read an agent card at {url}: {exc}") from exc
    card = result.card or {}
    preview = CardPreview(url=result.url, card=card, etag=result.etag or "")
    preview.problems = [_problem_text(p) for p in validate_card(card)]
    try:
        iface = choose_interface(card, card_url=result.url)
    except IncompatibleAgentError as exc:
        preview.problems.append(str(exc))
    else:
        preview.interface = {
            "url": iface.url,
            "binding": iface.binding,
            "protocol_version": iface.protocol_version,
            "tenant": iface.tenant,
        }
    return preview


def _apply_preview(agent: Agent, preview: CardPreview) -> None:
    capabilities = preview.card.get("capabilities") or {}
    agent.card = preview.card
    agent.card_url = preview.url
    agent.card_etag = preview.etag
    agent.card_fetched_at = timezone.now()
    agent.card_problems = preview.problems
    agent.interface_url = preview.interface.get("url", "")
    agent.binding = preview.interface.get("binding", "")
    agent.protocol_version = preview.interface.get("protocol_version", "")
    agent.tenant = preview.interface.get("tenant", "")
    agent.streaming = capabilities.get("streaming") is True
    agent.push = capabilities.get("pushNotifications") is True
    agent.reachable = True
    agent.last_error = ""
    agent.last_contact_at = timezone.now()


def add_agent(
    url: str,
    *,
    name: str = "",
    credentials: dict[str, str] | None = None,
    actor_id: int | None = None,
) -> Agent:
    """Fetch the card at ``url``, check it, and store the agent (or update it if known)."""
    url = url.strip()
    preview = preview_card(url)
    if not preview.interface:
        raise AgentError(f"The agent at {url} offers no interface this dashboard speaks: {'; '.join(preview.problems)}")
    base_url = url
    with transaction.atomic():
        agent = Agent.objects.filter(base_url=base_url).first() or Agent(base_url=base_url)
        _apply_preview(agent, preview)
        agent.name = (name or preview.name or base_url)[:200]
        if credentials:
            agent.credentials_encrypted = encrypt_json({k: v for k, v in credentials.items() if v})
        agent.save()
        OperatorAction.objects.create(
            agent=agent, actor_id=actor_id, action="add-agent", payload={"url": url}
        )
    return agent


def refresh_card(agent: Agent, *, actor_id: int | None = None) -> Agent:
    """Fetch the card again (revalidating with the ETag) and store what changed."""
    try:
        result = outbound.run(
            lambda http: fetch_card(
                agent.card_url or agent.base_url,
                http=http,
                etag=agent.card_etag or None,
                deadline=settings.A2A_CALL_DEADLINE_SECONDS,
            )
        )
    except A2AError as exc:
        mark_unreachable(agent.pk, str(exc))
        raise AgentError(f"Could not refresh the card of {agent.name}: {exc}") from exc
    if result.not_modified:
        Agent.objects.filter(pk=agent.pk).update(
            card_fetched_at=timezone.now(), reachable=True, last_error="", last_contact_at=timezone.now()
        )
    else:
        preview = preview_card(agent.card_url or agent.base_url)
        _apply_preview(agent, preview)
        agent.save()
    OperatorAction.objects.create(agent=agent, actor_id=actor_id, action="refresh-card")
    agent.refresh_from_db()
    return agent


def set_credentials(agent: Agent, credentials: dict[str, str], *, actor_id: int | None = None) -> None:
    """Store new credentials (encrypted). They are never shown back."""
    Agent.objects.filter(pk=agent.pk).update(
        credentials_encrypted=encrypt_json({k: v for k, v in credentials.items() if v})
    )
    OperatorAction.objects.create(
        agent=agent, actor_id=actor_id, action="set-credentials", payload={"fields": sorted(credentials)}
    )


def mark_unreachable(agent_pk: int, error: str) -> None:
    Agent.objects.filter(pk=agent_pk).update(reachable=False, last_error=error[:2000])


def mark_reachable(agent_pk: int) -> None:
    """Cheap when nothing changes: writes only if the agent was not already reachable."""
    Agent.objects.filter(pk=agent_pk).exclude(reachable=True).update(reachable=True, last_error="")
