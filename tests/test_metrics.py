"""``/metrics``: staff or the token only, and counters that move while the system works
(counted by the worker's processes, summed in Redis, read by the web process)."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from tasks_app.services import tasks as task_services
from tasks_app.services.agents import add_agent
from tests.people import member
from tests.test_mirror import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def sample(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in the exposition text (0 when absent)."""
    pattern = (
        re.escape(name)
        + (re.escape("{" + labels + "}") if labels else r"(?:\{\})?")
        + r" ([0-9.e+-]+)"
    )
    found = re.search(r"^" + pattern + r"$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_only_staff_or_the_token_may_read_metrics(settings, django_user_model) -> None:
    settings.METRICS_TOKEN = "metrics-token-123"
    assert Client().get("/metrics").status_code == 403
    assert Client().get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 403
    viewer = Client()
    viewer.force_login(
        member(django_user_model.objects.create_user("v", password="pw-12345678"), "agent-admin")
    )
    assert viewer.get("/metrics").status_code == 403  # a role in a project is not staff
    answer = Client().get("/metrics", headers={"Authorization": "Bearer metrics-token-123"})
    assert answer.status_code == 200 and "dashboard_tasks" in answer.content.decode()
    staff = Client()
    staff.force_login(
        django_user_model.objects.create_user("s", password="pw-12345678", is_staff=True)
    )
    assert staff.get("/metrics").status_code == 200
    # The scheme's case does not matter (RFC 9110); the token's does.
    assert (
        Client().get("/metrics", headers={"Authorization": "bearer metrics-token-123"}).status_code
        == 200
    )
    assert (
        Client().get("/metrics", headers={"Authorization": "Bearer METRICS-TOKEN-123"}).status_code
        == 403
    )
    assert (
        Client().get("/metrics", headers={"Authorization": "Basic metrics-token-123"}).status_code
        == 403
    )
    settings.METRICS_TOKEN = ""
    assert (
        Client().get("/metrics", headers={"Authorization": "Bearer "}).status_code == 403
    )  # no token set


def test_every_status_and_state_has_a_series_and_redis_away_is_no_500(settings) -> None:
    """The gauges listed only statuses some task had: with nothing streaming or polling,
    ``sum(dashboard_watchers{status=~"streaming|polling"}) == 0`` (the sample rule) had no
    series to compare and never fired. With Redis away, every scrape was a 500 and a
    traceback, the database's gauges lost with the counters."""
    from tasks_app.models import Agent, RemoteTask

    settings.METRICS_TOKEN = "t0k"
    agent = Agent.objects.create(name="m", base_url="http://127.0.0.1:9/m")
    RemoteTask.objects.create(agent=agent, title="t", state="TASK_STATE_WORKING",
                              watcher_status=RemoteTask.WatcherStatus.LOST)  # fmt: skip
    scrape = Client().get("/metrics", headers={"Authorization": "Bearer t0k"}).content.decode()
    assert re.search(r'^dashboard_watchers\{status="streaming"\} 0\.0$', scrape, re.M)
    assert sample(scrape, "dashboard_watchers", 'status="lost"') == 1.0
    assert re.search(r'^dashboard_tasks\{state="TASK_STATE_COMPLETED"\} 0\.0$', scrape, re.M)
    assert sample(scrape, "dashboard_metrics_redis_up") == 1.0
    settings.REDIS_URL = "redis://127.0.0.1:1/9"  # nothing listens there
    answer = Client().get("/metrics", headers={"Authorization": "Bearer t0k"})
    assert answer.status_code == 200
    text = answer.content.decode()
    assert sample(text, "dashboard_metrics_redis_up") == 0.0
    assert sample(text, "dashboard_watchers", 'status="lost"') == 1.0


def held(text: str) -> float:
    """Streams held now, summed over the workers (``dashboard_held_tasks{worker=...}``)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("dashboard_held_tasks{")
    )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_counters_move_while_a_worker_follows_a_task(
    agent, start_celery_worker, django_user_model
) -> None:
    """Scraped during the run: the stream shows as held, and the events recorded and the relay
    latency histogram move between two scrapes while the task still streams."""
    staff = Client()
    staff.force_login(
        django_user_model.objects.create_user("ops", password="pw-12345678", is_staff=True)
    )

    def scraped() -> str:
        return staff.get("/metrics").content.decode()

    start_celery_worker()
    demo = add_agent(agent.base_url, name="metrics demo")
    task = task_services.start_task(demo, "slow 60 0.1", mode="stream")  # about 6 s of streaming
    wait_for(lambda: held(scraped()) == 1, timeout=30, what="the stream to show as held")
    first = scraped()

    def moved_while_held() -> bool:
        text = scraped()
        return (
            held(text) == 1
            and sample(text, "dashboard_events_recorded_total", 'channel="stream"')
            > sample(first, "dashboard_events_recorded_total", 'channel="stream"')
            and sample(text, "dashboard_relay_latency_seconds_count")
            > sample(first, "dashboard_relay_latency_seconds_count")
        )

    # The worker adds its counts to Redis each second; the task is still held at that scrape.
    wait_for(moved_while_held, timeout=15, what="the counts to move while the stream is held")
    # Settling is the holder's last write to the task; it gives the lease back just after,
    # in a statement of its own (its turn ended): wait for both, then scrape.
    wait_for(
        lambda: task_services.RemoteTask.objects.filter(
            pk=task.pk, settled_at__isnull=False, lease_token=""
        ).exists(),
        what="the task to settle and its lease to be given back",
    )
    text = scraped()
    assert sample(text, "dashboard_tasks", 'state="TASK_STATE_COMPLETED"') >= 1
    assert held(text) == 0 and "dashboard_watchers" in text
    assert "# TYPE dashboard_relay_latency_seconds histogram" in text


def test_webhook_refusals_are_counted(settings, django_user_model) -> None:
    """A delivery for a config that does not exist is a 404, and /metrics counts it."""
    from tasks_app import metrics

    staff = Client()
    staff.force_login(
        django_user_model.objects.create_user("ops2", password="pw-12345678", is_staff=True)
    )
    before = sample(
        staff.get("/metrics").content.decode(), "dashboard_webhook_rejections_total", 'status="404"'
    )
    answer = Client().post("/push/no-such-config/", "{}", content_type="application/json")
    assert answer.status_code == 404
    metrics.flush()
    after = sample(
        staff.get("/metrics").content.decode(), "dashboard_webhook_rejections_total", 'status="404"'
    )
    assert after == before + 1


def test_a_relayed_batch_counts_every_row_once(settings) -> None:
    """A packed message's rows are observed once per commit time, each time with its row count:
    the histogram still counts every relayed row once."""
    from datetime import timedelta

    from django.utils import timezone

    from tasks_app import metrics, relay
    from tasks_app.runtime import shared_redis

    r = shared_redis.client(settings.REDIS_URL)

    def counted() -> float:
        metrics.flush()
        return sum(float(v) for v in r.hgetall(metrics._key("relay_latency_bucket")).values())

    before = counted()
    first = timezone.now() - timedelta(seconds=2)
    later = first + timedelta(seconds=1)
    events = [{"received_at": first.isoformat()}] * 3 + [{"received_at": later.isoformat()}]
    relay._observe({"type": "task.events", "events": events})
    relay._observe({"type": "task.event", "received_at": later.isoformat()})
    assert counted() - before == 5
