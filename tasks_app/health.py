"""``/healthz``: is every part the dashboard needs answering?

No login: load balancers and ``manage.py up`` poll it. It reports each check by
name and answers 200 only when all of them are ok, 503 otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache


def check_database() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    return "ok"


def check_redis() -> str:
    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    finally:
        client.close()
    return "ok"


def check_channel_layer() -> str:
    layer = get_channel_layer()
    if layer is None:
        raise RuntimeError("no channel layer configured")

    async def round_trip() -> None:
        channel = await layer.new_channel()
        await layer.send(channel, {"type": "health.ping"})
        message = await layer.receive(channel)
        if message.get("type") != "health.ping":
            raise RuntimeError("channel layer returned a different message")

    async_to_sync(round_trip)()
    return "ok"


def check_worker() -> str:
    from dashboard.celery import app

    # limit=1: answer as soon as one worker replies instead of always waiting the timeout.
    replies = app.control.ping(timeout=1.5, limit=1)
    if not replies:
        raise RuntimeError("no Celery worker answered")
    return "ok"


CHECKS: dict[str, Callable[[], str]] = {
    "database": check_database,
    "redis": check_redis,
    "channel_layer": check_channel_layer,
    "worker": check_worker,
}


def run_checks() -> dict[str, dict[str, object]]:
    results: dict[str, dict[str, object]] = {}
    for name, check in CHECKS.items():
        started = time.monotonic()
        try:
            status = check()
        except Exception as exc:  # each failure is reported by name, never raised
            status = f"error: {type(exc).__name__}: {exc}"
        results[name] = {"status": status, "ms": round((time.monotonic() - started) * 1000, 1)}
    return results


@never_cache
def healthz(request: HttpRequest) -> JsonResponse:
    results = run_checks()
    ok = all(result["status"] == "ok" for result in results.values())
    return JsonResponse({"status": "ok" if ok else "error", "checks": results}, status=200 if ok else 503)
