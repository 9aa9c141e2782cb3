"""The protocol layer against agents that misbehave on purpose.

The first part checks :mod:`tasks_app.a2a.safejson` on its own (examples and
Hypothesis properties). The rest runs the real client against raw HTTP servers
on 127.0.0.1 (``tests/hostile_servers.py``) that trickle, nest, stream
keep-alives forever or send text that cannot be stored, and asserts both the
precise error and the bound (time, bytes) at which the client gave up.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks_app.a2a import (
    A2AClient,
    DeadlineExceeded,
    IncompatibleAgentError,
    Interface,
    PayloadTooLarge,
    ProtocolError,
    StreamIdleTimeout,
    TransportError,
    choose_interface,
    fetch_card,
    user_message,
    validate_card,
)
from tasks_app.a2a._http import decode_json, error_for_status
from tasks_app.a2a.guard import GuardedTransport, Policy
from tasks_app.a2a.safejson import clean, loads
from tasks_app.a2a.streams import LINES_PER_TURN, iter_sse
from tests.examples import examples
from tests.hostile_servers import TASK_ID, Conn, HostileServer

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- safejson: loads


def _nested(depth: int, *, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + closer * depth


def test_loads_refuses_deep_nesting_with_the_offset() -> None:
    body = _nested(10_000).encode()
    with pytest.raises(ProtocolError) as info:
        loads(body)
    assert "JSON nested deeper than 256 levels (at byte 256)" in str(info.value)


def test_loads_deep_objects_and_prefix_offset() -> None:
    body = '{"k": "ééé", "v": ' + '{"a":' * 300 + "1" + "}" * 301
    with pytest.raises(ProtocolError) as info:
        loads(body.encode())
    # 256 objects nest inside the outer one; the 257th opener is the culprit.
    prefix = '{"k": "ééé", "v": ' + '{"a":' * 255
    assert f"(at byte {len(prefix.encode())})" in str(info.value)


def test_loads_accepts_exactly_max_depth() -> None:
    assert loads(_nested(256)) == json.loads(_nested(256))
    with pytest.raises(ProtocolError, match="deeper than 256"):
        loads(_nested(257))
    assert loads(_nested(5), max_depth=5) == [[[[[]]]]]
    with pytest.raises(ProtocolError, match="deeper than 4 levels"):
        loads(_nested(5), max_depth=4)


def test_brackets_inside_strings_do_not_count() -> None:
    text = json.dumps({"a": "[" * 5000 + '\\"{' * 100, "b": ["]" * 10]})
    assert loads(text, max_depth=2) == json.loads(text)
    assert loads(text.encode(), max_depth=2) == json.loads(text)


def test_loads_invalid_json_is_a_protocol_error() -> None:
    for bad in (b"", b"<html>oops</html>", b"{", b'"unterminated \\', b"\xff\xfe\xfa", b"[1,]"):
        with pytest.raises(ProtocolError, match="expected JSON"):
            loads(bad)


def test_unterminated_escapes_scan_in_linear_time() -> None:
    # Each quote would start a failing string match in a naive scanner: O(n^2).
    body = b"[" * 300 + b'"' + b'\\"' * 200_000
    with pytest.raises(ProtocolError):
        loads(body)


def test_utf16_and_bom_bodies() -> None:
    value = {"x": ["é", 1]}
    assert loads(json.dumps(value).encode("utf-16")) == value
    assert loads(b"\xef\xbb\xbf" + json.dumps(value).encode()) == value
    with pytest.raises(ProtocolError, match=r"deeper than 2 levels \(at byte 4\)"):
        loads("[[[1]]]".encode("utf-16-le"), max_depth=2)


def test_decode_json_and_error_for_status_use_the_depth_check() -> None:
    deep = _nested(10_000).encode()
    with pytest.raises(ProtocolError) as info:
        decode_json(deep, "SendMessage")
    assert info.value.where == "SendMessage"
    assert "nested deeper than 256" in str(info.value)
    with pytest.raises(ProtocolError, match="expected JSON, got text/html"):
        decode_json(b"<html>", "GetTask", mt="text/html")
    # Labelled JSON and not JSON: said so, not "expected JSON, got application/json".
    with pytest.raises(
        ProtocolError, match=r"GetTask: the body is not valid JSON \(application/json\): hello"
    ):
        decode_json(b"hello", "GetTask", mt="application/json")


# Valid, storable JSON: no NaN/Infinity, no surrogates, no NUL.
safe_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"))
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | safe_text,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(safe_text, children, max_size=4)
    ),
    max_leaves=30,
)


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=examples(200), deadline=None)
@given(json_values, st.integers(min_value=0, max_value=8))
def test_loads_matches_json_within_depth(value: object, max_depth: int) -> None:
    text = json.dumps(value)
    if _depth(value) <= max_depth:
        assert loads(text, max_depth=max_depth) == json.loads(text)
        assert loads(text.encode(), max_depth=max_depth) == json.loads(text)
    else:
        with pytest.raises(ProtocolError, match=f"deeper than {max_depth} levels"):
            loads(text.encode(), max_depth=max_depth)


@settings(max_examples=examples(200), deadline=None)
@given(st.binary(max_size=200))
def test_loads_never_raises_anything_but_protocol_error(data: bytes) -> None:
    try:
        expected: object = json.loads(data)
    except (ValueError, RecursionError):
        expected = ProtocolError
    try:
        got: object = loads(data, max_depth=3)
    except ProtocolError:
        got = ProtocolError
    if expected is ProtocolError or _depth(expected) <= 3:
        assert got == expected or (got != got and expected != expected)  # NaN
    else:
        assert got is ProtocolError


# --------------------------------------------------------------------------- safejson: clean


def _storable(value: object) -> bool:
    """What PostgreSQL jsonb and a UTF-8 column accept."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    text.encode("utf-8")
    return "\x00" not in text and "\\u0000" not in text


def test_clean_replaces_and_counts() -> None:
    value = {
        "text": "a\ud800b\x00c",
        # Two code points forming a pair: joined into the one character they encode, and
        # counted, since what is stored differs from what was sent.
        "pair": "\ud83d\ude00",
        "k\udc00": [math.nan, math.inf, -math.inf, 1.5, "ok", None, True],
    }
    cleaned, count = clean(value)
    assert count == 7
    assert cleaned == {
        "text": "a\ufffdb\ufffdc",
        "pair": "\U0001f600",
        "k\ufffd": ["NaN", "Infinity", "-Infinity", 1.5, "ok", None, True],
    }
    assert _storable(cleaned)
    assert value["text"] == "a\ud800b\x00c"  # the input is not modified


def test_clean_returns_clean_values_as_they_are() -> None:
    value = {"a": [1, "é", {"b": "\ufffd"}]}
    cleaned, count = clean(value)
    assert count == 0 and cleaned is value
    assert clean("plain") == ("plain", 0)
    assert clean(3) == (3, 0)


def test_clean_keeps_both_values_when_keys_collide() -> None:
    cleaned, count = clean(dict([("\ud800", 1), ("\ufffd", 2)]))
    assert count == 1
    assert sorted(cleaned.values()) == [1, 2]


def test_many_colliding_keys_keep_every_value_under_short_keys() -> None:
    """Keys of two lone surrogates each all clean to the same text. Each was kept under one
    more U+FFFD than the last: n keys took n**3 steps and n**2 characters (3,000 of them,
    57 KB from an agent, took 2.8 s to record; a 1 MB push, hours). A count keeps each key
    short, and the first collision is named as before."""
    n = 3_000
    value: dict[str, Any] = {
        "\ufffd\ufffd\ufffd2": "the agent's own key, which a count could repeat"
    }
    value.update({chr(0xD800 + i // 1024) + chr(0xD800 + i % 1024): i for i in range(n)})
    cleaned, count = clean(value)
    assert count == 2 * n
    assert sorted(v for v in cleaned.values() if isinstance(v, int)) == list(range(n))
    assert len(cleaned) == n + 1
    assert cleaned["\ufffd\ufffd"] == 0 and cleaned["\ufffd\ufffd\ufffd"] == 1
    assert cleaned["\ufffd\ufffd\ufffd2"] == "the agent's own key, which a count could repeat"
    assert cleaned["\ufffd\ufffd\ufffd3"] == 2  # the count passes over a key already there
    assert max(len(key) for key in cleaned) <= len("\ufffd\ufffd\ufffd") + len(str(n))


@pytest.mark.slow  # 100,000 levels deep
def test_clean_is_iterative() -> None:
    value: list[object] = []
    for _ in range(100_000):
        value = [value, "\x00"]
    cleaned, count = clean(value)
    assert count == 100_000
    node = cleaned
    while node:
        assert node[1] == "\ufffd"
        node = node[0]


surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
hostile_text = st.lists(
    st.one_of(st.characters(codec=None), surrogates, st.just("\x00")), max_size=12
).map("".join)
hostile_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | hostile_text,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(hostile_text, children, max_size=4)
    ),
    max_leaves=30,
)


@pytest.mark.slow  # hypothesis, 300 examples
@settings(max_examples=examples(300), deadline=None)
@given(hostile_values)
def test_clean_makes_anything_storable(value: object) -> None:
    cleaned, count = clean(value)
    assert _storable(cleaned)
    if count == 0:
        assert cleaned is value or cleaned == value
    again, more = clean(cleaned)
    assert more == 0 and again == cleaned


@settings(max_examples=examples(200), deadline=None)
@given(json_values)
def test_clean_leaves_valid_json_unchanged(value: object) -> None:
    assert clean(value) == (value, 0)


def test_error_for_status_with_deep_body_is_not_a_crash() -> None:
    resp = httpx.Response(500, headers={"content-type": "application/json"})
    err = error_for_status(resp, _nested(10_000).encode(), "GetTask")
    assert "HTTP 500" in str(err)


# --------------------------------------------------------------------------- real hostile servers


@pytest.fixture(scope="module")
def hostile() -> Iterator[HostileServer]:
    server = HostileServer(interval=0.25, trickle_bytes=160).start()
    try:
        yield server
    finally:
        server.close()


BINDINGS = ["JSONRPC", "HTTP+JSON"]
# The call deadline of the trickling tests: long enough that a loaded machine (4 test processes
# on 2 cores) still reaches the server inside it (at 1 s, one CI run ended before the request
# was read), far under the trickle it cuts short (160 bytes, one per 0.25 s: 40 s).
DEADLINE = 3.0


def hostile_client(
    server: HostileServer, mode: str, binding: str, http: httpx.AsyncClient, **kw: Any
) -> A2AClient:
    return A2AClient(Interface(url=server.url_for(mode), binding=binding), http=http, **kw)  # type: ignore[arg-type]


def _opener_past(body: bytes, depth: int) -> int:
    """Offset of the first bracket nesting deeper than ``depth`` (bodies without strings in brackets)."""
    level = 0
    for i, byte in enumerate(body):
        if byte in b"[{":
            level += 1
            if level > depth:
                return i
        elif byte in b"]}":
            level -= 1
    raise AssertionError("not that deep")


def _last_conn(server: HostileServer, mode: str) -> Conn:
    conns = server.conns_for(mode)
    assert conns, f"the client never reached /{mode}"
    return conns[-1]


@pytest.mark.parametrize("binding", BINDINGS)
async def test_trickling_reply_fails_at_the_call_deadline(
    hostile: HostileServer, http: httpx.AsyncClient, binding: str
) -> None:
    client = hostile_client(hostile, "trickle", binding, http, call_deadline=DEADLINE, timeout=30.0)
    trickle_seconds = hostile.trickle_bytes * hostile.interval  # 40 s to finish the reply
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        await client.get_task(TASK_ID)
    elapsed = time.monotonic() - start
    assert isinstance(info.value, TransportError)
    assert f"no complete response after {DEADLINE:g} s" in str(info.value)
    assert elapsed < trickle_seconds / 4  # well under the trickle, though bytes kept coming
    conn = _last_conn(hostile, "trickle")
    assert hostile.wait_peer_closed(conn), "the client kept the connection open"
    assert 1 <= conn.body_bytes_sent < hostile.trickle_bytes / 4


async def test_trickling_blocking_send_uses_the_send_deadline(
    hostile: HostileServer, http: httpx.AsyncClient
) -> None:
    client = hostile_client(
        hostile, "trickle", "JSONRPC", http, call_deadline=60.0, send_deadline=DEADLINE
    )
    start = time.monotonic()
    with pytest.raises(
        DeadlineExceeded, match=rf"SendMessage.*no complete response after {DEADLINE:g} s"
    ):
        await client.send_message(user_message("hello"))
    assert time.monotonic() - start < hostile.trickle_bytes * hostile.interval / 4
    assert hostile.wait_peer_closed(_last_conn(hostile, "trickle"))


async def test_trickling_card_fails_at_its_deadline(
    hostile: HostileServer, http: httpx.AsyncClient
) -> None:
    start = time.monotonic()
    with pytest.raises(
        DeadlineExceeded, match=rf"card fetch .* no complete response after {DEADLINE:g} s"
    ):
        await fetch_card(hostile.url_for("trickle"), http=http, deadline=DEADLINE)
    assert time.monotonic() - start < hostile.trickle_bytes * hostile.interval / 4
    conn = _last_conn(hostile, "trickle")
    assert conn.path.endswith("/.well-known/agent-card.json")
    assert hostile.wait_peer_closed(conn)


@pytest.mark.parametrize("mode", ["keepalive", "blanklines"])
@pytest.mark.parametrize("binding", BINDINGS)
async def test_stream_of_keepalives_only_ends_at_the_idle_bound(
    hostile: HostileServer, http: httpx.AsyncClient, binding: str, mode: str
) -> None:
    # Bytes arrive every 0.25 s, so httpx's read timeout (0.8 s) never fires;
    # the gap between complete events is what ends the stream.
    client = hostile_client(hostile, mode, binding, http, stream_idle_timeout=0.8)
    events = []
    start = time.monotonic()
    with pytest.raises(StreamIdleTimeout) as info:
        async with aclosing(client.subscribe_to_task(TASK_ID)) as stream:
            async for event in stream:
                events.append(event)
    elapsed = time.monotonic() - start
    assert not isinstance(info.value, DeadlineExceeded)
    assert "no complete event for 0.8 s (only keep-alives or partial data)" in str(info.value)
    assert events == []
    assert elapsed < 10
    conn = _last_conn(hostile, mode)
    assert hostile.wait_peer_closed(conn)
    assert conn.body_bytes_sent >= 3  # bytes did keep arriving: not a silent stream


@pytest.mark.parametrize("binding", BINDINGS)
async def test_event_that_never_finishes_fails_at_the_call_deadline(
    hostile: HostileServer, http: httpx.AsyncClient, binding: str
) -> None:
    client = hostile_client(
        hostile, "slowevent", binding, http, call_deadline=DEADLINE, stream_idle_timeout=30.0
    )
    events = []
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded) as info:
        async with aclosing(client.subscribe_to_task(TASK_ID)) as stream:
            async for event in stream:
                events.append(event)
    elapsed = time.monotonic() - start
    assert (
        f"no complete response after {DEADLINE:g} s (an SSE event started and did not finish)"
        in str(info.value)
    )
    assert [e.kind for e in events] == ["task"]  # the complete event before it got through
    assert elapsed < 10  # the idle bound (30 s) was not what ended it
    assert hostile.wait_peer_closed(_last_conn(hostile, "slowevent"))


@pytest.mark.parametrize("binding", BINDINGS)
async def test_deeply_nested_reply_is_a_precise_protocol_error(
    hostile: HostileServer, http: httpx.AsyncClient, binding: str
) -> None:
    client = hostile_client(hostile, "deep", binding, http)
    before = len(hostile.conns_for("deep"))
    with pytest.raises(ProtocolError) as info:
        await client.get_task(TASK_ID)
    assert not isinstance(info.value.__cause__, RecursionError)
    conn = _last_conn(hostile, "deep")
    at = _opener_past(bytes(conn.body_sent), 256)
    assert f"JSON nested deeper than 256 levels (at byte {at})" in str(info.value)
    assert "GetTask" in info.value.where
    assert len(hostile.conns_for("deep")) == before + 1  # one request, no retry
    assert conn.body_bytes_sent == len(conn.body_sent) < 64 * 1024


@pytest.mark.parametrize("binding", BINDINGS)
async def test_deeply_nested_sse_event_is_a_precise_protocol_error(
    hostile: HostileServer, http: httpx.AsyncClient, binding: str
) -> None:
    client = hostile_client(hostile, "deepsse", binding, http)
    with pytest.raises(ProtocolError) as info:
        async with aclosing(client.subscribe_to_task(TASK_ID)) as stream:
            async for _ in stream:
                pass
    message = str(info.value)
    assert "SSE event" in message and "JSON nested deeper than 256 levels (at byte" in message
    conn = _last_conn(hostile, "deepsse")
    sent = bytes(conn.body_sent)
    event_data = sent[sent.index(b"data: ") + len(b"data: ") :]
    assert f"(at byte {_opener_past(event_data, 256)})" in message
    assert conn.body_bytes_sent < 64 * 1024


@pytest.mark.parametrize("binding", BINDINGS)
async def test_lone_surrogates_nul_and_nan_come_back_and_clean_makes_them_safe(
    hostile: HostileServer, http: httpx.AsyncClient, binding: str
) -> None:
    client = hostile_client(hostile, "badtext", binding, http)
    task = await client.get_task(TASK_ID)
    text = task["status"]["message"]["parts"][0]["text"]
    assert text == "\ud800 and \x00"  # the client returns what the agent said
    assert math.isnan(task["metadata"]["score"])
    with pytest.raises(UnicodeEncodeError):
        json.dumps(task, ensure_ascii=False).encode("utf-8")
    cleaned, count = clean(task)
    assert count == 3
    assert cleaned["status"]["message"]["parts"][0]["text"] == "\ufffd and \ufffd"
    assert cleaned["metadata"]["score"] == "NaN"
    assert _storable(cleaned)
    assert task["status"]["message"]["parts"][0]["text"] == text  # input untouched
    assert _last_conn(hostile, "badtext").body_bytes_sent < 4096


async def test_javascript_interface_url_is_refused_and_never_chosen(
    hostile: HostileServer, http: httpx.AsyncClient
) -> None:
    result = await fetch_card(hostile.url_for("jscard"), http=http)
    problems = [f"{p.path}: {p.message}" for p in validate_card(result.card)]
    sentence = "supportedInterfaces[0].url: only http and https URLs are accepted"
    assert sentence in problems
    with pytest.raises(IncompatibleAgentError, match=re.escape(sentence)):
        choose_interface(result.card, card_url=result.url)
    with pytest.raises(IncompatibleAgentError, match=re.escape(sentence)):
        await A2AClient.connect(hostile.url_for("jscard"), http=http)
    # Only the card was ever fetched: nothing went to the interface.
    assert {c.path for c in hostile.conns_for("jscard")} == {"/jscard/.well-known/agent-card.json"}


async def test_an_http_interface_after_a_file_one_is_chosen(
    hostile: HostileServer, http: httpx.AsyncClient
) -> None:
    result = await fetch_card(hostile.url_for("mixedcard"), http=http)
    problems = [f"{p.path}: {p.message}" for p in validate_card(result.card)]
    assert problems == ["supportedInterfaces[0].url: only http and https URLs are accepted"]
    iface = choose_interface(result.card, card_url=result.url)
    assert iface.url == hostile.url_for("mixedcard")


@pytest.mark.parametrize(
    "url",
    [
        "javascript:alert(1)",
        "file:///etc/passwd",
        "data:text/html,hi",
        "agent.example:8080/rpc",
        "example.com/rpc",
        "http://",
        "ftp://example.com/rpc",
    ],
)
def test_non_http_interface_urls_are_validation_problems(url: str) -> None:
    card = {
        "name": "x",
        "description": "x",
        "version": "1",
        "supportedInterfaces": [
            {"url": url, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
        ],
        "capabilities": {},
        "defaultInputModes": ["text/plain"],
        "defaultOutputModes": ["text/plain"],
        "skills": [{"id": "s", "name": "s", "description": "s", "tags": ["t"]}],
    }
    problems = [f"{p.path}: {p.message}" for p in validate_card(card)]
    assert problems == ["supportedInterfaces[0].url: only http and https URLs are accepted"]
    with pytest.raises(IncompatibleAgentError, match="only http and https URLs are accepted"):
        choose_interface(card, card_url="https://agent.example/.well-known/agent-card.json")


async def test_card_url_must_be_http(http: httpx.AsyncClient) -> None:
    for url in ("file:///etc/passwd", "javascript:alert(1)", "localhost:8000"):
        with pytest.raises(ProtocolError, match="only http and https URLs are accepted"):
            await fetch_card(url, http=http)


@pytest.mark.django_db
def test_registration_of_a_javascript_card_fails_with_the_sentence(
    hostile: HostileServer,
) -> None:
    from tasks_app.models import Agent
    from tasks_app.services.agents import AgentError, add_agent

    with pytest.raises(AgentError) as info:
        add_agent(hostile.url_for("jscard"))
    assert "supportedInterfaces[0].url: only http and https URLs are accepted" in str(info.value)
    assert Agent.objects.count() == 0


@pytest.mark.parametrize("binding", BINDINGS)
async def test_agent_chosen_ids_with_lone_surrogates_can_be_sent_back(
    hostile: HostileServer, http: httpx.AsyncClient, binding: str
) -> None:
    # A task id or page token the agent chose is echoed in later requests:
    # it must not crash the request encoder.
    client = hostile_client(hostile, "badtext", binding, http)
    before = len(hostile.conns_for("badtext"))
    task = await client.get_task("id-\ud800")
    assert task["id"] == TASK_ID
    listed = await client.list_tasks(context_id="ctx-\udfff", page_token="tok-\ud800")
    assert isinstance(listed["tasks"], list)
    conns = hostile.conns_for("badtext")[before:]
    assert len(conns) == 2  # exactly one request each
    if binding == "HTTP+JSON":
        assert conns[0].path == "/badtext/tasks/id-%ED%A0%80"


# --------------------------------------------------------------------------- SSE clocks (no network)


async def _chunks(parts: list[bytes], pause: float = 0.0) -> AsyncIterator[bytes]:
    for part in parts:
        if pause:
            await asyncio.sleep(pause)
        yield part


async def test_time_the_consumer_spends_is_not_the_agents() -> None:
    # Three events arrive at once; the consumer takes longer than the gap and
    # the event deadline on each. The agent was not slow: nothing may fail.
    body = [b'data: {"a": 1}\n\ndata: {"a": 2}\n\ndata: {"a"', b": 3}\n\n"]
    got = []
    async for msg in iter_sse(_chunks(body), event_deadline=0.2, event_gap=0.2, where="t"):
        got.append(json.loads(msg.data))
        await asyncio.sleep(0.5)
    assert got == [{"a": 1}, {"a": 2}, {"a": 3}]


async def test_regular_events_never_trip_the_gap() -> None:
    body = [b'data: {"n": %d}\n\n: ping\n\n' % i for i in range(20)]
    got = [
        json.loads(m.data)["n"]
        async for m in iter_sse(_chunks(body, 0.02), event_deadline=5, event_gap=5, where="t")
    ]
    assert got == list(range(20))


async def test_comment_lines_alone_end_at_the_gap() -> None:
    start = time.monotonic()
    with pytest.raises(StreamIdleTimeout, match=r"no complete event for 0\.3 s"):
        async for _ in iter_sse(_chunks([b": ping\n"] * 1000, 0.01), event_gap=0.3, where="t"):
            pass
    assert time.monotonic() - start < 5  # 1000 pings would take 10 s


# --------------------------------------------------------------------------- compressed replies


@pytest.fixture
async def guarded() -> AsyncIterator[httpx.AsyncClient]:
    """A client on the outbound guard's transport (loopback allowed), as the dashboard's are."""
    from tasks_app.outbound import shared_ssl_context

    transport = GuardedTransport(
        lambda: Policy.from_entries(["127.0.0.0/8"]),
        limits=httpx.Limits(),
        ssl_context=shared_ssl_context(),  # as the dashboard's: one a process
    )
    async with httpx.AsyncClient(transport=transport) as client:
        yield client


@pytest.mark.parametrize("binding", BINDINGS)
async def test_a_compressed_reply_is_refused_before_it_is_decoded(
    hostile: HostileServer, guarded: httpx.AsyncClient, binding: str
) -> None:
    """64 KB of gzip decoded to 64 MB at once in httpx, and a stream of such line breaks held
    the event loop for a minute. Only ``identity`` is asked for; a compressed reply is the
    agent's protocol error, refused before a byte of it is decoded."""
    for mode in ("gzip", "gzipsse"):
        client = hostile_client(hostile, mode, binding, guarded)
        with pytest.raises(ProtocolError, match=r"the reply is compressed \('gzip'\) although"):
            if mode == "gzip":
                await client.get_task(TASK_ID)
            else:
                async with aclosing(client.subscribe_to_task(TASK_ID)) as stream:
                    async for _ in stream:
                        pass
        conn = _last_conn(hostile, mode)
        assert conn.accept_encoding == "identity"


# --------------------------------------------------------------------------- SSE without events


@pytest.mark.parametrize(
    "unit",
    [b"\n", b": ping\n", b"event: x\n", b"data: \n\n", b"datax: 1\n", b"id: 7\n\n", b"\r\n"],
)
async def test_a_stream_of_anything_but_events_ends_at_the_event_limit(unit: bytes) -> None:
    """Line breaks, comments, other fields and empty events made no event and were never
    counted: a stream of them ran without end. Bytes since the last event now count
    against the event limit."""
    body = [unit * 1000] * 20  # 20 chunks of 1,000 units, no event
    with pytest.raises(PayloadTooLarge, match="more than 2000 bytes without an event"):
        async for _ in iter_sse(_chunks(body), max_event_bytes=2000, where="t"):
            pass
    # Events in between reset the count: a long quiet stream with keep-alives is fine.
    body = [b": keep-alive\n\n" * 100 + b'data: {"n": 1}\n\n'] * 20
    got = [m.data async for m in iter_sse(_chunks(body), max_event_bytes=2000, where="t")]
    assert len(got) == 20


async def test_a_chunk_of_many_lines_lets_the_loop_run() -> None:
    """One chunk of 200,000 line breaks was split and read without ever giving the event
    loop back (a worker's other streams waited); the reader now yields every
    ``LINES_PER_TURN`` lines."""
    turns = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal turns
        while not stop.is_set():
            turns += 1
            await asyncio.sleep(0)

    running = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = turns
    body = [b"\n" * 200_000 + b'data: {"n": 1}\n\n']
    got = [m.data async for m in iter_sse(_chunks(body), max_event_bytes=1_000_000, where="t")]
    during = turns - before
    stop.set()
    await running
    assert got == ['{"n": 1}']
    assert during >= 200_000 // LINES_PER_TURN // 2, during
