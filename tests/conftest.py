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
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.conf import settings

HOOK_DIR = Path(__file__).resolve().parent / "loopback_only"
LOOPBACK_ALLOW = "127.0.0.0/8,::1/128"

# Before any child starts and before the settings are read: children inherit both.
os.environ["OUTBOUND_ALLOW"] = LOOPBACK_ALLOW
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(HOOK_DIR), os.environ.get("PYTHONPATH")])
)
os.environ.setdefault(
    "LOOPBACK_ONLY_LOG", str(Path(tempfile.gettempdir()) / f"loopback-only-{os.getpid()}.log")
)
sys.path.insert(0, str(HOOK_DIR))
import loopback_hook  # noqa: E402 - needs the folder on sys.path; the same module children load

loopback_hook.install()
settings.OUTBOUND_ALLOW = LOOPBACK_ALLOW.split(",")  # in case the settings were read already


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
