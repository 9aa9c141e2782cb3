"""A credential that an HTTP header cannot carry is refused where it is given, never echoed.

A token file with a stray NUL (or a token pasted with a carriage return) was accepted; every
call then failed in httpx with "Illegal header value b'Bearer <the token>…'", and that text
became the task's send error and a row of its append-only log, for everyone who reads the
project to see.
"""

from __future__ import annotations

import httpx
import pytest
from django.core.management import CommandError, call_command

from tasks_app.a2a._http import map_transport_error
from tasks_app.models import Agent
from tasks_app.services import agents as agent_services

SECRET = "tok-SEKRIT-1234"


@pytest.mark.django_db
@pytest.mark.parametrize("bad", [SECRET + "\x00", "tok\x1bSEKRIT", "tok\tSEKRIT", "tökSEKRIT"])
def test_a_token_file_with_what_no_header_carries_is_refused_without_the_token(
    tmp_path, bad
) -> None:
    path = tmp_path / "token"
    path.write_bytes(bad.encode() + b"\n")
    with pytest.raises(CommandError) as refused:
        call_command("agents", "add", "http://127.0.0.1:9/", "--token-file", str(path))
    assert "cannot carry" in str(refused.value) and "SEKRIT" not in str(refused.value)


@pytest.mark.django_db
def test_credentials_with_what_no_header_carries_are_refused_by_the_service() -> None:
    agent = Agent.objects.create(name="a", base_url="http://127.0.0.1:9/")
    for field in ("token", "api_key"):
        with pytest.raises(agent_services.AgentError, match="cannot carry") as refused:
            agent_services.set_credentials(agent, {field: SECRET + "\x00"})
        assert "SEKRIT" not in str(refused.value)
    agent.refresh_from_db()
    assert agent.credentials_encrypted == ""
    agent_services.set_credentials(agent, {"token": SECRET})  # a plain one is kept
    agent.refresh_from_db()
    assert agent.credentials_encrypted


def test_a_header_httpx_refuses_is_reported_without_its_value() -> None:
    request = httpx.Request("POST", "http://127.0.0.1:9/")
    exc = httpx.LocalProtocolError(f"Illegal header value b'Bearer {SECRET}\\x00'", request=request)
    message = str(map_transport_error(exc, "SendMessage (JSON-RPC http://127.0.0.1:9/)"))
    assert "SEKRIT" not in message and "could not be written" in message


def test_an_a2a_token_from_the_environment_with_a_control_character_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("A2A_TOKEN", "tok\rSEKRIT-1234\r\n")  # a carriage return inside
    with pytest.raises(CommandError) as refused:
        call_command("a2a", "card", "http://127.0.0.1:9/")
    assert "A2A_TOKEN" in str(refused.value) and "SEKRIT" not in str(refused.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://:hun/ter2@127.0.0.1:1/0",
        "redis://:a#b-ter2@127.0.0.1:1/0",
        "redis://u:p?ter2@127.0.0.1:1/0",
    ],
)
def test_a_redis_url_whose_password_ends_the_host_early_is_printed_without_it(url) -> None:
    """``/``, ``#`` or ``?`` in a password (not percent-encoded) left the parser with no
    password to hide, and redis-py's error quoted part of it: `up` printed both."""
    from tasks_app.runtime.net import redact_url
    from tasks_app.runtime.redis_server import ping_error

    assert "ter2" not in redact_url(url) and "***" in redact_url(url)
    assert "ter2" not in (ping_error(url, timeout=0.5) or "")
