"""What one ListTasks page can hold, and what it must not stop: a bad task, a task that
vanishes meanwhile, a huge token, a falsy token, a task larger than one event; and two
claims of one agent's imports, one of them paused between its look and its write.

The agent is a raw JSON-RPC server on 127.0.0.1 answering its n-th ListTasks with
``page(n)`` (``tests/test_imports.ListingAgent``, its answer replaced).
"""

from __future__ import annotations

import gc
import threading
import tracemalloc
from collections.abc import Callable, Iterator

import pytest
from django.db import close_old_connections
from django.test import override_settings

from tasks_app.models import Agent, ImportJob, OperatorAction, RemoteTask
from tasks_app.services import imports
from tests.test_imports import ListingAgent

pytestmark = pytest.mark.django_db(transaction=True)

DONE = {"state": "TASK_STATE_COMPLETED"}


class PageAgent(ListingAgent):
    def __init__(self, page: Callable[[int], dict]) -> None:
        super().__init__(lambda n: "")
        self.page = page

    def answer(self, body: dict) -> dict:
        if body.get("method") != "ListTasks":
            return super().answer(body)
        with self._lock:
            self.list_requests += 1
            n = self.list_requests
        return {"jsonrpc": "2.0", "id": body.get("id"), "result": self.page(n)}


@pytest.fixture
def run(monkeypatch) -> Iterator[Callable[..., tuple[ImportJob, Agent]]]:
    monkeypatch.setattr(imports, "dispatch", lambda pk: None)  # no worker here
    started: list[PageAgent] = []

    def go(page: Callable[[int], dict], **kwargs) -> tuple[ImportJob, Agent]:
        server = PageAgent(page).start()
        started.append(server)
        agent = server.register(f"pages-{len(started)}")
        job = imports.run_job(imports.create_job(agent).pk, **kwargs)
        return job, agent

    yield go
    for server in started:
        server.stop()


def dropped(agent: Agent) -> dict:
    return OperatorAction.objects.get(agent=agent, action="import").payload["dropped"]


def test_a_task_the_agent_got_wrong_is_dropped_not_the_page(run):
    """One invalid task failed the whole page, and every page after it; even one beyond the
    page size, which the import would not have taken anyway."""
    tasks = [
        {"id": "good-1", "status": DONE},
        {"id": "bad", "status": {"state": "TASK_STATE_BOGUS"}},
        {"id": "good-2", "status": DONE},
        {"id": "beyond", "status": {"state": "WORKING"}},  # past page_size: cut first
    ]
    job, agent = run(
        lambda n: {"tasks": tasks if n == 1 else [{"id": "p2", "status": DONE}],
                   "nextPageToken": "two" if n == 1 else ""},
        page_size=3,
    )  # fmt: skip
    # Failed only for the page-size note (the agent ignored pageSize), every page walked.
    assert job.status == "failed" and job.error.startswith("The agent ignored pageSize")
    assert "protocol error" not in job.error and job.pages == 2
    names = set(RemoteTask.objects.filter(agent=agent).values_list("remote_id", flat=True))
    assert names == {"good-1", "good-2", "p2"}
    assert dropped(agent) == {"invalid-task": 1, "over-page-size": 1}


def test_a_task_deleted_while_its_page_is_recorded_is_skipped(run, monkeypatch):
    """Retention deleting a listed task between its row and its record() ended the whole
    import on an internal error."""
    real = imports.record

    def pruned_first(task, *args, **kwargs):
        if task.remote_id == "old":
            RemoteTask.objects.filter(pk=task.pk).delete()
        return real(task, *args, **kwargs)

    monkeypatch.setattr(imports, "record", pruned_first)
    listing = [{"id": "old", "status": DONE}, {"id": "new", "status": DONE}]
    job, agent = run(lambda n: {"tasks": listing, "nextPageToken": ""})
    assert job.status == "done", job.error
    assert list(RemoteTask.objects.filter(agent=agent).values_list("remote_id", flat=True)) == [
        "new"
    ]
    assert dropped(agent) == {"vanished": 1}


@pytest.mark.parametrize("token", [0, False, {}, []])
def test_a_falsy_token_that_is_not_a_string_is_not_the_end(run, token):
    job, _ = run(lambda n: {"tasks": [{"id": f"t-{n}", "status": DONE}], "nextPageToken": token})
    assert job.status == "failed" and "nextPageToken that is not a string" in job.error


def test_a_listed_task_larger_than_one_event_is_dropped(run, settings):
    settings.WATCH_MAX_EVENT_BYTES = 50_000
    listing = [
        {"id": "huge", "status": DONE, "metadata": {"blob": "m" * 60_000}},
        {"id": "small", "status": DONE},
    ]
    job, agent = run(lambda n: {"tasks": listing, "nextPageToken": ""})
    assert job.status == "done", job.error
    assert set(RemoteTask.objects.filter(agent=agent).values_list("remote_id", flat=True)) == {
        "small"
    }
    assert dropped(agent) == {"too-large": 1}


def test_page_tokens_are_not_kept_whole(run):
    """Each token was kept as it came, for the whole walk: 200 pages of tokens as large as a
    reply (32 MiB) could hold gigabytes."""
    grew: list[int] = []

    def held_now(job: ImportJob) -> None:
        # Garbage first: replies of earlier pages that only wait for the collector (whose
        # pace the shared loop's tuning slows, when an earlier test started it) are not kept.
        gc.collect()
        grew.append(tracemalloc.get_traced_memory()[0])

    # What exists before the walk is set aside from the collector (not freed, not scanned):
    # each collection then looks only at what the walk made, not the whole suite's objects.
    gc.collect()
    gc.freeze()
    tracemalloc.start()
    try:
        with override_settings(IMPORT_MAX_PAGES=10):
            run(lambda n: {"tasks": [], "nextPageToken": f"{n}-" + "x" * 2**20}, progress=held_now)
    finally:
        tracemalloc.stop()
        gc.unfreeze()
    assert len(grew) == 10
    assert grew[-1] - grew[1] < 4 * 2**20, f"{(grew[-1] - grew[1]) / 2**20:.0f} MiB kept"


def test_two_claims_never_both_run_even_when_one_pauses_inside_its_claim(monkeypatch):
    """A claim wrote its clock's time and stepped back only for an earlier one: a claimer
    paused between reading its clock and writing (or one whose clock was behind) wrote the
    earlier time after the other had looked, and both imports ran."""
    agent = Agent.objects.create(name="twice", base_url="http://127.0.0.1:9/twice")
    job = ImportJob.objects.create(agent=agent)  # one job, its message delivered twice
    first = second = job
    paused, go_on = threading.Event(), threading.Event()
    real_now = imports.timezone.now

    class Clock:
        @staticmethod
        def now():
            moment = real_now()
            if threading.current_thread().name == "B" and not paused.is_set():
                paused.set()
                go_on.wait(10)  # B has read its clock; A claims meanwhile
            return moment

    monkeypatch.setattr(imports, "timezone", Clock)
    claims: dict[str, bool] = {}

    def claim(name: str, pk: int) -> None:
        try:
            claims[name] = imports.claim(pk)
        finally:
            close_old_connections()

    b = threading.Thread(target=claim, args=("B", second.pk), name="B")
    b.start()
    assert paused.wait(10)
    a = threading.Thread(target=claim, args=("A", first.pk), name="A")
    a.start()
    a.join(10)
    go_on.set()
    b.join(10)
    assert sorted(claims.values()) == [False, True], claims
    assert ImportJob.objects.filter(agent=agent, status="running").count() == 1
