"""How many bytes of files one person may send to agents in an hour.

A file a person attaches (to a new task, or to an answer) is stored with the task: in the
log entry of what was sent and in the conversation. One file is at most
``forms.MAX_UPLOAD_BYTES``, but nothing bounded how many a person sent: any operator could
grow the database by 10 MB a click. So each person's files are counted per clock hour
(``BUDGET_PERSON_UPLOAD_BYTES_PER_HOUR``), in Redis, shared by every web process.

Charging is add-then-check in one round trip: the bytes are added, and a total past the
budget takes them back and refuses, so of sends released at once none passes the budget.
A send that fails after its charge (the task could not be started) is refunded. With
Redis out of reach a file goes through (logged): the budget bounds, it does not permit.
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
from collections.abc import Iterable

import redis
from django.conf import settings

from tasks_app.runtime import shared_redis

log = logging.getLogger(__name__)

HOUR = 3600
KEY_PREFIX = "upload-bytes:"


def _key(person_id: int, hour: int) -> str:
    return f"{KEY_PREFIX}{person_id}:{hour}"


def size_of(parts: Iterable[dict]) -> int:
    """Bytes of the files in ``parts`` (each ``raw`` is base64)."""
    total = 0
    for part in parts:
        raw = part.get("raw") or ""
        try:
            total += len(base64.b64decode(raw, validate=False))
        except (binascii.Error, ValueError):
            total += len(raw)
    return total


def charge(person_id: int, parts: Iterable[dict]) -> tuple[int, str]:
    """Count ``parts`` against the person's hour: (bytes charged, "") or (0, why not).

    1. Add the bytes to this hour's count (the key expires after two hours).
    2. Past ``BUDGET_PERSON_UPLOAD_BYTES_PER_HOUR``: take them back and say when the
       hour ends; the file is not sent.
    """
    nbytes = size_of(parts)
    if nbytes == 0:
        return 0, ""
    budget = settings.BUDGET_PERSON_UPLOAD_BYTES_PER_HOUR
    now = time.time()
    key = _key(person_id, int(now // HOUR))
    try:
        client = shared_redis.client(settings.REDIS_URL)
        pipe = client.pipeline(transaction=True)
        pipe.incrby(key, nbytes)
        pipe.expire(key, 2 * HOUR)
        total = pipe.execute()[0]
        if total <= budget:
            return nbytes, ""
        client.decrby(key, nbytes)
    except redis.RedisError:
        log.warning("upload budget: Redis out of reach; a file of %d bytes let through", nbytes)
        return 0, ""
    minutes = max(1, round((HOUR - now % HOUR) / 60))
    sent = max(0, total - nbytes)
    return 0, (
        f"You have sent {_mb(sent)} of files this hour; this one ({_mb(nbytes)}) would pass "
        f"the {_mb(budget)} one person may send in an hour. Send it in {minutes} min, or "
        "without the file."
    )


def refund(person_id: int, nbytes: int) -> None:
    """Give back what :func:`charge` counted for a send that did not happen."""
    if nbytes <= 0:
        return
    try:
        shared_redis.client(settings.REDIS_URL).decrby(
            _key(person_id, int(time.time() // HOUR)), nbytes
        )
    except redis.RedisError:
        log.warning("upload budget: could not refund %d bytes", nbytes)


def _mb(nbytes: int) -> str:
    return f"{nbytes / (1024 * 1024):.1f} MB"
