"""The outbound guard: which addresses a server-side fetch may connect to (SSRF).

Every URL the dashboard fetches on someone else's say-so - a card URL typed into a form,
the interface URL a card names, a redirect, a ListTasks page - could otherwise point it at
the cloud metadata service, the database or an admin port on the private network. The
check runs where the connection is made, in the httpcore network backend of every outbound
client (:func:`guarded_transport`): the host is resolved here, *every* address it resolves
to is checked, and the connection goes to an address that was checked (no second name
resolution, so DNS rebinding has no window). Being at connect time, it covers every hop
of a redirect and every binding without each caller remembering to ask.

The rules (:class:`Policy`):

* link-local (``169.254.0.0/16``, ``fe80::/10``), cloud-metadata, unspecified, multicast and
  reserved addresses are always refused, whatever the allow list says;
* loopback, private and other non-public addresses are refused unless allow-listed (a
  network in CIDR form, or the host name the URL names);
* public addresses are allowed.

:func:`url_problem` is the cheap check of a URL before anything is fetched (scheme, path,
a literal address), so a person is told at once and nothing is saved. This module imports
nothing from Django: ``tasks_app.outbound`` builds the policy from ``OUTBOUND_ALLOW``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import re
import socket
import ssl
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import httpcore
import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

SETTING = "OUTBOUND_ALLOW"
# What "allow loopback" means where the dashboard itself starts a local agent (demo, bench).
LOOPBACK = ("127.0.0.0/8", "::1/128")
PREFIX = "refused by the outbound guard: "

# Instance-metadata services hand out credentials: never an agent, never allow-listable.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS, GCP, Azure, Oracle, DigitalOcean, OpenStack
        "169.254.170.2",  # AWS ECS task metadata
        "fd00:ec2::254",  # AWS over IPv6
        "100.100.100.200",  # Alibaba Cloud
        "168.63.129.16",  # Azure host services
    )
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_BROADCAST = ipaddress.ip_address("255.255.255.255")
_NEVER_TAIL = f"never fetched, whatever {SETTING} says"
_ALLOW_TAIL = f"fetched only when {SETTING} lists it (a CIDR or the host name)"
_HOSTNAME = re.compile(
    r"(?=.{1,253}$)([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*"
)
BAD_PATH = (
    "the URL path has a '.' or '..' segment (perhaps percent-encoded), which would reach "
    "another path than the one written; give the path without them"
)


class GuardRefusal(httpcore.ConnectError):
    """The guard refused to connect; nothing was sent and nothing was received.

    An ``httpcore.ConnectError``, so httpx reports it as ``httpx.ConnectError`` (with this
    as its ``__cause__``) and :func:`tasks_app.a2a._http.map_transport_error` turns it into
    :class:`~tasks_app.a2a.errors.OutboundRefused`. Its message never holds a response body:
    there was no response.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(PREFIX + reason)
        self.reason = reason


def _ip(address: str | IPAddress) -> IPAddress:
    if isinstance(address, ipaddress.IPv4Address | ipaddress.IPv6Address):
        return address
    return ipaddress.ip_address(
        address.split("%", 1)[0]
    )  # a scope (fe80::1%eth0) is not the address


def literal_ip(host: str) -> IPAddress | None:
    """The address ``host`` spells (``[::1]`` or ``::1``, ``10.0.0.1``), else None (a name)."""
    try:
        return _ip(host.strip("[]"))
    except ValueError:
        return None


def _embedded_v4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one reaches (mapped, NAT64, 6to4): checked like itself."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.sixtofour


def never_reason(ip: IPAddress) -> str | None:
    """Why ``ip`` is refused whatever the allow list says, or None."""
    if ip in METADATA_ADDRESSES:
        return "link-local (cloud metadata)" if ip.is_link_local else "a cloud metadata address"
    if ip.is_link_local:
        return "link-local"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_multicast:
        return "multicast"
    if isinstance(ip, ipaddress.IPv4Address) and (ip.is_reserved or ip == _BROADCAST):
        return "reserved"
    return None


def private_reason(ip: IPAddress) -> str | None:
    """Why ``ip`` needs the allow list (loopback, private, otherwise not public), or None."""
    if ip.is_loopback:
        return "loopback"
    if ip.is_private:
        return "private"
    if not ip.is_global:
        return "not a public address"
    return None


def _host_key(host: str) -> str:
    return host.strip().strip("[]").rstrip(".").lower()


@dataclass(frozen=True)
class Policy:
    """Which non-public addresses may be reached: networks, and hosts by the name a URL gives."""

    networks: tuple[IPNetwork, ...] = ()
    hosts: frozenset[str] = frozenset()

    @classmethod
    def from_entries(cls, entries: Iterable[str]) -> Policy:
        """``["127.0.0.0/8", "::1", "agents.corp.internal"]``: CIDRs, addresses, host names.

        Raises ``ValueError`` naming an entry that is neither.
        """
        networks: list[IPNetwork] = []
        hosts: set[str] = set()
        for raw in entries:
            entry = raw.strip()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            name = _host_key(entry)
            if not _HOSTNAME.fullmatch(name):
                raise ValueError(
                    f"{entry!r} is neither a network (CIDR), an address nor a host name"
                )
            hosts.add(name)
        return cls(tuple(networks), frozenset(hosts))

    def allows(self, ip: IPAddress, host: str = "") -> bool:
        """Whether the allow list names ``ip`` (or the address it embeds) or ``host``."""
        if host and _host_key(host) in self.hosts:
            return True
        candidates = [c for c in (ip, _embedded_v4(ip)) if c is not None]
        return any(
            c in net for c in candidates for net in self.networks if c.version == net.version
        )

    def address_problem(self, address: str | IPAddress, host: str = "") -> str | None:
        """Why connecting to ``address`` (which ``host`` resolved to) is refused, or None."""
        ip = _ip(address)
        named = bool(host) and literal_ip(host) is None
        subject = f"{host} resolves to {ip}, which" if named else str(ip)
        # An address that reaches an IPv4 one (::ffff:10.0.0.1) is judged by what it reaches first.
        candidates = [c for c in (_embedded_v4(ip), ip) if c is not None]
        for candidate in candidates:
            never = never_reason(candidate)
            if never:
                return f"{subject} is {never}{_via(candidate, ip)}; {_NEVER_TAIL}"
        if self.allows(ip, host):
            return None
        for candidate in candidates:
            why = private_reason(candidate)
            if why:
                return f"{subject} is {why}{_via(candidate, ip)}; {_ALLOW_TAIL}"
        return None


def _via(candidate: IPAddress, ip: IPAddress) -> str:
    return "" if candidate == ip else f" (it reaches {candidate})"


def path_problem(path: str) -> str | None:
    """Why a URL path must not be used as written: dot segments, or None.

    httpx (like every client) removes ``.`` and ``..`` segments before sending, so
    ``/.well-known/../admin`` fetches ``/admin``; percent-encoded ones (``%2e%2e``, and
    ``%2f`` or ``\\`` as separators) are undone by many servers. Refusing them keeps the
    path that is fetched the path that was written.
    """
    decoded = unquote(path)
    if any(segment in (".", "..") for segment in re.split(r"[/\\]", decoded)):
        return BAD_PATH
    return None


def url_problem(url: str, policy: Policy) -> str | None:
    """Why ``url`` may not be fetched, judged without the network, or None.

    Scheme (http or https only), a host, the path (:func:`path_problem`) and, when the host
    is a literal address, the address itself. A host name is checked when it is resolved,
    at connect time (:class:`GuardedBackend`).
    """
    try:
        parts = urlsplit(url.strip())
        host = parts.hostname
    except ValueError:
        return "not a valid URL"
    if parts.scheme.lower() not in ("http", "https") or not host:
        return "only http and https URLs are accepted"
    problem = path_problem(parts.path) or unwritable(url)
    if problem:
        return problem
    ip = literal_ip(host)
    if ip is not None:
        reason = policy.address_problem(ip, host)
        if reason:
            return PREFIX + reason
    return None


def unwritable(url: str) -> str | None:
    """Why a request to the http(s) URL ``url`` cannot be written at all, or None.

    Its port past 65535, or a host that is no internationalized domain name (a right-to-left
    override, a combining accent, an ``xn--`` label that decodes to nothing): ``urlsplit``
    and httpx raise ``ValueError`` or ``httpx.InvalidURL`` for those only when the port or
    host is read, or as the request is built, and the agent-add page answered 500.
    """
    try:
        _ = urlsplit(url.strip()).port  # read: past 65535 it raises
    except ValueError:
        return "the port must be a number from 0 to 65535"
    try:
        _ = httpx.URL(url.strip()).host  # read: an IDNA host is decoded here
    except (httpx.InvalidURL, ValueError):
        return "the host name is not a valid (internationalized) domain name"
    return None


def check_addresses(policy: Policy, host: str, addresses: Iterable[str | IPAddress]) -> list[str]:
    """The addresses as strings, in order and without repeats; raises on the first refused one."""
    checked: list[str] = []
    for address in addresses:
        ip = _ip(address)
        reason = policy.address_problem(ip, host)
        if reason:
            raise GuardRefusal(reason)
        if str(ip) not in checked:
            checked.append(str(ip))
    if not checked:
        raise httpcore.ConnectError(f"{host} resolves to no address")
    return checked


# Name lookups run here, not on the loop's default executor: ``asyncio.run`` waits for that
# executor's threads when it ends, so a resolver that ignores the deadline held a caller
# (a page, the alert evaluation) as long as the system resolver liked. A lookup past its
# deadline is given up; its thread finishes in the background, at most this many at once
# (past that, lookups wait here and time out like any other).
RESOLVER_THREADS = 8
_resolver = ThreadPoolExecutor(RESOLVER_THREADS, thread_name_prefix="outbound-resolve")


def _lookup(host: str, port: int) -> list[tuple]:
    # Looked up at call time, so tests can stub names.
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def lookup_within(host: str, port: int, timeout: float) -> list[str] | None:
    """The addresses ``host`` resolves to, looked up on the guard's threads for at most
    ``timeout`` seconds (for a caller that is not on a loop: a page's check before a fetch);
    None when the name does not resolve in time or at all (the fetch says so in its words)."""
    try:
        infos = _resolver.submit(_lookup, host, port).result(timeout=timeout)
    except (OSError, ValueError, concurrent.futures.TimeoutError):
        return None
    return _addresses(infos)


def _addresses(infos: list[tuple]) -> list[str]:
    """The IPv4 and IPv6 addresses of ``getaddrinfo``'s answer, in its order."""
    inet = (socket.AF_INET, socket.AF_INET6)
    return [str(info[4][0]) for info in infos if info[0] in inet]


async def resolve_checked(policy: Policy, host: str, port: int, timeout: float | None) -> list[str]:
    """Resolve ``host`` (unless it is an address) and check every address it resolves to."""
    ip = literal_ip(host)
    if ip is not None:
        return check_addresses(policy, host, [ip])
    loop = asyncio.get_running_loop()
    scope = asyncio.timeout(timeout)
    try:
        async with scope:
            infos = await loop.run_in_executor(_resolver, _lookup, host, port)
    except TimeoutError:
        if scope.expired():
            raise httpcore.ConnectTimeout(
                f"resolving {host} took longer than {timeout:g} s"
            ) from None
        raise
    except OSError as exc:
        raise httpcore.ConnectError(f"cannot resolve {host}: {exc.strerror or exc}") from None
    return check_addresses(policy, host, _addresses(infos))


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """An httpcore network backend that connects only to addresses the policy allows.

    ``policy`` is asked on every connection, so a changed setting applies to long-lived
    clients too. TLS is unaffected: httpcore takes the SNI name and the ``Host`` header
    from the URL, not from the address connected to.
    """

    def __init__(
        self, policy: Callable[[], Policy], inner: httpcore.AsyncNetworkBackend | None = None
    ) -> None:
        self._policy = policy
        self._inner = inner or httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = await resolve_checked(self._policy(), host, port, timeout)
        error: Exception | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address,
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc  # the next address of the host may answer
        assert error is not None  # resolve_checked never returns an empty list
        raise error

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise GuardRefusal(f"a Unix socket ({path}) is never fetched")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's own transport, on a connection pool whose every connection passes the guard.

    httpx 0.28 offers no way to give ``AsyncHTTPTransport`` a network backend, so the
    httpcore pool is built here with the settings httpx would use; httpx's
    ``handle_async_request`` needs nothing but ``self._pool``. ``super().__init__`` is not
    called: it would build a second pool and SSL context (~33 ms of CPU). No proxy: through
    a proxy the guard would see the proxy's address, not the one the request is for.
    """

    def __init__(
        self,
        policy: Callable[[], Policy],
        *,
        limits: httpx.Limits,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context or httpx.create_ssl_context(),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            http1=True,
            http2=False,
            network_backend=GuardedBackend(policy),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Ask for the body as it is, and refuse one that comes compressed anyway.

        httpx decodes gzip and deflate a network chunk at a time with no bound on the
        output: 65 KB of gzip became 64 MB in memory at once, and an SSE stream of such
        blank lines held the event loop for a minute before any time bound could look.
        A server must honour ``identity`` (RFC 9110, 12.5.3), so a compressed reply is
        the agent's error, said as such (``COMPRESSED_REPLY``) before a byte is decoded.
        """
        request.headers["Accept-Encoding"] = "identity"
        response = await super().handle_async_request(request)
        encoding = response.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            await response.aclose()
            raise httpx.DecodingError(
                f"{COMPRESSED_REPLY} ({encoding[:40]!r}) although only identity was accepted",
                request=request,
            )
        return response


COMPRESSED_REPLY = "the reply is compressed"


def refusal_in(exc: BaseException) -> GuardRefusal | None:
    """The guard's refusal behind an httpx exception (its cause chain), if that is what it was."""
    seen: BaseException | None = exc
    for _ in range(8):  # a short chain; never loop on a cycle
        if seen is None:
            return None
        if isinstance(seen, GuardRefusal):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
