"""Agent cards: discovery, validation against A2A 1.0, and interface choice.

A card is kept as the plain JSON dict the agent served. :func:`validate_card`
lists *all* problems instead of stopping at the first, so an operator sees
everything wrong with an agent at once. A 0.3 card (top-level ``url`` /
``preferredTransport`` and no ``supportedInterfaces``) is recognised and
reported as such; :func:`card_protocol_family` is the seam where 0.3 support
will plug in later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx

from ._http import (
    HTTPX_ERRORS,
    decode_json,
    error_for_status,
    map_transport_error,
    media_type,
    read_bounded,
)
from ._http import deadline as deadline_scope  # ``deadline`` is a parameter name here
from .errors import IncompatibleAgentError, ProtocolError
from .guard import path_problem, unwritable
from .origins import split_http_url
from .types import (
    A2A_VERSION,
    LEGACY_CARD_PATH,
    SUPPORTED_BINDINGS,
    WELL_KNOWN_CARD_PATH,
    CardProblem,
    CardResult,
    Interface,
)

DEFAULT_CARD_MAX_BYTES = 1024 * 1024
DEFAULT_CARD_DEADLINE = 30.0
# A card may move (http to https, a new path); each hop is a new URL, checked like the first.
MAX_CARD_REDIRECTS = 3
REDIRECT_STATUSES = (301, 302, 303, 307, 308)
HTTP_SCHEMES = ("http", "https")
HTTP_ONLY = "only http and https URLs are accepted"
SCHEME_KINDS = (
    "apiKeySecurityScheme",
    "httpAuthSecurityScheme",
    "oauth2SecurityScheme",
    "openIdConnectSecurityScheme",
    "mtlsSecurityScheme",
)
OAUTH_FLOWS = ("authorizationCode", "clientCredentials", "deviceCode", "implicit", "password")


class CardNotFoundError(ProtocolError):
    """No agent card at the well-known paths (or at the given card URL)."""


def http_url_problem(url: str, *, relative_ok: bool = False) -> str | None:
    """Why ``url`` may not be used to reach an agent, or None.

    Only absolute ``http``/``https`` URLs with a host are accepted: a card is
    untrusted input and may name ``javascript:``, ``file:``, ``data:`` or a
    scheme-less ``host:port`` (which parses as a scheme). With
    ``relative_ok``, a path reference starting with ``/`` is accepted too: it
    is resolved against the (http or https) card URL. A path with ``.`` or
    ``..`` segments is refused (:func:`~tasks_app.a2a.guard.path_problem`):
    ``/.well-known/../admin`` would fetch ``/admin``.
    """
    if relative_ok and url.startswith("/") and not url.startswith("//"):
        return path_problem(url.split("#", 1)[0].split("?", 1)[0])
    try:
        parts = urlsplit(url.strip())
        host = parts.hostname
    except ValueError:
        return HTTP_ONLY
    if parts.scheme.lower() not in HTTP_SCHEMES or not host:
        return HTTP_ONLY
    return path_problem(parts.path) or unwritable(url)


def card_urls(base_or_card_url: str) -> list[str]:
    """Candidate card URLs: the URL itself if it names a JSON document, else well-known paths."""
    parts = urlsplit(base_or_card_url)
    path = parts.path or ""
    if path.endswith(".json") or "/.well-known/" in path:
        return [base_or_card_url]
    base = base_or_card_url.split("?", 1)[0].split("#", 1)[0].rstrip("/")
    return [base + WELL_KNOWN_CARD_PATH, base + LEGACY_CARD_PATH]


def registration_url(url: str) -> str:
    """``url`` in the one form an agent is registered under: the same agent, the same text.

    ``http://a.example``, ``HTTP://A.example:80/`` and ``http://a.example/?x#y`` fetch the same
    card (``card_urls`` drops the query, fragment and trailing slashes of a base URL), so
    each project held them as three agents. The scheme and host are lower-cased, a default
    port is dropped, and a base URL loses its query, fragment and trailing slashes; the
    well-known card's URL (``WELL_KNOWN_CARD_PATH``, no query) is its base URL; another card
    document's URL (``.json`` or under ``/.well-known/``) keeps its query, which may choose
    the card. Anything that does not parse is returned stripped, for the checks that say why.
    """
    url = url.strip()
    split = split_http_url(url)
    if split is None:
        return url
    parts = split.parts
    if parts.username is not None or parts.password is not None:
        return url  # refused later with its own reason; not rebuilt without it
    path = parts.path or ""
    if path.endswith(WELL_KNOWN_CARD_PATH) and not parts.query:
        # The card a base URL is discovered at first: the same agent as that base URL (added
        # by its card's URL, it was a second agent of the project, its tasks imported twice).
        path = path[: -len(WELL_KNOWN_CARD_PATH)]
    elif path.endswith(".json") or "/.well-known/" in path:
        return f"{split.scheme}://{split.netloc}{path}" + (f"?{parts.query}" if parts.query else "")
    return f"{split.scheme}://{split.netloc}{path.rstrip('/')}"


async def fetch_card(
    base_or_card_url: str,
    *,
    http: httpx.AsyncClient,
    etag: str | None = None,
    timeout: float = 15.0,
    deadline: float | None = DEFAULT_CARD_DEADLINE,
    max_bytes: int = DEFAULT_CARD_MAX_BYTES,
    headers: dict[str, str] | None = None,
) -> CardResult:
    """Fetch an agent card, revalidating with ``If-None-Match`` when ``etag`` is given.

    Tries ``/.well-known/agent-card.json`` then the pre-1.0
    ``/.well-known/agent.json`` for a base URL. The card is *not* validated
    here (call :func:`validate_card`): a broken card is still worth showing.
    ``timeout`` bounds each read; ``deadline`` the whole fetch (all candidate
    URLs), raising :class:`DeadlineExceeded`. Only http(s) URLs are fetched.
    At most :data:`MAX_CARD_REDIRECTS` redirects are followed, each target
    checked like the URL given (the client's transport checks the address of
    every hop); the card's URL is then the last hop's.
    """
    problem = http_url_problem(base_or_card_url)
    if problem:
        raise ProtocolError(problem, where=f"card URL {base_or_card_url[:200]!r}")
    async with deadline_scope(deadline, f"card fetch from {base_or_card_url}"):
        return await _fetch_card(
            base_or_card_url,
            http=http,
            etag=etag,
            timeout=timeout,
            max_bytes=max_bytes,
            headers=headers,
        )


async def _fetch_card(
    base_or_card_url: str,
    *,
    http: httpx.AsyncClient,
    etag: str | None,
    timeout: float,
    max_bytes: int,
    headers: dict[str, str] | None,
) -> CardResult:
    candidates = card_urls(base_or_card_url)
    for url in candidates:
        result = await _fetch_candidate(
            url,
            http=http,
            etag=etag,
            timeout=timeout,
            max_bytes=max_bytes,
            headers=headers,
            tried=candidates if url == candidates[-1] else None,
        )
        if result is not None:
            return result
    raise CardNotFoundError(
        f"no agent card found (last tried {candidates[-1]})"
    )  # pragma: no cover


async def _fetch_candidate(
    url: str,
    *,
    http: httpx.AsyncClient,
    etag: str | None,
    timeout: float,
    max_bytes: int,
    headers: dict[str, str] | None,
    tried: list[str] | None,
) -> CardResult | None:
    """GET one candidate URL, following redirects; None: not there (404), try the next.

    ``tried`` is given for the last candidate: its 404 is the final answer.
    """
    hop = url
    for _ in range(MAX_CARD_REDIRECTS + 1):
        req_headers = {"Accept": "application/json"}
        if _origin(hop) == _origin(url):  # the caller's headers may hold credentials
            req_headers.update(headers or {})
        if etag:
            req_headers["If-None-Match"] = etag
        where = f"GET {hop}" if hop == url else f"GET {hop} (redirected from {url})"
        try:
            async with http.stream("GET", hop, headers=req_headers, timeout=timeout) as resp:
                target = _redirect_target(resp, hop, where)
                if target is None:
                    return await _card_from(
                        resp, hop, where, etag=etag, max_bytes=max_bytes, tried=tried
                    )
        except HTTPX_ERRORS as exc:
            raise map_transport_error(exc, where) from exc
        hop = target
    raise ProtocolError(f"more than {MAX_CARD_REDIRECTS} redirects", where=f"GET {url}")


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port


def _redirect_target(resp: httpx.Response, hop: str, where: str) -> str | None:
    """Where a redirect points (checked like any card URL), or None for any other answer.

    The redirect's body is never read: nothing of it can end up in a message.
    """
    if resp.status_code not in REDIRECT_STATUSES:
        return None
    location = resp.headers.get("location", "").strip()
    if not location:
        raise ProtocolError(f"HTTP {resp.status_code} redirect without a Location", where=where)
    try:
        target = urljoin(hop, location)
        # urljoin removes dot segments itself: the Location is judged as the server wrote it.
        problem = path_problem(urlsplit(location).path) or http_url_problem(target)
    except ValueError:
        raise ProtocolError("redirect to a URL that cannot be read", where=where) from None
    if problem:
        raise ProtocolError(f"redirect not followed: {problem}", where=where)
    if urlsplit(hop).scheme.lower() == "https" and urlsplit(target).scheme.lower() == "http":
        raise ProtocolError("redirect from https to http not followed", where=where)
    return target


async def _card_from(
    resp: httpx.Response,
    url: str,
    where: str,
    *,
    etag: str | None,
    max_bytes: int,
    tried: list[str] | None,
) -> CardResult | None:
    if resp.status_code == 304:
        return CardResult(
            url=url,
            card=None,
            etag=resp.headers.get("etag") or etag,
            not_modified=True,
            cache_control=resp.headers.get("cache-control"),
        )
    body = await read_bounded(resp, max_bytes, where)
    if resp.status_code in (404, 410) and tried is None:
        return None
    if resp.status_code in (404, 410):
        raise CardNotFoundError(
            f"no agent card found (HTTP {resp.status_code}; tried {', '.join(tried or [url])})",
            where=where,
        )
    if resp.status_code >= 400:
        raise error_for_status(resp, body, where)
    card = decode_json(body, where, mt=media_type(resp))
    if not isinstance(card, dict):
        raise ProtocolError(
            f"agent card must be a JSON object, got {type(card).__name__}", where=where
        )
    return CardResult(
        url=url,
        card=card,
        etag=resp.headers.get("etag"),
        cache_control=resp.headers.get("cache-control"),
    )


# --------------------------------------------------------------------------- validation


def is_v03_card(card: Any) -> bool:
    """A 0.3 card has top-level url/preferredTransport and no supportedInterfaces."""
    return (
        isinstance(card, dict)
        and "supportedInterfaces" not in card
        and any(k in card for k in ("url", "preferredTransport", "additionalInterfaces"))
    )


def card_protocol_family(card: dict[str, Any]) -> str:
    """``"1.0"`` or ``"0.3"``: where 0.3 normalisation will be added later."""
    return "0.3" if is_v03_card(card) else "1.0"


class _Checker:
    def __init__(self) -> None:
        self.problems: list[CardProblem] = []

    def add(self, path: str, message: str) -> None:
        self.problems.append(CardProblem(path, message))

    def string(self, obj: dict[str, Any], key: str, path: str, *, required: bool) -> None:
        full = f"{path}.{key}" if path else key
        if key not in obj:
            if required:
                self.add(full, "required field is missing")
            return
        value = obj[key]
        if not isinstance(value, str):
            self.add(full, f"must be a string, got {type(value).__name__}")
        elif required and not value:
            self.add(full, "required field is empty")

    def str_list(self, obj: dict[str, Any], key: str, path: str, *, required: bool) -> None:
        full = f"{path}.{key}" if path else key
        if key not in obj:
            if required:
                self.add(full, "required field is missing")
            return
        value = obj[key]
        if not isinstance(value, list):
            self.add(full, f"must be an array of strings, got {type(value).__name__}")
            return
        if required and not value:
            self.add(full, "required array is empty")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                self.add(f"{full}[{i}]", f"must be a string, got {type(item).__name__}")

    def obj(self, value: Any, path: str) -> bool:
        if not isinstance(value, dict):
            self.add(path, f"must be an object, got {type(value).__name__}")
            return False
        return True

    def requirements(self, reqs: Any, path: str, scheme_names: set[str] | None) -> None:
        if not isinstance(reqs, list):
            self.add(path, "must be an array")
            return
        for i, req in enumerate(reqs):
            rp = f"{path}[{i}]"
            if not self.obj(req, rp):
                continue
            schemes = req.get("schemes", {})
            if not self.obj(schemes, f"{rp}.schemes"):
                continue
            for name, scopes in schemes.items():
                sp = f"{rp}.schemes.{name}"
                if scheme_names is not None and name not in scheme_names:
                    self.add(sp, "names a scheme not declared in securitySchemes")
                if self.obj(scopes, sp) and "list" in scopes:
                    self.str_list(scopes, "list", sp, required=False)


def validate_card(card: Any) -> list[CardProblem]:
    """Every way ``card`` deviates from an A2A 1.0 AgentCard (empty list = valid)."""
    c = _Checker()
    if not isinstance(card, dict):
        c.add("", f"agent card must be a JSON object, got {type(card).__name__}")
        return c.problems
    v03 = is_v03_card(card)
    if v03:
        c.add(
            "",
            "agent speaks A2A 0.3 (top-level url/preferredTransport, no supportedInterfaces); "
            "0.3 is not supported yet",
        )
    for key in ("name", "description", "version"):
        c.string(card, key, "", required=True)
    for key in ("documentationUrl", "iconUrl"):
        c.string(card, key, "", required=False)
        _check_link(c, card, key, "")

    if not v03:
        ifaces = card.get("supportedInterfaces")
        if ifaces is None:
            c.add("supportedInterfaces", "required field is missing")
        elif not isinstance(ifaces, list):
            c.add("supportedInterfaces", "must be an array")
        else:
            if not ifaces:
                c.add("supportedInterfaces", "required array is empty")
            for i, iface in enumerate(ifaces):
                p = f"supportedInterfaces[{i}]"
                if not c.obj(iface, p):
                    continue
                for key in ("url", "protocolBinding", "protocolVersion"):
                    c.string(iface, key, p, required=True)
                url = iface.get("url")
                if isinstance(url, str) and url:
                    problem = http_url_problem(url, relative_ok=True)
                    if problem:
                        c.add(f"{p}.url", problem)
                c.string(iface, "tenant", p, required=False)
                ver = iface.get("protocolVersion")
                if isinstance(ver, str) and ver and _major_minor(ver) is None:
                    c.add(f"{p}.protocolVersion", f"not a Major.Minor version: {ver!r}")

    if "provider" in card and c.obj(card["provider"], "provider"):
        c.string(card["provider"], "url", "provider", required=True)
        _check_link(c, card["provider"], "url", "provider")
        c.string(card["provider"], "organization", "provider", required=True)

    caps = card.get("capabilities")
    if caps is None:
        c.add("capabilities", "required field is missing")
    elif c.obj(caps, "capabilities"):
        for flag in ("streaming", "pushNotifications", "extendedAgentCard"):
            if flag in caps and not isinstance(caps[flag], bool):
                c.add(f"capabilities.{flag}", f"must be a boolean, got {type(caps[flag]).__name__}")
        exts = caps.get("extensions")
        if exts is not None:
            if not isinstance(exts, list):
                c.add("capabilities.extensions", "must be an array")
            else:
                for i, ext in enumerate(exts):
                    p = f"capabilities.extensions[{i}]"
                    if not c.obj(ext, p):
                        continue
                    c.string(ext, "uri", p, required=True)
                    c.string(ext, "description", p, required=False)
                    if "required" in ext and not isinstance(ext["required"], bool):
                        c.add(f"{p}.required", "must be a boolean")
                    if "params" in ext:
                        c.obj(ext["params"], f"{p}.params")

    c.str_list(card, "defaultInputModes", "", required=True)
    c.str_list(card, "defaultOutputModes", "", required=True)

    schemes = card.get("securitySchemes")
    scheme_names: set[str] | None = None
    if schemes is not None and c.obj(schemes, "securitySchemes"):
        scheme_names = set(schemes)
        for name, scheme in schemes.items():
            _check_scheme(c, scheme, f"securitySchemes.{name}")
    if "securityRequirements" in card:
        c.requirements(card["securityRequirements"], "securityRequirements", scheme_names or set())

    skills = card.get("skills")
    if skills is None:
        c.add("skills", "required field is missing")
    elif not isinstance(skills, list):
        c.add("skills", "must be an array")
    else:
        if not skills:
            c.add("skills", "required array is empty")
        for i, skill in enumerate(skills):
            p = f"skills[{i}]"
            if not c.obj(skill, p):
                continue
            for key in ("id", "name", "description"):
                c.string(skill, key, p, required=True)
            c.str_list(skill, "tags", p, required=True)
            for key in ("examples", "inputModes", "outputModes"):
                c.str_list(skill, key, p, required=False)
            if "securityRequirements" in skill:
                c.requirements(
                    skill["securityRequirements"],
                    f"{p}.securityRequirements",
                    scheme_names or set(),
                )

    sigs = card.get("signatures")
    if sigs is not None:
        if not isinstance(sigs, list):
            c.add("signatures", "must be an array")
        else:
            for i, sig in enumerate(sigs):
                p = f"signatures[{i}]"
                if c.obj(sig, p):
                    c.string(sig, "protected", p, required=True)
                    c.string(sig, "signature", p, required=True)
                    if "header" in sig:
                        c.obj(sig["header"], f"{p}.header")
    return c.problems


def _check_link(c: _Checker, obj: dict[str, Any], key: str, path: str) -> None:
    """A link the UI may render (documentation, icon, provider): http(s) only."""
    value = obj.get(key)
    if isinstance(value, str) and value and http_url_problem(value):
        c.add(f"{path}.{key}" if path else key, HTTP_ONLY)


def _check_scheme(c: _Checker, scheme: Any, path: str) -> None:
    if not c.obj(scheme, path):
        return
    kinds = [k for k in SCHEME_KINDS if k in scheme]
    if "type" in scheme and not kinds:
        # Beside a 1.0 wrapper key, 0.3's fields are unknown fields to ignore: the official SDK
        # writes both into every scheme of a card that also offers a 0.3 interface.
        c.add(path, "OpenAPI-style scheme with 'type' (A2A 0.3); 1.0 uses a oneof wrapper key")
        return
    if len(kinds) != 1:
        c.add(path, f"must have exactly one of {', '.join(SCHEME_KINDS)} (found {len(kinds)})")
        return
    kind = kinds[0]
    body = scheme[kind]
    p = f"{path}.{kind}"
    if not c.obj(body, p):
        return
    c.string(body, "description", p, required=False)
    if kind == "apiKeySecurityScheme":
        c.string(body, "name", p, required=True)
        loc = body.get("location")
        if loc not in ("header", "query", "cookie"):
            c.add(f"{p}.location", f"must be 'header', 'query' or 'cookie', got {loc!r}")
    elif kind == "httpAuthSecurityScheme":
        c.string(body, "scheme", p, required=True)
        c.string(body, "bearerFormat", p, required=False)
    elif kind == "oauth2SecurityScheme":
        flows = body.get("flows")
        if flows is None:
            c.add(f"{p}.flows", "required field is missing")
        elif c.obj(flows, f"{p}.flows"):
            present = [f for f in OAUTH_FLOWS if f in flows]
            if len(present) != 1:
                c.add(
                    f"{p}.flows",
                    f"must have exactly one of {', '.join(OAUTH_FLOWS)} (found {len(present)})",
                )
            for f in present:
                fp = f"{p}.flows.{f}"
                if c.obj(flows[f], fp):
                    # The proto marks these REQUIRED in the current flows only, not in the
                    # deprecated password and implicit ones.
                    if f in ("authorizationCode", "clientCredentials", "deviceCode", "password"):
                        c.string(flows[f], "tokenUrl", fp, required=f != "password")
                    if f in ("authorizationCode", "implicit"):
                        c.string(flows[f], "authorizationUrl", fp, required=f != "implicit")
                    if f == "deviceCode":
                        c.string(flows[f], "deviceAuthorizationUrl", fp, required=True)
                    if "scopes" in flows[f]:
                        c.obj(flows[f]["scopes"], f"{fp}.scopes")
        c.string(body, "oauth2MetadataUrl", p, required=False)
    elif kind == "openIdConnectSecurityScheme":
        c.string(body, "openIdConnectUrl", p, required=True)


# --------------------------------------------------------------------------- interface choice


def _major_minor(version: str) -> tuple[int, int] | None:
    bits = version.strip().split(".")
    if len(bits) < 2:
        return None
    try:
        return int(bits[0]), int(bits[1])
    except ValueError:
        return None


# Candidate interfaces (our binding and version) checked before giving up, and interfaces
# named in the error: a card may list thousands (it may be 1 MB).
MAX_INTERFACES_CHECKED = 16
MAX_INTERFACES_NAMED = 20


def choose_interface(
    card: dict[str, Any],
    *,
    binding: str | None = None,
    card_url: str | None = None,
    check_url: Callable[[str], str | None] | None = None,
) -> Interface:
    """The interface to use, per §8.3.2: first entry we can speak, in card order.

    ``binding`` restricts the choice to ``"JSONRPC"`` or ``"HTTP+JSON"``
    (CLI ``--binding``). A relative interface URL (``/path``) is resolved
    against ``card_url``. An interface whose URL is not http(s) is never
    chosen, nor one ``check_url`` finds a problem with (the dashboard passes
    its outbound guard's check, so an interface at a refused address is
    passed over, with the reason). Raises :class:`IncompatibleAgentError`
    when nothing fits (saying why URLs were refused, if any were).
    """
    if is_v03_card(card):
        raise IncompatibleAgentError(
            "agent speaks A2A 0.3 only (its card has no supportedInterfaces); 0.3 is not supported yet",
            problems=validate_card(card),
        )
    wanted = SUPPORTED_BINDINGS if binding is None else (_normalise_binding(binding),)
    target = _major_minor(A2A_VERSION)
    offered: list[str] = []
    refused: list[str] = []
    checked, cut = 0, False
    ifaces = card.get("supportedInterfaces")
    for i, iface in enumerate(ifaces if isinstance(ifaces, list) else []):
        if not isinstance(iface, dict):
            continue
        b = iface.get("protocolBinding")
        v = iface.get("protocolVersion")
        url = iface.get("url")
        if len(offered) < MAX_INTERFACES_NAMED:
            offered.append(f"{str(b)[:40]} {str(v)[:20]}")
        if not isinstance(b, str) or not isinstance(v, str) or not isinstance(url, str) or not url:
            continue
        if b.upper() not in wanted or _major_minor(v) != target:
            continue
        if checked == MAX_INTERFACES_CHECKED:
            # Each check may resolve a name: a card of thousands of refused interfaces must
            # not hold the request (or the worker) for as many lookups.
            refused.insert(
                0, f"only the first {MAX_INTERFACES_CHECKED} usable interfaces are tried"
            )
            cut = True
            break
        checked += 1
        if card_url and not http_url_problem(url, relative_ok=True):
            url = urljoin(card_url, url)
        problem = http_url_problem(url) or (check_url(url) if check_url else None)
        if problem:
            refused.append(f"supportedInterfaces[{i}].url: {problem}")
            continue
        tenant = iface.get("tenant") if isinstance(iface.get("tenant"), str) else ""
        return Interface(url=url, binding=b.upper(), protocol_version=A2A_VERSION, tenant=tenant)  # type: ignore[arg-type]
    want = " or ".join(wanted)
    why = f"; {'; '.join(refused)}" if refused else ""
    more = ", …" if cut or len(offered) == MAX_INTERFACES_NAMED else ""
    raise IncompatibleAgentError(
        f"no {want} interface for A2A {A2A_VERSION} in the card "
        f"(offered: {', '.join(offered) or 'none'}{more}){why}"
    )


def _normalise_binding(binding: str) -> str:
    b = binding.strip().upper()
    if b in ("REST", "HTTP+JSON", "HTTP_JSON", "HTTPJSON"):
        return "HTTP+JSON"
    if b in ("JSONRPC", "JSON-RPC", "JSON_RPC"):
        return "JSONRPC"
    raise ValueError(f"unknown binding {binding!r} (use jsonrpc or rest)")
