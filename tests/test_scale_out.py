"""Acceptance of the spread-out deployment (issue 14), in one run of real processes.

Two web parts, three workers and two beats, each a ``manage.py up --only ROLE`` with a data
folder of its own, share one PostgreSQL (a scratch database this test creates and drops, on the
server of the PostgreSQL pass) and one Redis (a database number of its own, and its own
``CELERY_QUEUE``). A real a2a-sdk agent streams long tasks. The test checks:

- the seven parts start together (the two web parts migrate and make the login one at a time);
- tasks started through both web parts are streamed to a websocket client on web A *and* one on
  web B, every seq in order, relayed live through the channel layer;
- after SIGKILL of the worker holding the most streams and of one beat, every stream it held is
  held again by a surviving worker (lease owner changes, new events recorded), the agent created
  exactly one task per start, and the reconcile tick ran at most once per period
  (``dashboard_reconcile_ticks_total``: counted only by whoever claimed the period);
- ``/metrics`` refuses a request without the token, and its gauges and counters move.

PostgreSQL only (``postgres_only``): it runs in the PostgreSQL pass of ``./dash test``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import psutil
import pytest
import redis
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tasks_app.a2a.client import A2AClient
from tasks_app.runtime.net import free_port
from tasks_app.runtime.supervisor import Child, Supervisor
from tests.agents import AgentHandle, start_agent
from tests.infra import REPO_ROOT, _claim_database, claim_owner
from tests.test_metrics import sample
from tests.test_up_command import log_in

# It starts everything itself: up (daphne, Celery workers and beats) and the demo agent.
pytestmark = [
    pytest.mark.postgres_only,
    pytest.mark.server,
    pytest.mark.worker,
    pytest.mark.agent,
    pytest.mark.slow,
    pytest.mark.timeout(300),
]

LEASE_SECONDS = 2.0
RECONCILE_SECONDS = 1.0
TASKS = 6
SCRIPT = "slow 100 0.2"  # a status update and an artifact chunk every 0.2 s, about 20 s in all
METRICS_TOKEN = "scale-out-metrics-token"
DEFAULT_SERVER = "postgres://postgres@127.0.0.1:5432/test"  # ./dash test's default


def until(predicate: Callable[[], Any], timeout: float, what: str, logs: Callable[[], str]) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with the parts' logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n{logs()}", pytrace=False)


# -- the data stores: a scratch database and a Redis database number of our own --------------


def _postgres_server() -> str:
    """The PostgreSQL pass's server (``DATABASE_URL``), else the one ``./dash test`` uses."""
    url = os.environ.get("DATABASE_URL", "").strip()
    if urlsplit(url).scheme not in ("postgres", "postgresql"):
        url = os.environ.get("DASH_TEST_POSTGRES_URL", "").strip() or DEFAULT_SERVER
    return url


@pytest.fixture
def scratch_database() -> Iterator[str]:
    """A fresh database on the pass's server (never the suite's own), dropped afterwards."""
    # psycopg is imported where used: every pass collects this module, and the import (its
    # adapters) cost each fast-tier process about 0.3 s of CPU.
    import psycopg

    server = urlsplit(_postgres_server())
    name = f"dash_scaleout_{uuid.uuid4().hex[:10]}"
    maintenance = urlunsplit(server._replace(path="/postgres"))
    with psycopg.connect(maintenance, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlunsplit(server._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(maintenance, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def own_redis(redis_url: str) -> Iterator[str]:
    """A Redis database number for this test alone (the channel layer's groups are named by
    task pk, which a scratch database numbers from 1 like every other)."""
    url, release = _claim_database(redis_url, claim_owner("scale-out"))
    try:
        yield url
    finally:
        if url != redis_url:  # only a number we claimed is ours to empty
            with contextlib.suppress(redis.RedisError):
                redis.Redis.from_url(url).flushdb()
        release()


# -- the parts ------------------------------------------------------------------------------------


class Part:
    """One ``manage.py up --only ROLE`` process, its log and (for web) its address."""

    def __init__(
        self, name: str, role: str, child: Child, data_dir: Path, port: int | None
    ) -> None:
        self.name = name
        self.role = role
        self.child = child
        self.data_dir = data_dir
        self.url = f"http://127.0.0.1:{port}" if port else ""

    def log(self) -> str:
        return self.child.log_tail(400)

    def ready(self) -> bool:
        said = "Dashboard running at" if self.role == "web" else f"Running {self.role} (Ctrl-C"
        return said in self.log()

    def started_pids(self) -> list[int]:
        """The Celery or daphne processes ``up`` started (children in their own sessions)."""
        return [p.pid for p in psutil.Process(self.child.pid).children(recursive=True)]

    def crash(self) -> None:
        """SIGKILL the part's processes, as a machine dying would: no warm shutdown. Its Celery
        process goes first, since ``up`` dying would make the kernel send it SIGTERM."""
        for pid in self.started_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.child.kill()


class Cluster:
    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp = tmp
        self.env = env
        self.supervisor = Supervisor(output=None)
        self.parts: dict[str, Part] = {}

    def start(self, name: str, role: str) -> Part:
        port = free_port() if role == "web" else None
        data_dir = self.tmp / name
        argv = [sys.executable, "manage.py", "up", "--only", role]
        argv += ["--port", str(port)] if port else []
        child = self.supervisor.start(
            name,
            argv,
            env={**self.env, "DATA_DIR": str(data_dir)},
            cwd=REPO_ROOT,
            log_path=self.tmp / f"{name}.log",
        )
        self.parts[name] = part = Part(name, role, child, data_dir, port)
        return part

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{p.log()[-3000:]}" for p in self.parts.values())


class Browser:
    """A websocket client on one web part following one task, as the task page does (without
    its idle re-sync, so every event after the first ``synced`` came as a live relay)."""

    def __init__(self, base_url: str, session: str, task_pk: int) -> None:
        self.seqs: list[int] = []
        self.live_from: int | None = None
        self.socket = ws_connect(
            base_url.replace("http://", "ws://") + f"/ws/tasks/{task_pk}/?after=0",
            origin=base_url,  # type: ignore[arg-type]
            additional_headers={"Cookie": f"sessionid={session}"},
            open_timeout=15,
        )
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with contextlib.suppress(ConnectionClosed):
            for raw in self.socket:
                message = json.loads(raw)
                if message.get("type") == "event":
                    self.seqs.append(int(message["seq"]))
                elif message.get("type") == "synced" and self.live_from is None:
                    self.live_from = int(message["last_seq"])

    def live(self) -> list[int]:
        return [s for s in self.seqs if self.live_from is not None and s > self.live_from]

    def close(self) -> None:
        self.socket.close()
        self.thread.join(5)


def form_post(client: httpx.Client, path: str, data: dict[str, str]) -> httpx.Response:
    """GET the form (for its CSRF token), then POST it, as a browser does."""
    page = client.get(path)
    assert page.status_code == 200, page.text[:500]
    token = client.cookies.get("csrftoken")
    assert token, "no CSRF cookie"
    return client.post(
        path,
        data={**data, "csrfmiddlewaretoken": token},
        headers={"Referer": f"{client.base_url}{path.lstrip('/')}"},
    )


def remote_task_count(agent: AgentHandle) -> int:
    """How many tasks the agent holds: every SendMessage that created one (ListTasks)."""

    async def run() -> int:
        async with httpx.AsyncClient() as http:
            client = await A2AClient.connect(agent.base_url, http=http)
            return int((await client.list_tasks(page_size=1)).get("totalSize", 0))

    return asyncio.run(run())


def test_two_web_three_workers_two_beats_survive_a_worker_and_a_beat_killed(
    tmp_path: Path, scratch_database: str, own_redis: str
) -> None:
    import psycopg

    started = time.monotonic()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DASHBOARD_TEST_DB_FILE", "CELERY_BROKER_URL", "DASHBOARD_PRODUCTION"}
    }
    env.update(
        DJANGO_SETTINGS_MODULE="dashboard.settings",
        DATABASE_URL=scratch_database,
        REDIS_URL=own_redis,
        CELERY_QUEUE=f"scale-out-{uuid.uuid4().hex[:8]}",
        SECRET_KEY=f"scale-out-{uuid.uuid4().hex}{uuid.uuid4().hex}",  # one for every part
        METRICS_TOKEN=METRICS_TOKEN,
        WATCH_LEASE_SECONDS=str(LEASE_SECONDS),
        RECONCILE_EVERY_SECONDS=str(RECONCILE_SECONDS),
        PYTHONUNBUFFERED="1",
    )
    cluster = Cluster(tmp_path, env)
    agent = start_agent(delay=0.2)
    db = psycopg.connect(scratch_database, autocommit=True)
    browsers: list[tuple[str, int, Browser]] = []
    try:
        # All seven at once, as a fresh deployment's process manager starts them.
        web_a, web_b = cluster.start("web-a", "web"), cluster.start("web-b", "web")
        workers = [cluster.start(f"worker-{i}", "worker") for i in (1, 2, 3)]
        beats = [cluster.start(f"beat-{i}", "beat") for i in (1, 2)]

        def all_ready() -> bool:
            dead = [p.name for p in cluster.parts.values() if not p.child.alive()]
            if dead:
                pytest.fail(f"{', '.join(dead)} exited while starting\n{cluster.logs()}")
            return all(p.ready() for p in cluster.parts.values())

        until(all_ready, 150, "every part to start", cluster.logs)
        startup = time.monotonic() - started
        # One web part made the login, the other found it: they took turns.
        passwords = [
            (p.data_dir / "admin_password").read_text().strip()
            for p in (web_a, web_b)
            if (p.data_dir / "admin_password").exists()
        ]
        assert len(passwords) == 1, cluster.logs()

        # /metrics: refused without the token, on both web parts.
        for web in (web_a, web_b):
            assert httpx.get(f"{web.url}/metrics", timeout=10).status_code == 403

        def scrape() -> str:
            answer = httpx.get(
                f"{web_b.url}/metrics",
                headers={"Authorization": f"Bearer {METRICS_TOKEN}"},
                timeout=10,
            )
            assert answer.status_code == 200
            return answer.text

        # Two people, one on each web part, log in through the login form.
        person_a = httpx.Client(base_url=web_a.url, timeout=30)
        person_b = httpx.Client(base_url=web_b.url, timeout=30)
        log_in(person_a, "admin", passwords[0])
        log_in(person_b, "admin", passwords[0])
        added = form_post(
            person_a, "/agents/add/", {"url": agent.base_url, "name": "streamer", "action": "save"}
        )
        assert added.status_code == 302, added.text[:2000]
        agent_pk = added.headers["Location"].rstrip("/").rsplit("/", 1)[-1]

        task_pks: list[int] = []
        for i in range(TASKS):
            person = (person_a, person_b)[i % 2]
            answer = form_post(
                person, "/tasks/new", {"agent": agent_pk, "text": SCRIPT, "mode": "stream"}
            )
            assert answer.status_code == 302, answer.text[:2000]
            pk = int(answer.headers["Location"].rstrip("/").rsplit("/", 1)[-1])
            task_pks.append(pk)
            for web, person_session in ((web_a, person_a), (web_b, person_b)):
                session = person_session.cookies.get("sessionid")
                assert session
                browsers.append((web.name, pk, Browser(web.url, session, pk)))

        def leases() -> dict[int, str]:
            """Task pk -> the worker holding its live lease ("" when nobody does)."""
            rows = db.execute(
                "SELECT id, CASE WHEN lease_token <> '' AND lease_expires_at > now()"
                " THEN lease_owner ELSE '' END FROM tasks_app_remotetask"
            ).fetchall()
            return {pk: owner for pk, owner in rows}

        def events_after(pk: int, moment: Any) -> int:
            row = db.execute(
                "SELECT count(*) FROM tasks_app_taskevent WHERE task_id = %s AND received_at > %s",
                [pk, moment],
            ).fetchone()
            return int(row[0]) if row else 0

        # Every stream is held, and both web parts relay events live.
        until(
            lambda: all(leases().get(pk) for pk in task_pks),
            30,
            "every task's stream to be held",
            cluster.logs,
        )
        until(
            lambda: all(len(b.live()) >= 3 for _, _, b in browsers),
            30,
            "live events on both web parts",
            cluster.logs,
        )
        before_kill = scrape()
        held = {pk: owner for pk, owner in leases().items() if pk in task_pks}
        held_by: dict[str, int] = {}
        for owner in held.values():
            held_by[owner] = held_by.get(owner, 0) + 1
        assert sum(
            sample(before_kill, "dashboard_held_tasks", f'worker="{o}"') for o in held_by
        ) >= (
            TASKS - 1  # a renewal may lapse between the two reads on a busy machine
        )

        # The victim: the worker holding the most streams (its Celery process's pid is in the
        # lease owner, "host:pid").
        victim_owner = max(held_by, key=lambda owner: held_by[owner])
        victim_pid = int(victim_owner.rsplit(":", 1)[1])
        victim = next(w for w in workers if victim_pid in w.started_pids())
        survivors = [w for w in workers if w is not victim]
        orphans = [pk for pk, owner in held.items() if owner == victim_owner]
        ticks_before = sample(before_kill, "dashboard_reconcile_ticks_total")
        takeovers_before = sample(before_kill, "dashboard_lease_takeovers_total")
        window_start = time.monotonic()
        victim.crash()
        beats[0].crash()

        # Every orphaned stream is held again by a surviving worker, which records new events.
        survivor_pids = {pid for w in survivors for pid in w.started_pids()}

        def held_again() -> bool:
            owners = leases()
            return all(
                owners.get(pk) and int(owners[pk].rsplit(":", 1)[1]) in survivor_pids
                for pk in orphans
            )

        until(held_again, 30, "the surviving workers to take the streams over", cluster.logs)
        recovered_after = time.monotonic() - window_start
        taken_at = db.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
        seq_at_takeover = dict(
            db.execute(
                "SELECT id, last_seq FROM tasks_app_remotetask WHERE id = ANY(%s)", [orphans]
            ).fetchall()
        )
        until(
            lambda: all(events_after(pk, taken_at) >= 2 for pk in orphans),
            20,
            "new events from the new holders",
            cluster.logs,
        )

        # Everything completes, with a gapless log, the same on both web parts' sockets. Settled
        # too: the settle's row comes after the completion, and a log still growing would be
        # compared with sockets that have not heard its last row yet.
        def all_completed() -> bool:
            rows = db.execute(
                "SELECT count(*) FROM tasks_app_remotetask"
                " WHERE state = 'TASK_STATE_COMPLETED' AND settled_at IS NOT NULL"
                " AND id = ANY(%s)",
                [task_pks],
            ).fetchone()
            return bool(rows and rows[0] == TASKS)

        until(all_completed, 90, "every task to complete and settle", cluster.logs)

        def log_and_last_seq(pk: int) -> tuple[list[int], int, list[Any]]:
            """The task's log and its ``last_seq`` from one statement, so one snapshot: a row
            recorded between two separate reads would look like a gap or an extra row."""
            row = db.execute(
                "SELECT t.last_seq, array_agg(e.seq ORDER BY e.seq),"
                " (array_agg(e.seq || ' ' || e.channel || ' ' || e.kind || ' ' || e.state_after"
                "  || ' ' || left(e.note, 80) ORDER BY e.seq DESC))[1:4]"
                " FROM tasks_app_remotetask t JOIN tasks_app_taskevent e ON e.task_id = t.id"
                " WHERE t.id = %s GROUP BY t.last_seq",
                [pk],
            ).fetchone()
            assert row is not None, pk
            return list(row[1]), int(row[0]), list(row[2])

        for pk in task_pks:
            seqs, last, tail = log_and_last_seq(pk)
            assert seqs == list(range(1, last + 1)), (pk, last, tail)

        def sockets_caught_up() -> bool:
            return all(b.seqs and b.seqs[-1] == log_and_last_seq(pk)[1] for _, pk, b in browsers)

        until(
            sockets_caught_up, 20, "both web parts' sockets to reach each task's last event",
            cluster.logs,
        )  # fmt: skip
        last_seq = {pk: log_and_last_seq(pk)[1] for pk in task_pks}
        for web_name, pk, browser in browsers:
            assert browser.seqs == list(range(1, last_seq[pk] + 1)), (web_name, pk)
            if pk in orphans:  # what the new holder recorded reached this web part live
                assert browser.live_from is not None
                assert browser.live_from < seq_at_takeover[pk] < last_seq[pk], (web_name, pk)

        # No duplicate remote task: one per start, each mirrored once.
        assert remote_task_count(agent) == TASKS
        remote_ids = [
            r[0] for r in db.execute("SELECT remote_id FROM tasks_app_remotetask").fetchall()
        ]
        assert len(remote_ids) == TASKS and len(set(remote_ids)) == TASKS and all(remote_ids)

        # No double dispatch: at most one reconcile tick per claimed period, whatever the
        # beats (one left) and worker timers (two left) asked for; and ticks did happen.
        time.sleep(1.5)  # let the workers' last counts reach Redis (flushed each second)
        after = scrape()
        window = time.monotonic() - window_start
        ticks = sample(after, "dashboard_reconcile_ticks_total") - ticks_before
        # Claims last 0.9 periods; the second before the first scrape may be counted in it too.
        most = (window + 1.0) / (0.9 * RECONCILE_SECONDS) + 1
        assert window / (3 * RECONCILE_SECONDS) <= ticks <= most, (ticks, window)
        assert sample(after, "dashboard_lease_takeovers_total") - takeovers_before >= len(orphans)
        assert sample(after, "dashboard_events_recorded_total", 'channel="stream"') > sample(
            before_kill, "dashboard_events_recorded_total", 'channel="stream"'
        )
        assert sample(after, "dashboard_held_tasks", f'worker="{victim_owner}"') == 0
        assert sample(after, "dashboard_tasks", 'state="TASK_STATE_COMPLETED"') == TASKS
        assert all(p.child.alive() for p in (web_a, web_b, *survivors, beats[1]))
        sys.stderr.write(
            f"scale-out: {startup:.1f} s to start 7 parts, {len(orphans)} streams held again "
            f"{recovered_after:.1f} s after the kill, {ticks:.0f} reconcile ticks in "
            f"{window:.1f} s, {time.monotonic() - started:.1f} s in all\n"
        )
    finally:
        for _, _, browser in browsers:
            browser.close()
        cluster.supervisor.stop_all(10)
        agent.stop()
        db.close()
