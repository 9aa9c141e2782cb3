"""Agent cards: discovery (ETag, fallback path), validation, interface choice."""

from __future__ import annotations

import copy

import httpx
import pytest

from tasks_app.a2a import (
    CardNotFoundError,
    IncompatibleAgentError,
    Interface,
    ProtocolError,
    choose_interface,
    fetch_card,
    is_v03_card,
    validate_card,
)
from tasks_app.a2a.card import MAX_INTERFACES_CHECKED, MAX_INTERFACES_NAMED, registration_url
from tests.agents import V03_CARD, AgentHandle, BadServer

pytestmark = pytest.mark.timeout(30)

GOOD = {
    "name": "Invoice Agent",
    "description": "Extracts and reconciles invoices.",
    "version": "2.3.0",
    "supportedInterfaces": [
        {
            "url": "https://agents.acme.test/invoice/grpc",
            "protocolBinding": "GRPC",
            "protocolVersion": "1.0",
        },
        {
            "url": "https://agents.acme.test/invoice/v03",
            "protocolBinding": "JSONRPC",
            "protocolVersion": "0.3",
        },
        {
            "url": "https://agents.acme.test/invoice/rest",
            "protocolBinding": "HTTP+JSON",
            "protocolVersion": "1.0.1",
            "tenant": "acme-eu",
        },
        {
            "url": "https://agents.acme.test/invoice/rpc",
            "protocolBinding": "JSONRPC",
            "protocolVersion": "1.0",
        },
    ],
    "capabilities": {"streaming": True, "pushNotifications": True, "extendedAgentCard": False},
    "securitySchemes": {
        "bearer": {"httpAuthSecurityScheme": {"scheme": "Bearer", "bearerFormat": "JWT"}}
    },
    "securityRequirements": [{"schemes": {"bearer": {"list": []}}}],
    "defaultInputModes": ["text/plain", "application/pdf"],
    "defaultOutputModes": ["application/json", "text/plain"],
    "skills": [
        {
            "id": "extract",
            "name": "Extract invoice",
            "description": "PDF to JSON",
            "tags": ["finance"],
        }
    ],
}


async def test_fetch_from_base_url_with_etag_revalidation(
    agent: AgentHandle, http: httpx.AsyncClient
) -> None:
    first = await fetch_card(agent.base_url + "/", http=http)
    assert first.url == agent.card_url and first.card and first.card["name"] == "Demo Agent"
    assert first.etag and first.cache_control == "max-age=60" and not first.not_modified
    again = await fetch_card(agent.base_url, http=http, etag=first.etag)
    assert again.not_modified and again.card is None and again.etag == first.etag
    changed = await fetch_card(agent.base_url, http=http, etag='W/"something-else"')
    assert changed.card == first.card
    direct = await fetch_card(agent.card_url, http=http)
    assert direct.url == agent.card_url and validate_card(direct.card) == []


async def test_fetch_falls_back_to_legacy_path(
    bad_server: BadServer, http: httpx.AsyncClient
) -> None:
    res = await fetch_card(bad_server.url_for("legacycard"), http=http)
    assert res.url.endswith("/.well-known/agent.json") and res.card["name"] == "Legacy path agent"
    iface = choose_interface(res.card, card_url=res.url)  # relative URL resolved against the card's
    assert iface.url == f"http://127.0.0.1:{bad_server.port}/legacycard/rpc"


async def test_fetch_errors(bad_server: BadServer, http: httpx.AsyncClient) -> None:
    with pytest.raises(CardNotFoundError, match="no agent card"):
        await fetch_card(bad_server.url_for("nocard"), http=http)
    with pytest.raises(ProtocolError, match="expected JSON"):
        await fetch_card(bad_server.url_for("html200"), http=http)


async def test_v03_card_is_recognised(bad_server: BadServer, http: httpx.AsyncClient) -> None:
    res = await fetch_card(bad_server.url_for("card03"), http=http)
    assert is_v03_card(res.card)
    problems = validate_card(res.card)
    assert any("0.3" in p.message and "not supported yet" in p.message for p in problems)
    with pytest.raises(IncompatibleAgentError, match=r"0\.3"):
        choose_interface(res.card)
    assert is_v03_card(V03_CARD)


def test_good_card_validates_and_chooses_first_usable_interface() -> None:
    assert validate_card(GOOD) == []
    iface = choose_interface(GOOD)
    assert iface == Interface(
        url="https://agents.acme.test/invoice/rest", binding="HTTP+JSON", tenant="acme-eu"
    )
    rpc = choose_interface(GOOD, binding="jsonrpc")
    assert rpc.url.endswith("/rpc") and rpc.tenant == ""


def test_no_usable_interface() -> None:
    card = copy.deepcopy(GOOD)
    card["supportedInterfaces"] = card["supportedInterfaces"][:2]
    with pytest.raises(IncompatibleAgentError) as err:
        choose_interface(card)
    assert "GRPC 1.0" in str(err.value) and "JSONRPC 0.3" in str(err.value)
    with pytest.raises(ValueError):
        choose_interface(GOOD, binding="grpc")


def test_a_card_of_thousands_of_interfaces_is_tried_a_bounded_number_of_times() -> None:
    """Each check may resolve a name; a 1 MB card must not make thousands of lookups."""
    card = copy.deepcopy(GOOD)
    card["supportedInterfaces"] = [
        {"url": f"https://h{i}.test/rpc", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
        for i in range(5000)
    ]
    checked: list[str] = []

    def refuse(url: str) -> str:
        checked.append(url)
        return "refused here"

    with pytest.raises(IncompatibleAgentError) as err:
        choose_interface(card, check_url=refuse)
    assert checked == [f"https://h{i}.test/rpc" for i in range(MAX_INTERFACES_CHECKED)]
    text = err.value.message  # str() is one line of 300 characters at most
    assert f"only the first {MAX_INTERFACES_CHECKED} usable interfaces are tried" in text
    assert text.count("JSONRPC 1.0") <= MAX_INTERFACES_NAMED and ", …)" in text
    # A usable interface within the bound is still chosen.
    card["supportedInterfaces"][3]["url"] = "https://ok.test/rpc"
    assert choose_interface(card, check_url=lambda url: None if "ok" in url else "no").url == (
        "https://ok.test/rpc"
    )


def test_validate_lists_every_problem() -> None:
    bad = {
        "description": "",
        "version": 3,
        "supportedInterfaces": [{"protocolBinding": "JSONRPC", "protocolVersion": "one"}, "x"],
        "capabilities": {"streaming": "yes", "extensions": [{"required": "no"}]},
        "defaultInputModes": [],
        "securitySchemes": {
            "two": {
                "apiKeySecurityScheme": {"name": "k", "location": "header"},
                "mtlsSecurityScheme": {},
            },
            "loc": {"apiKeySecurityScheme": {"name": "k", "location": "body"}},
            "old": {"type": "apiKey", "in": "header", "name": "k"},
            "oauth": {"oauth2SecurityScheme": {"flows": {}}},
        },
        "securityRequirements": [{"schemes": {"ghost": {"list": []}}}],
        "skills": [{"id": "s", "name": "S", "description": "d"}],
        "signatures": [{"protected": "abc"}],
    }
    paths = {p.path for p in validate_card(bad)}
    for expected in (
        "name", "description", "version",
        "supportedInterfaces[0].url", "supportedInterfaces[0].protocolVersion", "supportedInterfaces[1]",
        "capabilities.streaming", "capabilities.extensions[0].uri", "capabilities.extensions[0].required",
        "defaultInputModes", "defaultOutputModes",
        "securitySchemes.two", "securitySchemes.loc.apiKeySecurityScheme.location", "securitySchemes.old",
        "securitySchemes.oauth.oauth2SecurityScheme.flows",
        "securityRequirements[0].schemes.ghost",
        "skills[0].tags", "signatures[0].signature",
    ):  # fmt: skip
        assert expected in paths, expected
    assert validate_card([]) and validate_card({})[0].message == "required field is missing"
    assert str(validate_card({"name": 1})[0]) == "name: must be a string, got int"


def test_a_scheme_with_0_3_fields_beside_its_1_0_wrapper_is_checked_as_1_0() -> None:
    """The official SDK writes 0.3's ``type``, ``in`` and ``scheme`` into every scheme of a card
    that also offers a 0.3 interface: unknown fields beside the 1.0 wrapper, to be ignored.
    They made the scheme "OpenAPI-style (A2A 0.3)" and its 1.0 content went unchecked."""
    card = copy.deepcopy(GOOD)
    card["securitySchemes"] = {
        "both": {
            "type": "http",
            "scheme": "bearer",
            "httpAuthSecurityScheme": {"scheme": "Bearer"},
        },
        "broken": {"type": "http", "httpAuthSecurityScheme": {}},
        "oauth": {"oauth2SecurityScheme": {"flows": {"password": {"scopes": {}}}}},
    }
    card["securityRequirements"] = [{"schemes": {"both": {"list": []}}}]
    problems = {p.path: p.message for p in validate_card(card)}
    assert problems == {
        "securitySchemes.broken.httpAuthSecurityScheme.scheme": "required field is missing"
    }


@pytest.mark.parametrize(
    ("written", "registered"),
    [
        ("http://a.example", "http://a.example"),
        ("HTTP://A.Example:80/", "http://a.example"),
        ("https://a.example:443/agent//?q=1#f", "https://a.example/agent"),
        ("https://a.example:8443/agent/", "https://a.example:8443/agent"),
        ("http://[::1]:8000/x/", "http://[::1]:8000/x"),
        # A card document's query may choose the card: kept (its fragment is not sent).
        ("http://a.example/.well-known/agent-card.json?v=2#f",
         "http://a.example/.well-known/agent-card.json?v=2"),
        ("http://a.example/cards/one.json", "http://a.example/cards/one.json"),
        # The card a base URL finds first is that base URL's agent (it was a second agent).
        ("http://a.example/.well-known/agent-card.json", "http://a.example"),
        ("HTTP://A.example:80/agent/.well-known/agent-card.json", "http://a.example/agent"),
        ("http://a.example/.well-known/agent.json", "http://a.example/.well-known/agent.json"),
        # Left as typed (stripped) for the checks that refuse them with their reason.
        (" http://u:p@a.example/ ", "http://u:p@a.example/"),
        ("http://a.example:99999/", "http://a.example:99999/"),
        ("ftp://a.example/", "ftp://a.example/"),
        ("not a url", "not a url"),
    ],
)  # fmt: skip
def test_an_agent_url_has_one_registration_form(written: str, registered: str) -> None:
    assert registration_url(written) == registered
    assert registration_url(registered) == registered  # the form is its own form
