"""Prometheus metrics for the whole deployment, from any web process.

The parts run as many processes on many machines (``up --only``), so a per-process registry
would show one process's share. Instead:

1. **Counters and the relay-latency histogram** are counted in each process (a dict under a
   lock: an increment on the hot path costs a dict update) and a daemon thread adds the
   deltas to Redis hashes once a second (``HINCRBYFLOAT``; a failed flush keeps the deltas
   for the next one).
2. **Gauges** (tasks by state, watchers by status, streams held per worker) are read from the
   database when ``/metrics`` is scraped: they are the mirror's own truth.
3. ``/metrics`` (a staff login, or ``Authorization: Bearer METRICS_TOKEN``) renders both with
   the official client library's exposition format.

Counter names and their labels are listed in ``COUNTERS``; docs/operations.md lists them all.
"""

from __future__ import annotations

import atexit
import hmac
import json
import logging
import threading
import time
from collections.abc import Iterator
from datetime import datetime

from django.conf import settings
from django.db.models import Count, Q
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from tasks_app.a2a.types import ALL_STATES, STATE_UNSPECIFIED
from tasks_app.models import TERMINAL_STATES, RemoteTask
from tasks_app.runtime import shared_redis

log = logging.getLogger(__name__)

COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "events_recorded": ("Log entries appended, by the channel that brought them", ("channel",)),
    "protocol_errors": (
        "protocol-error entries (an agent broke the protocol), by agent id",
        ("agent",),
    ),
    "send_failures": ("Sends that failed before the agent named a task", ()),
    "webhook_rejections": ("Push deliveries refused by the webhook, by HTTP status", ("status",)),
    "lease_takeovers": ("Leases found expired by the reconciler (a worker stopped renewing)", ()),
    "reconcile_ticks": ("Reconcile ticks run (one per claimed RECONCILE_EVERY_SECONDS)", ()),
}
# Seconds from an entry's commit to its send to browsers (channel layer).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FLUSH_EVERY_SECONDS = 1.0
PREFIX = "dashboard_"


def _key(name: str) -> str:
    return f"dashboard:metrics:{settings.CELERY_TASK_DEFAULT_QUEUE}:{name}"


class _Pending:
    """This process's increments not yet added to Redis."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, dict[str, float]] = {}
        self.flusher: threading.Thread | None = None
        self.failing = False  # said once per Redis outage, not once a second

    def add(self, name: str, field: str, amount: float) -> None:
        with self.lock:
            bucket = self.values.setdefault(name, {})
            bucket[field] = bucket.get(field, 0.0) + amount
            if self.flusher is None:
                self.flusher = threading.Thread(
                    target=self._flush_forever, name="metrics-flush", daemon=True
                )
                self.flusher.start()
                # A command (tasks start, cancel) ends before the next flush, and any part's
                # last second would be lost with it.
                atexit.register(self.flush)

    def take(self) -> dict[str, dict[str, float]]:
        with self.lock:
            values, self.values = self.values, {}
        return values

    def put_back(self, values: dict[str, dict[str, float]]) -> None:
        for name, fields in values.items():
            for field, amount in fields.items():
                with self.lock:
                    bucket = self.values.setdefault(name, {})
                    bucket[field] = bucket.get(field, 0.0) + amount

    def flush(self) -> None:
        values = self.take()
        if not values:
            return
        try:
            pipe = shared_redis.client(settings.REDIS_URL).pipeline(transaction=False)
            for name, fields in values.items():
                for field, amount in fields.items():
                    pipe.hincrbyfloat(_key(name), field, amount)
            pipe.execute()
        except Exception as exc:  # Redis away: keep the counts for the next flush
            self.put_back(values)
            if not self.failing:
                self.failing = True
                log.warning(
                    "metrics: flush failed (%s); counts are kept until Redis answers",
                    type(exc).__name__,
                )
            return
        if self.failing:
            self.failing = False
            log.info("metrics: flushed again; the kept counts are in Redis")

    def _flush_forever(self) -> None:
        while True:
            time.sleep(FLUSH_EVERY_SECONDS)
            self.flush()


_pending = _Pending()


def count(name: str, amount: float = 1, **labels: object) -> None:
    """Add to counter ``name`` (one of ``COUNTERS``) with these label values."""
    if amount:
        _pending.add(name, json.dumps([str(labels[k]) for k in COUNTERS[name][1]]), amount)


def observe_relay_latency(received_at: str | datetime | None, entries: int = 1) -> None:
    """``entries`` relayed entries committed at ``received_at``: the time from then to now."""
    if isinstance(received_at, str):
        try:
            received_at = datetime.fromisoformat(received_at)
        except ValueError:
            return
    if received_at is None:
        return
    seconds = max(0.0, (timezone.now() - received_at).total_seconds())
    bucket = next((str(b) for b in LATENCY_BUCKETS if seconds <= b), "+Inf")
    _pending.add("relay_latency_bucket", bucket, entries)
    _pending.add("relay_latency_sum", "", seconds * entries)


def flush() -> None:
    """Send this process's pending counts now (tests; also run at exit)."""
    _pending.flush()


class DeploymentCollector(Collector):
    """What ``/metrics`` shows: the Redis counters of every process, and gauges from the database."""

    def collect(self) -> Iterator[object]:
        try:
            counters = list(self._counters())
        except Exception as exc:  # Redis away: the database's gauges are still worth a scrape
            log.warning("metrics: the counters could not be read (%s)", type(exc).__name__)
            counters = []
        up = GaugeMetricFamily(
            PREFIX + "metrics_redis_up", "Whether the counters could be read from Redis"
        )
        up.add_metric([], 1.0 if counters else 0.0)
        yield up
        yield from counters
        yield from self._gauges()

    def _counters(self) -> Iterator[object]:
        r = shared_redis.client(settings.REDIS_URL)
        for name, (help_text, labels) in COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, help_text, labels=list(labels))
            for field, value in (r.hgetall(_key(name)) or {}).items():
                family.add_metric(json.loads(field), float(value))
            yield family
        buckets = {
            k.decode(): float(v) for k, v in (r.hgetall(_key("relay_latency_bucket")) or {}).items()
        }
        total = sum(float(v) for v in (r.hgetall(_key("relay_latency_sum")) or {}).values())
        cumulative, points = 0.0, []
        for bound in [*(str(b) for b in LATENCY_BUCKETS), "+Inf"]:
            cumulative += buckets.get(bound, 0.0)
            points.append((bound, cumulative))
        yield HistogramMetricFamily(
            PREFIX + "relay_latency_seconds",
            "Seconds from an entry's commit to its relay to browsers",
            buckets=points,
            sum_value=total,
        )

    def _gauges(self) -> Iterator[object]:
        states = GaugeMetricFamily(
            PREFIX + "tasks", "Mirrored tasks by state (phase when none)", labels=["state"]
        )
        # Every known state and status, 0 when none: an absent series is no number, and an
        # alert rule comparing a sum with 0 would never fire when the last one went away.
        by_state = dict.fromkeys(sorted(ALL_STATES - {STATE_UNSPECIFIED}), 0)
        for row in RemoteTask.objects.values("state", "phase").annotate(n=Count("id")).order_by():
            key = row["state"] or f"phase:{row['phase']}"
            by_state[key] = by_state.get(key, 0) + row["n"]
        for state, n in by_state.items():
            states.add_metric([state], n)
        yield states
        watchers = GaugeMetricFamily(
            PREFIX + "watchers", "Unfinished tasks by watcher status", labels=["status"]
        )
        active = RemoteTask.objects.exclude(state__in=TERMINAL_STATES)
        by_status = dict.fromkeys(RemoteTask.WatcherStatus.values, 0)
        for row in active.values("watcher_status").annotate(n=Count("id")).order_by():
            by_status[row["watcher_status"]] = by_status.get(row["watcher_status"], 0) + row["n"]
        for status, n in by_status.items():
            watchers.add_metric([status], n)
        yield watchers
        held = GaugeMetricFamily(
            PREFIX + "held_tasks", "Tasks whose lease a worker holds now", labels=["worker"]
        )
        live = RemoteTask.objects.filter(~Q(lease_token=""), lease_expires_at__gt=timezone.now())
        for row in live.values("lease_owner").annotate(n=Count("id")).order_by():
            held.add_metric([row["lease_owner"]], row["n"])
        yield held


def _allowed(request: HttpRequest) -> bool:
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and user.is_staff:
        return True
    token = settings.METRICS_TOKEN
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    # The scheme's case does not matter (RFC 9110); the token is compared in constant time.
    return (
        bool(token)
        and scheme.lower() == "bearer"
        and hmac.compare_digest(given.strip().encode(), token.encode())
    )


def metrics_view(request: HttpRequest) -> HttpResponse:
    """``/metrics``: staff or ``Authorization: Bearer METRICS_TOKEN``; anyone else 403."""
    if not _allowed(request):
        return HttpResponse(
            "Forbidden: a staff login or the metrics token is needed.\n",
            status=403,
            content_type="text/plain",
        )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DeploymentCollector())
    return HttpResponse(
        generate_latest(registry), content_type="text/plain; version=0.0.4; charset=utf-8"
    )
