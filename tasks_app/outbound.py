"""Every outbound request to an agent starts here.

One place builds the HTTP clients and the A2A clients for stored agents, so the
SSRF guard, proxy settings and limits (roadmap) have one home. httpx clients
are costly to build (~33 ms of CPU for the SSL context) and bound to an event
loop: the watcher loop keeps one for all its streams; one-off service calls
build a short-lived one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import httpx
from django.conf import settings

from tasks_app.a2a import A2AClient, Credentials, Interface
from tasks_app.a2a.errors import A2AError
from tasks_app.a2a.origins import origin_of
from tasks_app.crypto import SecretError, decrypt_json
from tasks_app.models import Agent

T = TypeVar("T")

LIMITS = httpx.Limits(max_connections=4000, max_keepalive_connections=200, keepalive_expiry=30)


def new_http_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(limits=LIMITS, follow_redirects=False, timeout=30.0)


@asynccontextmanager
async def http_client() -> AsyncIterator[httpx.AsyncClient]:
    client = new_http_client()
    try:
        yield client
    finally:
        await client.aclose()


class CredentialsWithheld(A2AError):
    """The agent's stored credentials may not be used now; only a person can change that.

    Also an ``A2AError``: every caller that turns a failed call to an agent into a clear
    message (refresh, cancel, import, finding a lost send) says this sentence instead of
    answering 500; the watcher parks the task on it (``watchers.Holder._hold``).
    """


APPROVAL_NOTE = "Credentials withheld:"


class NeedsApproval(CredentialsWithheld):
    """The card moved the interface to an origin the credentials were not approved for."""


class CredentialsUnreadable(SecretError, CredentialsWithheld):
    """The agent's stored credentials cannot be decrypted (a rotated key not listed as old).

    Also an ``A2AError``: every caller that turns a failed call to an agent into a clear
    message (refresh, cancel, import, finding a lost send) says this sentence instead of
    answering 500; the watcher parks the task on it (``watchers.Holder._hold``).
    """


def credentials_for(agent: Agent) -> Credentials | None:
    """The agent's credentials, only for the origin they were approved for (else NeedsApproval)."""
    if agent.credentials_encrypted and origin_of(agent.interface_url) not in agent.credential_origins:
        approved = ", ".join(agent.credential_origins) or "no origin"
        raise NeedsApproval(
            f"{APPROVAL_NOTE} the agent's card moved it to {origin_of(agent.interface_url) or agent.interface_url}; "
            f"its credentials were approved for {approved}. An agent admin must approve the new origin "
            "on the agent page."
        )
    try:
        data = decrypt_json(agent.credentials_encrypted)
    except SecretError as exc:
        raise CredentialsUnreadable(str(exc)) from None
    if not data:
        return None
    return Credentials(
        token=data.get("token") or None,
        api_key=data.get("api_key") or None,
        api_key_name=data.get("api_key_name") or None,
        api_key_location=data.get("api_key_location") or None,
    )


def client_for(agent: Agent, http: httpx.AsyncClient, **options: float | None) -> A2AClient:
    """An A2A client for a stored agent, on its chosen interface.

    Whole-call deadlines come from the settings (a trickling agent must not
    hold a call past them); ``options`` override any A2AClient option.
    """
    options = {
        "call_deadline": settings.A2A_CALL_DEADLINE_SECONDS,
        "send_deadline": settings.A2A_SEND_DEADLINE_SECONDS,
        **options,
    }
    interface = Interface(
        url=agent.interface_url,
        binding=agent.binding,  # type: ignore[arg-type]
        protocol_version=agent.protocol_version or "1.0",
        tenant=agent.tenant,
    )
    return A2AClient(
        interface,
        http=http,
        credentials=credentials_for(agent),
        card=agent.card,
        **options,  # type: ignore[arg-type]
    )


def run(call: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    """Run one async call with a fresh HTTP client, from synchronous code (services)."""

    async def runner() -> T:
        async with http_client() as http:
            return await call(http)

    return asyncio.run(runner())
