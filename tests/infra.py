"""Real infrastructure for tests: Redis, Celery workers, celery beat and daphne as processes.

Registered by ``tests/conftest.py`` (``pytest_plugins``). Nothing here is mocked: a worker is
``python -m celery -A dashboard worker`` in a subprocess, exactly as ``manage.py up`` starts it.

Fixtures
--------
``redis_url`` (session) -> str
    The Redis this session uses, verified reachable. The server is ``REDIS_URL`` (default
    ``redis://127.0.0.1:6379/0``); the session claims a free database number 1-15 on it with
    a lock key, so two test runs (or a run and a leftover process) never share a broker queue,
    a remote-control channel or a channel-layer group. An autouse session fixture points the
    settings, the Celery app and the channel layers of the test process at it, and picks a
    unique ``CELERY_QUEUE``, before any test runs.
``start_celery_worker(*, concurrency=8, **env) -> WorkerProcess`` (function-scoped factory)
    Starts a worker subprocess on the session's queue and waits until it answers ping. Extra
    keyword arguments become environment variables (``WATCH_LEASE_SECONDS="2"``). Call it
    again for a second worker. Every worker started is stopped after the test.
``celery_worker`` (function) -> WorkerProcess
    One worker; ``.pid``, ``.hostname``, ``.stop()``, ``.kill()`` (SIGKILL), ``.log_tail()``.
``start_celery_beat(**env) -> ServiceProcess`` / ``celery_beat`` (function)
    celery beat with its schedule file in a temporary folder.
``start_daphne(**env) -> DaphneProcess`` (function) / ``live_server_daphne`` (session) -> str
    daphne serving ``dashboard.asgi:application`` on a free port; ``live_server_daphne`` is
    its base URL without a trailing slash (a ``str`` with a ``.process`` attribute).
``child_env`` (function) -> Callable[..., dict[str, str]]
    The environment a subprocess needs to share this session's database and Redis.
``screenshot_dir`` (session) -> Path
    ``test-artifacts/screenshots/`` (created; git-ignored), for browser tests.

How subprocesses share the test database
----------------------------------------
pytest-django creates the test database (``test_<name>`` on PostgreSQL; on SQLite the file
named by ``DATABASES["default"]["TEST"]["NAME"]``, which this module sets to a fresh file in
the session's temporary folder unless ``DASHBOARD_TEST_DB_FILE`` is set; never SQLite's
in-memory database, which other processes cannot open; the file starts as a copy of one
migrated template kept for the migrations it was built from, see ``SQLiteTemplate``). After creation Django's connection
settings name the test database, and :func:`test_database_url` turns them back into a
``DATABASE_URL`` that the subprocess's settings parse like any other. Subprocesses only see
committed data: use ``@pytest.mark.django_db(transaction=True)`` in tests that start
processes (a plain ``django_db`` test holds its data, and on SQLite the write lock, in a
transaction that is never committed).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
import pytest
import redis

from tasks_app.runtime.net import free_port, redact_url, wait_until
from tasks_app.runtime.redis_server import apply_redis_url, ping_error
from tasks_app.runtime.supervisor import Child, Supervisor

REPO_ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT_DIR = REPO_ROOT / "test-artifacts" / "screenshots"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
READY_TIMEOUT = 45.0
STOP_TIMEOUT = 8.0
_LOCK_PREFIX = "a2a-dashboard:test-redis-db:"

# What the session's Redis check found, for a clear failure in the tests that need Redis.
_redis_state: dict[str, str | None] = {"url": None, "problem": None}


# -- the test database -------------------------------------------------------------------


@pytest.fixture(scope="session")
def django_db_modify_db_settings(
    django_db_modify_db_settings_parallel_suffix: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Give each session its own SQLite test file (concurrent runs must not share one)."""
    from django.conf import settings

    database = settings.DATABASES["default"]
    if database["ENGINE"] == "django.db.backends.sqlite3" and not os.environ.get(
        "DASHBOARD_TEST_DB_FILE"
    ):
        path = tmp_path_factory.mktemp("db") / "test_dashboard.sqlite3"
        database.setdefault("TEST", {})["NAME"] = str(path)


class SQLiteTemplate:
    """One migrated SQLite test database per set of migrations, copied by every test process.

    Each process of a ``-n 4`` run migrated a database of its own: 1.5 s of CPU alone, 3.4 s
    each with four at once on two cores, all at the start of the run, and again at every
    run. The first process to take the lock migrates and leaves a copy; the others (of this
    run and of later ones) wait for it and start from a copy, which Django then keeps
    (``keepdb``: its migrate finds nothing to apply). The copy is named by
    :func:`migrations_key`, so a changed or added migration (or another Django or SQLite)
    builds a new one. Only for the SQLite file this module names.
    """

    def __init__(self, database: Path | None, folder: Path, key: str) -> None:
        self.database = database
        self.copied = False
        self._lock: Any = None
        self._template = folder / f"dash-template-{key}.sqlite3"
        if database is None:
            return
        import fcntl

        # Held until built; the lock file stays (removing it would let two builders race).
        self._lock = open(folder / f"dash-template-{key}.lock", "w")  # noqa: SIM115
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        if self._template.exists():
            import shutil

            shutil.copyfile(self._template, database)
            self._template.touch()  # in use: not forgotten (see _forget_old)
            self.copied = True
            self.release()

    def built(self) -> None:
        """The builder's database is migrated: leave a consistent copy (WAL included)."""
        if self._lock is None or self.copied or self.database is None:
            return
        import sqlite3

        partial = self._template.with_suffix(".partial")
        with (
            contextlib.closing(sqlite3.connect(self.database)) as source,
            contextlib.closing(sqlite3.connect(partial)) as copy,
        ):
            source.backup(copy)
        partial.replace(self._template)
        self.release()
        self._forget_old()

    def _forget_old(self) -> None:
        """Templates of other migrations not used for a day: another branch's, or superseded."""
        a_day_ago = time.time() - 86400
        for path in self._template.parent.glob("dash-template-*"):
            if path.stem != self._template.stem:
                with contextlib.suppress(OSError):
                    if path.stat().st_mtime < a_day_ago:
                        path.unlink()

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file gives the lock up
            self._lock = None


@pytest.fixture(scope="session")
def sqlite_template(
    django_db_modify_db_settings: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SQLiteTemplate]:
    from django.conf import settings

    database = settings.DATABASES["default"]
    name = database.get("TEST", {}).get("NAME")
    ours = (
        database["ENGINE"] == "django.db.backends.sqlite3"
        and name
        and not os.environ.get("DASHBOARD_TEST_DB_FILE")
    )
    # pytest's own folder for this user (``pytest-of-<user>``), above each run's numbered one.
    base = tmp_path_factory.getbasetemp()
    folder = base.parent.parent if os.environ.get("PYTEST_XDIST_WORKER") else base.parent
    template = SQLiteTemplate(Path(name) if ours else None, folder, migrations_key())
    yield template
    template.release()


def migrations_key() -> str:
    """What a migrated database depends on: every installed app's migration files and models
    module (migrations use its field classes), and the versions of Django and SQLite.
    (``tests/test_migrations.py`` checks that models and migrations agree.)"""
    import hashlib
    import sqlite3

    import django
    from django.apps import apps

    digest = hashlib.sha256(f"{django.__version__} {sqlite3.sqlite_version}".encode())
    for config in sorted(apps.get_app_configs(), key=lambda config: config.label):
        folder = Path(config.path) / "migrations"
        if not folder.is_dir():
            continue
        models_file = getattr(config.models_module, "__file__", None)
        for path in [*sorted(folder.glob("*.py")), *([Path(models_file)] if models_file else [])]:
            digest.update(f"{config.label}/{path.name}".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def django_db_keepdb(request: pytest.FixtureRequest, sqlite_template: SQLiteTemplate) -> bool:
    """``--reuse-db``, or this process's database is a copy of the run's migrated template."""
    return bool(request.config.getvalue("reuse_db")) or sqlite_template.copied


@pytest.fixture(scope="session")
def django_db_setup(
    django_db_setup: None, django_db_blocker: Any, sqlite_template: SQLiteTemplate
) -> Iterator[None]:
    """pytest-django's test database, plus: nobody is left connected when it is dropped.

    Threads of this process (``database_sync_to_async``, concurrent-writer tests) keep their
    own connections open, and PostgreSQL refuses to drop a database in use ("is being accessed
    by other users"), which would leave ``test_<name>`` behind.
    """
    sqlite_template.built()
    yield
    from django.db import connection, connections

    with django_db_blocker.unblock():
        if connection.vendor == "postgresql":
            with contextlib.suppress(Exception), connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
        connections.close_all()


def test_database_url() -> str:
    """``DATABASE_URL`` of the test database, for subprocesses (call after it was created)."""
    from django.db import connections

    config = connections["default"].settings_dict
    name = str(config["NAME"])
    if config["ENGINE"] == "django.db.backends.sqlite3":
        if name == ":memory:" or name.startswith("file:"):
            raise RuntimeError("the SQLite test database must be a file to share it")
        return f"sqlite:///{Path(name).resolve()}"
    original = os.environ.get("DATABASE_URL", "").strip()
    if not original:
        raise RuntimeError("DATABASE_URL is needed to reach a non-SQLite test database")
    return urlunsplit(urlsplit(original)._replace(path="/" + quote(name)))


# Pytest would otherwise collect the function above as a test.
test_database_url.__test__ = False  # type: ignore[attr-defined]


# -- Redis ---------------------------------------------------------------------------------


def _with_db(url: str, number: int) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{number}"))


_CLAIM_SECONDS = 6 * 3600
# Take a claim over only from the owner that was read (another session may be doing the same).
_TAKE_OVER = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('set', KEYS[1], ARGV[2], 'EX', ARGV[3])
end
return false
"""


def claim_owner(purpose: str = "session") -> str:
    """Who holds a claim: this machine, this process (so that a dead one is recognized)."""
    return f"{os.uname().nodename}:{os.getpid()}:{purpose}-{uuid.uuid4().hex[:8]}"


def _owner_gone(owner: str) -> bool:
    """Whether ``owner`` (see :func:`claim_owner`) was a process of this machine that is no
    longer running: killed before it could give its claim back."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != os.uname().nodename or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def _claim_database(
    base_url: str, owner: str, numbers: Iterable[int] = range(1, 16)
) -> tuple[str, Callable[[], None]]:
    """Lock a Redis database number (1-15) for ``owner``; fall back to ``base_url``.

    1. The locks are keys of database 0 of ``base_url``'s server, whichever database
       ``base_url`` names: a claim made from a session's own database (the scale-out
       test's) must see the sessions' claims. (It once looked in its session's database,
       found nothing, took another running session's number, and emptied it at the end.)
    2. A free number is locked with SET NX and an expiry.
    3. A number whose owner was a process of this machine that died (a run killed before
       it could release) is taken over, compare-and-set on that owner.
    4. The claimed database is emptied: what an earlier session left there (channel
       groups, queues, a person's hourly counts under ids this session's people take
       again) is not ours.
    5. With no number to have (every one held by a live owner, or a server with fewer
       databases), the session shares ``base_url`` and says so.
    """
    client = redis.Redis.from_url(_with_db(base_url, 0), socket_timeout=2, socket_connect_timeout=2)
    for number in numbers:
        key = f"{_LOCK_PREFIX}{number}"
        if not client.set(key, owner, nx=True, ex=_CLAIM_SECONDS):
            holder = client.get(key)
            if holder is None or not _owner_gone(holder.decode(errors="replace")):
                continue
            if not client.eval(_TAKE_OVER, 1, key, holder, owner, _CLAIM_SECONDS):
                continue
        url = _with_db(base_url, number)
        if ping_error(url) is not None:  # e.g. a server configured with fewer databases
            client.delete(key)
            break
        with contextlib.closing(redis.Redis.from_url(url, socket_timeout=5)) as left:
            left.flushdb()

        def release(key: str = key) -> None:
            with contextlib.suppress(redis.RedisError):
                if client.get(key) == owner.encode():
                    client.delete(key)
            client.close()

        return url, release
    client.close()
    warnings.warn(
        f"no Redis database of 1-15 to claim: sharing {redact_url(base_url)} with other "
        "test sessions (their channel groups and queues can mix)",
        stacklevel=2,
    )
    return base_url, lambda: None


@pytest.fixture(scope="session", autouse=True)
def _session_redis() -> Iterator[None]:
    """Point the whole session (this process and its children) at a private Redis database.

    Autouse, so in-process code (the relay's ``group_send``, health checks) and subprocesses
    agree from the first test on. When Redis is not reachable nothing is changed and only
    the tests that ask for ``redis_url`` (directly or through a process fixture) fail.
    """
    base = os.environ.get("REDIS_URL", "").strip() or DEFAULT_REDIS_URL
    problem = ping_error(base, timeout=1.0)
    if problem is not None:
        _redis_state["problem"] = (
            f"Redis is not reachable at REDIS_URL={redact_url(base)} ({problem})"
        )
        yield
        return
    saved = {name: os.environ.get(name) for name in ("REDIS_URL", "CELERY_QUEUE")}
    url, release = _claim_database(base, claim_owner())
    queue = f"test-{uuid.uuid4().hex[:10]}"
    apply_redis_url(url, queue=queue)
    _redis_state["url"] = url
    try:
        yield
    finally:
        release()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The session's Redis URL (its own database number), verified reachable."""
    if _redis_state["url"] is None:
        pytest.fail(
            f"{_redis_state['problem']}; start one (./dash test does) or set REDIS_URL.",
            pytrace=False,
        )
    return str(_redis_state["url"])


# -- processes -----------------------------------------------------------------------------


class ServiceProcess:
    """A real process started for a test; stopped with SIGTERM, or killed with SIGKILL."""

    def __init__(self, name: str, child: Child) -> None:
        self.name = name
        self.child = child

    @property
    def pid(self) -> int:
        return self.child.pid

    def alive(self) -> bool:
        return self.child.alive()

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM (warm shutdown), then SIGKILL after ``timeout`` seconds."""
        return self.child.stop(timeout)

    def kill(self) -> int | None:
        """SIGKILL, as a crash or an OOM kill would: no cleanup runs."""
        return self.child.kill()

    def log_tail(self, lines: int = 60) -> str:
        return self.child.log_tail(lines)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} pid={self.pid}>"


class WorkerProcess(ServiceProcess):
    def __init__(self, name: str, child: Child, hostname: str, queue: str) -> None:
        super().__init__(name, child)
        self.hostname = hostname
        self.queue = queue

    def ping(self, timeout: float = 1.0) -> bool:
        from dashboard.celery import app

        return bool(app.control.ping(destination=[self.hostname], timeout=timeout))


class DaphneProcess(ServiceProcess):
    def __init__(self, name: str, child: Child, url: str) -> None:
        super().__init__(name, child)
        self.url = url


class LiveServerURL(str):
    """The base URL of a daphne started for tests; ``.process`` is its handle."""

    process: DaphneProcess


def make_child_env(**extra: Any) -> dict[str, str]:
    """Environment for a subprocess that shares this session's test database and Redis."""
    from django.conf import settings

    env = os.environ.copy()
    env.update(
        DJANGO_SETTINGS_MODULE="dashboard.settings",
        DATABASE_URL=test_database_url(),
        REDIS_URL=settings.REDIS_URL,
        CELERY_QUEUE=settings.CELERY_TASK_DEFAULT_QUEUE,
        SECRET_KEY=settings.SECRET_KEY,  # sessions made in-process are valid in daphne
        DATA_DIR=str(settings.DATA_DIR),
        PYTHONUNBUFFERED="1",
    )
    env.pop("DASHBOARD_TEST_DB_FILE", None)
    env.update({key: str(value) for key, value in extra.items()})
    return env


class ProcessStarter:
    """Starts workers, beat and daphne for one scope and stops them all at its end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.supervisor = Supervisor(output=None)
        self.started: list[ServiceProcess] = []

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> Child:
        log_path = self.log_dir / f"{name}.log"
        return self.supervisor.start(name, argv, env=env, cwd=REPO_ROOT, log_path=log_path)

    def _unique(self, kind: str) -> str:
        return f"{kind}-{uuid.uuid4().hex[:6]}"

    def worker(self, *, concurrency: int = 8, **env: Any) -> WorkerProcess:
        from django.conf import settings

        name = self._unique("worker")
        hostname = f"{name}@test"
        queue = settings.CELERY_TASK_DEFAULT_QUEUE
        argv = [
            sys.executable, "-m", "celery", "-A", "dashboard", "worker",
            "--pool", "threads", "--concurrency", str(concurrency), "-Q", queue,
            "-n", hostname, "--loglevel", "INFO",
            "--without-mingle", "--without-gossip", "--without-heartbeat",
        ]  # fmt: skip
        child = self._start(name, argv, make_child_env(**env))
        worker = WorkerProcess(name, child, hostname, queue)
        self.started.append(worker)
        if not wait_until(
            lambda: worker.ping(0.5), READY_TIMEOUT, interval=0.1, abort=lambda: not child.alive()
        ):
            self._fail(worker, "did not answer ping")
        return worker

    def beat(self, **env: Any) -> ServiceProcess:
        name = self._unique("beat")
        schedule = self.log_dir / f"{name}-schedule"
        argv = [
            sys.executable, "-m", "celery", "-A", "dashboard", "beat",
            "--schedule", str(schedule), "--loglevel", "INFO",
        ]  # fmt: skip
        child = self._start(name, argv, make_child_env(**env))
        beat = ServiceProcess(name, child)
        self.started.append(beat)
        if not wait_until(
            lambda: "beat: Starting" in beat.log_tail(200),
            READY_TIMEOUT,
            abort=lambda: not child.alive(),
        ):
            self._fail(beat, "did not start")
        return beat

    def daphne(self, **env: Any) -> DaphneProcess:
        name = self._unique("daphne")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [
            sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
            "dashboard.asgi:application",
        ]  # fmt: skip
        child = self._start(name, argv, make_child_env(**env))
        server = DaphneProcess(name, child, url)
        self.started.append(server)

        def answers() -> bool:
            try:
                httpx.get(f"{url}/healthz", timeout=5)
            except httpx.HTTPError:
                return False
            return True

        if not wait_until(answers, READY_TIMEOUT, interval=0.1, abort=lambda: not child.alive()):
            self._fail(server, "did not answer HTTP")
        return server

    def _fail(self, process: ServiceProcess, what: str) -> None:
        tail = process.log_tail()
        process.kill()
        pytest.fail(
            f"{process.name} {what} within {READY_TIMEOUT:.0f} s; its log:\n{tail}", pytrace=False
        )

    def stop_all(self) -> None:
        self.supervisor.stop_all(STOP_TIMEOUT)
        self.started.clear()


@pytest.fixture
def child_env(redis_url: str, django_db_setup: None) -> Callable[..., dict[str, str]]:
    """A function returning the environment for a subprocess of this test (``**extra`` added)."""
    return make_child_env


@pytest.fixture
def _processes(redis_url: str, django_db_setup: None, tmp_path: Path) -> Iterator[ProcessStarter]:
    starter = ProcessStarter(tmp_path / "process-logs")
    try:
        yield starter
    finally:
        starter.stop_all()


@pytest.fixture
def start_celery_worker(_processes: ProcessStarter) -> Callable[..., WorkerProcess]:
    """Factory: ``start_celery_worker(concurrency=8, **env)`` -> a running :class:`WorkerProcess`."""
    return _processes.worker


@pytest.fixture
def celery_worker(start_celery_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    """A real Celery worker process on this session's queue, stopped after the test."""
    return start_celery_worker()


@pytest.fixture
def start_celery_beat(_processes: ProcessStarter) -> Callable[..., ServiceProcess]:
    """Factory: ``start_celery_beat(**env)``, e.g. ``RECONCILE_EVERY_SECONDS="1"``."""
    return _processes.beat


@pytest.fixture
def celery_beat(start_celery_beat: Callable[..., ServiceProcess]) -> ServiceProcess:
    return start_celery_beat()


@pytest.fixture
def start_daphne(_processes: ProcessStarter) -> Callable[..., DaphneProcess]:
    """Factory: ``start_daphne(**env)`` -> a :class:`DaphneProcess` (``.url``) for this test."""
    return _processes.daphne


@pytest.fixture(scope="session")
def live_server_daphne(
    redis_url: str, django_db_setup: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServerURL]:
    """One daphne for the session; yields its base URL (no trailing slash).

    Session-scoped because starting it costs about a second; it depends on
    ``django_db_setup`` so it is stopped before the test database is dropped.
    """
    starter = ProcessStarter(tmp_path_factory.mktemp("daphne-logs"))
    try:
        server = starter.daphne()
        url = LiveServerURL(server.url)
        url.process = server
        yield url
    finally:
        starter.stop_all()


@pytest.fixture(scope="session")
def screenshot_dir() -> Path:
    """Where browser tests save screenshots (kept after the run, ignored by git)."""
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    return SCREENSHOT_DIR


def wait_for_healthz(base_url: str, timeout: float = 30.0) -> httpx.Response:
    """GET /healthz until it answers 200 or the timeout passes; returns the last response."""
    deadline = time.monotonic() + timeout
    while True:
        response = httpx.get(f"{base_url}/healthz", timeout=10)
        if response.status_code == 200 or time.monotonic() >= deadline:
            return response
        time.sleep(0.3)
