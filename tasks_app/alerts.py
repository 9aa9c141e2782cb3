"""Alerts: rules that open an alert when something needs a person, and resolve it when it ends.

The rules (thresholds from the settings; a rule whose setting is 0 or "off" is off):

=====================  ======================================================  ==============================
rule                   open while                                              threshold
=====================  ======================================================  ==============================
``silent-working``     a followed task is ``working`` and nothing was          ALERT_SILENT_WORKING_SECONDS
                       recorded for it for longer than the threshold (not
                       a parked one while ``parked`` is on: that tells it)
``question-waiting``   a task asks (input or auth required) and has waited     ALERT_QUESTION_WAITING_SECONDS
                       for an answer for longer than the threshold, counted
                       from the first question of the wait (an agent asking
                       again, unanswered, does not restart it)
``agent-unreachable``  the agent's last contact failed, for longer than the    ALERT_AGENT_UNREACHABLE_SECONDS
                       threshold (counted from the first evaluation that saw
                       it: the agent row keeps no time for it)
``send-failed``        the first send failed before the agent named a task     ALERT_SEND_FAILED (on/off)
``parked``             the task's watcher parked it (needs attention)          ALERT_PARKED (on/off)
=====================  ======================================================  ==============================

:func:`evaluate` runs on the beat schedule (``tasks_app.jobs.evaluate_alerts``, every
ALERT_EVERY_SECONDS). Per rule it first resolves the unresolved alerts whose condition no
longer holds (one query joining their subject, so "the task moved" is seen even if it went
silent again since), then finds what matches now (one query on an index, at most
ALERT_MAX_PER_RULE rows) and opens what is not open yet. Opening is an INSERT guarded by
the partial unique index on ``key`` among unresolved alerts, and resolving a
compare-and-set on ``resolved_at``: two evaluators running at once open (and deliver)
each alert once.

Delivery: the alerts one evaluation opened (and resolved, with ALERT_NOTIFY_RESOLVED) go
out together: one e-mail to ALERT_EMAIL_TO (Django's mail) and one JSON POST to
ALERT_WEBHOOK_URL (through the outbound guard, like every server-side fetch), each within
ALERT_DELIVERY_TIMEOUT_SECONDS. Every attempt is an ``AlertDelivery`` row per alert with
its outcome; a failure is recorded and never stops the evaluation. Payloads carry what a
person would read on the page (rule, message, task title and ids, agent name, project,
times) and never a credential; the webhook's URL is recorded only as its origin.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings
from django.core.mail import EmailMessage, get_connection
from django.db import IntegrityError, transaction
from django.db.models import Exists, F, OuterRef, Q, QuerySet
from django.urls import reverse
from django.utils import timezone
from django.utils.timesince import timesince

from tasks_app import access, outbound
from tasks_app.a2a import guard
from tasks_app.models import (
    INTERRUPTED_STATES,
    Agent,
    Alert,
    AlertDelivery,
    OperatorAction,
    RemoteTask,
    for_list,
)
from tasks_app.services.tasks import WITHDRAWN

log = logging.getLogger(__name__)

Rule = Alert.Rule
WORKING = "TASK_STATE_WORKING"
# The most alerts the pages list inline; the alerts page lists more.
SHOWN = 20
# The most alerts one e-mail or webhook body lists (the rest are counted).
LISTED = 100
# The most open alerts a page counts (and its live version covers).
COUNTED = 1000


# -- the rules -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Found:
    """A condition that holds now, for one subject."""

    key: str
    agent_id: int
    since: datetime
    message: str
    task_id: int | None = None


@dataclass(frozen=True)
class RuleSpec:
    """One rule: how to find what matches now, and what "still holds" means for an open alert.

    ``holds`` is a condition on ``Alert`` rows (through their task or agent); an unresolved
    alert of this rule that does not satisfy it is resolved. ``pending``: the subject keeps
    no time for the condition, so a first sighting is a pending row that opens once it is
    older than ``threshold``.
    """

    rule: str
    threshold: float | None
    find: Callable[[datetime], list[Found]]
    holds: Q
    pending: bool = False


def _limit() -> int:
    return max(1, int(settings.ALERT_MAX_PER_RULE))


def _task_name(title: str, remote_id: str, pk: int) -> str:
    return _line(title or remote_id or f"#{pk}", 80)


def _line(text: str, limit: int) -> str:
    """One line of printable text, cut to ``limit``: names and notes come from agents and go
    into subjects and mail bodies (a name with line breaks wrote lines that looked like
    alerts of their own; a NUL reached a mail header)."""
    name = " ".join("".join(ch if ch.isprintable() else " " for ch in str(text)).split())
    return name if len(name) <= limit else name[: limit - 1] + "…"


def _duration(seconds: float) -> str:
    """A duration in words; under a minute in seconds (timesince would say "0 minutes")."""
    if seconds < 60:
        whole = max(0, int(seconds))
        return f"{whole} second{'' if whole == 1 else 's'}"
    now = timezone.now()
    return timesince(now - timedelta(seconds=seconds), now)


def age(since: datetime | None, now: datetime | None = None) -> str:
    """How long an alert's condition has lasted, in words."""
    if since is None:
        return ""
    return _duration(((now or timezone.now()) - since).total_seconds())


def _not_alerted(rule: str, subject: str = "task") -> Exists:
    """No unresolved alert of ``rule`` about the row (so a find reaches past the open ones)."""
    return ~Exists(
        Alert.objects.filter(
            rule=rule, resolved_at__isnull=True, **{f"{subject}_id": OuterRef("pk")}
        )
    )


# Tasks the dashboard follows and nobody gave up on: only their silence means something.
_LIVE_TASK = Q(abandoned_at__isnull=True, gone_at__isnull=True)
_LIVE_ALERT_TASK = Q(task__abandoned_at__isnull=True, task__gone_at__isnull=True)


def _silent_working(threshold: float, *, parked_told: bool = False) -> RuleSpec:
    """``parked_told``: the parked rule is on, so a parked task's silence is told by its
    ``parked`` alert alone (each parked task had both, for one cause)."""

    def find(now: datetime) -> list[Found]:
        silent = (
            RemoteTask.objects.filter(
                _LIVE_TASK, state=WORKING, updated_at__lt=now - timedelta(seconds=threshold)
            )
            .filter(_not_alerted(Rule.SILENT_WORKING))
            .exclude(watch=RemoteTask.Watch.NONE)
        )
        if parked_told:
            silent = silent.exclude(watcher_status=RemoteTask.WatcherStatus.PARKED)
        rows = silent.order_by("updated_at").values_list(
            "pk", "agent_id", "updated_at", "title", "remote_id"
        )[: _limit()]
        return [
            Found(
                key=f"{Rule.SILENT_WORKING}:task:{pk}",
                task_id=pk,
                agent_id=agent_id,
                since=updated_at,
                message=f"Task {_task_name(title, remote_id, pk)} is working with no news for over {_duration(threshold)}.",
            )
            for pk, agent_id, updated_at, title, remote_id in rows
        ]

    # Still silent: still working and nothing recorded since the alert's ``since``.
    holds = (
        Q(task__state=WORKING, task__updated_at=F("since"))
        & _LIVE_ALERT_TASK
        & ~Q(task__watch=RemoteTask.Watch.NONE)
    )
    if parked_told:
        holds &= ~Q(task__watcher_status=RemoteTask.WatcherStatus.PARKED)
    return RuleSpec(Rule.SILENT_WORKING, threshold, find, holds)


def _question_waiting(threshold: float) -> RuleSpec:
    def find(now: datetime) -> list[Found]:
        rows = (
            RemoteTask.objects.filter(
                _LIVE_TASK,
                state__in=INTERRUPTED_STATES,
                question_since__lt=now - timedelta(seconds=threshold),
                answered_seq__lt=F("asked_seq"),
            )
            .filter(_not_alerted(Rule.QUESTION_WAITING))
            .order_by("question_since")
            .values_list("pk", "agent_id", "question_since", "title", "remote_id", "state")[
                : _limit()
            ]
        )
        return [
            Found(
                key=f"{Rule.QUESTION_WAITING}:task:{pk}",
                task_id=pk,
                agent_id=agent_id,
                since=question_since,
                message=(
                    f"Task {_task_name(title, remote_id, pk)} has waited for "
                    f"{'authorization' if state == 'TASK_STATE_AUTH_REQUIRED' else 'an answer'} "
                    f"for over {_duration(threshold)}."
                ),
            )
            for pk, agent_id, question_since, title, remote_id, state in rows
        ]

    holds = (
        Q(task__state__in=INTERRUPTED_STATES, task__answered_seq__lt=F("task__asked_seq"))
        & _LIVE_ALERT_TASK
    )
    return RuleSpec(Rule.QUESTION_WAITING, threshold, find, holds)


def _agent_unreachable(threshold: float) -> RuleSpec:
    def find(now: datetime) -> list[Found]:
        rows = (
            Agent.objects.filter(reachable=False, retired_at__isnull=True)
            .filter(_not_alerted(Rule.AGENT_UNREACHABLE, "agent"))
            .order_by("pk")
            .values_list("pk", "name")[: _limit()]
        )
        return [
            Found(
                key=f"{Rule.AGENT_UNREACHABLE}:agent:{pk}",
                agent_id=pk,
                since=now,
                message=(
                    f"Agent {_line(name, 80)} has been unreachable for over {_duration(threshold)}."
                ),
            )
            for pk, name in rows
        ]

    return RuleSpec(
        Rule.AGENT_UNREACHABLE,
        threshold,
        find,
        # A retired agent is not called, so its being unreachable is nobody's concern.
        Q(agent__reachable=False, agent__retired_at__isnull=True),
        pending=True,
    )


def _send_failed() -> RuleSpec:
    def find(now: datetime) -> list[Found]:
        # state "" first: the (state, updated_at) index holds them together.
        rows = (
            RemoteTask.objects.filter(_LIVE_TASK, state="", phase=RemoteTask.Phase.FAILED)
            .exclude(send_error=WITHDRAWN)  # an operator's cancel, not a failure
            .filter(_not_alerted(Rule.SEND_FAILED))
            .order_by("updated_at")
            .values_list("pk", "agent_id", "updated_at", "title", "remote_id")[: _limit()]
        )
        return [
            Found(
                key=f"{Rule.SEND_FAILED}:task:{pk}",
                task_id=pk,
                agent_id=agent_id,
                since=updated_at,
                message=f"The send of task {_task_name(title, remote_id, pk)} failed.",
            )
            for pk, agent_id, updated_at, title, remote_id in rows
        ]

    # The same condition as ``find``: a send retried and then withdrawn between two
    # evaluations kept its alert open (failed, yet no failure), and nothing resolved it.
    holds = (
        Q(task__state="", task__phase=RemoteTask.Phase.FAILED)
        & ~Q(task__send_error=WITHDRAWN)
        & _LIVE_ALERT_TASK
    )
    return RuleSpec(Rule.SEND_FAILED, None, find, holds)


def parked_scan() -> QuerySet[RemoteTask]:
    """Parked live tasks without an open alert, in pk order (the partial index ``parked_tasks``)."""
    return (
        RemoteTask.objects.filter(_LIVE_TASK, watcher_status=RemoteTask.WatcherStatus.PARKED)
        .filter(_not_alerted(Rule.PARKED))
        .order_by("pk")
    )


def _parked() -> RuleSpec:
    def find(now: datetime) -> list[Found]:
        rows = parked_scan().values_list(
            "pk",
            "agent_id",
            "watcher_since",
            "updated_at",
            "title",
            "remote_id",
            "watcher_note",
        )[: _limit()]
        return [
            Found(
                key=f"{Rule.PARKED}:task:{pk}",
                task_id=pk,
                agent_id=agent_id,
                since=watcher_since or updated_at,
                message=(
                    f"The watcher parked task {_task_name(title, remote_id, pk)}: "
                    f"{_line(note or 'needs attention', 300)}"
                ),
            )
            for pk, agent_id, watcher_since, updated_at, title, remote_id, note in rows
        ]

    holds = Q(task__watcher_status=RemoteTask.WatcherStatus.PARKED) & _LIVE_ALERT_TASK
    return RuleSpec(Rule.PARKED, None, find, holds)


def rules() -> list[RuleSpec]:
    """The rules that are on, from the settings (read on every evaluation)."""
    specs: list[RuleSpec] = []
    if settings.ALERT_SILENT_WORKING_SECONDS:
        specs.append(
            _silent_working(
                settings.ALERT_SILENT_WORKING_SECONDS, parked_told=bool(settings.ALERT_PARKED)
            )
        )
    if settings.ALERT_QUESTION_WAITING_SECONDS:
        specs.append(_question_waiting(settings.ALERT_QUESTION_WAITING_SECONDS))
    if settings.ALERT_AGENT_UNREACHABLE_SECONDS:
        specs.append(_agent_unreachable(settings.ALERT_AGENT_UNREACHABLE_SECONDS))
    if settings.ALERT_SEND_FAILED:
        specs.append(_send_failed())
    if settings.ALERT_PARKED:
        specs.append(_parked())
    return specs


# -- evaluation ------------------------------------------------------------------------------


@dataclass
class Evaluation:
    """What one evaluation changed (only what this evaluator won)."""

    opened: list[Alert] = field(default_factory=list)
    resolved: list[Alert] = field(default_factory=list)
    deliveries: list[AlertDelivery] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{len(self.opened)} opened, {len(self.resolved)} resolved, {len(self.deliveries)} deliveries"


def evaluate(now: datetime | None = None, *, deliver: bool = True) -> Evaluation:
    """Run every rule that is on; resolve alerts of rules that were turned off."""
    now = now or timezone.now()
    result = Evaluation()
    specs = rules()
    for spec in specs:
        result.resolved += _resolve(spec.rule, ~spec.holds, now)
        result.opened += _open(spec, now)
    # A rule turned off: its alerts end (nothing would ever resolve them otherwise).
    off = [r for r in Rule.values if r != Rule.TEST and r not in {s.rule for s in specs}]
    for rule in off:
        result.resolved += _resolve(rule, Q(), now)
    if deliver:
        result.deliveries = _tell(result.opened, result.resolved)
        result.deliveries += _tell_untold(now)
    return result


def tell_grace() -> timedelta:
    """How long the evaluator that opened or resolved an alert has to tell it (both channels
    within their deadlines, and more) before another evaluation tells it instead."""
    return timedelta(seconds=max(60, 3 * settings.ALERT_DELIVERY_TIMEOUT_SECONDS))


def _tell(opened: list[Alert], resolved: list[Alert]) -> list[AlertDelivery]:
    """Deliver the news, then note it told (also when no channel or ``ALERT_NOTIFY_RESOLVED``
    leaves nothing to send: there is nothing left to tell later)."""
    deliveries = deliver_changes(opened, resolved if settings.ALERT_NOTIFY_RESOLVED else [])
    now = timezone.now()
    Alert.objects.filter(pk__in=[a.pk for a in opened], opened_told_at__isnull=True).update(
        opened_told_at=now
    )
    Alert.objects.filter(pk__in=[a.pk for a in resolved], resolved_told_at__isnull=True).update(
        resolved_told_at=now
    )
    return deliveries


def _tell_untold(now: datetime) -> list[AlertDelivery]:
    """News an evaluator made and did not tell (it died between its commit and the send,
    or before noting it told), told now: at least once, never lost.

    1. Alerts whose news is untold and whose ``tell_after`` has passed.
    2. Each is claimed by compare-and-set on ``tell_after`` (moved one grace ahead), so of
       two evaluations one tells it; one that dies after its claim leaves it for the next.
    3. Told as any news, then noted told.
    """
    untold = Q(opened_at__isnull=False, opened_told_at__isnull=True) | Q(
        resolved_at__isnull=False, resolved_told_at__isnull=True
    )
    candidates = list(
        Alert.objects.filter(untold, tell_after__lte=now)
        .exclude(rule=Rule.TEST)
        .order_by("pk")[: _limit()]
    )
    won = [
        alert
        for alert in candidates
        if Alert.objects.filter(pk=alert.pk, tell_after=alert.tell_after).update(
            tell_after=now + tell_grace()
        )
    ]
    opened = [a for a in won if a.opened_at is not None and a.opened_told_at is None]
    resolved = [a for a in won if a.resolved_at is not None and a.resolved_told_at is None]
    return _tell(opened, resolved) if won else []


def _resolve(rule: str, ended: Q, now: datetime) -> list[Alert]:
    """Resolve this rule's unresolved alerts matching ``ended`` (pending ones are deleted)."""
    stale = list(
        for_list(
            Alert.objects.filter(ended, rule=rule, resolved_at__isnull=True).select_related(
                "task", "agent__project"
            ),
            task="task__",
        ).order_by("pk")[: _limit()]
    )
    resolved: list[Alert] = []
    for alert in stale:
        if alert.opened_at is None:
            Alert.objects.filter(
                pk=alert.pk, opened_at__isnull=True, resolved_at__isnull=True
            ).delete()
            continue
        # Compare-and-set: of two evaluators, one resolves it (and tells about it).
        if Alert.objects.filter(pk=alert.pk, resolved_at__isnull=True).update(
            resolved_at=now, last_seen_at=now, tell_after=now + tell_grace()
        ):
            alert.resolved_at = now
            resolved.append(alert)
    return resolved


class _NoLongerHolds(Exception):
    """Rolls back an alert whose condition ended between ``find`` and its insert."""


def _open(spec: RuleSpec, now: datetime) -> list[Alert]:
    """Touch the alerts that still hold (what ``_resolve`` left), then open what is new."""
    Alert.objects.filter(rule=spec.rule, resolved_at__isnull=True).update(last_seen_at=now)
    opened: list[Alert] = []
    for item in spec.find(now):  # only subjects with no unresolved alert of this rule
        try:
            with transaction.atomic():
                alert = Alert.objects.create(
                    rule=spec.rule,
                    key=item.key,
                    task_id=item.task_id,
                    agent_id=item.agent_id,
                    message=item.message[:500],
                    since=item.since,
                    opened_at=None if spec.pending else now,
                    last_seen_at=now,
                    tell_after=None if spec.pending else now + tell_grace(),
                )
                # What ``find`` read may be stale by now (the task had news meanwhile): the
                # alert is kept only if its condition holds as the row goes in; else it
                # would open, be delivered, and resolve at the next evaluation.
                if not Alert.objects.filter(spec.holds, pk=alert.pk).exists():
                    raise _NoLongerHolds
        except IntegrityError:  # another evaluator opened it first: it is theirs to deliver
            continue
        except _NoLongerHolds:
            continue
        if not spec.pending:
            opened.append(alert)
    if spec.pending:
        opened += _open_due(spec, now)
    return opened


def _open_due(spec: RuleSpec, now: datetime) -> list[Alert]:
    """Pending alerts whose condition has now lasted past the threshold: open them (CAS)."""
    assert spec.threshold is not None
    due = list(
        Alert.objects.filter(
            rule=spec.rule,
            resolved_at__isnull=True,
            opened_at__isnull=True,
            since__lte=now - timedelta(seconds=spec.threshold),
        ).order_by("pk")[: _limit()]
    )
    opened = []
    for alert in due:
        if Alert.objects.filter(
            pk=alert.pk, opened_at__isnull=True, resolved_at__isnull=True
        ).update(opened_at=now, tell_after=now + tell_grace()):
            alert.opened_at = now
            opened.append(alert)
    return opened


# -- who sees what ---------------------------------------------------------------------------


def open_alerts(user: Any) -> QuerySet[Alert]:
    """The open alerts about the agents (and their tasks) this person may read, newest first."""
    qs = Alert.objects.filter(resolved_at__isnull=True, opened_at__isnull=False)
    ids = access.projects_with(user, access.Perm.READ)
    if ids is not None:
        qs = qs.filter(agent__project_id__in=ids)
    return qs.order_by("-opened_at", "-id")


def version(alerts: Iterable[Alert] | Iterable[int]) -> str:
    """A short token that changes whenever the set of open alerts a person sees changes."""
    pks = sorted(a if isinstance(a, int) else a.pk for a in alerts)
    return hashlib.sha256(",".join(map(str, pks)).encode()).hexdigest()[:16]


def current_version(user: Any) -> str:
    return version(list(open_alerts(user).values_list("pk", flat=True)[:COUNTED]))


def may_test(user: Any) -> bool:
    """Staff, and agent admins of some project, may send a test alert."""
    if user is None or not user.is_authenticated or not user.is_active:
        return False
    return bool(user.is_staff) or access.projects_with(user, access.Perm.MANAGE_AGENTS) != []


# -- delivery --------------------------------------------------------------------------------


def webhook_origin(url: str) -> str:
    """What of a webhook URL may be shown and stored: its origin (the rest may be a secret).

    Never raises: the alerts page and delivery show it, and settings refuse a bad URL anyway.
    """
    try:
        parts = urlsplit(url.strip())
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # a port that is no number or past 65535, an unclosed "[": no origin
        return "(not a URL)"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}{port}" if parts.scheme and host else "(not a URL)"


def channels() -> list[tuple[str, str]]:
    """The configured channels as (channel, target shown), for the alerts page."""
    found = []
    if settings.ALERT_EMAIL_TO:
        found.append((AlertDelivery.Channel.EMAIL.value, ", ".join(settings.ALERT_EMAIL_TO)))
    if settings.ALERT_WEBHOOK_URL:
        found.append(
            (AlertDelivery.Channel.WEBHOOK.value, webhook_origin(settings.ALERT_WEBHOOK_URL))
        )
    return found


def _link(path: str) -> str | None:
    return f"{settings.PUBLIC_URL}{path}" if settings.PUBLIC_URL else None


def describe(alert: Alert, event: str) -> dict[str, Any]:
    """One alert as the webhook and the e-mail tell it: what a page shows, never a secret."""
    item: dict[str, Any] = {
        "id": alert.pk,
        "event": event,
        "rule": alert.rule,
        "rule_label": alert.get_rule_display(),
        "key": alert.key,
        "message": alert.message,
        "since": alert.since.isoformat() if alert.since else None,
        "opened_at": alert.opened_at.isoformat() if alert.opened_at else None,
        "resolved_at": alert.resolved_at.isoformat() if alert.resolved_at else None,
        "task": None,
        "agent": None,
        "project": None,
    }
    if alert.task_id is not None and alert.task is not None:
        task = alert.task
        item["task"] = {
            "id": task.pk,
            "remote_id": task.remote_id,
            "title": task.title,
            "state": task.state,
            "url": _link(reverse("task-detail", args=[task.pk])),
        }
    if alert.agent_id is not None and alert.agent is not None:
        agent = alert.agent
        item["agent"] = {
            "id": agent.pk,
            "name": agent.name,
            "url": _link(reverse("agent-detail", args=[agent.pk])),
        }
        item["project"] = agent.project.name
    return item


def deliver_changes(opened: list[Alert], resolved: list[Alert]) -> list[AlertDelivery]:
    items = [(a, "opened") for a in opened] + [(a, "resolved") for a in resolved]
    return _deliver(items) if items and channels() else []


def _deliver(items: list[tuple[Alert, str]]) -> list[AlertDelivery]:
    """Send ``items`` once through each configured channel; record one row per alert and channel."""
    # Fresh rows with their subjects: what was read while evaluating may be stale by now.
    fresh = {
        a.pk: a
        for a in for_list(
            Alert.objects.filter(pk__in=[a.pk for a, _ in items]).select_related(
                "task", "agent__project"
            ),
            task="task__",
        )
    }
    # An alert gone since (its task or agent deleted, and the alert with it) is not described:
    # reading its subject raised, and the whole batch's notifications were lost.
    items = [(fresh[a.pk], event) for a, event in items if a.pk in fresh]
    if not items:
        return []
    described = [describe(alert, event) for alert, event in items]
    rows: list[AlertDelivery] = []
    for channel, send in (
        (AlertDelivery.Channel.EMAIL, _send_email),
        (AlertDelivery.Channel.WEBHOOK, _send_webhook),
    ):
        target = dict(channels()).get(channel.value)
        if target is None:
            continue
        started = time.monotonic()
        error = send(described)
        elapsed = int((time.monotonic() - started) * 1000)
        outcome = AlertDelivery.Outcome.FAILED if error else AlertDelivery.Outcome.SENT
        if error:
            log.warning("alert delivery by %s to %s failed: %s", channel.value, target, error)
        now = timezone.now()
        rows += [
            AlertDelivery(
                alert_id=alert.pk,
                channel=channel,
                event=event,
                target=target[:500],
                outcome=outcome,
                error=(error or "")[:500],
                attempted_at=now,
                duration_ms=elapsed,
            )
            for alert, event in items
        ]
    return AlertDelivery.objects.bulk_create(rows)


def _subject(described: list[dict[str, Any]]) -> str:
    opened = [d for d in described if d["event"] == "opened"]
    resolved = [d for d in described if d["event"] == "resolved"]
    if all(d["event"] == "test" for d in described):
        return "[A2A dashboard] Test alert"
    parts = []
    if opened:
        parts.append(f"{len(opened)} alert{'s' if len(opened) != 1 else ''} opened")
    if resolved:
        parts.append(f"{len(resolved)} resolved")
    first = (opened or resolved)[0]["message"]
    # One line whatever a message holds (a newline in a header is refused by Django's mail).
    return _line(f"[A2A dashboard] {', '.join(parts)}: {first}", 200)


def _email_body(described: list[dict[str, Any]]) -> str:
    lines = []
    for item in described[:LISTED]:
        lines.append(f"[{item['event']}] {item['rule_label']}: {_line(item['message'], 600)}")
        if item["project"]:
            lines.append(
                f"    project {_line(item['project'], 100)}, "
                f"agent {_line(item['agent']['name'], 100)}"
            )
        link = (item["task"] or {}).get("url") or (item["agent"] or {}).get("url")
        if link:
            lines.append(f"    {link}")
        lines.append(f"    since {item['since']}")
    if len(described) > LISTED:
        lines.append(f"... and {len(described) - LISTED} more (see the alerts page).")
    return "\n".join(lines) + "\n"


# The e-mail send that outlived its deadline, still running (see _send_email).
_mail_in_flight: list[threading.Thread] = []


def _send_email(described: list[dict[str, Any]]) -> str | None:
    """One message to every ALERT_EMAIL_TO address; the error sentence, or None when sent.

    Within ``ALERT_DELIVERY_TIMEOUT_SECONDS`` in all: smtplib's timeout bounds each read,
    and a mail server that answered a line now and then held the evaluation (and the test
    button's request) for as long as it liked. The send runs on a thread of its own that
    is waited for until the deadline, then left to end (each read is still bounded); while
    one is left running, no other is started.
    """
    timeout = settings.ALERT_DELIVERY_TIMEOUT_SECONDS
    if any(thread.is_alive() for thread in _mail_in_flight):
        return "the mail server has not finished the previous delivery"
    _mail_in_flight.clear()
    failure: list[str] = []

    def send() -> None:
        try:
            EmailMessage(
                subject=_subject(described),
                body=_email_body(described),
                from_email=settings.ALERT_EMAIL_FROM or settings.DEFAULT_FROM_EMAIL,
                to=list(settings.ALERT_EMAIL_TO),
                connection=get_connection(timeout=timeout),
            ).send()
        except Exception as exc:  # any failure is recorded; the evaluation goes on
            failure.append(f"{type(exc).__name__}: {exc}"[:500])

    thread = threading.Thread(target=send, name="alert-mail", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        _mail_in_flight.append(thread)
        return f"the mail server did not finish within {timeout:g} s"
    return failure[0] if failure else None


def webhook_body(described: list[dict[str, Any]]) -> bytes:
    body = {
        "source": "a2a-dashboard",
        "sent_at": timezone.now().isoformat(),
        "alerts": described[:LISTED],
        "more": max(0, len(described) - LISTED),
    }
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def _send_webhook(described: list[dict[str, Any]]) -> str | None:
    """POST the alerts as JSON, through the outbound guard, within the delivery timeout."""
    url = settings.ALERT_WEBHOOK_URL
    shown = webhook_origin(url)
    problem = outbound.url_problem(url, resolve=False)
    if problem:
        return f"refused by the outbound guard: {problem}"[:500]
    body = webhook_body(described)
    headers = {"Content-Type": "application/json", "User-Agent": "a2a-dashboard-alerts"}
    if settings.ALERT_WEBHOOK_SECRET:
        digest = hmac.new(settings.ALERT_WEBHOOK_SECRET.encode(), body, hashlib.sha256).hexdigest()
        headers["X-Dashboard-Signature"] = f"sha256={digest}"
    limit = settings.ALERT_DELIVERY_TIMEOUT_SECONDS

    async def post(http: httpx.AsyncClient) -> int:
        async with asyncio.timeout(limit):  # the whole call, not only each read
            # Only the status is wanted: the body is never read. ``post`` read all of it,
            # so a receiver answering 200 with an endless body filled memory until the
            # deadline, and the delivery was recorded as failed.
            async with http.stream(
                "POST", url, content=body, headers=headers, timeout=limit
            ) as response:
                return response.status_code

    try:
        status = outbound.run(post)
    except TimeoutError:
        return f"no answer from {shown} within {limit:g} s"
    except Exception as exc:  # any failure is recorded; the evaluation goes on
        refusal = guard.refusal_in(exc)
        if refusal is not None:
            return f"refused by the outbound guard: {refusal.reason}"[:500]
        # Never the URL itself (its path or query may be the webhook's secret).
        return f"{type(exc).__name__}: {str(exc).replace(url, shown)}"[:500]
    if not 200 <= status < 300:
        return f"{shown} answered HTTP {status}"
    return None


def send_test(user: Any) -> tuple[Alert, list[AlertDelivery]]:
    """A test alert through every configured channel (recorded, resolved at once: never shown open)."""
    now = timezone.now()
    alert = Alert.objects.create(
        rule=Rule.TEST,
        key=f"{Rule.TEST}:{uuid.uuid4().hex}",
        # Names no one: test deliveries are listed to agent admins of every project, and
        # who sent it is in the audit log (the alert-test action below).
        message="Test alert from the alerts page.",
        since=now,
        opened_at=now,
        resolved_at=now,
        last_seen_at=now,
        opened_told_at=now,  # its one news is the delivery below
        resolved_told_at=now,
    )
    deliveries = _deliver([(alert, "test")]) if channels() else []
    outcome = "; ".join(f"{d.channel}: {d.outcome}" for d in deliveries) or "no channel configured"
    OperatorAction.objects.create(
        actor_id=user.pk, action="alert-test", payload={"alert": alert.pk}, outcome=outcome[:500]
    )
    return alert, deliveries
