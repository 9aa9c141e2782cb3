"""What a conforming A2A 1.0 agent may send, taken as the spec says (an audit against the spec).

Each test names what happened before its fix: a legal reply refused, read wrongly, or an
error decided from our copy instead of the agent's task.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from tasks_app import eventloop, outbound, watchers
from tasks_app.a2a import ProtocolError, TaskNotFoundError, parse_stream_response
from tasks_app.a2a.errors import from_http_error
from tasks_app.a2a.streams import iter_sse
from tasks_app.models import Agent, RemoteTask, TaskEvent
from tasks_app.rendering import decode_raw
from tasks_app.services import tasks as task_services
from tests.serving import RpcError, json_rpc_peer

WORKING = {"state": "TASK_STATE_WORKING"}


# Parsing ------------------------------------------------------------------------------------


def test_a_member_that_is_null_is_not_set() -> None:
    """ProtoJSON reads null as the default: ``"message": null`` beside a task made the
    reply "more than one StreamResponse member", and the reply was thrown away."""
    event = parse_stream_response({"task": {"id": "t", "status": WORKING}, "message": None})
    assert event.kind == "task"


def test_fields_1_0_does_not_know_are_ignored_beside_the_1_0_shape() -> None:
    """A 1.0 agent that still sends 0.3's ``final`` or ``kind`` for older clients lost the
    whole reply or stream ("a 0.3-shaped payload"); the spec says to ignore unknown fields."""
    update = {"taskId": "t", "status": {"state": "TASK_STATE_COMPLETED"}, "final": True,
              "kind": "status-update"}  # fmt: skip
    assert parse_stream_response({"statusUpdate": update}).kind == "statusUpdate"
    message = {"messageId": "m", "role": "ROLE_AGENT", "kind": "message",
               "parts": [{"kind": "text", "text": "hi"}]}  # fmt: skip
    assert parse_stream_response({"message": message}).kind == "message"
    # A 0.3 payload (no 1.0 member) is still named for what it is.
    with pytest.raises(ProtocolError, match=r"0\.3-shaped"):
        parse_stream_response({"kind": "status-update", "taskId": "t", "final": True})
    with pytest.raises(ProtocolError, match=r"looks like A2A 0\.3"):
        parse_stream_response({"task": {"id": "t", "status": {"state": "working"}}})


def test_a_byte_order_mark_before_the_first_event_is_not_part_of_it() -> None:
    """The first line "\\ufeffdata: …" was not a data line: the stream's first event (its
    task, or its only message) was lost."""

    async def chunks() -> AsyncIterator[bytes]:
        yield b'\xef\xbb\xbfdata: {"a":1}\n\ndata: {"b":2}\n\n'

    async def read() -> list[str]:
        return [m.data async for m in iter_sse(chunks())]

    assert asyncio.run(read()) == ['{"a":1}', '{"b":2}']


def test_url_safe_base64_is_decoded_as_such() -> None:
    """The lenient decoder skipped "-" and "_": URL-safe text (ProtoJSON allows it) gave
    other bytes, silently (about 4% of random contents)."""
    for size in range(64):
        data = bytes(range(256))[size : size + 40] + b"\xfb\xef\xff"
        for text in (
            base64.urlsafe_b64encode(data).decode().rstrip("="),
            base64.b64encode(data).decode(),
            base64.encodebytes(data).decode(),  # line breaks, as MIME writes it
        ):
            assert decode_raw({"raw": text}) == data


def test_a_bare_google_rpc_status_keeps_its_meaning() -> None:
    """A REST error sent as google.rpc.Status itself (no ``error`` wrapper, as gRPC
    gateways send it) was a bare HTTP 404: a protocol error instead of task-not-found."""
    body = {"code": 5, "message": "no such task", "details": [
        {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "TASK_NOT_FOUND",
         "domain": "a2a-protocol.org"}]}  # fmt: skip
    error = from_http_error(404, body)
    assert isinstance(error, TaskNotFoundError) and "no such task" in str(error)


# Replies from an agent on loopback -------------------------------------------------------------


@pytest.fixture
def replies() -> dict[str, Any]:
    return {}


@pytest.fixture
def peer(replies) -> Iterator[str]:
    def answer(request: dict) -> Any:
        reply = replies.get(request.get("method", ""), {})
        if isinstance(reply, RpcError):
            raise reply
        return reply

    with json_rpc_peer(answer) as url:
        yield url


def agent_at(url: str, **fields: Any) -> Agent:
    return Agent.objects.create(
        name=f"a-{uuid.uuid4().hex[:6]}", base_url=url, interface_url=f"{url}/rpc",
        binding="JSONRPC", protocol_version="1.0", **fields,
    )  # fmt: skip


@pytest.mark.django_db
def test_a_listing_whose_tasks_are_null_is_an_empty_page(peer, replies) -> None:
    """``"tasks": null`` (ProtoJSON's default) was "'tasks' must be an array"."""
    replies["ListTasks"] = {"tasks": None, "nextPageToken": ""}
    replies["ListTaskPushNotificationConfigs"] = {"configs": None}
    agent = agent_at(peer)
    listing = outbound.run(lambda http: outbound.client_for(agent, http).list_tasks())
    assert listing["tasks"] == []
    configs = outbound.run(lambda http: outbound.client_for(agent, http).list_push_configs("t-1"))
    assert configs["configs"] == []


def lease(task: RemoteTask) -> str:
    token = task_services.acquire_lease(task.pk, watchers.OWNER)
    assert token is not None
    return token


def in_loop(work: Any) -> Any:
    async def run() -> Any:
        async with outbound.new_http_client() as http:
            return await work(http)

    return eventloop.submit(run()).result(timeout=60)


def streamed_task(agent: Agent) -> RemoteTask:
    return RemoteTask.objects.create(
        agent=agent, title="t", remote_id="t-1", context_id="c-1", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_WORKING", watch=RemoteTask.Watch.STREAM,
    )  # fmt: skip


def follow_one_turn(task: RemoteTask, token: str, agent: Agent) -> watchers.Outcome:
    """One turn of a holder following ``task`` by stream, in the loop, as a worker makes it."""

    async def follow(http: Any) -> watchers.Outcome:
        holder = watchers.Holder(task.pk, token, http=None)
        holder._take(await eventloop.db(RemoteTask.objects.select_related("agent").get, pk=task.pk))
        holder.streaming, holder.remote_id, holder.state = True, "t-1", "TASK_STATE_WORKING"
        return await holder._follow_turn(outbound.client_for(agent, http))

    return in_loop(follow)


@pytest.mark.django_db(transaction=True)
def test_a_subscribe_refused_as_not_found_asks_gettask_before_calling_the_task_gone(
    peer, replies, shared_loop
) -> None:
    """Some agents answer SubscribeToTask for a task that ended with -32001: the task was
    marked gone at the agent, and its end (and final artifacts) never fetched."""
    agent = agent_at(peer, streaming=True)
    task = streamed_task(agent)
    replies["SubscribeToTask"] = RpcError(-32001, "task not found")
    replies["GetTask"] = {"id": "t-1", "contextId": "c-1",
                          "status": {"state": "TASK_STATE_COMPLETED"}}  # fmt: skip
    token = lease(task)
    follow_one_turn(task, token, agent)
    task.refresh_from_db()
    assert task.state == "TASK_STATE_COMPLETED" and task.gone_at is None


@pytest.mark.django_db(transaction=True)
def test_a_task_that_ended_while_no_stream_was_live_says_what_was_missed(
    peer, replies, shared_loop
) -> None:
    """A holder taking over a streamed task that had ended meanwhile (its worker killed, or
    the database down past the lease) was refused SubscribeToTask and recorded GetTask's
    snapshot without the gap check: the log said nothing of the events never seen live."""
    agent = agent_at(peer, streaming=True)
    task = streamed_task(agent)
    replies["SubscribeToTask"] = RpcError(-32004, "the task has ended")
    replies["GetTask"] = {
        "id": "t-1", "contextId": "c-1", "status": {"state": "TASK_STATE_COMPLETED"},
        "artifacts": [{"artifactId": "a-1", "parts": [{"text": "made while unwatched"}]}],
    }  # fmt: skip
    token = lease(task)
    follow_one_turn(task, token, agent)
    task.refresh_from_db()
    assert task.state == "TASK_STATE_COMPLETED"
    kinds = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("kind", flat=True))
    assert kinds == ["gap", "task"], kinds
    gap = TaskEvent.objects.get(task=task, kind="gap")
    missed = ["state TASK_STATE_WORKING -> TASK_STATE_COMPLETED", "artifacts changed"]
    assert gap.raw == {"gap": {"missed": missed}}


@pytest.mark.django_db(transaction=True)
def test_an_answer_refused_for_a_task_that_ended_says_so_after_gettask(
    peer, replies, shared_loop
) -> None:
    """An answer refused with -32004 (the task was canceled elsewhere meanwhile) opened the
    question again on our copy, which still asked: every new answer failed the same way."""
    agent = agent_at(peer)
    answer = {"messageId": "a-1", "role": "ROLE_USER", "taskId": "t-1", "contextId": "c-1",
              "parts": [{"text": "yes"}]}  # fmt: skip
    task = RemoteTask.objects.create(
        agent=agent, title="t", remote_id="t-1", context_id="c-1", phase=RemoteTask.Phase.TASK,
        state="TASK_STATE_INPUT_REQUIRED", watch=RemoteTask.Watch.POLL, asked_seq=1,
        answered_seq=1, outbox={"message": answer},
    )  # fmt: skip
    replies["SendMessage"] = RpcError(-32004, "this task cannot take messages")
    replies["GetTask"] = {"id": "t-1", "contextId": "c-1",
                          "status": {"state": "TASK_STATE_CANCELED"}}  # fmt: skip
    token = lease(task)

    async def send(http: Any) -> Any:
        holder = watchers.Holder(task.pk, token, http=None)
        loaded = await eventloop.db(RemoteTask.objects.select_related("agent").get, pk=task.pk)
        holder._take(loaded)
        holder.streaming, holder.remote_id = False, "t-1"
        return await holder._send(loaded, outbound.client_for(agent, http))

    in_loop(send)
    task.refresh_from_db()
    assert task.state == "TASK_STATE_CANCELED" and task.outbox is None
    said = [r["system"]["detail"] for r in TaskEvent.objects.filter(task=task, kind="system")
            .values_list("raw", flat=True) if r["system"]["event"] == "answer-failed"]  # fmt: skip
    assert len(said) == 1 and "the task had ended (TASK_STATE_CANCELED)" in said[0]


@pytest.mark.django_db
def test_a_reply_with_a_null_member_names_the_task(peer) -> None:
    """The parser took ``"message": null`` as not set, but record() still counted it: a
    protocol error, and the task never named."""
    from tasks_app.services.record import record

    task = RemoteTask.objects.create(agent=agent_at(peer), title="t")
    reply = parse_stream_response({"task": {"id": "t-9", "contextId": "c", "status": WORKING},
                                   "message": None})  # fmt: skip
    recorded = record(task.pk, reply.raw, "send-response")
    task.refresh_from_db()
    assert recorded.kinds == ["task"] and task.remote_id == "t-9"
