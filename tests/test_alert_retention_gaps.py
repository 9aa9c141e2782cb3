"""Alerts and retention gaps: an endless webhook answer is not read, no redirect is followed,
a withdrawn send's alert resolves, prune keeps a task with an open alert and records a run
stopped half-way.

Webhook receivers listen on 127.0.0.1 only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core.mail.utils import DNS_NAME
from django.utils import timezone

from tasks_app import alerts, retention
from tasks_app.models import Agent, Alert, AlertDelivery, OperatorAction, RemoteTask
from tests.serving import serve_in_thread, stop_serving

pytestmark = pytest.mark.django_db(transaction=True)

DAY = timedelta(days=1)


@pytest.fixture(autouse=True)
def alert_settings(settings, monkeypatch) -> None:
    monkeypatch.setattr(DNS_NAME, "_fqdn", "dashboard.test", raising=False)
    settings.ALERT_SILENT_WORKING_SECONDS = 60
    settings.ALERT_QUESTION_WAITING_SECONDS = 120
    settings.ALERT_AGENT_UNREACHABLE_SECONDS = 300
    settings.ALERT_SEND_FAILED = True
    settings.ALERT_PARKED = True
    settings.ALERT_EMAIL_TO = []
    settings.ALERT_WEBHOOK_URL = ""
    settings.ALERT_WEBHOOK_SECRET = ""
    settings.ALERT_DELIVERY_TIMEOUT_SECONDS = 2
    settings.ALERT_NOTIFY_RESOLVED = True
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"


@pytest.fixture
def agent(db) -> Agent:
    return Agent.objects.create(name="probe agent", base_url="http://127.0.0.1:9/p")


def old_task(agent: Agent, name: str, **extra) -> RemoteTask:
    old = timezone.now() - 40 * DAY
    task = RemoteTask.objects.create(
        agent=agent, remote_id=name, title=name, phase="task",
        state="TASK_STATE_COMPLETED", settled_at=old, **extra,
    )  # fmt: skip
    RemoteTask.objects.filter(pk=task.pk).update(updated_at=old)
    return task


class EndlessBody:
    """A receiver on 127.0.0.1 that answers 200 at once, then sends a body that never ends."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Length", str(10**12))
                self.end_headers()
                chunk = b"x" * 65536
                try:
                    while not owner.stop.is_set():
                        self.wfile.write(chunk)
                except OSError:
                    pass

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        serve_in_thread(self.server)

    def close(self) -> None:
        self.stop.set()
        stop_serving(self.server)


@pytest.fixture
def endless() -> Iterator[EndlessBody]:
    r = EndlessBody()
    yield r
    r.close()


def test_webhook_response_body_is_not_read(agent, settings, endless) -> None:
    settings.ALERT_WEBHOOK_URL = f"http://127.0.0.1:{endless.port}/hook"
    settings.ALERT_DELIVERY_TIMEOUT_SECONDS = 1.5
    task = RemoteTask.objects.create(
        agent=agent, title="t", phase="task", state="TASK_STATE_WORKING", watch="stream"
    )
    started = time.monotonic()
    result = alerts.evaluate(task.updated_at + timedelta(hours=1))
    elapsed = time.monotonic() - started
    assert len(result.opened) == 1
    delivery = AlertDelivery.objects.get()
    assert delivery.outcome == "sent", delivery.error
    assert elapsed < 1.0


def test_prune_interrupted_halfway_still_records_its_run(agent, monkeypatch) -> None:
    for n in range(4):
        old_task(agent, f"old-{n}")
    real = retention._remove
    calls = {"n": 0}

    def remove(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(retention, "_remove", remove)
    with pytest.raises(KeyboardInterrupt):
        retention.prune(30, batch=2)
    assert RemoteTask.objects.count() == 2  # the first batch is gone
    run = OperatorAction.objects.get(action="prune")
    assert run.payload["tasks"] == 2


def test_prune_keeps_a_task_with_an_open_alert(agent) -> None:
    task = old_task(agent, "parked", watcher_status=RemoteTask.WatcherStatus.PARKED)
    result = alerts.evaluate()
    assert [a.task_id for a in result.opened] == [task.pk]
    retention.prune(30)
    assert Alert.objects.filter(task_id=task.pk, resolved_at__isnull=True).exists()


def test_a_send_retried_then_withdrawn_between_evaluations_resolves(agent) -> None:
    from tasks_app.services import tasks as task_services

    task = RemoteTask.objects.create(
        agent=agent, title="send me", request={"message": {"messageId": "m-1"}}
    )
    task_services.fail_send(task.pk, "connection refused", retry_safe=True)
    key = f"send-failed:task:{task.pk}"
    assert [a.key for a in alerts.evaluate().opened] == [key]
    task.refresh_from_db()
    task_services.retry_send(task)
    task.refresh_from_db()
    assert task_services.withdraw_send(task, reason="not needed", actor_id=None)
    # No failure any more: an operator's cancel (find skips it, so nothing would reopen it).
    assert [a.key for a in alerts.evaluate().resolved] == [key]


def test_a_webhook_redirect_is_not_followed(agent, settings) -> None:
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            hits.append(self.path)
            self.send_response(307)
            self.send_header("Location", "/elsewhere")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    serve_in_thread(server)
    try:
        port = server.server_address[1]
        settings.ALERT_WEBHOOK_URL = f"http://127.0.0.1:{port}/hook"
        task = RemoteTask.objects.create(
            agent=agent, title="t", phase="task", state="TASK_STATE_WORKING", watch="stream"
        )
        alerts.evaluate(task.updated_at + timedelta(hours=1))
    finally:
        stop_serving(server)
    assert hits == ["/hook"]
    delivery = AlertDelivery.objects.get()
    assert delivery.outcome == "failed" and delivery.error.endswith("answered HTTP 307")


def test_an_alert_opened_before_a_crash_is_still_told_once(agent, settings, mailoutbox) -> None:
    """The alert was committed open before it was sent: a process that died in between left
    it open and untold for good (each later evaluation saw it open already)."""
    settings.ALERT_EMAIL_TO = ["ops@example.org"]
    task = RemoteTask.objects.create(
        agent=agent, title="t", phase="task", state="TASK_STATE_WORKING", watch="stream"
    )
    later = task.updated_at + timedelta(hours=1)

    def crash(described: list) -> None:
        raise KeyboardInterrupt  # the process dies between the commit and the send

    real = alerts._send_email
    alerts._send_email = crash
    try:
        with pytest.raises(KeyboardInterrupt):
            alerts.evaluate(later)
    finally:
        alerts._send_email = real
    assert Alert.objects.filter(opened_at__isnull=False, resolved_at__isnull=True).count() == 1
    # Within the grace the opener had, nobody else tells it; after it, the next one does.
    alerts.evaluate(later + timedelta(seconds=30))
    assert mailoutbox == []
    alerts.evaluate(later + alerts.tell_grace() + timedelta(seconds=1))
    assert len(mailoutbox) == 1 and "opened" in mailoutbox[0].subject.lower()
    assert AlertDelivery.objects.filter(event="opened", outcome="sent").count() == 1
    # Told: never again.
    alerts.evaluate(later + 3 * alerts.tell_grace())
    assert len(mailoutbox) == 1


def test_news_an_evaluator_told_is_not_told_again(agent, settings, mailoutbox) -> None:
    settings.ALERT_EMAIL_TO = ["ops@example.org"]
    task = RemoteTask.objects.create(
        agent=agent, title="t", phase="task", state="TASK_STATE_WORKING", watch="stream"
    )
    later = task.updated_at + timedelta(hours=1)
    alerts.evaluate(later)
    assert len(mailoutbox) == 1
    RemoteTask.objects.filter(pk=task.pk).update(state="TASK_STATE_COMPLETED")
    alerts.evaluate(later + timedelta(seconds=5))  # resolved, and told so
    assert len(mailoutbox) == 2
    alerts.evaluate(later + 5 * alerts.tell_grace())
    assert len(mailoutbox) == 2
    assert Alert.objects.get().resolved_told_at is not None
