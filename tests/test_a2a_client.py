"""The client against real a2a-sdk servers (the demo agent), on both bindings.

No HTTP mocking: every test talks to a ``tasks_app.demo_agent`` subprocess on
loopback. Agent processes are session-scoped (see tests/agents.py).
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from tasks_app.a2a import (
    A2AClient,
    AuthError,
    Credentials,
    Interface,
    PushNotificationNotSupportedError,
    StreamEvent,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
    VersionNotSupportedError,
    artifact_text,
    message_text,
    parse_stream_response,
    user_message,
)
from tasks_app.a2a._http import error_for_status
from tests.agents import AGENT_TOKEN, AgentHandle, WebhookReceiver

pytestmark = pytest.mark.timeout(60)

BINDINGS = ["jsonrpc", "rest"]


@pytest.fixture(params=BINDINGS)
def binding(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def client_for(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient, **kw: object
) -> A2AClient:
    iface = (
        Interface.jsonrpc(agent.jsonrpc_url)
        if binding == "jsonrpc"
        else Interface.rest(agent.rest_url)
    )
    return A2AClient(iface, http=http, **kw)  # type: ignore[arg-type]


async def collect(stream: AsyncIterator[StreamEvent]) -> list[StreamEvent]:
    return [ev async for ev in stream]


async def wait_state(client: A2AClient, task_id: str, state: str, timeout: float = 5.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        task = await client.get_task(task_id)
        if task["status"]["state"] == state:
            return task
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(
                f"task {task_id} stuck in {task['status']['state']}, wanted {state}"
            )
        await asyncio.sleep(0.05)


# --------------------------------------------------------------------------- discovery


async def test_connect_discovers_card_and_prefers_first_interface(
    agent: AgentHandle, http: httpx.AsyncClient
) -> None:
    client = await A2AClient.connect(agent.base_url, http=http)
    assert client.interface == Interface(url=agent.jsonrpc_url, binding="JSONRPC")
    assert client.capabilities["streaming"] is True
    rest = await A2AClient.connect(agent.card_url, http=http, binding="rest")
    assert rest.interface.binding == "HTTP+JSON" and rest.interface.url == agent.rest_url


# --------------------------------------------------------------------------- stream shapes


async def test_plain_message_reply(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    client = client_for(agent, binding, http)
    reply = await client.send_message(user_message("hello there"))
    assert reply.kind == "message" and reply.task_id is None and reply.context_id
    assert message_text(reply.payload) == "Hello! You said: hello there"
    assert reply.payload["role"] == "ROLE_AGENT"
    events = await collect(client.send_streaming_message(user_message("hello again")))
    assert [e.kind for e in events] == ["message"]
    assert events[0].raw == {"message": events[0].payload}


async def test_quick_task(agent: AgentHandle, binding: str, http: httpx.AsyncClient) -> None:
    client = client_for(agent, binding, http)
    res = await client.send_message(user_message("quick"))
    assert res.kind == "task" and res.state == "TASK_STATE_COMPLETED"
    assert artifact_text(res.payload["artifacts"][0]) == "quick result"
    events = await collect(client.send_streaming_message(user_message("quick")))
    assert events[0].kind == "task" and events[0].state == "TASK_STATE_SUBMITTED"
    assert events[-1].state == "TASK_STATE_COMPLETED"
    assert [e.state for e in events if e.state].count("TASK_STATE_COMPLETED") == 1


async def test_slow_task_progress_and_chunked_artifact(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    client = client_for(agent, binding, http)
    events = await collect(client.send_streaming_message(user_message("slow 4 0.02")))
    assert events[0].kind == "task" and events[0].state == "TASK_STATE_SUBMITTED"
    progress = [
        message_text(e.status_message)
        for e in events
        if e.kind == "statusUpdate" and e.status_message
    ]
    assert [p for p in progress if p.startswith("step")] == [f"step {i}/4" for i in range(1, 5)]
    chunks = [e.payload for e in events if e.kind == "artifactUpdate"]
    assert len(chunks) == 4
    assert not chunks[0].get("append") and all(c.get("append") for c in chunks[1:])
    assert [bool(c.get("lastChunk")) for c in chunks] == [False, False, False, True]
    assert events[-1].kind == "statusUpdate" and events[-1].state == "TASK_STATE_COMPLETED"
    assert len({c["artifact"]["artifactId"] for c in chunks}) == 1
    streamed = "".join(artifact_text(c["artifact"]) for c in chunks)
    assert streamed == "chunk 1\nchunk 2\nchunk 3\nchunk 4\n"
    # the server's own assembly agrees with the chunks as streamed
    server = await client.get_task(events[0].task_id)
    assert artifact_text(server["artifacts"][0]) == streamed


async def test_ask_input_required_then_answer_on_same_task(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    client = client_for(agent, binding, http)
    first = await client.send_message(user_message("ask"))
    assert first.state == "TASK_STATE_INPUT_REQUIRED"
    assert message_text(first.status_message) == "What is your name?"
    answer = user_message("Ada", task_id=first.task_id, context_id=first.context_id)
    events = await collect(client.send_streaming_message(answer))
    # a follow-up stream starts with a statusUpdate, not a Task (SDK behaviour)
    assert events[0].kind == "statusUpdate" and events[0].task_id == first.task_id
    assert events[-1].state == "TASK_STATE_COMPLETED"
    assert all(e.task_id == first.task_id for e in events)
    answered = [e.payload["artifact"] for e in events if e.kind == "artifactUpdate"]
    assert artifact_text(answered[-1]) == "You answered: Ada"
    task = await client.get_task(first.task_id)
    assert task["status"]["state"] == "TASK_STATE_COMPLETED"
    assert answer["messageId"] in [m["messageId"] for m in task.get("history", [])]


async def test_ask_stream_closes_at_input_required(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    client = client_for(agent, binding, http)
    events = await collect(client.send_streaming_message(user_message("ask")))
    assert events[-1].state == "TASK_STATE_INPUT_REQUIRED"
    # answering with a blocking send completes it
    done = await client.send_message(
        user_message("Bob", task_id=events[0].task_id, context_id=events[0].context_id)
    )
    assert done.state == "TASK_STATE_COMPLETED"


async def test_subscribe_to_waiting_task_sees_the_answer(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    client = client_for(agent, binding, http)
    first = await client.send_message(user_message("ask"))
    seen: list[StreamEvent] = []

    async def watch() -> None:
        async for ev in client.subscribe_to_task(first.task_id):
            seen.append(ev)
            if ev.state == "TASK_STATE_COMPLETED":
                return

    watcher = asyncio.create_task(watch())
    while not seen:
        await asyncio.sleep(0.02)
    assert seen[0].kind == "task" and seen[0].state == "TASK_STATE_INPUT_REQUIRED"
    await client.send_message(
        user_message("Cy", task_id=first.task_id, context_id=first.context_id)
    )
    await asyncio.wait_for(watcher, 10)
    assert seen[-1].state == "TASK_STATE_COMPLETED"


async def test_auth_required_resumes_on_its_own(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    client = client_for(agent, binding, http)
    events = await collect(client.send_streaming_message(user_message("auth 0.3")))
    states = [e.state for e in events if e.state]
    assert "TASK_STATE_AUTH_REQUIRED" in states and states[-1] == "TASK_STATE_COMPLETED"
    auth_ev = next(e for e in events if e.state == "TASK_STATE_AUTH_REQUIRED")
    assert "Authorization needed" in message_text(auth_ev.status_message)
    # a blocking send returns at the interrupted state; the task then finishes by itself
    blocking = await client.send_message(user_message("auth 0.3"))
    assert blocking.state == "TASK_STATE_AUTH_REQUIRED"
    await wait_state(client, blocking.task_id, "TASK_STATE_COMPLETED")


@pytest.mark.parametrize(
    ("word", "state", "text"),
    [
        ("fail", "TASK_STATE_FAILED", "Simulated failure"),
        ("reject", "TASK_STATE_REJECTED", "will not"),
    ],
)
async def test_failure_and_rejection(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient, word: str, state: str, text: str
) -> None:
    client = client_for(agent, binding, http)
    res = await client.send_message(user_message(word))
    assert res.state == state and text in message_text(res.status_message)
    events = await collect(client.send_streaming_message(user_message(word)))
    assert events[-1].state == state


async def test_data_and_file_artifacts(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    client = client_for(agent, binding, http)
    res = await client.send_message(user_message("data"))
    data_art, file_art = res.payload["artifacts"]
    data_part = data_art["parts"][0]
    assert data_part["data"]["items"] == ["a", "b"] and data_part["mediaType"] == "application/json"
    file_part = file_art["parts"][0]
    assert file_part["filename"] == "hello.txt"
    assert base64.b64decode(file_part["raw"]) == b"hello, file\n"


async def test_markdown_artifact_carries_hostile_html(
    agent: AgentHandle, http: httpx.AsyncClient
) -> None:
    res = await client_for(agent, "rest", http).send_message(user_message("markdown"))
    part = res.payload["artifacts"][0]["parts"][0]
    assert part["mediaType"] == "text/markdown"
    assert "<script>" in part["text"] and "javascript:" in part["text"]


# --------------------------------------------------------------------------- task operations


async def test_long_task_subscribe_then_cancel(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    client = client_for(agent, binding, http)
    started = await client.send_message(user_message("long 30"), return_immediately=True)
    assert started.kind == "task" and started.state in (
        "TASK_STATE_SUBMITTED",
        "TASK_STATE_WORKING",
    )
    tid = started.task_id
    seen: list[StreamEvent] = []
    stream = client.subscribe_to_task(tid)
    async for ev in stream:
        seen.append(ev)
        if len(seen) == 2:
            break
    await stream.aclose()
    assert seen[0].kind == "task" and seen[0].task_id == tid  # the snapshot comes first
    assert seen[1].state == "TASK_STATE_WORKING"
    canceled = await client.cancel_task(tid)
    assert canceled["id"] == tid and canceled["status"]["state"] == "TASK_STATE_CANCELED"
    with pytest.raises(TaskNotCancelableError) as err:
        await client.cancel_task(tid)
    assert err.value.code == -32002 and "-32002" in str(err.value)
    with pytest.raises(UnsupportedOperationError) as err2:
        await collect(client.subscribe_to_task(tid))
    assert err2.value.code == -32004 and err2.value.reason == "UNSUPPORTED_OPERATION"


async def test_cancel_ends_an_open_stream(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    client = client_for(agent, binding, http)
    events: list[StreamEvent] = []

    async def run() -> None:
        async for ev in client.send_streaming_message(user_message("long 30")):
            events.append(ev)

    runner = asyncio.create_task(run())
    while not events:
        await asyncio.sleep(0.02)
    await client.cancel_task(events[0].task_id)
    await asyncio.wait_for(runner, 10)  # the stream closes (its last state may not be shown)
    task = await client.get_task(events[0].task_id)
    assert task["status"]["state"] == "TASK_STATE_CANCELED"


async def test_get_task_and_history_length(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    client = client_for(agent, binding, http)
    res = await client.send_message(user_message("quick"))
    full = await client.get_task(res.task_id)
    assert full["id"] == res.task_id and full.get("history")
    bare = await client.get_task(res.task_id, history_length=0)
    assert not bare.get("history")
    with pytest.raises(TaskNotFoundError) as err:
        await client.get_task(str(uuid.uuid4()))
    assert err.value.code == -32001 and err.value.reason == "TASK_NOT_FOUND"


async def test_list_tasks_with_paging_and_filters(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    client = client_for(agent, binding, http)
    first = await client.send_message(user_message("quick"))
    ctx = first.context_id
    for _ in range(2):
        await client.send_message(user_message("quick", context_id=ctx))
    await client.send_message(user_message("fail", context_id=ctx))
    page1 = await client.list_tasks(context_id=ctx, page_size=2)
    assert len(page1["tasks"]) == 2 and page1["nextPageToken"]
    assert all("artifacts" not in t for t in page1["tasks"])
    page2 = await client.list_tasks(context_id=ctx, page_size=2, page_token=page1["nextPageToken"])
    assert len(page2["tasks"]) == 2 and page2["nextPageToken"] == ""
    ids = {t["id"] for t in page1["tasks"] + page2["tasks"]}
    assert len(ids) == 4 and first.task_id in ids
    completed = await client.list_tasks(
        context_id=ctx, status="TASK_STATE_COMPLETED", include_artifacts=True
    )
    assert len(completed["tasks"]) == 3
    assert all(
        t["status"]["state"] == "TASK_STATE_COMPLETED" and t["artifacts"]
        for t in completed["tasks"]
    )
    later = await client.list_tasks(context_id=ctx, status_timestamp_after="2999-01-01T00:00:00Z")
    assert later["tasks"] == []


async def test_push_config_lifecycle(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    client = client_for(agent, binding, http)
    started = await client.send_message(user_message("long 30"), return_immediately=True)
    tid = started.task_id
    try:
        made = await client.create_push_config(
            tid,
            "http://127.0.0.1:9/hook",
            config_id="pn-1",
            token="tok",
            auth_scheme="Bearer",
            auth_credentials="s3",
        )
        assert (
            made["id"] == "pn-1"
            and made["taskId"] == tid
            and made["url"] == "http://127.0.0.1:9/hook"
        )
        auto = await client.create_push_config(tid, "http://127.0.0.1:9/other")
        assert auto["id"] and auto["id"] != tid  # we always send our own id
        got = await client.get_push_config(tid, "pn-1")
        assert got["token"] == "tok" and got["authentication"]["scheme"] == "Bearer"
        listed = await client.list_push_configs(tid)
        assert {c["id"] for c in listed["configs"]} == {"pn-1", auto["id"]}
        await client.delete_push_config(tid, "pn-1")
        await client.delete_push_config(tid, "pn-1")  # idempotent
        listed = await client.list_push_configs(tid)
        assert [c["id"] for c in listed["configs"]] == [auto["id"]]
        with pytest.raises(TaskNotFoundError):
            await client.get_push_config(tid, "pn-1")
    finally:
        await client.cancel_task(tid)


async def test_inline_push_config_on_send(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    client = client_for(agent, binding, http)
    res = await client.send_message(
        user_message("long 30"),
        return_immediately=True,
        push_config={"id": "inline-1", "url": "http://127.0.0.1:9/hook", "token": "t"},
    )
    try:
        configs = await client.list_push_configs(res.task_id)
        assert [c["id"] for c in configs["configs"]] == ["inline-1"]
    finally:
        await client.cancel_task(res.task_id)


async def test_extended_card(agent: AgentHandle, binding: str, http: httpx.AsyncClient) -> None:
    card = await client_for(agent, binding, http).get_extended_agent_card()
    assert "admin" in [s["id"] for s in card["skills"]]


# --------------------------------------------------------------------------- refusals & auth


async def test_streaming_refused_without_capability(
    agent_nostream: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    client = client_for(agent_nostream, binding, http)
    with pytest.raises(UnsupportedOperationError) as err:
        await collect(client.send_streaming_message(user_message("quick")))
    assert err.value.code == -32004
    res = await client.send_message(user_message("quick"))
    with pytest.raises(UnsupportedOperationError):
        await collect(client.subscribe_to_task(res.task_id))


async def test_push_refused_without_capability(
    agent_nopush: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    client = client_for(agent_nopush, binding, http)
    res = await client.send_message(user_message("quick"))
    with pytest.raises(PushNotificationNotSupportedError) as err:
        await client.create_push_config(res.task_id, "http://127.0.0.1:9/hook")
    assert err.value.code == -32003 and err.value.reason == "PUSH_NOTIFICATION_NOT_SUPPORTED"
    with pytest.raises(PushNotificationNotSupportedError):
        await client.list_push_configs(res.task_id)
    with pytest.raises(PushNotificationNotSupportedError):
        await client.get_push_config(res.task_id, "x")
    with pytest.raises(PushNotificationNotSupportedError):
        await client.delete_push_config(res.task_id, "x")


async def test_bearer_token_from_card(
    agent_token: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    anon = await A2AClient.connect(agent_token.base_url, http=http, binding=binding)
    assert anon.card and "bearer" in anon.card["securitySchemes"]
    with pytest.raises(AuthError) as err:
        await anon.get_extended_agent_card()
    assert err.value.http_status == 401
    authed = await A2AClient.connect(
        agent_token.base_url, http=http, binding=binding, credentials=Credentials(token=AGENT_TOKEN)
    )
    assert "admin" in [s["id"] for s in (await authed.get_extended_agent_card())["skills"]]
    assert (await authed.send_message(user_message("quick"))).state == "TASK_STATE_COMPLETED"


async def test_missing_version_header_is_version_not_supported(
    agent: AgentHandle, http: httpx.AsyncClient
) -> None:
    # What a 1.0 server says to a client that forgets A2A-Version (we never do).
    body = {"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x"}}
    r = await http.post(agent.jsonrpc_url, json=body)
    from tasks_app.a2a.errors import from_jsonrpc_error

    assert isinstance(from_jsonrpc_error(r.json()["error"]), VersionNotSupportedError)
    r2 = await http.get(f"{agent.rest_url}/tasks/x")
    assert isinstance(error_for_status(r2, r2.content, "GET"), VersionNotSupportedError)


async def test_message_id_is_reusable_for_retries() -> None:
    m1 = user_message("hi", message_id="fixed-id")
    assert m1["messageId"] == "fixed-id" and m1["role"] == "ROLE_USER"
    assert user_message("hi")["messageId"] != user_message("hi")["messageId"]
    m2 = user_message(
        data={"a": 1}, files=[{"raw": "aGk=", "filename": "f.txt"}], task_id="t", context_id="c"
    )
    assert [next(iter(p)) for p in m2["parts"]] == ["data", "raw"] and m2["taskId"] == "t"
    with pytest.raises(ValueError):
        user_message()


async def test_push_notifications_are_delivered(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient, webhook: WebhookReceiver
) -> None:
    client = client_for(agent, binding, http)
    res = await client.send_message(
        user_message("slow 2 0.02"),
        push_config={
            "id": "p-1",
            "url": webhook.url,
            "token": "tok-1",
            "authentication": {"scheme": "Bearer", "credentials": "whsec-1"},
        },
    )
    assert res.state == "TASK_STATE_COMPLETED"

    def done(hooks: list) -> bool:
        return any(
            (h.body or {}).get("statusUpdate", {}).get("status", {}).get("state")
            == "TASK_STATE_COMPLETED"
            for h in hooks
        )

    hooks = await asyncio.to_thread(webhook.wait_for, done)
    events = [parse_stream_response(h.body, where="push") for h in hooks]
    assert {e.task_id for e in events} == {res.task_id}
    assert all(h.headers.get("x-a2a-notification-token") == "tok-1" for h in hooks)
    assert all(h.headers.get("authorization") == "Bearer whsec-1" for h in hooks)
    assert events[0].kind == "task"  # an inline config also receives the initial task
    assert events[-1].state == "TASK_STATE_COMPLETED"
    pushed = [e.payload["artifact"] for e in events if e.kind == "artifactUpdate"]
    assert "".join(artifact_text(a) for a in pushed) == "chunk 1\nchunk 2\n"


async def test_subscribe_to_unknown_task(
    agent: AgentHandle, binding: str, http: httpx.AsyncClient
) -> None:
    with pytest.raises(TaskNotFoundError):
        await collect(client_for(agent, binding, http).subscribe_to_task(str(uuid.uuid4())))


async def test_streams_go_through_their_own_pool(agent: AgentHandle, binding: str) -> None:
    """With ``stream_http``, streams use that client and every other call the first one:
    calls made beside hundreds of open streams must not pay for walking their pool."""
    paths: dict[str, list[str]] = {"calls": [], "streams": []}

    def hook(name: str) -> Callable[[httpx.Request], Awaitable[None]]:
        async def record(request: httpx.Request) -> None:
            paths[name].append(request.headers.get("accept", ""))

        return record

    async with (
        httpx.AsyncClient(event_hooks={"request": [hook("calls")]}) as calls,
        httpx.AsyncClient(event_hooks={"request": [hook("streams")]}) as streams,
    ):
        client = client_for(agent, binding, calls, stream_http=streams)
        events = await collect(client.send_streaming_message(user_message("quick")))
        assert events[-1].state == "TASK_STATE_COMPLETED"
        task = await client.get_task(events[0].task_id)
        assert task["status"]["state"] == "TASK_STATE_COMPLETED"
        started = await client.send_message(user_message("long 30"), return_immediately=True)
        stream = client.subscribe_to_task(started.task_id)
        async for _ in stream:
            break
        await stream.aclose()
        await client.cancel_task(started.task_id)
    assert len(paths["streams"]) == 2  # the streamed send and the subscription
    assert all("text/event-stream" in accept for accept in paths["streams"])
    assert len(paths["calls"]) == 3  # GetTask, the plain send, CancelTask
    assert not any("text/event-stream" in accept for accept in paths["calls"])
