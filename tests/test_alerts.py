"""Alerts: each rule opens and resolves; two evaluators at once open each alert once; delivery
by e-mail (Django's in-memory backend) and to a webhook receiver of this test's own on
loopback, each attempt recorded, failures recorded and the evaluation going on; the outbound
guard refuses a webhook anywhere else (before any connection); what people see.

Time: ``evaluate(now=...)`` is given a clock later than the rows' times instead of sleeping
past a threshold; every row is written by the services the watchers and views use.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core.mail.utils import DNS_NAME
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from tasks_app import alerts, jobs
from tasks_app.crypto import encrypt_json
from tasks_app.models import (
    Agent,
    Alert,
    AlertDelivery,
    Membership,
    OperatorAction,
    Project,
    RemoteTask,
)
from tasks_app.services import agents as agent_services
from tasks_app.services import tasks as task_services
from tasks_app.services.record import record
from tests.people import member
from tests.serving import serve_in_thread, stop_serving

pytestmark = pytest.mark.django_db(transaction=True)

HOUR = timedelta(hours=1)
AGENT_TOKEN = "agent-bearer-token-never-in-an-alert"


def snapshot(task_id: str, state: str, text: str | None = None) -> dict:
    status: dict = {"state": state}
    if text:
        status["message"] = {
            "messageId": f"m-{text}",
            "role": "ROLE_AGENT",
            "parts": [{"text": text}],
        }
    return {"task": {"id": task_id, "contextId": "c-1", "status": status}}


def status(task_id: str, state: str, text: str) -> dict:
    message = {"messageId": f"m-{text}", "role": "ROLE_AGENT", "parts": [{"text": text}]}
    return {
        "statusUpdate": {
            "taskId": task_id,
            "contextId": "c-1",
            "status": {"state": state, "message": message},
        }
    }


@pytest.fixture(autouse=True)
def alert_settings(settings, monkeypatch) -> None:
    """Every rule on with known thresholds; no channel unless a test sets one.

    The host name Django's mail code gives (Message-ID, the SMTP greeting) is set here: left
    alone it is ``socket.getfqdn()``, a real lookup the loopback hook refuses."""
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
    project = Project.objects.get_or_create(name="alpha")[0]
    return Agent.objects.create(
        project=project,
        name="alpha agent",
        base_url="http://127.0.0.1:9/alpha",
        interface_url="http://127.0.0.1:9/alpha/rpc",
        binding="JSONRPC",
        credentials_encrypted=encrypt_json({"token": AGENT_TOKEN}),
        credential_origins=["http://127.0.0.1:9"],
    )


def working_task(agent: Agent, remote_id: str = "t-1", title: str = "nightly report") -> RemoteTask:
    task = RemoteTask.objects.create(agent=agent, title=title, phase="task", watch="stream")
    record(task, snapshot(remote_id, "TASK_STATE_WORKING", "starting"), "stream")
    task.refresh_from_db()
    return task


def unresolved(key: str) -> list[Alert]:
    return list(Alert.objects.filter(key=key, resolved_at__isnull=True))


# -- each rule opens and resolves -------------------------------------------------------------


def test_silent_working_opens_past_its_threshold_and_resolves_when_the_task_moves(agent):
    task = working_task(agent)
    key = f"silent-working:task:{task.pk}"
    assert not alerts.evaluate(task.updated_at + timedelta(seconds=30)).opened  # not yet
    result = alerts.evaluate(task.updated_at + timedelta(seconds=61))
    assert [a.key for a in result.opened] == [key]
    alert = unresolved(key)[0]
    assert (
        alert.opened_at is not None
        and alert.since == task.updated_at
        and alert.agent_id == agent.pk
    )
    assert "nightly report" in alert.message
    # Evaluated again while still silent: the same alert, seen again, nothing new.
    later = alerts.evaluate(task.updated_at + timedelta(seconds=90))
    assert not later.opened and not later.resolved
    assert unresolved(key)[0].last_seen_at > alert.last_seen_at
    # The task moves: resolved, even by an evaluation whose clock says it is silent again.
    record(task, status("t-1", "TASK_STATE_WORKING", "step 1"), "stream")
    task.refresh_from_db()
    result = alerts.evaluate(task.updated_at + timedelta(seconds=5))
    assert [a.pk for a in result.resolved] == [alert.pk]
    assert not unresolved(key)
    # Silent again past the threshold: a new alert (the old one stays resolved, recorded).
    result = alerts.evaluate(task.updated_at + timedelta(seconds=61))
    assert [a.key for a in result.opened] == [key]
    assert Alert.objects.filter(key=key).count() == 2


def test_a_task_nobody_follows_or_that_was_abandoned_is_not_silent(agent):
    task = working_task(agent)
    RemoteTask.objects.filter(pk=task.pk).update(
        watch=RemoteTask.Watch.NONE
    )  # e.g. imported, not followed
    assert not alerts.evaluate(task.updated_at + HOUR).opened
    RemoteTask.objects.filter(pk=task.pk).update(watch=RemoteTask.Watch.STREAM)
    assert len(alerts.evaluate(task.updated_at + HOUR).opened) == 1
    task_services.abandon_task(task, reason="no longer needed")
    result = alerts.evaluate(timezone.now() + HOUR)
    assert len(result.resolved) == 1 and not result.opened


def test_question_waiting_opens_and_resolves_when_the_agent_goes_on(agent):
    task = RemoteTask.objects.create(
        agent=agent, title="needs a name", phase="task", watch="stream"
    )
    record(task, snapshot("t-q", "TASK_STATE_INPUT_REQUIRED", "What is your name?"), "stream")
    task.refresh_from_db()
    assert task.asked_seq > task.answered_seq
    key = f"question-waiting:task:{task.pk}"
    assert not alerts.evaluate(task.updated_at + timedelta(seconds=100)).opened
    result = alerts.evaluate(task.updated_at + timedelta(seconds=121))
    assert [a.key for a in result.opened] == [key]
    assert "waited for an answer" in result.opened[0].message
    record(task, status("t-q", "TASK_STATE_WORKING", "thanks"), "stream")
    result = alerts.evaluate(timezone.now() + timedelta(seconds=1))
    assert [a.key for a in result.resolved] == [key]


def test_an_agent_asking_again_does_not_restart_the_wait(agent, monkeypatch):
    """The wait was measured from the task's last change: an agent that repeats its question
    (a new status, still unanswered) every poll never reached the threshold. It counts from
    the first question of the wait now; an answer ends that wait, and a question after it
    begins a new one."""
    clock = [timezone.now()]
    monkeypatch.setattr(timezone, "now", lambda: clock[0])
    task = RemoteTask.objects.create(agent=agent, title="asks often", phase="task", watch="poll")
    record(task, snapshot("t-r", "TASK_STATE_INPUT_REQUIRED", "Your name?"), "poll")
    first = clock[0]
    for n in range(1, 5):  # asked again every 40 s: 160 s of waiting, 0 s since the last
        clock[0] = first + timedelta(seconds=40 * n)
        record(task, status("t-r", "TASK_STATE_INPUT_REQUIRED", f"Your name? ({n})"), "poll")
    task.refresh_from_db()
    assert task.asked_at == clock[0] and task.updated_at == clock[0]
    key = f"question-waiting:task:{task.pk}"
    result = alerts.evaluate(clock[0] + timedelta(seconds=1))
    assert [a.key for a in result.opened] == [key]
    assert result.opened[0].since == first
    # Answered: the wait ends (resolved); the agent's next question is a new wait.
    task_services.answer_task(task, "Ada")
    assert [a.key for a in alerts.evaluate(clock[0] + timedelta(seconds=2)).resolved] == [key]
    clock[0] += timedelta(seconds=10)
    record(task, status("t-r", "TASK_STATE_INPUT_REQUIRED", "And your surname?"), "poll")
    task.refresh_from_db()
    assert task.question_since == clock[0]
    assert not alerts.evaluate(clock[0] + timedelta(seconds=100)).opened
    assert [a.since for a in alerts.evaluate(clock[0] + timedelta(seconds=121)).opened] == [
        clock[0]
    ]


def test_an_answered_question_is_not_waiting(agent, django_user_model):
    task = RemoteTask.objects.create(
        agent=agent, title="q", phase="task", remote_id="", watch="stream"
    )
    record(task, snapshot("t-a", "TASK_STATE_INPUT_REQUIRED", "Which one?"), "stream")
    task.refresh_from_db()
    alerts.evaluate(task.updated_at + HOUR)
    assert unresolved(f"question-waiting:task:{task.pk}")
    task_services.answer_task(task, "the first")  # accepted: now it is the agent's turn
    result = alerts.evaluate(timezone.now() + HOUR)
    assert [a.rule for a in result.resolved] == ["question-waiting"]
    assert not unresolved(f"question-waiting:task:{task.pk}")


def test_agent_unreachable_opens_only_after_its_threshold_and_resolves_when_reachable(agent):
    key = f"agent-unreachable:agent:{agent.pk}"
    agent_services.mark_unreachable(agent.pk, "connection refused")
    t0 = timezone.now()
    assert not alerts.evaluate(t0).opened
    pending = unresolved(key)[0]
    assert pending.opened_at is None  # seen, not yet an alert: nobody is shown it
    assert (
        not alerts.open_alerts(None).exists()
        and not Alert.objects.filter(opened_at__isnull=False).exists()
    )
    assert not alerts.evaluate(t0 + timedelta(seconds=200)).opened
    result = alerts.evaluate(t0 + timedelta(seconds=301))
    assert [a.key for a in result.opened] == [key]
    assert unresolved(key)[0].since == pending.since  # counted from the first sighting
    agent_services.mark_reachable(agent.pk)
    result = alerts.evaluate(t0 + timedelta(seconds=302))
    assert [a.key for a in result.resolved] == [key]


def test_an_agent_back_before_its_threshold_leaves_no_alert(agent):
    agent_services.mark_unreachable(agent.pk, "timeout")
    alerts.evaluate()
    assert Alert.objects.count() == 1
    agent_services.mark_reachable(agent.pk)
    result = alerts.evaluate(timezone.now() + HOUR)
    assert not result.opened and not result.resolved
    assert Alert.objects.count() == 0  # the pending sighting is gone; it never was an alert


def test_send_failed_opens_at_once_and_resolves_on_retry(agent):
    task = RemoteTask.objects.create(
        agent=agent, title="send me", request={"message": {"messageId": "m-1"}}
    )
    task_services.fail_send(task.pk, "connection refused", retry_safe=True)
    key = f"send-failed:task:{task.pk}"
    result = alerts.evaluate()
    assert [a.key for a in result.opened] == [key]
    task.refresh_from_db()
    task_services.retry_send(task)
    result = alerts.evaluate()
    assert [a.key for a in result.resolved] == [key]


def test_parked_opens_at_once_and_resolves_when_watched_again(agent):
    task = working_task(agent, "t-p")
    token = task_services.acquire_lease(task.pk, "a watcher")
    assert token
    task_services.release_lease(
        task.pk,
        token,
        status=RemoteTask.WatcherStatus.PARKED,
        note="needs attention: 8 fruitless turns",
        hold_off=600,
    )
    key = f"parked:task:{task.pk}"
    result = alerts.evaluate()
    assert [a.key for a in result.opened] == [key]
    assert "8 fruitless turns" in result.opened[0].message
    task.refresh_from_db()
    task_services.watch_again(task)
    result = alerts.evaluate()
    assert [a.key for a in result.resolved] == [key]


def test_a_parked_silent_task_has_one_alert_for_its_one_cause(agent, settings):
    """A parked working task had both a ``parked`` and a ``silent-working`` alert open (found
    by driving the dashboard): its silence is what parking it tells. A silent alert opened
    before the task was parked resolves when it is; with the parked rule off, silence tells."""
    task = working_task(agent, "t-q")
    silent, parked = f"silent-working:task:{task.pk}", f"parked:task:{task.pk}"
    assert [a.key for a in alerts.evaluate(task.updated_at + HOUR).opened] == [silent]
    token = task_services.acquire_lease(task.pk, "a watcher")
    task_services.release_lease(
        task.pk, token, status=RemoteTask.WatcherStatus.PARKED, note="needs attention: x",
        hold_off=600,
    )  # fmt: skip
    result = alerts.evaluate(task.updated_at + HOUR)
    assert [a.key for a in result.opened] == [parked]
    assert [a.key for a in result.resolved] == [silent]
    assert not alerts.evaluate(task.updated_at + 2 * HOUR).opened
    settings.ALERT_PARKED = False
    result = alerts.evaluate(task.updated_at + 2 * HOUR)
    assert [a.key for a in result.opened] == [silent] and [a.key for a in result.resolved] == [
        parked
    ]


def test_a_rule_turned_off_resolves_its_alerts_and_opens_none(agent, settings):
    task = working_task(agent)
    alerts.evaluate(task.updated_at + HOUR)
    assert unresolved(f"silent-working:task:{task.pk}")
    settings.ALERT_SILENT_WORKING_SECONDS = None
    result = alerts.evaluate(task.updated_at + 2 * HOUR)
    assert [a.rule for a in result.resolved] == ["silent-working"] and not result.opened


def test_the_job_runs_the_evaluation_and_is_on_the_beat_schedule(agent, settings):
    from dashboard.celery import _beat_schedule

    task = working_task(agent)
    RemoteTask.objects.filter(pk=task.pk).update(
        updated_at=timezone.now() - HOUR
    )  # silent for an hour
    assert jobs.evaluate_alerts() == "1 opened, 0 resolved, 0 deliveries"
    settings.ALERT_EVERY_SECONDS = 7
    entry = _beat_schedule()["evaluate-alerts"]
    assert entry == {"task": "tasks_app.jobs.evaluate_alerts", "schedule": 7}


def test_each_rule_is_one_bounded_query(agent, settings, django_assert_max_num_queries):
    settings.ALERT_MAX_PER_RULE = 3
    for i in range(5):
        working_task(agent, f"t-{i}", f"task {i}")
    later = timezone.now() + HOUR
    result = alerts.evaluate(later)
    assert len(result.opened) == 3  # at most ALERT_MAX_PER_RULE per rule and evaluation
    assert len(alerts.evaluate(later).opened) == 2  # the rest on the next one
    # Nothing new: per rule one resolve query, one find query, one lookup and one touch.
    with django_assert_max_num_queries(5 * 4 + 1):
        assert not alerts.evaluate(later).opened


# -- concurrency -----------------------------------------------------------------------------


def _race(n: int, when) -> list[alerts.Evaluation]:
    """Release ``n`` evaluations at once (threads, each with its own connection)."""
    barrier = threading.Barrier(n)
    results: list[alerts.Evaluation] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            barrier.wait(timeout=10)
            results.append(alerts.evaluate(when))
        except BaseException as exc:  # reported below: a thread's failure must fail the test
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert len(results) == n
    return results


def test_two_evaluators_at_once_open_and_resolve_each_alert_once(agent, settings, mailoutbox):
    settings.ALERT_EMAIL_TO = ["ops@example.org"]
    tasks = [working_task(agent, f"t-{i}", f"task {i}") for i in range(4)]
    agent_services.mark_unreachable(agent.pk, "refused")
    t0 = timezone.now()
    assert not alerts.evaluate(
        t0
    ).opened  # the agent's first sighting (pending); tasks not silent yet
    results = _race(2, t0 + timedelta(seconds=301))
    opened = [a.key for r in results for a in r.opened]
    assert sorted(opened) == sorted(
        [f"silent-working:task:{t.pk}" for t in tasks] + [f"agent-unreachable:agent:{agent.pk}"]
    )  # each once, by one evaluator or the other
    for key in opened:
        assert len(unresolved(key)) == 1
    # Each alert was delivered once (by the evaluator that opened it).
    per_alert = [d.alert_id for d in AlertDelivery.objects.filter(event="opened")]
    assert sorted(per_alert) == sorted(set(per_alert)) and len(per_alert) == len(opened)
    assert sum(len(m.to) for m in mailoutbox) == sum(1 for r in results if r.opened)
    # Both see the tasks move at once: each alert resolved once.
    for task in tasks:
        record(task, status(task.remote_id, "TASK_STATE_WORKING", "moved"), "stream")
    agent_services.mark_reachable(agent.pk)
    results = _race(2, timezone.now() + timedelta(seconds=1))
    resolved = [a.key for r in results for a in r.resolved]
    assert sorted(resolved) == sorted(opened)
    assert not Alert.objects.filter(resolved_at__isnull=True).exists()


# -- delivery --------------------------------------------------------------------------------


class Receiver:
    """A webhook receiver of this test's own on 127.0.0.1: records each request, answers ``status``."""

    def __init__(self, status: int = 204, delay: float = 0.0) -> None:
        self.status = status
        self.delay = delay
        self.requests: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.requests.append(
                    {"path": self.path, "headers": dict(self.headers), "body": body}
                )
                if receiver.delay:
                    time.sleep(receiver.delay)
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        serve_in_thread(self.server)

    def url(self, path: str = "/hooks/alerts") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        stop_serving(self.server)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def test_email_on_open_and_on_resolve_through_djangos_mail(agent, settings, mailoutbox):
    settings.ALERT_EMAIL_TO = ["ops@example.org", "oncall@example.org"]
    settings.ALERT_EMAIL_FROM = "dashboard@example.org"
    settings.PUBLIC_URL = "https://dash.example.org"
    task = working_task(agent)
    result = alerts.evaluate(task.updated_at + HOUR)
    assert len(mailoutbox) == 1
    mail = mailoutbox[0]
    assert (
        mail.to == ["ops@example.org", "oncall@example.org"]
        and mail.from_email == "dashboard@example.org"
    )
    assert "1 alert opened" in mail.subject and "nightly report" in mail.subject
    assert (
        f"https://dash.example.org/tasks/{task.pk}/" in mail.body and "project alpha" in mail.body
    )
    assert AGENT_TOKEN not in mail.body + mail.subject
    delivery = AlertDelivery.objects.get()
    assert (delivery.alert_id, delivery.channel, delivery.event, delivery.outcome) == (
        result.opened[0].pk, "email", "opened", "sent",
    )  # fmt: skip
    assert delivery.target == "ops@example.org, oncall@example.org"
    record(task, status("t-1", "TASK_STATE_COMPLETED", "done"), "stream")
    alerts.evaluate()
    assert len(mailoutbox) == 2 and "1 resolved" in mailoutbox[1].subject
    assert AlertDelivery.objects.filter(event="resolved", outcome="sent").count() == 1


def test_a_title_with_line_breaks_still_makes_a_one_line_subject(agent, settings, mailoutbox):
    settings.ALERT_EMAIL_TO = ["ops@example.org"]
    task = working_task(agent, "t-nl", "first line\r\nBcc: someone@example.org")
    alerts.evaluate(task.updated_at + HOUR)
    assert AlertDelivery.objects.get().outcome == "sent"
    [mail] = mailoutbox
    assert "\n" not in mail.subject and "\r" not in mail.subject and mail.bcc == []
    assert "first line Bcc: someone@example.org" in mail.subject


def test_webhook_gets_json_signed_and_without_secrets(agent, settings, receiver):
    settings.ALERT_WEBHOOK_URL = receiver.url("/hooks/s3cr3t-path?token=webhook-token")
    settings.ALERT_WEBHOOK_SECRET = "signing-secret"
    task = working_task(agent)
    alerts.evaluate(task.updated_at + HOUR)
    assert len(receiver.requests) == 1
    req = receiver.requests[0]
    assert req["path"] == "/hooks/s3cr3t-path?token=webhook-token"
    assert req["headers"]["Content-Type"] == "application/json"
    expected = hmac.new(b"signing-secret", req["body"], hashlib.sha256).hexdigest()
    assert req["headers"]["X-Dashboard-Signature"] == f"sha256={expected}"
    body = json.loads(req["body"])
    assert body["source"] == "a2a-dashboard" and body["more"] == 0
    [item] = body["alerts"]
    assert item["event"] == "opened" and item["rule"] == "silent-working"
    assert item["task"]["id"] == task.pk and item["task"]["remote_id"] == "t-1"
    assert (
        item["agent"] == {"id": agent.pk, "name": "alpha agent", "url": None}
        and item["project"] == "alpha"
    )
    text = req["body"].decode()
    for secret in (AGENT_TOKEN, "signing-secret", "webhook-token", agent.credentials_encrypted):
        assert secret not in text
    delivery = AlertDelivery.objects.get()
    assert delivery.outcome == "sent" and delivery.channel == "webhook"
    assert (
        delivery.target == f"http://127.0.0.1:{receiver.port}"
    )  # the origin only: the path is a secret


def test_a_failing_webhook_is_recorded_and_the_evaluation_goes_on(
    agent, settings, mailoutbox, receiver
):
    settings.ALERT_EMAIL_TO = ["ops@example.org"]
    settings.ALERT_WEBHOOK_URL = receiver.url()
    receiver.status = 500
    first = working_task(agent, "t-1", "first")
    result = alerts.evaluate(first.updated_at + HOUR)
    assert len(result.opened) == 1 and len(receiver.requests) == 1
    by_channel = {d.channel: d for d in AlertDelivery.objects.all()}
    assert by_channel["webhook"].outcome == "failed"
    assert by_channel["webhook"].error == f"http://127.0.0.1:{receiver.port} answered HTTP 500"
    assert (
        by_channel["email"].outcome == "sent" and len(mailoutbox) == 1
    )  # the other channel went out
    # Nobody listening: a connection error, recorded; the next alert still opens.
    receiver.close()
    second = working_task(agent, "t-2", "second")
    result = alerts.evaluate(second.updated_at + HOUR)
    assert [a.task_id for a in result.opened] == [second.pk]
    failed = AlertDelivery.objects.get(alert=result.opened[0], channel="webhook")
    assert failed.outcome == "failed" and "ConnectError" in failed.error
    assert "/hooks/alerts" not in failed.error


def test_a_slow_webhook_is_given_up_within_the_timeout(agent, settings, receiver):
    settings.ALERT_WEBHOOK_URL = receiver.url()
    settings.ALERT_DELIVERY_TIMEOUT_SECONDS = 0.5
    receiver.delay = 3
    task = working_task(agent)
    started = time.monotonic()
    result = alerts.evaluate(task.updated_at + HOUR)
    assert time.monotonic() - started < 2.5
    assert len(result.opened) == 1
    delivery = AlertDelivery.objects.get()
    assert delivery.outcome == "failed" and "within 0.5 s" in delivery.error


def test_a_webhook_whose_name_resolves_slowly_is_given_up_within_the_timeout(
    agent, settings, receiver, monkeypatch
):
    """The lookup timed out at the deadline, but ``asyncio.run`` then waited for the
    resolver's thread: the evaluation was held as long as the system resolver liked."""
    import socket

    real = socket.getaddrinfo
    released = threading.Event()

    def getaddrinfo(host, port, *args, **kwargs):
        if host == "slow-dns.test":
            released.wait(6)  # a resolver that ignores every deadline
            return real("127.0.0.1", port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    settings.ALERT_WEBHOOK_URL = f"http://slow-dns.test:{receiver.port}/hooks/alerts"
    settings.ALERT_DELIVERY_TIMEOUT_SECONDS = 0.5
    task = working_task(agent)
    started = time.monotonic()
    try:
        result = alerts.evaluate(task.updated_at + HOUR)
        took = time.monotonic() - started
    finally:
        released.set()
    assert took < 3, f"held {took:.1f} s by the resolver"
    assert len(result.opened) == 1
    delivery = AlertDelivery.objects.get()
    assert delivery.outcome == "failed" and "0.5 s" in delivery.error, delivery.error
    assert not receiver.requests


@pytest.mark.parametrize(
    "url",
    [
        "http://10.255.255.1/hook",
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00::1]/hook",
    ],
)
def test_the_outbound_guard_refuses_a_webhook_off_loopback(agent, settings, url):
    """OUTBOUND_ALLOW is loopback in tests; anything else is refused before any connection
    (the suite's connect hook would fail the test if one were attempted)."""
    settings.ALERT_WEBHOOK_URL = url
    task = working_task(agent)
    result = alerts.evaluate(task.updated_at + HOUR)
    assert len(result.opened) == 1
    delivery = AlertDelivery.objects.get()
    assert delivery.outcome == "failed" and delivery.error.startswith(
        "refused by the outbound guard"
    )


def test_a_broken_mail_server_is_recorded(agent, settings, receiver):
    settings.ALERT_EMAIL_TO = ["ops@example.org"]
    settings.ALERT_DELIVERY_TIMEOUT_SECONDS = 0.5
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST = "127.0.0.1"
    settings.EMAIL_PORT = receiver.port  # an HTTP server: it never greets like an SMTP server
    task = working_task(agent)
    result = alerts.evaluate(task.updated_at + HOUR)
    assert len(result.opened) == 1
    delivery = AlertDelivery.objects.get()
    assert delivery.channel == "email" and delivery.outcome == "failed" and delivery.error


# -- what people see ---------------------------------------------------------------------------


@pytest.fixture
def people(django_user_model) -> dict[str, Client]:
    clients = {}
    for name, role, project in (
        ("viewer", Membership.Role.VIEWER, "alpha"),
        ("admin", Membership.Role.AGENT_ADMIN, "alpha"),
        ("outsider", Membership.Role.AGENT_ADMIN, "beta"),
    ):
        user = member(
            django_user_model.objects.create_user(name, password="pw-12345678"), role, project
        )
        clients[name] = Client()
        clients[name].force_login(user)
    return clients


def test_open_alerts_show_on_the_overview_only_to_who_may_read_them(agent, people):
    task = working_task(agent)
    alerts.evaluate(task.updated_at + HOUR)
    alert = Alert.objects.get()
    page = people["viewer"].get(reverse("overview")).content.decode()
    assert f'data-alert="{alert.pk}"' in page and f'href="/tasks/{task.pk}/"' in page
    assert 'id="alerts"' in page and "alerts.js" in page
    other = people["outsider"].get(reverse("overview")).content.decode()
    assert f'data-alert="{alert.pk}"' not in other and "nightly report" not in other
    assert 'id="alerts"' in other  # the (empty, hidden) section, so that one can appear live
    inbox = people["viewer"].get(reverse("inbox")).content.decode()
    assert f'data-alert="{alert.pk}"' in inbox  # the inbox includes the same section
    assert (
        f'data-alert="{alert.pk}"' not in people["outsider"].get(reverse("inbox")).content.decode()
    )
    listing = people["viewer"].get(reverse("alerts")).content.decode()
    assert f'data-alert="{alert.pk}"' in listing and 'id="alert-test"' not in listing
    assert (
        f'data-alert="{alert.pk}"' not in people["outsider"].get(reverse("alerts")).content.decode()
    )


def test_the_live_section_answers_204_until_the_alerts_change(agent, people):
    client = people["viewer"]
    empty = client.get(reverse("alerts-live"))
    assert empty.status_code == 200
    version = alerts.current_version(None)
    assert f'data-version="{version}"' in empty.content.decode()
    assert client.get(reverse("alerts-live"), {"v": version}).status_code == 204
    task = working_task(agent)
    alerts.evaluate(task.updated_at + HOUR)
    changed = client.get(reverse("alerts-live"), {"v": version})
    assert changed.status_code == 200 and f'data-task="{task.pk}"' in changed.content.decode()
    # The outsider's set did not change: nothing new for them.
    assert people["outsider"].get(reverse("alerts-live"), {"v": version}).status_code == 204
    assert (
        f'data-task="{task.pk}"'
        not in people["outsider"].get(reverse("alerts-live")).content.decode()
    )


def test_send_a_test_alert_through_each_channel(agent, settings, mailoutbox, receiver, people):
    settings.ALERT_EMAIL_TO = ["ops@example.org"]
    settings.ALERT_WEBHOOK_URL = receiver.url()
    response = people["admin"].post(reverse("alerts-test"), follow=True)
    page = response.content.decode()
    assert response.status_code == 200
    assert "Test alert sent by e-mail to ops@example.org." in page
    assert f"Test alert sent by Webhook to http://127.0.0.1:{receiver.port}." in page
    assert len(mailoutbox) == 1 and mailoutbox[0].subject == "[A2A dashboard] Test alert"
    assert json.loads(receiver.requests[0]["body"])["alerts"][0]["event"] == "test"
    test_alert = Alert.objects.get(rule="test")
    assert test_alert.resolved_at is not None  # never shown as open
    assert set(test_alert.deliveries.values_list("channel", "outcome")) == {
        ("email", "sent"),
        ("webhook", "sent"),
    }
    assert 'id="alert-deliveries"' in page
    action = OperatorAction.objects.get(action="alert-test")
    assert action.outcome == "email: sent; webhook: sent" and action.actor.username == "admin"
    # A failing channel: its error is shown.
    receiver.status = 503
    page = people["admin"].post(reverse("alerts-test"), follow=True).content.decode()
    assert "answered HTTP 503" in page


def test_only_staff_and_agent_admins_may_send_a_test(
    agent, people, django_user_model, mailoutbox, settings
):
    settings.ALERT_EMAIL_TO = ["ops@example.org"]
    assert people["viewer"].post(reverse("alerts-test")).status_code == 403
    assert OperatorAction.objects.filter(action="forbidden").count() == 1
    assert not mailoutbox and not Alert.objects.exists()
    staff = django_user_model.objects.create_user("staff", password="pw-12345678", is_staff=True)
    client = Client()
    client.force_login(staff)
    assert client.post(reverse("alerts-test")).status_code == 302
    assert len(mailoutbox) == 1


def test_no_channel_configured_says_so(agent, people):
    page = people["admin"].post(reverse("alerts-test"), follow=True).content.decode()
    assert "No channel is configured" in page
    assert not AlertDelivery.objects.exists()


def test_every_page_links_to_the_alerts_page_in_its_main_navigation(people):
    link = f'href="{reverse("alerts")}"'
    for name in ("viewer", "outsider"):
        overview = people[name].get(reverse("overview")).content.decode()
        nav = overview[overview.index('<nav aria-label="Main">') : overview.index("</nav>")]
        assert link in nav and 'aria-current="page">Alerts' not in nav
    listing = people["viewer"].get(reverse("alerts")).content.decode()
    nav = listing[listing.index('<nav aria-label="Main">') : listing.index("</nav>")]
    assert f'{link} aria-current="page">Alerts</a>' in nav


@pytest.mark.django_db
def test_the_parked_scan_reads_its_partial_index() -> None:
    """The parked rule runs every ALERT_EVERY_SECONDS over all tasks: a partial index holds only
    the parked live ones, so the scan does not read the whole task table."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            # A small test table is read fastest by a plain scan: ask whether the index can serve.
            cursor.execute("SET LOCAL enable_seqscan = off")
        plan = alerts.parked_scan().values_list("pk")[:500].explain()
    assert "parked_tasks" in plan, plan


# -- what a slow mail server, a deleted subject and an agent's name may do ----------------------


class DripSMTP:
    """A mail server on loopback that greets one line of a multi-line reply every ``every``
    seconds, for ever: each read is in time, the greeting never ends."""

    def __init__(self, every: float) -> None:
        import socket

        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.stop = threading.Event()
        self.every = every
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.server.settimeout(0.2)
        while not self.stop.is_set():
            try:
                peer, _ = self.server.accept()
            except OSError:
                continue
            with peer:
                while not self.stop.is_set():
                    try:
                        peer.sendall(b"220-still greeting\r\n")
                    except OSError:
                        break
                    time.sleep(self.every)

    def close(self) -> None:
        self.stop.set()
        self.server.close()


def test_a_mail_server_that_never_finishes_answering_is_given_up_at_the_deadline(agent, settings):
    """smtplib's timeout bounds each read; a server that sent a line now and then held the
    evaluation (and the test button's request) for as long as it liked."""
    settings.ALERT_EMAIL_TO = ["ops@example.org"]
    settings.ALERT_DELIVERY_TIMEOUT_SECONDS = 0.5
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST = "127.0.0.1"
    server = DripSMTP(every=0.1)
    settings.EMAIL_PORT = server.port
    try:
        task = working_task(agent)
        started = time.monotonic()
        result = alerts.evaluate(task.updated_at + HOUR)
        took = time.monotonic() - started
        delivery = AlertDelivery.objects.get(alert__in=result.opened, channel="email")
        assert delivery.outcome == "failed" and "did not finish within 0.5 s" in delivery.error
        assert took < 5
        # While that send is still running, the next one is not started beside it.
        assert "previous delivery" in (alerts._send_email([]) or "")
    finally:
        server.close()
        for thread in alerts._mail_in_flight:  # it ends once the server hangs up
            thread.join(5)
        assert not any(thread.is_alive() for thread in alerts._mail_in_flight)


def test_an_alert_whose_subject_was_deleted_does_not_lose_the_others(agent, mailoutbox, settings):
    settings.ALERT_EMAIL_TO = ["ops@example.org"]
    gone, kept = working_task(agent, "t-a", "gone task"), working_task(agent, "t-b", "kept task")
    result = alerts.evaluate(kept.updated_at + HOUR, deliver=False)
    assert len(result.opened) == 2
    RemoteTask.objects.filter(pk=gone.pk).delete()  # its alert goes with it
    rows = alerts.deliver_changes(result.opened, result.resolved)
    assert len(mailoutbox) == 1 and "kept task" in mailoutbox[0].body
    assert "gone task" not in mailoutbox[0].body and len(rows) == 1


def test_an_agents_name_is_one_line_in_a_mail(agent, mailoutbox, settings):
    """An agent's name comes from its card: with line breaks it wrote lines into the mail
    that looked like alerts of their own; a NUL in a title reached the subject."""
    settings.ALERT_EMAIL_TO = ["ops@example.org"]
    Agent.objects.filter(pk=agent.pk).update(
        name="evil\n\n    https://phish.example/login\n[opened] fake: pay now"
    )
    agent_services.mark_unreachable(agent.pk, "connection refused")
    title = "title with a \x00 NUL" if connection.vendor == "sqlite" else "plain title"
    task = working_task(agent, "t-n", title)
    t0 = task.updated_at
    alerts.evaluate(t0)  # the agent is seen unreachable: counted from here
    alerts.evaluate(t0 + 2 * HOUR)
    mail = mailoutbox[-1]
    assert "unreachable" in mail.body
    assert "\x00" not in mail.subject
    assert not [line for line in mail.body.splitlines() if line.startswith("[opened] fake")]
    assert not [line for line in mail.body.splitlines() if line.strip().startswith("https://phish")]
