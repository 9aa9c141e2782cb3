"""The outbound (SSRF) guard, through the real paths: the agent add view and service, card
validation and interface choice, redirects, the A2A client a watcher uses, and a real worker.

Nothing here can send a packet off loopback, even with the guard broken: the test host names
are stubbed (``names``), the session's connect hook (``tests/loopback_only``) stops and
records any connect off loopback - in this process and in the worker - and fails the test,
and every server these tests talk to is their own, on 127.0.0.1 or ::1. "Refused before
any connection" is checked twice: the hook saw no attempt off loopback, and the loopback
servers that would have answered counted no connection.
"""

from __future__ import annotations

import html
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import loopback_hook
import pytest

from tasks_app import outbound
from tasks_app.a2a import OutboundRefused, ProtocolError, fetch_card, user_message, validate_card
from tasks_app.a2a.guard import GuardRefusal, Policy
from tasks_app.models import Agent, RemoteTask
from tasks_app.services import agents as agent_services
from tasks_app.services import tasks as task_services
from tests.agents import AgentHandle
from tests.people import member
from tests.serving import serve_in_thread, stop_serving

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(60)]

GUARD = "refused by the outbound guard: "
METADATA = (
    "169.254.169.254 is link-local (cloud metadata); never fetched, whatever OUTBOUND_ALLOW says"
)
DOTS = "the URL path has a '.' or '..' segment"

# Made-up names and what they "resolve" to (socket.getaddrinfo stubbed below).
NAMES = {
    "metadata.internal.test": ["169.254.169.254"],
    "private.internal.test": ["10.0.0.1"],
    "loopback.internal.test": ["127.0.0.1"],
    "v6loopback.internal.test": ["::1"],
    # The first address is allowed (loopback, in the tests); the second never is.
    "mixed.internal.test": ["127.0.0.1", "169.254.169.254"],
}


def card(*interface_urls: str) -> dict[str, Any]:
    """A valid A2A 1.0 card offering JSON-RPC at each URL, in order."""
    return {
        "name": "Guarded agent",
        "description": "Serves a card to the guard tests.",
        "version": "1.0.0",
        "supportedInterfaces": [
            {"url": url, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
            for url in interface_urls
        ],
        "capabilities": {"streaming": False},
        "defaultInputModes": ["text/plain"],
        "defaultOutputModes": ["text/plain"],
        "skills": [{"id": "echo", "name": "Echo", "description": "Echoes.", "tags": ["test"]}],
    }


# -- a loopback server of the tests' own -------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, owner: CardServer, host: str) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.owner = owner
        super().__init__((host, 0), _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        conn = super().get_request()
        self.owner.connections += 1
        return conn


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        status, headers, body = self.server.owner.routes.get(self.path, (404, {}, b"not here"))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class CardServer:
    """HTTP on loopback answering from ``routes`` (path -> status, headers, body); counts connections."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self.connections = 0
        self._server = _Server(self, host)
        self.port = int(self._server.server_address[1])
        self.base = f"http://{'[::1]' if ':' in host else host}:{self.port}"
        serve_in_thread(self._server)

    def card(self, body: dict[str, Any], path: str = "/.well-known/agent-card.json") -> None:
        self.routes[path] = (200, {"Content-Type": "application/json"}, json.dumps(body).encode())

    def redirect(self, path: str, location: str, status: int = 302) -> None:
        # The body must never show up in a message: it came with a redirect.
        self.routes[path] = (
            status,
            {"Location": location, "Content-Type": "text/plain"},
            b"SECRET-REDIRECT-BODY",
        )

    def close(self) -> None:
        stop_serving(self._server)


@pytest.fixture
def v4() -> Iterator[CardServer]:
    server = CardServer("127.0.0.1")
    server.card(card(f"{server.base}/rpc"))  # what a broken guard would fetch and register
    yield server
    server.close()


@pytest.fixture
def v6() -> Iterator[CardServer]:
    server = CardServer("::1")
    server.card(card(f"{server.base}/rpc"))
    yield server
    server.close()


@pytest.fixture
def names(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Stub name resolution for :data:`NAMES` (asyncio's resolver calls socket.getaddrinfo too)."""
    real = socket.getaddrinfo
    looked_up: list[str] = []

    def getaddrinfo(
        host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0
    ) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name not in NAMES:
            return real(host, port, family, type, proto, flags)
        looked_up.append(name)
        number = int(port or 0)
        return [
            (socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (a, number, 0, 0))
            if ":" in a
            else (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (a, number))
            for a in NAMES[name]
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return looked_up


@pytest.fixture
def client_in(client: Any, django_user_model: Any) -> Any:
    client.force_login(
        member(django_user_model.objects.create_user(username="op", password="pw-12345678"))
    )
    return client


def no_attempt_off_loopback(mark: int) -> None:
    assert loopback_hook.refused[mark:] == [], "the guard let a connect off loopback through"


# -- the hook the tests rely on ----------------------------------------------------------


@pytest.mark.subprocess
def test_the_connect_hook_stops_connects_off_loopback(tmp_path: Path) -> None:
    mark = len(loopback_hook.refused)
    with socket.socket() as sock:
        # Pinned to the loopback device: even without the hook no packet could leave.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")
        sock.setblocking(False)
        with pytest.raises(loopback_hook.OffLoopback, match=r"10\.0\.0\.1:9"):
            sock.connect(("10.0.0.1", 9))
    # Every name but localhost, whatever its TLD. AI_NUMERICHOST: were the hook not to stop
    # the lookup, the resolver would fail it in place rather than ask a DNS server.
    looked_up = ["metadata.internal.test", "example.org", "e.org", "dash.example.com"]
    for name in looked_up:
        with pytest.raises(loopback_hook.OffLoopback, match="must be stubbed"):
            socket.getaddrinfo(name, 80, flags=socket.AI_NUMERICHOST)
    assert loopback_hook.refused[mark:] == [
        "connect to 10.0.0.1:9",
        *(f"real name lookup of {name}" for name in looked_up),
    ]
    del loopback_hook.refused[mark:]  # expected here; any other would fail the test
    # localhost and IP literals (parsed, not looked up) resolve; so does a wildcard bind.
    for host in ("localhost", "127.0.0.1", "::1", "10.0.0.1", None):
        assert socket.getaddrinfo(host, 80, type=socket.SOCK_STREAM), host
    # The other lookups, judged without calling them (a real one could ask DNS).
    lookup = loopback_hook.real_lookup
    assert lookup("socket.gethostbyname", ("example.org",)) == "example.org"
    assert lookup("socket.gethostbyname_ex", ("e.org",)) == "e.org"
    assert lookup("socket.gethostbyname", ("localhost",)) is None
    assert lookup("socket.gethostbyaddr", ("93.184.216.34",)) == "93.184.216.34"  # PTR: DNS
    assert lookup("socket.gethostbyaddr", ("127.0.0.1",)) is None
    assert lookup("socket.getnameinfo", (("10.0.0.1", 80),)) == "10.0.0.1"
    assert lookup("socket.getnameinfo", (("::1", 80, 0, 0),)) is None
    assert loopback_hook.refused[mark:] == []

    # Children get it through sitecustomize (PYTHONPATH); their log is checked after each test.
    log = tmp_path / "child.log"
    code = (
        "import socket\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b'lo')\n"
        "s.setblocking(False)\n"
        "try:\n    s.connect(('10.0.0.1', 9))\nexcept ConnectionRefusedError as e:\n    print(type(e).__name__)\n"
    )
    env = {**os.environ, loopback_hook.LOG_ENV: str(log)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.stdout.strip() == "OffLoopback", done.stderr
    assert log.read_text().strip().endswith("connect to 10.0.0.1:9")


# -- the policy --------------------------------------------------------------------------


def test_policy_rules() -> None:
    none = Policy()
    assert none.address_problem("169.254.169.254") == METADATA
    assert (
        none.address_problem("93.184.216.34") is None
    )  # public: allowed (never connected to here)
    everything = Policy.from_entries(["0.0.0.0/0", "::/0", "metadata.internal.test"])
    # Link-local and metadata addresses stay refused whatever the allow list says.
    for address in (
        "169.254.169.254",
        "169.254.1.1",
        "fe80::1",
        "fd00:ec2::254",
        "100.100.100.200",
        "0.0.0.0",
    ):
        assert everything.address_problem(address, "metadata.internal.test"), address
    # An IPv6 address that reaches an IPv4 one is judged by it too.
    assert "it reaches 169.254.169.254" in (none.address_problem("::ffff:169.254.169.254") or "")
    assert "it reaches 10.0.0.1" in (none.address_problem("::ffff:10.0.0.1") or "")
    allowed = Policy.from_entries(["127.0.0.0/8", "agents.corp.test"])
    assert allowed.address_problem("127.0.0.1") is None
    assert allowed.address_problem("10.1.2.3", "agents.corp.test") is None  # by name
    assert "resolves to 10.1.2.3, which is private" in (
        allowed.address_problem("10.1.2.3", "other.corp.test") or ""
    )
    with pytest.raises(ValueError, match="neither a network"):
        Policy.from_entries(["not a host!"])


# -- card URLs: the add view and the service ---------------------------------------------

CARD_URLS = [
    # (id, URL ({v4}/{v6}: the tests' loopback servers), loopback allowed?, expected message)
    ("metadata", "http://169.254.169.254/latest/meta-data/", True, GUARD + METADATA),
    ("loopback", "{v4}/", False, GUARD + "127.0.0.1 is loopback; fetched only when OUTBOUND_ALLOW lists it"),
    ("private", "http://10.0.0.1/", True, GUARD + "10.0.0.1 is private"),
    ("v6-loopback", "{v6}/", False, GUARD + "::1 is loopback"),
    ("name-metadata", "http://metadata.internal.test/", True,
     GUARD + "metadata.internal.test resolves to 169.254.169.254, which is link-local (cloud metadata)"),
    ("name-private", "http://private.internal.test/", True,
     GUARD + "private.internal.test resolves to 10.0.0.1, which is private"),
    ("name-loopback", "http://loopback.internal.test:{v4port}/", False,
     GUARD + "loopback.internal.test resolves to 127.0.0.1, which is loopback"),
    ("name-v6-loopback", "http://v6loopback.internal.test:{v6port}/", False,
     GUARD + "v6loopback.internal.test resolves to ::1, which is loopback"),
    ("one-bad-address", "http://mixed.internal.test:{v4port}/", True,
     GUARD + "mixed.internal.test resolves to 169.254.169.254, which is link-local"),
    ("dot-dot", "{v4}/.well-known/../admin", True, DOTS),
    ("encoded-dot-dot", "{v4}/.well-known/%2e%2e/admin", True, DOTS),
    ("encoded-slash", "{v4}/x%2f..%2fadmin", True, DOTS),
]  # fmt: skip


def _url(template: str, v4: CardServer, v6: CardServer) -> str:
    return template.format(v4=v4.base, v6=v6.base, v4port=v4.port, v6port=v6.port)


@pytest.mark.parametrize(
    ("url", "loopback", "expected"), [c[1:] for c in CARD_URLS], ids=[c[0] for c in CARD_URLS]
)
def test_add_view_refuses_card_urls_before_connecting(
    client_in: Any, v4: CardServer, v6: CardServer, names: list[str], settings: Any,
    url: str, loopback: bool, expected: str,
) -> None:  # fmt: skip
    mark = len(loopback_hook.refused)
    if not loopback:
        settings.OUTBOUND_ALLOW = []
    url = _url(url, v4, v6)
    for action in ("preview", "save"):
        response = client_in.post("/agents/add/", {"url": url, "action": action})
        page = html.unescape(response.content.decode())
        assert response.status_code == 200
        assert f"Could not read an agent card at {url}: {expected}" in page
    assert not Agent.objects.exists()  # nothing half-saved
    assert (v4.connections, v6.connections) == (0, 0)
    no_attempt_off_loopback(mark)


def test_the_check_before_a_fetch_gives_up_a_lookup_at_the_call_deadline(
    names: list[str], settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``outbound.url_problem`` looked the name up on the page's own thread with no deadline:
    a resolver that ignores deadlines held the agent-add page as long as it liked. It now
    asks the guard's threads for at most the call deadline and leaves the rest to the fetch;
    a name that resolves in time is still checked (here, to a refused address)."""
    stubbed = socket.getaddrinfo  # the ``names`` stub
    released = threading.Event()

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "slow-dns.test":
            released.wait(6)  # a resolver that ignores every deadline
            host = "loopback.internal.test"  # then answers, never off this machine
        return stubbed(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    settings.A2A_CALL_DEADLINE_SECONDS = 0.5
    started = time.monotonic()
    try:
        problem = outbound.url_problem("https://slow-dns.test/.well-known/agent-card.json")
        took = time.monotonic() - started
    finally:
        released.set()
    assert problem is None and took < 3, f"held {took:.1f} s by the resolver"
    settings.OUTBOUND_ALLOW = []
    refused = outbound.url_problem("http://private.internal.test/")
    assert refused and "10.0.0.1" in refused, refused


@pytest.mark.parametrize(
    ("url", "loopback", "expected"),
    [c[1:] for c in CARD_URLS if c[3].startswith(GUARD)],
    ids=[c[0] for c in CARD_URLS if c[3].startswith(GUARD)],
)
def test_the_transport_refuses_by_itself(
    v4: CardServer,
    v6: CardServer,
    names: list[str],
    settings: Any,
    url: str,
    loopback: bool,
    expected: str,
) -> None:
    """Without the check before fetching, the client's transport refuses at connect time."""
    mark = len(loopback_hook.refused)
    if not loopback:
        settings.OUTBOUND_ALLOW = []
    url = _url(url, v4, v6)
    with pytest.raises(OutboundRefused) as err:
        outbound.run(lambda http: fetch_card(url, http=http))
    assert expected in str(err.value)
    assert "SECRET" not in str(err.value)
    with pytest.raises(httpx.ConnectError) as raw:
        outbound.run(lambda http: http.get(url))
    assert isinstance(raw.value.__cause__, GuardRefusal)
    assert (v4.connections, v6.connections) == (0, 0)
    no_attempt_off_loopback(mark)


def test_loopback_allowed_by_setting_reaches_the_card(v4: CardServer, names: list[str]) -> None:
    """The control: with loopback allowed (as in the tests) the same server is reachable, by name too."""
    preview = agent_services.preview_card(f"http://loopback.internal.test:{v4.port}/")
    assert preview.interface["url"] == f"{v4.base}/rpc" and not preview.problems
    assert v4.connections == 1 and names == ["loopback.internal.test"] * 2  # checked, then fetched


# -- interface URLs a card names -----------------------------------------------------------


def test_a_card_whose_only_interface_is_refused_is_not_registered(
    v4: CardServer, names: list[str]
) -> None:
    mark = len(loopback_hook.refused)
    v4.card(card("http://169.254.169.254/rpc"))
    with pytest.raises(agent_services.AgentError) as err:
        agent_services.add_agent(v4.base)
    assert "offers no interface" in str(err.value)
    assert f"interface http://169.254.169.254/rpc: {GUARD}{METADATA}" in str(err.value)
    assert not Agent.objects.exists()
    no_attempt_off_loopback(mark)


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (
            "http://metadata.internal.test/rpc",
            GUARD + "metadata.internal.test resolves to 169.254.169.254",
        ),
        (
            "http://private.internal.test/rpc",
            GUARD + "private.internal.test resolves to 10.0.0.1, which is private",
        ),
        ("http://10.0.0.1/rpc", GUARD + "10.0.0.1 is private"),
        ("http://[fe80::1]/rpc", GUARD + "fe80::1 is link-local"),
    ],
)
def test_a_refused_interface_is_passed_over_and_said(
    v4: CardServer, names: list[str], bad: str, expected: str
) -> None:
    v4.card(card(bad, f"{v4.base}/rpc"))
    agent = agent_services.add_agent(v4.base)
    assert agent.interface_url == f"{v4.base}/rpc"
    assert f"interface {bad}: {expected}" in "\n".join(agent.card_problems)


def test_interface_paths_with_dot_segments_are_problems(v4: CardServer) -> None:
    body = card("/../admin/rpc", f"{v4.base}/.well-known/../rpc")
    problems = [f"{p.path}: {p.message}" for p in validate_card(body)]
    assert any(p.startswith("supportedInterfaces[0].url: " + DOTS) for p in problems)
    assert any(p.startswith("supportedInterfaces[1].url: " + DOTS) for p in problems)
    v4.card(body)
    with pytest.raises(agent_services.AgentError, match="offers no interface"):
        agent_services.add_agent(v4.base)
    assert not Agent.objects.exists()


# -- redirects ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("location", "expected"),
    [
        (
            "http://metadata.internal.test/card.json",
            GUARD + "metadata.internal.test resolves to 169.254.169.254",
        ),
        ("http://169.254.169.254/latest/meta-data/", GUARD + METADATA),
        ("http://10.0.0.1/card.json", GUARD + "10.0.0.1 is private"),
        (
            "http://private.internal.test/card.json",
            GUARD + "private.internal.test resolves to 10.0.0.1",
        ),
        ("{v6}/card.json", GUARD + "::1 is loopback"),  # loopback allowed for IPv4 only here
        ("/.well-known/../admin", "redirect not followed: " + DOTS),
        ("file:///etc/passwd", "redirect not followed: only http and https URLs are accepted"),
    ],
)
def test_a_redirect_to_a_refused_address_is_not_followed(
    v4: CardServer, v6: CardServer, names: list[str], settings: Any, location: str, expected: str
) -> None:
    mark = len(loopback_hook.refused)
    settings.OUTBOUND_ALLOW = ["127.0.0.0/8"]
    v4.redirect("/.well-known/agent-card.json", location.format(v6=v6.base))
    with pytest.raises(agent_services.AgentError) as err:
        agent_services.add_agent(v4.base)
    message = str(err.value)
    assert expected in message and "SECRET-REDIRECT-BODY" not in message
    assert v4.connections == 1 and v6.connections == 0  # the first hop only
    assert not Agent.objects.exists()
    no_attempt_off_loopback(mark)


def test_redirects_are_followed_a_few_times_only(v4: CardServer) -> None:
    v4.redirect("/.well-known/agent-card.json", "/moved/agent-card.json", status=301)
    v4.card(card(f"{v4.base}/rpc"), path="/moved/agent-card.json")
    preview = agent_services.preview_card(v4.base)
    assert preview.url == f"{v4.base}/moved/agent-card.json" and preview.interface

    for hop in range(5):
        v4.redirect(f"/loop{hop}.json", f"/loop{hop + 1}.json", status=307)
    with pytest.raises(agent_services.AgentError, match="more than 3 redirects"):
        agent_services.preview_card(f"{v4.base}/loop0.json")
    assert v4.connections == 2 + 4  # the move and the card, then the first hop and three redirects


# -- what error messages echo ---------------------------------------------------------------


def test_error_messages_echo_little_of_a_body(v4: CardServer) -> None:
    body = ("\u202e\x1b[31m" + "Q" * 200 + "TAIL").encode()
    v4.routes["/.well-known/agent-card.json"] = (500, {"Content-Type": "text/html"}, body)
    with pytest.raises(agent_services.AgentError) as err:
        agent_services.preview_card(f"{v4.base}/.well-known/agent-card.json")
    message = str(err.value)
    assert "HTTP 500" in message and "TAIL" not in message
    assert "\u202e" not in message and "\x1b" not in message
    assert 0 < message.count("Q") <= 80


# -- the worker path: a stored agent whose interface is refused ---------------------------


def test_a_stored_interface_that_resolves_to_a_refused_address_is_not_called(
    names: list[str],
) -> None:
    """What a watcher does (outbound.client_for + send) fails with the guard's sentence."""
    mark = len(loopback_hook.refused)
    agent = Agent.objects.create(
        name="moved", base_url="http://metadata.internal.test/", binding="JSONRPC",
        interface_url="http://metadata.internal.test/rpc", protocol_version="1.0",
    )  # fmt: skip
    with pytest.raises(OutboundRefused) as err:
        outbound.run(lambda http: outbound.client_for(agent, http).send_message(user_message("hi")))
    assert GUARD + "metadata.internal.test resolves to 169.254.169.254" in str(err.value)
    no_attempt_off_loopback(mark)


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_the_worker_refuses_to_send_to_a_refused_interface(
    agent: AgentHandle, celery_worker: Any
) -> None:
    """A real worker (its own process, its own guard): the send fails, saying why; nothing is sent.

    Were the worker's guard broken, its connect hook would stop the connect and log it, and
    this test would fail on that log.
    """
    row = agent_services.add_agent(agent.base_url, name="demo")
    Agent.objects.filter(pk=row.pk).update(interface_url="http://10.0.0.1:9/jsonrpc")
    row.refresh_from_db()
    task = task_services.start_task(row, "quick", mode="return-immediately")
    wait(
        lambda: RemoteTask.objects.get(pk=task.pk).phase == RemoteTask.Phase.FAILED,
        30,
        "the send to fail",
    )
    task.refresh_from_db()
    assert GUARD + "10.0.0.1 is private" in task.send_error
    assert task.remote_id == ""


def wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def test_fetch_card_refuses_dot_segments_as_written() -> None:
    """A URL with dot segments never reaches a client: fetch_card refuses it as written."""

    async def fetch(http: httpx.AsyncClient) -> Any:
        return await fetch_card("http://127.0.0.1:9/.well-known/../agent-card.json", http=http)

    with pytest.raises(ProtocolError, match=r"'\.' or '\.\.' segment"):
        outbound.run(fetch)


def test_every_shard_of_a_workers_clients_passes_the_guard(v4: CardServer, settings: Any) -> None:
    """The holders' HTTP clients come in shards (``outbound.ClientShards``): each refuses by
    itself, a task always gets the same one, and they share the process's SSL context with
    every one-off client (building one costs about 30 ms of CPU)."""
    import asyncio

    settings.OUTBOUND_ALLOW = []  # loopback refused too: the card server must see nothing
    mark = len(loopback_hook.refused)

    async def main() -> None:
        shards = outbound.ClientShards(4)
        try:
            assert shards.for_task(5) is shards.for_task(9) is shards.clients[1]
            assert len({id(shards.for_task(pk)) for pk in range(8)}) == 4
            # One SSL context for the shards and for a one-off client: the process's.
            async with outbound.new_http_client() as one_off:
                clients = [*shards.clients, one_off]
                contexts = {id(c._transport._pool._ssl_context) for c in clients}  # type: ignore[attr-defined]
            assert contexts == {id(outbound.shared_ssl_context())}
            for client in shards.clients:
                with pytest.raises(httpx.ConnectError) as raw:
                    await client.get(f"{v4.base}/.well-known/agent-card.json")
                assert isinstance(raw.value.__cause__, GuardRefusal)
        finally:
            await shards.aclose()
        assert all(client.is_closed for client in shards.clients)

    asyncio.run(main())
    assert v4.connections == 0
    no_attempt_off_loopback(mark)
