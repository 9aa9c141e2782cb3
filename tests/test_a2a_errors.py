"""Typed errors: a misbehaving local server, dropped connections, SSE framing, error mapping."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from tasks_app.a2a import (
    A2AClient,
    AuthError,
    ConnectError,
    ConnectionDropped,
    Credentials,
    HTTPStatusError,
    Interface,
    InternalError,
    InvalidParamsError,
    PayloadTooLarge,
    ProtocolError,
    RemoteError,
    RequestTimeout,
    StreamIdleTimeout,
    TaskNotCancelableError,
    TaskNotFoundError,
    TransportError,
    UnsupportedOperationError,
    auth_plan,
    user_message,
)
from tasks_app.a2a.errors import from_http_error, from_jsonrpc_error
from tasks_app.a2a.streams import iter_sse
from tests.agents import AgentHandle, BadServer, TcpProxy

pytestmark = pytest.mark.timeout(30)

BINDINGS = ["jsonrpc", "rest"]


def bad_client(
    server: BadServer, mode: str, binding: str, http: httpx.AsyncClient, **kw: object
) -> A2AClient:
    url = server.url_for(mode)
    iface = Interface.jsonrpc(url) if binding == "jsonrpc" else Interface.rest(url)
    return A2AClient(iface, http=http, **kw)  # type: ignore[arg-type]


async def drain(client: A2AClient) -> list:
    return [ev async for ev in client.send_streaming_message(user_message("hi"))]


# --------------------------------------------------------------------------- malformed answers


@pytest.mark.parametrize("binding", BINDINGS)
async def test_html_error_page(
    bad_server: BadServer, binding: str, http: httpx.AsyncClient
) -> None:
    client = bad_client(bad_server, "html", binding, http)
    with pytest.raises(HTTPStatusError) as err:
        await client.get_task("t-1")
    assert err.value.http_status == 500 and isinstance(err.value, ProtocolError)
    assert "text/html" in str(err.value) and "500" in str(err.value)
    with pytest.raises(HTTPStatusError):
        await drain(client)


@pytest.mark.parametrize("binding", BINDINGS)
@pytest.mark.parametrize(
    ("mode", "needle"),
    [
        ("html200", "text/html"),
        ("wrongtype", "text/plain"),
        ("badjson", "the body is not valid JSON (application/json)"),
    ],
)
async def test_wrong_content(
    bad_server: BadServer, binding: str, mode: str, needle: str, http: httpx.AsyncClient
) -> None:
    client = bad_client(bad_server, mode, binding, http)
    with pytest.raises(ProtocolError) as err:
        await client.get_task("t-1")
    assert needle in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ProtocolError) as err2:
        await drain(client)
    assert "text/event-stream" in str(err2.value) or "JSON" in str(err2.value)


@pytest.mark.parametrize("binding", BINDINGS)
async def test_v03_shaped_payload(
    bad_server: BadServer, binding: str, http: httpx.AsyncClient
) -> None:
    client = bad_client(bad_server, "v03", binding, http)
    with pytest.raises(ProtocolError, match=r"0\.3"):
        await client.get_task("t-1")
    with pytest.raises(ProtocolError, match=r"0\.3"):
        await client.send_message(user_message("hi"))
    with pytest.raises(ProtocolError, match=r"0\.3"):
        await drain(client)


@pytest.mark.parametrize("binding", BINDINGS)
async def test_oversized_event_and_body(
    bad_server: BadServer, binding: str, http: httpx.AsyncClient
) -> None:
    client = bad_client(bad_server, "oversized", binding, http, max_event_bytes=64 * 1024)
    with pytest.raises(PayloadTooLarge, match="limit"):
        await drain(client)
    small = bad_client(bad_server, "echo", binding, http, max_response_bytes=100)
    with pytest.raises(PayloadTooLarge):
        await small.get_task("t-1")


@pytest.mark.parametrize("binding", BINDINGS)
async def test_agent_that_never_answers(
    bad_server: BadServer, binding: str, http: httpx.AsyncClient
) -> None:
    client = bad_client(
        bad_server, "silent", binding, http, timeout=0.3, stream_idle_timeout=0.3, send_timeout=0.3
    )
    with pytest.raises(RequestTimeout):
        await client.get_task("t-1")
    with pytest.raises(RequestTimeout):
        await client.send_message(user_message("hi"))
    with pytest.raises(StreamIdleTimeout):
        await drain(client)


@pytest.mark.parametrize("binding", BINDINGS)
async def test_stream_goes_silent(
    bad_server: BadServer, binding: str, http: httpx.AsyncClient
) -> None:
    client = bad_client(bad_server, "silentstream", binding, http, stream_idle_timeout=0.3)
    seen = []
    with pytest.raises(StreamIdleTimeout) as err:
        async for ev in client.send_streaming_message(user_message("hi")):
            seen.append(ev)
    assert [e.kind for e in seen] == ["task"]
    assert isinstance(err.value, TransportError)


@pytest.mark.parametrize("binding", BINDINGS)
async def test_connection_dropped_mid_stream(
    bad_server: BadServer, binding: str, http: httpx.AsyncClient
) -> None:
    client = bad_client(bad_server, "dropped", binding, http)
    seen = []
    with pytest.raises(ConnectionDropped):
        async for ev in client.send_streaming_message(user_message("hi")):
            seen.append(ev)
    assert [e.kind for e in seen] == ["task"]


@pytest.mark.parametrize("binding", BINDINGS)
async def test_error_event_mid_stream(
    bad_server: BadServer, binding: str, http: httpx.AsyncClient
) -> None:
    client = bad_client(bad_server, "sseerror", binding, http)
    seen = []
    with pytest.raises(InternalError) as err:
        async for ev in client.send_streaming_message(user_message("hi")):
            seen.append(ev)
    assert len(seen) == 1 and "agent crashed" in str(err.value)


async def test_problem_json_and_gateway_401(bad_server: BadServer, http: httpx.AsyncClient) -> None:
    with pytest.raises(TaskNotFoundError) as err:
        await bad_client(bad_server, "problem", "rest", http).get_task("t-9")
    assert err.value.http_status == 404 and "no task t-9" in str(err.value)
    for binding in BINDINGS:
        with pytest.raises(AuthError) as err2:
            await bad_client(bad_server, "gateway401", binding, http).get_task("t-1")
        assert err2.value.http_status == 401


async def test_connection_refused(http: httpx.AsyncClient) -> None:
    from tests.agents import free_port

    client = A2AClient(Interface.jsonrpc(f"http://127.0.0.1:{free_port()}/"), http=http)
    with pytest.raises(ConnectError) as err:
        await client.get_task("t")
    assert isinstance(err.value, TransportError) and not isinstance(err.value, RemoteError)


async def test_proxy_cut_mid_stream_is_a_transport_error(
    agent: AgentHandle, tcp_proxy: Callable[[str, int], TcpProxy], http: httpx.AsyncClient
) -> None:
    proxy = tcp_proxy("127.0.0.1", agent.port)
    client = A2AClient(Interface.rest(f"{proxy.url}/rest"), http=http)
    started = await A2AClient(Interface.rest(agent.rest_url), http=http).send_message(
        user_message("long 30"), return_immediately=True
    )
    seen = []
    with pytest.raises(ConnectionDropped):
        async for ev in client.subscribe_to_task(started.task_id):
            seen.append(ev)
            if len(seen) == 1:
                assert proxy.cut() >= 1
    assert seen[0].kind == "task"
    # the task itself is fine: reattach directly and cancel it
    direct = A2AClient(Interface.rest(agent.rest_url), http=http)
    assert (await direct.get_task(started.task_id))["status"]["state"] == "TASK_STATE_WORKING"
    await direct.cancel_task(started.task_id)


# --------------------------------------------------------------------------- headers & credentials


@pytest.mark.parametrize("binding", BINDINGS)
async def test_service_headers_and_credentials(
    bad_server: BadServer, binding: str, http: httpx.AsyncClient
) -> None:
    card = {
        "securitySchemes": {
            "key": {"apiKeySecurityScheme": {"location": "query", "name": "key"}},
            "tok": {"httpAuthSecurityScheme": {"scheme": "Bearer"}},
        },
        "securityRequirements": [{"schemes": {"tok": {"list": []}, "key": {"list": []}}}],
    }
    client = bad_client(
        bad_server,
        "echo",
        binding,
        http,
        credentials=Credentials(token="T0K", api_key="K3Y"),
        card=card,
        extensions=["urn:a", "urn:b"],
    )
    task = await client.get_task("t-1")
    echo = task["metadata"]
    assert echo["headers"]["a2a-version"] == "1.0"
    assert echo["headers"]["a2a-extensions"] == "urn:a,urn:b"
    assert echo["headers"]["authorization"] == "Bearer T0K"
    assert "key=K3Y" in echo["query"]


def test_auth_plan_locations() -> None:
    def card(loc: str) -> dict:
        return {
            "securitySchemes": {"k": {"apiKeySecurityScheme": {"location": loc, "name": "X-Key"}}}
        }

    creds = Credentials(api_key="v")
    assert auth_plan(card("header"), creds).headers == {"X-Key": "v"}
    assert auth_plan(card("query"), creds).query == {"X-Key": "v"}
    assert auth_plan(card("cookie"), creds).headers == {"Cookie": "X-Key=v"}
    assert auth_plan(None, creds).headers == {"X-API-Key": "v"}
    basic = {"securitySchemes": {"b": {"httpAuthSecurityScheme": {"scheme": "Basic"}}}}
    assert auth_plan(basic, Credentials(token="abc")).headers == {"Authorization": "Basic abc"}
    assert auth_plan(None, None).headers == {}
    assert "v" not in repr(Credentials(api_key="v", token="v"))


async def test_rest_subscribe_falls_back_to_get(
    bad_server: BadServer, http: httpx.AsyncClient
) -> None:
    # The bad server's "nocard" mode answers 404 to everything: POST fails, GET is
    # tried once, and that error surfaces (a clear HTTP status error, not a hang).
    client = bad_client(bad_server, "nocard", "rest", http)
    with pytest.raises(HTTPStatusError) as err:
        async for _ in client.subscribe_to_task("t-1"):
            pass
    assert err.value.http_status == 404


# --------------------------------------------------------------------------- SSE framing


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


async def sse(*parts: bytes, limit: int = 1 << 20) -> list[tuple[str, str]]:
    return [(m.event, m.data) async for m in iter_sse(_chunks(*parts), max_event_bytes=limit)]


async def test_sse_framing_variants() -> None:
    assert await sse(b": ping\n\ndata: a\n\n") == [("", "a")]
    assert await sse(b"data: a\r\n\r\ndata: b\r\rdata: c\n\n") == [("", "a"), ("", "b"), ("", "c")]
    # a CRLF split across chunks is one line end, not two
    assert await sse(b"data: x\r", b"\ndata: y\r\n\r\n") == [("", "x\ny")]
    assert await sse(b"da", b"ta: spl", b"it\n", b"\n") == [("", "split")]
    assert await sse(b"event: error\ndata: {}\n\n") == [("error", "{}")]
    # empty-data events (httpx-sse quirk) and id/retry fields are skipped
    assert await sse(b"id: 1\n\ndata:\n\nretry: 5\ndata: z\n\n") == [("", "z")]
    # a stream ending without the final blank line still delivers its event
    assert await sse(b"data: last") == [("", "last")]


async def test_sse_size_bound() -> None:
    with pytest.raises(PayloadTooLarge):
        await sse(b"data: " + b"x" * 5000 + b"\n\n", limit=1000)
    with pytest.raises(PayloadTooLarge):
        await sse(*([b"data: " + b"x" * 300 + b"\n"] * 10), limit=1000)
    with pytest.raises(PayloadTooLarge):
        await sse(b"x" * 600, b"x" * 600, limit=1000)


# --------------------------------------------------------------------------- error mapping


def test_jsonrpc_error_mapping_tolerates_every_data_shape() -> None:
    info = {
        "@type": "type.googleapis.com/google.rpc.ErrorInfo",
        "reason": "TASK_NOT_CANCELABLE",
        "domain": "a2a-protocol.org",
        "metadata": {"taskId": "t-9"},
    }
    err = from_jsonrpc_error({"code": -32002, "message": "Task t-9 is done", "data": [info]})
    assert isinstance(err, TaskNotCancelableError) and err.metadata == {"taskId": "t-9"}
    assert str(err) == "A2A error -32002 TASK_NOT_CANCELABLE: Task t-9 is done"
    assert isinstance(
        from_jsonrpc_error({"code": -32004, "message": "x", "data": {"k": 1}}),
        UnsupportedOperationError,
    )
    assert isinstance(
        from_jsonrpc_error({"code": -32602, "message": "x", "data": "bad"}), InvalidParamsError
    )
    odd = from_jsonrpc_error({"code": -32050, "message": "multi\nline", "data": None})
    assert type(odd) is RemoteError and "\n" not in str(odd) and "-32050" in str(odd)
    # an unknown code with a known reason still picks the class
    assert isinstance(
        from_jsonrpc_error({"code": 1, "message": "m", "data": [{"reason": "TASK_NOT_FOUND"}]}),
        TaskNotFoundError,
    )


def test_rest_status_mapping() -> None:
    body = {
        "error": {
            "code": 400,
            "status": "FAILED_PRECONDITION",
            "message": "nope",
            "details": [
                {
                    "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                    "reason": "UNSUPPORTED_OPERATION",
                    "domain": "a2a-protocol.org",
                }
            ],
        }
    }
    err = from_http_error(400, body)
    assert (
        isinstance(err, UnsupportedOperationError) and err.code == -32004 and err.http_status == 400
    )
    assert "HTTP 400" in str(err)
    assert isinstance(from_http_error(403, None, text="Forbidden"), AuthError)
    assert isinstance(from_http_error(418, None, text="<html>teapot</html>"), HTTPStatusError)
    assert isinstance(from_http_error(503, None, text="busy"), TransportError)


async def test_tenant_goes_into_path_and_body(
    bad_server: BadServer, http: httpx.AsyncClient
) -> None:
    rest = A2AClient(Interface.rest(bad_server.url_for("echo"), tenant="acme eu"), http=http)
    echo = (await rest.get_task("t/1"))["metadata"]
    assert echo["path"] == "/echo/acme%20eu/tasks/t%2F1" and echo["verb"] == "GET"
    sent = (await rest.cancel_task("t-1"))["metadata"]
    assert sent["path"] == "/echo/acme%20eu/tasks/t-1:cancel" and sent["body"] == {
        "tenant": "acme eu"
    }
    rpc = A2AClient(Interface.jsonrpc(bad_server.url_for("echo"), tenant="acme"), http=http)
    body = (await rpc.get_task("t-1"))["metadata"]["body"]
    assert body["method"] == "GetTask" and body["params"] == {"id": "t-1", "tenant": "acme"}


@pytest.mark.parametrize("mode", ["getonly", "misroute"])
async def test_rest_subscribe_verb_fallback_is_remembered(
    bad_server: BadServer, mode: str, http: httpx.AsyncClient
) -> None:
    client = bad_client(bad_server, mode, "rest", http)
    bad_server.subscribe_verbs.clear()
    events = [ev async for ev in client.subscribe_to_task("t-1")]
    assert [e.kind for e in events] == ["task"]
    assert bad_server.subscribe_verbs == ["POST", "GET"]
    events = [ev async for ev in client.subscribe_to_task("t-1")]
    assert bad_server.subscribe_verbs == ["POST", "GET", "GET"]  # GET remembered for this agent
