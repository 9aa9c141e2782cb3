"""The mirror against real parts: a Celery worker process, Redis, and a2a-sdk agents.

Each scenario ends with the mirror equal to the agent's own GetTask, every
field including history (modulo the normalizations documented in
``tasks_app.services.snapshot``), its log replaying to its view and its hash
chain verifying.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from django.utils.dateparse import parse_datetime

from tasks_app.a2a import A2AClient, normalize
from tasks_app.models import Agent, RemoteTask, TaskEvent
from tasks_app.outbound import client_for, http_client
from tasks_app.services import imports
from tasks_app.services import tasks as task_services
from tasks_app.services.agents import add_agent
from tasks_app.services.audit import replay, verify
from tasks_app.services.snapshot import task_document, task_view

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

SETTLED = (
    "TASK_STATE_COMPLETED",
    "TASK_STATE_FAILED",
    "TASK_STATE_CANCELED",
    "TASK_STATE_REJECTED",
)


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def settled(task: RemoteTask, states: tuple[str, ...] = SETTLED) -> bool:
    task.refresh_from_db()
    return task.phase in ("message", "failed") or task.state in states


def agent_call(agent: Agent, call: Callable[[A2AClient], object]) -> object:
    async def run() -> object:
        async with http_client() as http:
            return await call(client_for(agent, http))  # type: ignore[misc]

    return asyncio.run(run())


def comparable(view: dict) -> dict:
    """A Task view with its documented normalizations applied (default values, timestamp form)."""
    view = normalize.task(view)
    status = dict(view["status"])
    if "timestamp" in status:
        status["timestamp"] = parse_datetime(status["timestamp"].replace("Z", "+00:00"))
    return {**view, "status": status}


def assert_converged(task: RemoteTask) -> None:
    """``tasks show --json``'s snapshot equals the agent's GetTask, field for field, history included."""
    task.refresh_from_db()
    remote = agent_call(task.agent, lambda c: c.get_task(task.remote_id))
    mirror = task_document(task)["snapshot"]
    assert comparable(mirror) == comparable(remote)  # type: ignore[arg-type]
    assert verify(task).ok, str(verify(task))
    assert replay(task).ok, str(replay(task))


def log_kinds(task: RemoteTask) -> list[str]:
    return list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("kind", flat=True))


def assert_log_is_gapless(task: RemoteTask) -> None:
    """The log holds exactly seqs 1..last_seq, read between two equal reads of last_seq.

    A settled task may still record (a last GetTask after the stream's end): a log read
    between two different ``last_seq`` reads would compare two moments, so it is read again.
    """
    for _ in range(50):
        task.refresh_from_db()
        before = task.last_seq
        seqs = list(
            TaskEvent.objects.filter(task=task).order_by("seq").values_list("seq", flat=True)
        )
        task.refresh_from_db()
        if task.last_seq == before:
            break
        time.sleep(0.1)
    assert task.last_seq == before, "the task kept recording for 5 s"
    assert seqs == list(range(1, task.last_seq + 1))


@pytest.fixture
def demo(agent, celery_worker) -> Agent:
    return add_agent(agent.base_url, name="demo")


SCENARIOS = [
    ("quick", "TASK_STATE_COMPLETED"),
    ("slow 4 0.05", "TASK_STATE_COMPLETED"),
    ("data", "TASK_STATE_COMPLETED"),
    ("fail", "TASK_STATE_FAILED"),
    ("reject", "TASK_STATE_REJECTED"),
    ("auth 0.5", "TASK_STATE_COMPLETED"),
]


@pytest.mark.parametrize("mode", ["stream", "return-immediately", "blocking"])
@pytest.mark.parametrize(("text", "final"), SCENARIOS)
def test_scenario_converges_in_every_mode(demo, mode, text, final):
    task = task_services.start_task(demo, text, mode=mode)
    wait_for(lambda: settled(task), what=f"{text!r} in {mode} to settle")
    assert task.phase == "task", task.send_error
    assert task.state == final
    assert_converged(task)
    assert_log_is_gapless(task)


@pytest.mark.parametrize("mode", ["stream", "return-immediately", "blocking"])
def test_plain_message_reply_is_recorded_without_a_task(demo, mode):
    task = task_services.start_task(demo, "hello there", mode=mode)
    wait_for(lambda: settled(task), what="the reply")
    assert (task.phase, task.remote_id) == ("message", "")
    assert log_kinds(task) == ["operator", "message"]
    texts = [m.message["parts"][0].get("text") for m in task.messages.order_by("seq")]
    assert texts[0] == "hello there" and len(texts) == 2


@pytest.mark.parametrize("mode", ["stream", "return-immediately", "blocking"])
def test_question_answered_on_the_same_task(demo, mode):
    task = task_services.start_task(demo, "ask", mode=mode)
    wait_for(lambda: settled(task, ("TASK_STATE_INPUT_REQUIRED",)), what="the question")
    assert task.state == "TASK_STATE_INPUT_REQUIRED"
    assert_converged(task)
    remote_id = task.remote_id
    task_services.answer_task(task, "blue")
    with pytest.raises(task_services.TaskActionError):
        task_services.answer_task(task, "a second operator")  # exactly one answer wins
    wait_for(lambda: settled(task), what="completion after the answer")
    assert (task.remote_id, task.state) == (remote_id, "TASK_STATE_COMPLETED")
    assert_converged(task)
    assert "You answered: blue" in str(task_view(task)["artifacts"])


@pytest.mark.parametrize("mode", ["stream", "return-immediately"])
def test_long_task_canceled(demo, mode):
    task = task_services.start_task(demo, "long 60", mode=mode)
    wait_for(lambda: settled(task, ("TASK_STATE_WORKING",)), what="work to start")
    task_services.cancel_task(task, reason="test")
    wait_for(lambda: settled(task), what="cancel")
    assert task.state == "TASK_STATE_CANCELED"
    assert_converged(task)
    done = task_services.start_task(demo, "quick", mode="blocking")
    wait_for(lambda: settled(done), what="a quick task")
    with pytest.raises(task_services.TaskActionError, match="cannot be canceled: it has ended"):
        task_services.cancel_task(done)


def test_auto_mode_polls_an_agent_without_streaming(agent_nostream, celery_worker):
    demo = add_agent(agent_nostream.base_url, name="no stream")
    task = task_services.start_task(demo, "slow 3 0.1", from_browser=True)
    assert task.mode == "return-immediately" and task.watch == "poll"
    wait_for(lambda: settled(task), what="the polled task")
    assert task.state == "TASK_STATE_COMPLETED"
    assert_converged(task)
    assert "poll" in set(TaskEvent.objects.filter(task=task).values_list("channel", flat=True))


def test_import_mirrors_tasks_started_elsewhere(agent, celery_worker):
    demo = add_agent(agent.base_url, name="demo")

    async def start_elsewhere() -> str:
        async with http_client() as http:
            client = client_for(demo, http)
            from tasks_app.a2a import user_message

            event = await client.send_message(user_message("quick"))
            return event.payload["id"]

    remote_ids = [asyncio.run(start_elsewhere()) for _ in range(3)]
    remote_id = remote_ids[0]
    result = imports.import_tasks(demo, page_size=2)  # several pages
    assert result.seen >= 3
    assert RemoteTask.objects.filter(agent=demo, remote_id__in=remote_ids).count() == 3
    task = RemoteTask.objects.get(agent=demo, remote_id=remote_id)
    assert task.state == "TASK_STATE_COMPLETED" and task.mode == "imported"
    assert_converged(task)
    again = imports.import_tasks(demo)
    assert again.created == 0


def test_unreachable_agent_fails_the_send_visibly(celery_worker):
    from tests.agents import free_port

    port = free_port()
    demo = Agent.objects.create(
        name="gone", base_url=f"http://127.0.0.1:{port}", interface_url=f"http://127.0.0.1:{port}/jsonrpc",
        binding="JSONRPC", protocol_version="1.0", streaming=True,
    )  # fmt: skip
    task = task_services.start_task(demo, "quick", mode="stream")
    wait_for(lambda: settled(task), what="the failed send")
    assert task.phase == "failed" and task.send_error
    demo.refresh_from_db()
    assert demo.reachable is False and demo.last_error
    assert log_kinds(task) == ["operator", "system"]


def test_connection_dropped_mid_stream_resubscribes_with_a_gap(
    agent, tcp_proxy, start_celery_worker
):
    start_celery_worker(WATCH_BACKOFF_BASE_SECONDS="1.5", WATCH_BACKOFF_MAX_SECONDS="2")
    proxy = tcp_proxy("127.0.0.1", agent.port)
    demo = add_agent(agent.base_url, name="via proxy")
    Agent.objects.filter(pk=demo.pk).update(interface_url=f"{proxy.url}/jsonrpc")
    demo.refresh_from_db()
    task = task_services.start_task(demo, "slow 40 0.1", mode="stream")
    wait_for(
        lambda: TaskEvent.objects.filter(task=task, kind="artifactUpdate").count() >= 3,
        what="chunks",
    )
    assert proxy.cut() > 0, proxy.connections
    wait_for(lambda: settled(task), timeout=40, what="convergence after the cut")
    assert task.state == "TASK_STATE_COMPLETED"
    assert_converged(task)
    # The drop is in the log, then what the agent did meanwhile (the backoff is
    # at least 0.75 s while the agent emits every 0.1 s) as a gap.
    kinds = log_kinds(task)
    assert "system" in kinds and "gap" in kinds
    assert kinds.index("system") < kinds.index("gap")
    events = [
        e.raw["system"]["event"]
        for e in TaskEvent.objects.filter(task=task, kind="system").order_by("seq")
    ]
    assert events[0] == "stream-dropped" and events[-1] == "settled"
    channels = set(TaskEvent.objects.filter(task=task).values_list("channel", flat=True))
    assert {"resubscribe", "poll"} & channels
    assert_log_is_gapless(task)


def remote_total(demo: Agent) -> int:
    listing = agent_call(demo, lambda c: c.list_tasks(page_size=1))
    return int(listing.get("totalSize", 0))


def test_killed_worker_is_replaced_and_no_second_task_is_created(
    agent, start_celery_worker, start_celery_beat
):
    first = start_celery_worker(WATCH_LEASE_SECONDS="2")
    demo = add_agent(agent.base_url, name="demo")
    before = remote_total(demo)
    task = task_services.start_task(demo, "slow 40 0.15", mode="stream")
    wait_for(
        lambda: TaskEvent.objects.filter(task=task, kind="artifactUpdate").count() >= 3,
        what="chunks",
    )
    first.kill()
    start_celery_worker(WATCH_LEASE_SECONDS="2")
    # Beat's reconciler re-dispatches the task once the dead worker's lease expires.
    start_celery_beat(RECONCILE_EVERY_SECONDS="1")
    wait_for(lambda: settled(task), timeout=60, what="another worker to finish the watch")
    assert task.state == "TASK_STATE_COMPLETED"
    assert_converged(task)
    assert remote_total(demo) == before + 1
    assert RemoteTask.objects.filter(agent=demo).count() == 1
    assert_log_is_gapless(task)


def test_a_stopping_worker_hands_its_streams_over_at_once(
    agent, start_celery_worker, start_celery_beat
):
    """A warm shutdown (SIGTERM) gives the leases back: no waiting for them to expire."""
    first = start_celery_worker(WATCH_LEASE_SECONDS="600")
    demo = add_agent(agent.base_url, name="demo")
    task = task_services.start_task(demo, "slow 40 0.15", mode="stream")
    wait_for(
        lambda: TaskEvent.objects.filter(task=task, kind="artifactUpdate").count() >= 3,
        what="chunks",
    )
    first.stop()
    task.refresh_from_db()
    assert (task.lease_token, task.lease_expires_at) == ("", None)
    assert task.watcher_note.startswith("worker stopped")
    start_celery_worker(WATCH_LEASE_SECONDS="600")
    start_celery_beat(RECONCILE_EVERY_SECONDS="1")
    wait_for(lambda: settled(task), timeout=40, what="the new worker to finish the watch")
    assert task.state == "TASK_STATE_COMPLETED"
    assert_converged(task)
