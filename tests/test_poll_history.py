"""A polled task's snapshots hold the newest messages of its history, in the agent's order.

An agent's history grows with every status message, and a poll that stored a changed
snapshot stored the whole history each time: the demo agent's ten-minute task, one status a
second, made a 185 KB row a poll, went over its byte budget and was parked after six
minutes (found by driving the running dashboard). A poll asks GetTask for the newest
messages, widening the window while its oldest message is not one the mirror holds (a window
alone mirrored the messages it skipped after newer ones, when the settling GetTask found
them), and the next poll's window follows what the agent said since the last. A real demo
agent, a real worker.
"""

from __future__ import annotations

import pytest

from tasks_app import eventloop
from tasks_app.a2a import A2AClient
from tasks_app.a2a.types import Interface
from tasks_app.models import Agent, ConversationMessage, RemoteTask, TaskEvent
from tasks_app.services import polls
from tasks_app.services import tasks as task_services
from tasks_app.services.agents import add_agent
from tests.hostile_servers import NEWIDS_WHOLE, TASK_ID, HostileServer
from tests.serving import loopback_client
from tests.test_mirror import assert_converged, settled, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _ids(messages: list) -> list[str]:
    return [m["messageId"] for m in messages if isinstance(m, dict) and m.get("messageId")]


def _polled_windows(task: RemoteTask) -> list[tuple[list[str], set[str]]]:
    """Each polled snapshot's history ids, with the ids the log held before it."""
    held: set[str] = set()
    found = []
    for event in TaskEvent.objects.filter(task=task).order_by("seq"):
        raw = event.raw if isinstance(event.raw, dict) else {}
        snapshot = raw.get("task") if isinstance(raw.get("task"), dict) else {}
        if event.channel == "poll" and event.kind == "task":
            found.append((_ids(snapshot.get("history") or []), set(held)))
        update = raw.get("statusUpdate") if isinstance(raw.get("statusUpdate"), dict) else {}
        said = [
            *(snapshot.get("history") or []),
            (snapshot.get("status") or {}).get("message"),
            raw.get("message"),
            (update.get("status") or {}).get("message"),
        ]
        held.update(_ids(said))
    return found


def _start(agent, start_celery_worker, seconds_between_polls: str, text: str) -> RemoteTask:
    start_celery_worker(
        WATCH_POLL_MIN_SECONDS=seconds_between_polls, WATCH_POLL_MAX_SECONDS=seconds_between_polls
    )
    row = add_agent(agent.base_url, name="demo")
    task = task_services.start_task(row, text, mode="return-immediately")
    wait_for(lambda: settled(task), timeout=90, what="the long task to complete")
    assert task.state == "TASK_STATE_COMPLETED"
    return task


def test_polls_faster_than_the_agent_talks_store_only_the_newest_messages(
    agent, start_celery_worker
):
    # The agent says a status every 0.2 s, the worker polls every 0.5 s: a few messages a
    # poll, far fewer than the window.
    task = _start(agent, start_celery_worker, "0.5", "long 8")
    windows = _polled_windows(task)[:-1]  # the last is the settling GetTask: all of it
    assert len(windows) >= 4, len(windows)
    for ids, held in windows:
        # A poll stored more than the window only when the window left a hole.
        if len(ids) > polls.POLL_HISTORY:
            assert ids[-polls.POLL_HISTORY] not in held, ids
    full = [ids for ids, _ in windows if len(ids) == polls.POLL_HISTORY]
    assert full, [len(ids) for ids, _ in windows]  # the agent's history was longer than it
    assert_converged(task)  # the conversation, in the agent's order


def test_an_agent_that_says_more_than_the_window_between_polls_is_mirrored_in_its_order(
    agent, start_celery_worker
):
    # About 25 status messages between two polls (one every 0.2 s, a poll every 5 s): the
    # first window's oldest message is new, so that poll widens it; later polls ask for
    # twice what the agent said since the last, which reaches back to a held message.
    task = _start(agent, start_celery_worker, "5", "long 25")
    polled = _polled_windows(task)
    first_message = polled[-1][0][0]  # the settling GetTask holds the whole history
    windows = polled[:-1]
    assert len(windows) >= 4, [len(ids) for ids, _ in windows]
    for ids, held in windows:
        # No hole: each stored window reaches back to a message already mirrored, unless
        # it is the agent's whole history (the task's first message).
        assert ids[0] in held or ids[0] == first_message, (len(ids), len(held))
    # Wider than the first window without being the whole history: the conversation is not
    # fetched and stored whole every poll (it was, before the window followed the agent).
    adapted = [
        ids for ids, held in windows if len(ids) > polls.POLL_HISTORY and ids[0] != first_message
    ]
    assert adapted, [(len(ids), ids[0] == first_message) for ids, _ in windows]
    # Every message mirrored once, where the agent has it: a window alone put the ones it
    # skipped after newer ones (the settling GetTask found them).
    assert_converged(task)


@pytest.mark.parametrize(
    ("new_messages", "window"),
    [(0, polls.POLL_HISTORY), (9, polls.POLL_HISTORY), (25, 50), (10**6, polls.POLL_HISTORY_MAX)],
)
def test_the_next_window_is_twice_what_the_agent_said_within_bounds(new_messages, window):
    assert polls.window_for(new_messages) == window


def test_an_agent_whose_window_never_reaches_back_costs_at_most_four_calls_a_poll(shared_loop):
    """The widening stops: an agent that answers every GetTask with fresh message ids, as
    many as asked, is asked three windows and then the whole history, once; the holder's
    next poll starts at the widest window (two calls, as when the window went straight to
    the whole history)."""

    server = HostileServer().start()
    try:
        agent = Agent.objects.create(name="newids", base_url=server.url_for("newids"))
        task = RemoteTask.objects.create(agent=agent, remote_id=TASK_ID, phase="task")

        async def poll(length: int) -> polls.Polled:
            async with loopback_client() as http:
                interface = Interface(url=server.url_for("newids"), binding="JSONRPC")  # type: ignore[arg-type]
                client = A2AClient(interface, http=http)
                return await polls.poll_task(client, TASK_ID, task.pk, length)

        first = eventloop.submit(poll(polls.POLL_HISTORY)).result(timeout=60)
        assert len(server.conns_for("newids")) == 4  # 20, 160, 1,280, then all of it
        assert len(first.task["history"]) == NEWIDS_WHOLE
        assert first.next_length == polls.POLL_HISTORY_MAX
        second = eventloop.submit(poll(first.next_length)).result(timeout=60)
        assert len(server.conns_for("newids")) == 6
        assert len(second.task["history"]) == NEWIDS_WHOLE
    finally:
        server.close()


def _poll_as_the_agent_speaks(
    server: HostileServer, said_per_turn: list[int]
) -> tuple[list[int], set[str], int]:
    """Each turn the ``steady`` agent says that many new messages, then a poll records what
    it read; checks each window reaches back to a message held. The GetTasks each poll made,
    the ids recorded, and the next window."""
    from tasks_app.services.record import record

    agent = Agent.objects.create(name="steady", base_url=server.url_for("steady"))
    task = RemoteTask.objects.create(agent=agent, remote_id=TASK_ID, phase="task")

    async def poll(length: int) -> polls.Polled:
        async with loopback_client() as http:
            interface = Interface(url=server.url_for("steady"), binding="JSONRPC")  # type: ignore[arg-type]
            return await polls.poll_task(A2AClient(interface, http=http), TASK_ID, task.pk, length)

    length, calls, recorded = polls.POLL_HISTORY, [], set()
    for turn, said in enumerate(said_per_turn):
        server.steady_history.extend(
            {"messageId": f"m-{turn}-{i}", "role": "ROLE_AGENT", "parts": [{"text": "x"}]}
            for i in range(said)
        )
        before = len(server.conns_for("steady"))
        polled = eventloop.submit(poll(length)).result(timeout=60)
        calls.append(len(server.conns_for("steady")) - before)
        oldest = polled.task["history"][0]["messageId"]
        assert oldest == "m-0-0" or oldest in recorded, oldest  # no hole
        recorded.update(m["messageId"] for m in polled.task["history"])
        record(task.pk, {"task": polled.task}, "poll")
        length = polled.next_length
    return calls, recorded, length


def test_an_agent_saying_the_same_amount_between_polls_costs_one_call_a_poll(shared_loop):
    """The window follows what the agent said since the last poll: an agent saying 45
    messages between polls (more than the first window) costs a widened first poll, then
    one GetTask a poll, each window reaching back to a mirrored message."""

    server = HostileServer().start()
    try:
        calls, _, length = _poll_as_the_agent_speaks(server, [45] * 5)
        # 20 left a hole; 160 brought all 45, fewer than asked with the oldest new (all it has,
        # or a limit of its own: the whole history says which); then 90, reaching back.
        assert calls == [3, 1, 1, 1, 1], calls
        assert length == 90  # twice what the agent said since the last poll
    finally:
        server.close()


def test_an_agent_that_caps_the_window_leaves_no_hole(shared_loop):
    """An agent may answer fewer messages than asked (the spec lets it apply a lower limit):
    fewer was taken for all it had, and the messages before its cap were skipped until the
    settling GetTask found them, after newer ones. Now the whole history is read then."""

    server = HostileServer().start()
    server.steady_cap = 10
    try:
        calls, recorded, _ = _poll_as_the_agent_speaks(server, [15, 5, 30])
        # Over the cap: the window, then the whole history; within it, the window alone.
        assert calls == [2, 1, 2], calls
        assert len(recorded) == 50
    finally:
        server.close()


def test_the_push_drain_keeps_each_tasks_window_between_notifications(shared_loop):
    """The push drain's GetTask follows the agent as a watcher's poll does: an agent saying
    45 messages between notifications costs a widened first GetTask (and the whole history
    once: fewer came than asked, and none the mirror holds), then one a notification (it
    began at the first window each time: two)."""

    from tasks_app.services import push

    server = HostileServer().start()
    try:
        agent = Agent.objects.create(
            name="steady push", base_url=server.url_for("steady"),
            interface_url=server.url_for("steady"), binding="JSONRPC", protocol_version="1.0",
        )  # fmt: skip
        task = RemoteTask.objects.create(
            agent=agent, remote_id=TASK_ID, phase="task", state="TASK_STATE_WORKING",
            watch=RemoteTask.Watch.PUSH,
        )  # fmt: skip

        async def drain() -> None:
            async with loopback_client() as http:
                await push.refresh_after_push(http, task.pk)

        calls = []
        for turn in range(4):
            server.steady_history.extend(
                {"messageId": f"m-{turn}-{i}", "role": "ROLE_AGENT", "parts": [{"text": "x"}]}
                for i in range(45)
            )
            before = len(server.conns_for("steady"))
            eventloop.submit(drain()).result(timeout=60)
            calls.append(len(server.conns_for("steady")) - before)
        assert calls == [3, 1, 1, 1], calls
        # Every message the agent said is mirrored once, in its order.
        mirrored = list(
            ConversationMessage.objects.filter(task=task).order_by("seq", "pk")
            .values_list("message_id", flat=True)
        )  # fmt: skip
        assert mirrored == [m["messageId"] for m in server.steady_history]
    finally:
        server.close()
