"""Every outbound request to an agent starts here.

One place builds the HTTP clients and the A2A clients for stored agents, so the
SSRF guard and limits have one home. httpx clients are bound to an event loop: the
watcher loop keeps a few for all its streams; one-off service calls build a
short-lived one. Their SSL context (~30 ms of CPU to build) is one per process.

The SSRF guard (``tasks_app.a2a.guard``): every client built here connects only to
addresses the policy allows, checked at connect time for every hop - public addresses,
plus the networks and host names ``settings.OUTBOUND_ALLOW`` lists; link-local and
cloud-metadata addresses never. :func:`url_problem` tells a person before anything is
fetched or saved. Environment proxies are not used: through a proxy the guard would
see the proxy's address instead of the one the request is for.
"""

from __future__ import annotations

import asyncio
import functools
import http.cookiejar
import os
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import TypeVar
from urllib.parse import urlsplit

import httpcore
import httpx
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from tasks_app.a2a import A2AClient, Credentials, Interface, guard
from tasks_app.a2a.errors import A2AError
from tasks_app.a2a.origins import origin_of
from tasks_app.crypto import SecretError, decrypt_json
from tasks_app.models import Agent

T = TypeVar("T")

# Keep-alive as high as the connection limit. httpcore 1.0 compares the number of *all* the
# pool's connections (streams included) with max_keepalive_connections whenever a request
# starts or ends: past it, every idle connection is closed at once, and the check is
# repeated per connection (quadratic in the connections held). With 100-1,000 streams on a
# worker's one client, a burst of GetTask calls (tasks ending together, a takeover) kept the
# loop busy in that bookkeeping for seconds and relays waited behind it (P1, P2x, py-spy).
# Idle connections still close after keepalive_expiry.
LIMITS = httpx.Limits(max_connections=4000, max_keepalive_connections=4000, keepalive_expiry=30)


def _entries(value: str | Iterable[str]) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    return tuple(item.strip() for item in items if item.strip())


@functools.lru_cache(maxsize=16)
def _policy_of(entries: tuple[str, ...]) -> guard.Policy:
    try:
        return guard.Policy.from_entries(entries)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{guard.SETTING}: {exc}") from None


def policy() -> guard.Policy:
    """The guard's policy from ``settings.OUTBOUND_ALLOW`` (read on every connection)."""
    return _policy_of(_entries(getattr(settings, guard.SETTING, ())))


class _RefuseAll(http.cookiejar.DefaultCookiePolicy):
    """A cookie policy that keeps nothing and sends nothing."""

    def set_ok(self, cookie: http.cookiejar.Cookie, request: object) -> bool:
        return False

    def return_ok(self, cookie: http.cookiejar.Cookie, request: object) -> bool:
        return False


@functools.cache
def shared_ssl_context() -> ssl.SSLContext:
    """The process's one SSL context (the system's certificates, loaded once).

    Building one costs about 30 ms of CPU, most of it reading the certificate store; a
    context is safe to share between threads and event loops once built, and nothing here
    changes it after. So a one-off call (a card preview, a cancel) builds a client, not
    a context.
    """
    return httpx.create_ssl_context()


def new_http_client(ssl_context: ssl.SSLContext | None = None) -> httpx.AsyncClient:
    """An HTTP client whose every connection passes the outbound guard.

    It keeps no cookies: a worker's clients serve every agent of every project, and a
    cookie one agent set would go to any other agent on the same host (cookies ignore
    the port). What an agent needs to know of us is in the credentials we send it.
    """
    return httpx.AsyncClient(
        transport=guard.GuardedTransport(
            policy, limits=LIMITS, ssl_context=ssl_context or shared_ssl_context()
        ),
        follow_redirects=False,
        timeout=30.0,
        cookies=http.cookiejar.CookieJar(policy=_RefuseAll()),
    )


# Enough that a thousand streams make pools of about 30 connections each.
SHARDS = 32


class ClientShards:
    """A few HTTP clients that share a process's tasks between them, a task always on one.

    httpcore walks every connection of a pool, with a system call for each idle one,
    whenever a request on it starts or ends. In one pool holding a hundred streams, the
    streams of a hundred tasks ending in the same second (each closing, then its GetTask)
    kept the loop busy for most of a second, and every relay waited behind it (P1 on
    PostgreSQL, py-spy). A task keeps to its shard, so its keep-alive connection is
    still reused; the shards share the process's SSL context (``shared_ssl_context``).
    """

    def __init__(self, shards: int = SHARDS) -> None:
        self.clients = [new_http_client() for _ in range(shards)]

    def for_task(self, task_pk: int) -> httpx.AsyncClient:
        return self.clients[task_pk % len(self.clients)]

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


def url_problem(url: str, *, resolve: bool = True) -> str | None:
    """Why ``url`` may not be fetched, or None; said before anything is fetched or saved.

    Scheme, path and a literal address are judged as they are written; with ``resolve``
    a host name is looked up and every address it has is checked (a name that does not
    resolve is left to the fetch, which says so). The fetch checks again when it connects.
    """
    problem = guard.url_problem(url, policy())
    if problem or not resolve:
        return problem
    parts = urlsplit(url.strip())
    host = parts.hostname or ""
    if guard.literal_ip(host) is not None:
        return None
    # On the guard's threads, within the call deadline: a resolver that ignores deadlines
    # held the page that asked (agent add, interface choice) as long as it liked.
    port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    addresses = guard.lookup_within(host, port, settings.A2A_CALL_DEADLINE_SECONDS)
    if addresses is None:
        return None
    try:
        guard.check_addresses(policy(), host, addresses)
    except guard.GuardRefusal as exc:
        return str(exc)
    except httpcore.ConnectError:  # no address: the fetch will say so in its own words
        return None
    return None


def with_loopback(value: str) -> str:
    """``OUTBOUND_ALLOW`` (comma-separated) with the loopback networks added."""
    entries = list(_entries(value))
    return ",".join(entries + [net for net in guard.LOOPBACK if net not in entries])


def allow_loopback() -> None:
    """Let this process and the children it starts from now on reach loopback.

    For commands that start their own agent on 127.0.0.1 (``up --demo``, ``bench``): the
    operator asked for it by running them, so it is said explicitly here rather than in
    a default that would let any card reach this machine's own ports.
    """
    os.environ[guard.SETTING] = with_loopback(os.environ.get(guard.SETTING, ""))
    current = ",".join(_entries(getattr(settings, guard.SETTING, ())))
    settings.OUTBOUND_ALLOW = list(_entries(with_loopback(current)))


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


class AgentRetired(CredentialsWithheld):
    """The agent was retired: nothing is sent to it (its credentials were wiped too)."""


def retired_note(agent: Agent) -> str:
    """What every refusal to reach a retired agent says, on a page or the command line."""
    return (
        f"{agent.name} is retired: nothing is sent to it. An agent admin can restore it "
        "(its page, or manage.py agents restore)."
    )


def credentials_for(agent: Agent) -> Credentials | None:
    """The agent's credentials, only for the origin they were approved for (else NeedsApproval)."""
    if (
        agent.credentials_encrypted
        and origin_of(agent.interface_url) not in agent.credential_origins
    ):
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


def client_for(
    agent: Agent,
    http: httpx.AsyncClient,
    *,
    stream_http: httpx.AsyncClient | None = None,
    **options: float | None,
) -> A2AClient:
    """An A2A client for a stored agent, on its chosen interface.

    Whole-call deadlines come from the settings (a trickling agent must not
    hold a call past them); ``options`` override any A2AClient option.
    ``stream_http`` carries the streams, apart from the other calls (see A2AClient).
    A retired agent gets no client: every call to it, from any path, is refused here.
    """
    if agent.retired_at is not None:
        raise AgentRetired(retired_note(agent))
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
        stream_http=stream_http,
        **options,  # type: ignore[arg-type]
    )


def run(call: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    """Run one async call with a fresh HTTP client, from synchronous code (services)."""

    async def runner() -> T:
        async with http_client() as http:
            return await call(http)

    return asyncio.run(runner())
