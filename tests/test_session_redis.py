"""The test sessions' Redis databases (``tests.infra._claim_database``): one owner a number.

Sessions run side by side (CI runs the SQLite and PostgreSQL passes at once, each on
several workers), and each needs a Redis database of its own: channel groups are named
by task pk, which every scratch database numbers from 1, so two stacks on one database
hear each other's tasks. The scale-out test claims one more number from inside its
session, and empties it when done.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis

from tests.infra import _LOCK_PREFIX, _claim_database, _with_db, claim_owner

pytestmark = pytest.mark.timeout(60)


def _dead_pid() -> int:
    """A pid no process of this machine has now (from the top of the range: rarely used)."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    for pid in range(top, top - 10_000, -1):
        if not Path(f"/proc/{pid}").exists():
            return pid
    raise AssertionError("no free pid found")


def test_a_claim_made_from_a_sessions_own_database_sees_every_sessions_claims(redis_url):
    session_number = int(redis_url.rsplit("/", 1)[1])
    url, release = _claim_database(redis_url, claim_owner("test"))
    try:
        number = int(url.rsplit("/", 1)[1])
        # Not the session's own database, which its session holds (the lock is in db 0).
        assert number != session_number
        locks = redis.Redis.from_url(_with_db(redis_url, 0))
        assert (
            locks.get(f"{_LOCK_PREFIX}{number}")
            .decode()
            .startswith(f"{os.uname().nodename}:{os.getpid()}:test-")
        )
        assert locks.get(f"{_LOCK_PREFIX}{session_number}") is not None
        locks.close()
    finally:
        release()


def test_a_claim_left_by_a_killed_session_is_taken_over_and_emptied(redis_url):
    # A number of our own to play the dead session's: claimed, then made to look abandoned.
    # The highest free one: sessions starting meanwhile claim from the lowest up, so none
    # takes it over in between.
    url, release = _claim_database(redis_url, claim_owner("test"), numbers=range(15, 0, -1))
    number = int(url.rsplit("/", 1)[1])
    key = f"{_LOCK_PREFIX}{number}"
    locks = redis.Redis.from_url(_with_db(redis_url, 0))
    left = redis.Redis.from_url(url)
    try:
        left.set("asgi:group:tasks", "what the killed session left")
        dead = f"{os.uname().nodename}:{_dead_pid()}:session-0000"
        owner = claim_owner("test")
        locks.set(key, dead)
        again, release_again = _claim_database(redis_url, owner, numbers=[number])
        assert again == url and locks.get(key) == owner.encode()
        assert left.get("asgi:group:tasks") is None  # emptied for its new owner
        release_again()
        assert locks.get(key) is None
    finally:
        release()
        left.close()
        locks.close()


def test_a_released_number_is_emptied_for_its_next_owner(redis_url):
    # What one session left (a person's hourly upload count, under an id the next session's
    # people take again) must not count against the next one.
    url, release = _claim_database(redis_url, claim_owner("test"), numbers=range(15, 0, -1))
    number = int(url.rsplit("/", 1)[1])
    left = redis.Redis.from_url(url)
    try:
        left.set("upload-bytes:3:1", "5")
        release()
        again, release = _claim_database(redis_url, claim_owner("test"), numbers=[number])
        assert again == url
        assert left.get("upload-bytes:3:1") is None
    finally:
        release()
        left.close()


def test_a_claim_held_by_a_live_session_is_never_taken(redis_url):
    session_number = int(redis_url.rsplit("/", 1)[1])
    with pytest.warns(UserWarning, match="sharing"):
        url, release = _claim_database(redis_url, claim_owner("test"), numbers=[session_number])
    release()
    assert url == redis_url  # shared, said so, and the session keeps its own claim
    locks = redis.Redis.from_url(_with_db(redis_url, 0))
    assert (
        locks.get(f"{_LOCK_PREFIX}{session_number}")
        .decode()
        .startswith(f"{os.uname().nodename}:{os.getpid()}:session-")
    )
    locks.close()
