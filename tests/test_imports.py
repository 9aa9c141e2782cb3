"""Import as a bounded background job, against agents that misbehave on ListTasks.

The misbehaving agent is a raw JSON-RPC server on 127.0.0.1 (no SDK: the SDK
would not repeat a page token) that counts the ListTasks requests it gets, so
every bound is asserted as a number of requests.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings
from django.utils import timezone

from tasks_app.models import Agent, ImportJob, OperatorAction, RemoteTask
from tasks_app.services import imports
from tasks_app.services.tasks import TaskActionError
from tests.people import member
from tests.serving import serve_in_thread, stop_serving

pytestmark = pytest.mark.django_db(transaction=True)

REPEATED = "same-token"
HOLD_LIMIT = 60.0  # a held answer is released at the latest after this (never hang a test)


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class ListingAgent:
    """A JSON-RPC agent whose ListTasks gives ``next_token(n)`` on its n-th answer.

    ``gate`` holds every ListTasks answer while it is clear (set it to let them go).
    With ``listed``, the n-th answer lists ``listed(n)`` distinct completed tasks
    whatever pageSize asked (else the one task ``listed-1``); ``delay`` seconds
    pass before each answer.
    """

    def __init__(
        self,
        next_token: Callable[[int], str],
        listed: Callable[[int], int] | None = None,
        delay: float = 0.0,
    ) -> None:
        self.next_token = next_token
        self.listed = listed
        self.delay = delay
        self.list_requests = 0
        self.tokens_received: list[str | None] = []
        self.page_sizes_received: list[int | None] = []
        self.gate = threading.Event()
        self.gate.set()
        self._lock = threading.Lock()
        agent = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep test output quiet
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                self.send_json(agent.answer(body))

            def send_json(self, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]

    def answer(self, body: dict) -> dict:
        if body.get("method") != "ListTasks":
            return {
                "jsonrpc": "2.0",
                "id": body.get("id"),
                "error": {"code": -32601, "message": "no"},
            }
        with self._lock:
            self.list_requests += 1
            n = self.list_requests
            self.tokens_received.append((body.get("params") or {}).get("pageToken"))
            self.page_sizes_received.append((body.get("params") or {}).get("pageSize"))
        self.gate.wait(HOLD_LIMIT)
        time.sleep(self.delay)
        if self.listed is not None:
            tasks = [
                {"id": f"listed-{n}-{i}", "status": {"state": "TASK_STATE_COMPLETED"}}
                for i in range(self.listed(n))
            ]
            result = {"tasks": tasks, "nextPageToken": self.next_token(n)}
            return {"jsonrpc": "2.0", "id": body.get("id"), "result": result}
        task = {
            "id": "listed-1",
            "contextId": "ctx-1",
            "status": {"state": "TASK_STATE_COMPLETED"},
            "history": [
                {"role": "ROLE_USER", "messageId": "m-1", "parts": [{"text": "hello there"}]}
            ],
        }
        result = {
            "tasks": [task],
            "nextPageToken": self.next_token(n),
            "pageSize": 1,
            "totalSize": 1,
        }
        return {"jsonrpc": "2.0", "id": body.get("id"), "result": result}

    def start(self) -> ListingAgent:
        serve_in_thread(self.server)
        return self

    def stop(self) -> None:
        self.gate.set()
        stop_serving(self.server)

    def register(self, name: str) -> Agent:
        url = f"http://127.0.0.1:{self.port}"
        return Agent.objects.create(
            name=name, base_url=url, interface_url=f"{url}/jsonrpc", binding="JSONRPC",
            protocol_version="1.0", streaming=False,
        )  # fmt: skip


@pytest.fixture
def listing_agent() -> Iterator[Callable[..., ListingAgent]]:
    started: list[ListingAgent] = []

    def make(next_token: Callable[[int], str], **behaviour: Any) -> ListingAgent:
        server = ListingAgent(next_token, **behaviour).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def operator(client, django_user_model):
    user = member(django_user_model.objects.create_user(username="op", password="pw-12345678"))
    client.force_login(user)
    return client


def test_web_import_returns_at_once_and_the_worker_stops_on_a_repeated_token(
    listing_agent, operator, celery_worker
):
    server = listing_agent(lambda n: REPEATED)
    agent = server.register("looper")
    server.gate.clear()  # the agent holds its first answer: the job cannot end before we say so

    response = operator.post(f"/agents/{agent.pk}/import/")

    # The request has answered while the agent has not answered a single page.
    assert response.status_code == 302 and response["Location"] == f"/agents/{agent.pk}/"
    job = ImportJob.objects.get(agent=agent)
    assert job.status in ("queued", "running") and job.pages == 0
    wait_for(lambda: server.list_requests == 1, what="the worker's first ListTasks")
    job.refresh_from_db()
    assert job.status == "running" and job.finished_at is None
    page = operator.get(f"/agents/{agent.pk}/")
    assert b'id="import-job"' in page.content and b'data-active="1"' in page.content
    assert b"running" in page.content and b"Stop this import" in page.content
    # A second import of the same agent is refused while this one runs.
    operator.post(f"/agents/{agent.pk}/import/")
    assert ImportJob.objects.filter(agent=agent).count() == 1

    server.gate.set()
    wait_for(lambda: ImportJob.objects.get(pk=job.pk).status == "failed", what="the job to fail")
    job.refresh_from_db()
    # Page 1 gave the token, page 2 (asked with it) gave it again: two requests, then stop.
    assert server.list_requests == 2
    assert server.tokens_received == [None, REPEATED]
    assert job.pages == 2 and job.seen == 2 and job.created == 1
    assert "repeated nextPageToken 'same-token'" in job.error
    assert "given on page 1, again on page 2" in job.error
    assert job.finished_at is not None
    assert RemoteTask.objects.filter(agent=agent, remote_id="listed-1").count() == 1
    task = RemoteTask.objects.get(agent=agent, remote_id="listed-1")
    assert task.state == "TASK_STATE_COMPLETED" and task.title == "hello there"
    assert OperatorAction.objects.filter(agent=agent, action="import").count() == 1

    page = operator.get(f"/agents/{agent.pk}/")
    assert b'data-active="0"' in page.content and b"failed" in page.content
    assert b"repeated nextPageToken" in page.content
    fragment = operator.get(f"/agents/{agent.pk}/import/status/")
    assert fragment.status_code == 200 and b"2</span> pages" in fragment.content
    assert server.list_requests == 2  # nothing kept asking after the job ended


def test_page_cap_stops_ever_new_tokens(listing_agent):
    server = listing_agent(lambda n: f"token-{n}")
    agent = server.register("endless")
    out = io.StringIO()
    with override_settings(IMPORT_MAX_PAGES=5), pytest.raises(CommandError) as failure:
        call_command("tasks", "import", agent.name, stdout=out)
    assert server.list_requests == 5
    assert "page cap (5 pages, IMPORT_MAX_PAGES)" in str(failure.value)
    lines = out.getvalue().splitlines()
    assert lines[:5] == [f"page {n}: {n} listed, 1 new, 1 changed" for n in range(1, 6)]
    assert lines[-1] == "failed: 5 pages, seen 5, new 1, changed 1"
    assert ImportJob.objects.get(agent=agent).status == "failed"


def test_command_json_reports_the_repeated_token(listing_agent):
    server = listing_agent(lambda n: REPEATED)
    agent = server.register("looper-cli")
    out = io.StringIO()
    with pytest.raises(CommandError, match="repeated nextPageToken"):
        call_command("tasks", "import", str(agent.pk), "--json", stdout=out)
    document = json.loads(out.getvalue())
    assert document["status"] == "failed" and document["active"] is False
    assert document["pages"] == 2 and "repeated nextPageToken" in document["error"]
    assert server.list_requests == 2


def test_deadline_bounds_an_agent_that_never_answers(listing_agent):
    server = listing_agent(lambda n: "")
    server.gate.clear()  # never answers within the deadline
    agent = server.register("silent")
    with override_settings(IMPORT_DEADLINE_SECONDS=1), pytest.raises(TaskActionError) as failure:
        imports.import_tasks(agent)
    assert "deadline (1 s, IMPORT_DEADLINE_SECONDS)" in str(failure.value)
    assert server.list_requests == 1
    job = ImportJob.objects.get(agent=agent)
    assert job.status == "failed" and job.pages == 0


def test_one_queued_or_running_import_per_agent(listing_agent):
    from django.db import IntegrityError, transaction

    agent = listing_agent(lambda n: "").register("single")
    first = imports.create_job(agent)
    with pytest.raises(IntegrityError), transaction.atomic():
        ImportJob.objects.create(agent=agent)  # as if a request raced past create_job's look
    with pytest.raises(TaskActionError, match="already queued"):
        imports.create_job(agent)
    assert imports.claim(first.pk) is True
    assert imports.claim(first.pk) is False  # a redelivered message does nothing
    with pytest.raises(TaskActionError, match="already running"):
        imports.create_job(agent)
    assert imports.cancel_job(first) is True
    assert imports.cancel_job(first) is False
    assert imports.create_job(agent).status == "queued"


def test_a_job_whose_worker_died_does_not_block_the_next(listing_agent):
    server = listing_agent(lambda n: "")
    agent = server.register("orphan")
    long_ago = timezone.now() - timedelta(hours=2)
    dead = ImportJob.objects.create(
        agent=agent, status="running", started_at=long_ago, created_at=long_ago
    )
    job = imports.import_tasks(agent)
    assert job.status == "done" and job.pages == 1 and job.seen == 1
    dead.refresh_from_db()
    assert dead.status == "failed" and "stopped before it ended" in dead.error


def test_cli_import_walks_a_healthy_agent_page_by_page(agent):
    from tasks_app.a2a import user_message
    from tasks_app.outbound import client_for, run
    from tasks_app.services.agents import add_agent

    demo = add_agent(agent.base_url, name="demo-import")
    for _ in range(3):
        run(lambda http: client_for(demo, http).send_message(user_message("quick")))
    out = io.StringIO()
    call_command("tasks", "import", "demo-import", "--page-size", "2", stdout=out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("page 1: 2 listed") and lines[1].startswith("page 2:")
    job = ImportJob.objects.get(agent=demo)
    assert job.status == "done" and job.pages >= 2 and job.seen >= 3 and job.error == ""
    assert (
        lines[-1]
        == f"done: {job.pages} pages, seen {job.seen}, new {job.created}, changed {job.changed}"
    )
    assert RemoteTask.objects.filter(agent=demo, mode="imported").count() >= 3


def import_audit(agent: Agent) -> dict:
    return OperatorAction.objects.get(agent=agent, action="import").payload


def test_a_page_larger_than_asked_is_cut_to_the_page_size(listing_agent):
    # The agent ignores pageSize: 60 tasks on each of two pages where 10 were asked for.
    server = listing_agent(lambda n: "next" if n == 1 else "", listed=lambda n: 60)
    agent = server.register("oversized")
    with pytest.raises(TaskActionError) as failure:
        imports.import_tasks(agent, page_size=10)
    error = str(failure.value)
    assert (
        "The agent ignored pageSize" in error and "10 tasks asked for on 2 page(s) (1, 2)" in error
    )
    assert "the 100 tasks beyond that were not imported" in error
    assert server.list_requests == 2 and server.page_sizes_received == [10, 10]
    job = ImportJob.objects.get(agent=agent)
    assert job.status == "failed" and job.pages == 2 and job.seen == 20
    # The first ten of each page are mirrored, nothing beyond them.
    assert set(RemoteTask.objects.filter(agent=agent).values_list("remote_id", flat=True)) == {
        f"listed-{n}-{i}" for n in (1, 2) for i in range(10)
    }
    assert import_audit(agent)["dropped"] == {"over-page-size": 100}


class OddIdsAgent(ListingAgent):
    """Lists tasks whose ids no column keeps, between tasks that are fine."""

    def answer(self, body: dict) -> dict:
        done = {"state": "TASK_STATE_COMPLETED"}
        tasks = [
            {"id": "i" * 301, "status": done},
            {"id": "fine-1", "status": done},
            {"id": "nul\u0000id", "status": done},
            {"id": "fine-2", "contextId": "c" * 301, "status": done},
            {"id": "fine-3", "contextId": "ctx", "status": done, "history": [
                {"role": "ROLE_USER", "messageId": "m", "parts": [{"text": "a\u0000title"}]}
            ]},
        ]  # fmt: skip
        result = {"tasks": tasks, "nextPageToken": "", "pageSize": 5, "totalSize": 5}
        return {"jsonrpc": "2.0", "id": body.get("id"), "result": result}


def test_listed_tasks_whose_ids_no_column_keeps_are_dropped_and_the_rest_imported() -> None:
    """An id over 300 characters or holding a NUL made PostgreSQL refuse the row, and the
    whole import failed on its internal error; SQLite kept the id as it came."""
    server = OddIdsAgent(lambda n: "").start()
    try:
        agent = server.register("odd ids")
        job = imports.import_tasks(agent, page_size=10)
    finally:
        server.stop()
    assert job.status == "done" and job.seen == 2 and job.created == 2
    rows = {t.remote_id: t for t in RemoteTask.objects.filter(agent=agent)}
    assert set(rows) == {"fine-1", "fine-3"}
    assert rows["fine-3"].title == "a\ufffdtitle" and rows["fine-3"].context_id == "ctx"
    assert import_audit(agent)["dropped"] == {"unusable-id": 3}


def test_a_page_size_asked_is_never_above_the_per_page_cap(listing_agent, monkeypatch):
    monkeypatch.setattr(imports, "MAX_TASKS_PER_PAGE", 5)
    server = listing_agent(lambda n: "", listed=lambda n: 5)  # as many as the cap: well-behaved
    agent = server.register("capped-ask")
    job = imports.import_tasks(agent, page_size=1000)
    assert server.page_sizes_received == [5]
    assert job.status == "done" and job.error == "" and job.seen == 5
    assert import_audit(agent)["dropped"] == {}


@pytest.mark.parametrize(
    ("cap", "requests", "message"),
    [
        (25, 3, "MAX_TASKS_PER_IMPORT): 5 tasks of page 3 were not imported"),
        (20, 2, "MAX_TASKS_PER_IMPORT) while the agent still offered more"),
    ],
)
def test_the_task_cap_stops_an_import(listing_agent, monkeypatch, cap, requests, message):
    monkeypatch.setattr(imports, "MAX_TASKS_PER_IMPORT", cap)
    # Well-behaved pages of 10, forever: only the task cap ends the walk.
    server = listing_agent(lambda n: f"token-{n}", listed=lambda n: 10)
    agent = server.register(f"many-{cap}")
    with pytest.raises(TaskActionError) as failure:
        imports.import_tasks(agent, page_size=10)
    assert f"task cap ({cap} tasks per import, {message}" in str(failure.value)
    assert f"{cap} tasks listed in {requests} pages were imported" in str(failure.value)
    assert server.list_requests == requests
    assert RemoteTask.objects.filter(agent=agent).count() == cap
    job = ImportJob.objects.get(agent=agent)
    assert job.status == "failed" and job.seen == cap
    assert import_audit(agent)["dropped"] == ({"over-task-cap": 5} if cap == 25 else {})


@pytest.mark.slow  # waits for its deadline by design
def test_the_deadline_is_checked_between_the_tasks_of_a_page(listing_agent):
    # The page arrives a second and a half before the deadline; recording 1000 tasks takes
    # longer (about 12 ms each).
    server = listing_agent(lambda n: "", listed=lambda n: 1000, delay=0.5)
    agent = server.register("slow-page")
    with override_settings(IMPORT_DEADLINE_SECONDS=2), pytest.raises(TaskActionError) as failure:
        imports.import_tasks(agent, page_size=1000)
    assert "deadline (2 s, IMPORT_DEADLINE_SECONDS) while recording page 1" in str(failure.value)
    job = ImportJob.objects.get(agent=agent)
    assert job.status == "failed" and job.pages == 1 and 0 < job.seen < 1000
    assert f"{1000 - job.seen} of its tasks were not imported" in job.error
    assert RemoteTask.objects.filter(agent=agent).count() == job.seen
    # Stopped inside the page (0 < seen < 1000 above), not after the whole of it.
    assert import_audit(agent)["dropped"] == {"at-deadline": 1000 - job.seen}


def test_an_import_canceled_in_the_middle_of_a_page_counts_what_it_did(listing_agent, monkeypatch):
    """The page's progress was saved only while the job ran: canceled as its tasks were
    recorded, the job and its audit entry said 0 created although the tasks existed."""
    monkeypatch.setattr(imports, "dispatch", lambda pk: None)
    agent = listing_agent(lambda n: "", listed=lambda n: 5).register("canceled-mid-page")
    job = imports.create_job(agent)
    real = imports._record_page

    def page_then_cancel(running, tasks, deadline=float("inf")):
        taken = real(running, tasks, deadline)
        assert imports.cancel_job(ImportJob.objects.get(pk=running.pk)) is True
        return taken

    monkeypatch.setattr(imports, "_record_page", page_then_cancel)
    imports.run_job(job.pk)
    job.refresh_from_db()
    assert job.status == "canceled"
    assert RemoteTask.objects.filter(agent=agent).count() == 5
    assert (job.pages, job.seen, job.created) == (1, 5, 5)
    assert import_audit(agent)["created"] == 5


def test_of_two_claims_released_together_exactly_one_runs(listing_agent, monkeypatch):
    """Each claimer wrote its claim, then stepped back for any other running: with a pause
    between the two steps, both stepped back and neither import ran. Two claims of one job
    (a redelivered message) released together: one runs."""
    from tests.races import release_together

    agent = listing_agent(lambda n: "").register("claimed-twice")
    real_expire = imports.expire_stale

    def slow_expire(agent_pk):  # both claims are under way before either writes
        time.sleep(0.2)
        return real_expire(agent_pk)

    monkeypatch.setattr(imports, "expire_stale", slow_expire)
    for _ in range(3):
        job = imports.create_job(agent)
        outcomes = release_together(*(lambda pk=job.pk: imports.claim(pk) for _ in range(2)))
        assert sorted(outcomes) == [False, True], outcomes
        assert ImportJob.objects.filter(agent=agent, status="running").count() == 1
        ImportJob.objects.filter(agent=agent).update(status="done")


def test_two_clicks_released_together_queue_one_import(listing_agent):
    """create_job looked for an active job, then created one: two clicks at once queued two
    (two worker messages; the whole walk ran twice, or the second failed)."""
    from tests.races import release_together

    agent = listing_agent(lambda n: "").register("clicked-twice")
    for _ in range(5):
        outcomes = release_together(*(lambda: imports.create_job(agent) for _ in range(2)))
        made = [o for o in outcomes if isinstance(o, ImportJob)]
        refused = [o for o in outcomes if isinstance(o, TaskActionError)]
        assert len(made) == 1 and len(refused) == 1, outcomes
        assert "already queued" in str(refused[0])
        ImportJob.objects.filter(agent=agent).update(status="done")


@pytest.mark.django_db
def test_a_queued_import_whose_job_is_gone_does_nothing_and_raises_nothing(caplog) -> None:
    """The job was deleted before a worker took its message (its agent removed): the worker
    logged a traceback for it. It says the job is gone."""
    from tasks_app import jobs

    assert jobs.run_import.run(987_654) == "gone"
    assert "import job 987654 is gone" in caplog.text
