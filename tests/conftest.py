"""Shared fixtures: real infrastructure (``tests.infra``) and real A2A peers (``tests.agents``).

See the docstrings of those modules for the fixture list; nothing in the suite is mocked.

Network: the suite stays on loopback. The agents it talks to are on 127.0.0.1, so the outbound
guard is told so explicitly (``OUTBOUND_ALLOW``, here and for every child process, which
inherit this environment), and a connect hook (``tests/loopback_only``) refuses and records
any connect off loopback, here and in every Python child; a test that caused one fails.
"""

import importlib.util
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from django.conf import settings

from tests import examples, flush_rows, static_scan

HOOK_DIR = Path(__file__).resolve().parent / "loopback_only"
LOOPBACK_ALLOW = "127.0.0.0/8,::1/128"

# Before any child starts and before the settings are read: children inherit both.
os.environ["OUTBOUND_ALLOW"] = LOOPBACK_ALLOW
# Celery runs Django's system checks at every worker start (the URLconf and every view: 0.18 s
# of a worker's 1.25 s of start-up CPU), and most worker tests start their own. The checks
# themselves run in the tests of ``manage.py check`` (tests/test_config_inputs.py).
os.environ["CELERY_SKIP_CHECKS"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(HOOK_DIR), os.environ.get("PYTHONPATH")])
)
# One log per test process: an xdist worker (PYTEST_XDIST_WORKER) inherits the controller's
# environment, and another worker's refusals must not fail this worker's tests.
if "PYTEST_XDIST_WORKER" in os.environ or "LOOPBACK_ONLY_LOG" not in os.environ:
    os.environ["LOOPBACK_ONLY_LOG"] = str(
        Path(tempfile.gettempdir()) / f"loopback-only-{os.getpid()}.log"
    )
sys.path.insert(0, str(HOOK_DIR))
import loopback_hook  # noqa: E402 - needs the folder on sys.path; the same module children load

loopback_hook.install()
settings.OUTBOUND_ALLOW = LOOPBACK_ALLOW.split(",")  # in case the settings were read already
static_scan.install()  # WhiteNoise lists the static files once per process, not per client
flush_rows.install()  # a flush puts back post_migrate's rows, not sends the signal again
# Users made here hash their password with 1,000 PBKDF2 iterations, not a million (tests/people.py).
settings.PASSWORD_HASHERS = ["tests.people.QuickPBKDF2PasswordHasher", *settings.PASSWORD_HASHERS]


def _children_refused() -> list[str]:
    try:
        lines = Path(os.environ["LOOPBACK_ONLY_LOG"]).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    return [line for line in lines if not line.startswith(f"{os.getpid()} ")]  # ours: in the list


@pytest.fixture(autouse=True)
def _loopback_only() -> Iterator[None]:
    """Fail the test if it (or a child process) tried to connect off loopback."""
    mine, theirs = len(loopback_hook.refused), len(_children_refused())
    yield
    found = loopback_hook.refused[mine:] + _children_refused()[theirs:]
    if found:
        pytest.fail(
            "connect(s) off loopback were attempted (and stopped): " + "; ".join(found),
            pytrace=False,
        )


@pytest.fixture(scope="session", autouse=True)
def _asgi_application_loaded() -> None:
    """Import ``dashboard.asgi`` before any test runs: its ``get_asgi_application()`` runs
    ``django.setup()`` again, which configures logging again (``dictConfig`` replaces the root
    logger's handlers). Done inside a test, that removes pytest's ``caplog`` handler for the
    rest of the test, so the first test of a process to import it saw no log records."""
    import dashboard.asgi  # noqa: F401


pytest_plugins = ["tests.infra"]
# The A2A peers are written separately; keep the suite importable while they are missing.
if importlib.util.find_spec("tests.agents") is not None:
    pytest_plugins.append("tests.agents")


# Fixtures that reach the pass's database (pytest-django's, and those built on them).
DATABASE_FIXTURES = {
    "db", "transactional_db", "django_db_reset_sequences", "django_db_serialized_rollback",
    "live_server", "admin_user", "admin_client",
}  # fmt: skip


def uses_the_database(item: pytest.Item) -> bool:
    """Whether a test reaches the database of the pass (SQLite or PostgreSQL)."""
    if item.get_closest_marker("django_db") is not None:
        return True
    return bool(DATABASE_FIXTURES & set(getattr(item, "fixturenames", ())))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The PostgreSQL pass (``DASH_TEST_PASS=postgres``, set by ``./dash test``) runs only the
    tests that reach the database: the others (protocol client, pages on a database of their
    own, the run command) ran the same way in the SQLite pass. They are deselected, and the
    count is printed, so nothing is silently skipped. Tests marked ``postgres_only`` (they need
    a PostgreSQL server of their own) run only in the PostgreSQL pass, deselected elsewhere."""
    postgres_only = [item for item in items if item.get_closest_marker("postgres_only")]
    if os.environ.get("DASH_TEST_PASS") != "postgres":
        if postgres_only:  # they need PostgreSQL itself; the PostgreSQL pass runs them
            config.hook.pytest_deselected(items=postgres_only)
            items[:] = [item for item in items if item not in postgres_only]
            sys.stderr.write(f"dash test: {len(postgres_only)} postgres_only tests deselected\n")
        return
    keep = [item for item in items if uses_the_database(item) or item in postgres_only]
    dropped = [item for item in items if item not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
        sys.stderr.write(
            f"dash test: PostgreSQL pass: {len(dropped)} tests that do not use the database deselected "
            "(they ran in the SQLite pass)\n"
        )


# -- what a test starts: markers and the fast tier ------------------------------------------
#
# Every test that starts a process carries a marker saying what it starts (registered in
# pyproject.toml). Most get theirs here, from the fixtures they use, so a new test that asks
# for ``celery_worker`` or ``agent`` is marked without anyone thinking of it; a test that starts
# something itself (subprocess.run, a stack of its own) is marked by hand in its module.
# ``--fast`` (``./dash test --fast``) runs only the tests without any of these markers, nor
# ``slow`` (a test that takes seconds by design: hypothesis runs, 10,000-row tables), and fails
# a test that starts a process anyway: the fast tier's selection stays honest.

PROCESS_MARKERS = ("worker", "agent", "server", "browser", "subprocess")
FAST_EXPRESSION = "not (" + " or ".join((*PROCESS_MARKERS, "slow")) + ")"

# Fixture -> the marker of what it starts (tests/infra.py, tests/agents.py).
PROCESS_FIXTURES = {
    "start_celery_worker": "worker", "celery_worker": "worker",
    "start_celery_beat": "worker", "celery_beat": "worker",
    "start_daphne": "server", "live_server_daphne": "server",
    "agent": "agent", "agent_nostream": "agent", "agent_nopush": "agent", "agent_token": "agent",
    "child_env": "subprocess",  # asked for only to start a command on the test database
}  # fmt: skip

# Audit events (sys.addaudithook) that mean a new process.
_PROCESS_EVENTS = {
    "subprocess.Popen",
    "os.fork",
    "os.forkpty",
    "os.posix_spawn",
    "os.spawn",
    "os.system",
}
_started: list[str] = []  # what the audit hook saw, in --fast runs
_START_COUNT = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help=f"the fast tier: only tests that start no process (-m {FAST_EXPRESSION!r}, "
        "combined with any -m given)",
    )


def _record_process_starts(event: str, args: tuple[object, ...]) -> None:
    if event in _PROCESS_EVENTS:
        what = args[1] if event == "subprocess.Popen" and len(args) > 1 else args
        _started.append(f"{event} {what!r}"[:300])


_controller = True  # False in a pytest-xdist worker: its reports reach the controller


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Name a failure the moment it happens, not only in the summary at the end: a pass cut
    short by ``./dash test``'s time limit (or CI's) still says which tests failed."""
    if report.failed and _controller:
        what = "FAILED" if report.when == "call" else "ERROR"  # as pytest's summary says
        sys.stderr.write(
            f"\ndash test: {what} {report.nodeid} ({report.when}, {report.duration:.1f} s)\n"
        )


def pytest_configure(config: pytest.Config) -> None:
    """``--fast``: narrow the marker expression, and watch for processes started anyway."""
    global _controller
    _controller = not hasattr(config, "workerinput")
    if not config.getoption("--fast", default=False):
        return
    given = config.option.markexpr
    config.option.markexpr = f"({FAST_EXPRESSION}) and ({given})" if given else FAST_EXPRESSION
    # Property tests try a share of their examples here; the full suite tries them all.
    examples.share = examples.FAST_TIER_SHARE
    sys.addaudithook(_record_process_starts)  # cannot be removed: installed for --fast runs only


@pytest.hookimpl(tryfirst=True)
def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark each test with what its fixtures start (before any ``-m`` selection is made)."""
    fixtures = set(getattr(item, "fixturenames", ()))
    for name in sorted({PROCESS_FIXTURES[f] for f in fixtures & PROCESS_FIXTURES.keys()}):
        if item.get_closest_marker(name) is None:
            item.add_marker(name)


def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_START_COUNT] = len(_started)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """In ``--fast`` runs: a test that started a process fails, naming the markers to add."""
    new = _started[item.stash.get(_START_COUNT, len(_started)) :]
    if new:
        pytest.fail(
            f"{item.nodeid} started a process in the fast tier ({new[0]}); mark it (or its module) "
            f"with what it starts: one of {', '.join(PROCESS_MARKERS)} (see pyproject.toml)",
            pytrace=False,
        )


@pytest.fixture
def no_dispatch(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Starts and answers dispatch no watcher (nothing reaches the broker); the task pks
    they would have dispatched are listed."""
    from tasks_app.services import tasks as task_services

    calls: list[int] = []
    monkeypatch.setattr(task_services, "dispatch", lambda pk: calls.append(pk))
    return calls


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    """A plain client for a test's peers on loopback (``serving.loopback_client``)."""
    from tests.serving import loopback_client

    async with loopback_client() as client:
        yield client


@pytest.fixture
def shared_loop() -> Iterator[None]:
    """The worker's shared loop (``tasks_app.eventloop``) in this process, for holders and the
    push drain run here; stopped, with its watchers, after the test."""
    from tasks_app import eventloop, relay, watchers

    eventloop.get_loop()
    yield
    if eventloop.running():
        eventloop.submit(watchers.registry.shutdown()).result(timeout=15)
        eventloop.stop()
    relay.use_loop(None)


@pytest.fixture
def empty_push_queue(redis_url: str) -> Iterator[None]:
    """No push notification waits, and no drain is scheduled, before and after the test.

    The queue is one Redis list per session: what one test leaves in it, the next test's
    reconciler tick finds and schedules a drain for.
    """
    from tasks_app.services import push

    push._redis().delete(push.QUEUE_KEY, push.DRAIN_KEY, push.QUEUE_BYTES_KEY, push.RUNNING_KEY)
    yield
    push._redis().delete(push.QUEUE_KEY, push.DRAIN_KEY, push.QUEUE_BYTES_KEY, push.RUNNING_KEY)
