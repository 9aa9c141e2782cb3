"""How many live sockets one person may hold open at once, over every web process.

A socket costs the server its group joins, a channel in Redis, re-syncs that read the
database, and a frame budget of its own (``consumers.FRAME_BURST``). Bounded per socket
only, one person (any role; a script with their session cookie) could open thousands and
multiply all of it. So each open socket holds a *place*: a member of its person's sorted
set in Redis, scored by when the place lapses. An open socket renews its place every
``RENEW_AFTER_SECONDS``, whatever its browser sends (an idle socket costs a channel all the
same); a web process killed with sockets open leaves places that lapse after
``PLACE_SECONDS`` instead of holding them for ever. A socket whose place is gone when it
renews (it lapsed while its process stalled) is closed.

Taking a place is add-then-count in one transaction (lapsed places dropped first): of
connects released at once, never more than ``settings.BUDGET_PERSON_SOCKETS`` (40: a page
opens one or two, so about twenty tabs' worth) stay; one past the cap
gives its place back and is refused (``consumers.CLOSE_TOO_MANY_SOCKETS``). With Redis out
of reach a socket is let in (logged): the live view needs Redis anyway, and the count is
a bound, not a permission.
"""

from __future__ import annotations

import logging
import time

import redis
from django.conf import settings

from tasks_app.runtime import shared_redis

log = logging.getLogger(__name__)

PLACE_SECONDS = 300.0
RENEW_AFTER_SECONDS = 60.0  # how often an open socket renews its place


def _key(prefix: str, user_id: int) -> str:
    return f"{prefix}:sockets:{user_id}"


def _client() -> redis.Redis:
    return shared_redis.client(settings.REDIS_URL)


def take(prefix: str, user_id: int, socket_id: str) -> bool:
    """Take a place for ``socket_id``; False when the person holds ``BUDGET_PERSON_SOCKETS``.

    1. In one transaction: drop the person's lapsed places, add this one, count them.
    2. Over the cap: give this place back (a connect released at the same moment may be
       refused too; none is let in past the cap).
    """
    key = _key(prefix, user_id)
    now = time.time()
    try:
        pipe = _client().pipeline(transaction=True)
        pipe.zremrangebyscore(key, "-inf", now)
        pipe.zadd(key, {socket_id: now + PLACE_SECONDS})
        pipe.zcard(key)
        pipe.expire(key, int(PLACE_SECONDS) + 60)
        count = pipe.execute()[2]
        if count <= settings.BUDGET_PERSON_SOCKETS:
            return True
        _client().zrem(key, socket_id)
        return False
    except redis.RedisError:
        log.warning("socket places: Redis out of reach; socket let in", exc_info=True)
        return True


def renew(prefix: str, user_id: int, socket_id: str) -> bool:
    """Push this socket's place's lapse further; False when it holds none any more (it
    lapsed, and may have been taken). Redis out of reach: True (as ``take``)."""
    key = _key(prefix, user_id)
    now = time.time()
    try:
        pipe = _client().pipeline(transaction=True)
        pipe.zscore(key, socket_id)
        pipe.zadd(key, {socket_id: now + PLACE_SECONDS}, xx=True)
        pipe.expire(key, int(PLACE_SECONDS) + 60)
        score = pipe.execute()[0]
    except redis.RedisError:
        log.warning("socket places: could not renew a place", exc_info=True)
        return True
    if score is not None and score > now:
        return True
    _client().zrem(key, socket_id)  # a lapsed place renewed above is not the socket's any more
    return False


def give_back(prefix: str, user_id: int, socket_id: str) -> None:
    try:
        _client().zrem(_key(prefix, user_id), socket_id)
    except redis.RedisError:  # it lapses by itself
        log.warning("socket places: could not give a place back", exc_info=True)
