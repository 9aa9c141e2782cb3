"""Retention: removing settled tasks older than a number of days, exported first when asked.

Only a task that can no longer change is removed: settled (``settled_at`` set: a terminal
task reconciled once with GetTask) in a terminal state before the cutoff, or a message
reply (the agent answered without a task), or abandoned, or gone at the agent before the
cutoff; and in each case last updated before the cutoff, not watched (no live lease, no
watcher status that is still following it), and with no unresolved alert (an open alert
stays, however old). Conditions are checked
again inside the transaction that deletes, so a task that moved between the scan and the
delete stays.

Why in batches: each transaction deletes at most ``batch`` tasks (and their log rows,
artifacts, messages, push configs), so locks are short and memory stays bounded
however much is due. With an export folder, each task is written there first as JSON
Lines (``tasks_app.exports``; atomically, mode 0600), and a task whose export failed is
not removed. The operator actions on a removed task stay in the action log (their task
link cleared: the log is the auditor's, not the task's). Each run that removes is one
``prune`` operator-action row with the counts and the range of task ids removed. Alerts
resolved before the same cutoff go too (an open alert stays, however old).

Used by ``manage.py prune`` and, when ``RETENTION_DAYS`` is set, by the beat job
``tasks_app.jobs.prune_settled``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.db import DatabaseError, transaction
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from tasks_app import exports
from tasks_app.models import TERMINAL_STATES, Alert, OperatorAction, RemoteTask, TaskEvent
from tasks_app.services.chain import timestamp_text
from tasks_app.services.tasks import locked_in_pk_order

log = logging.getLogger(__name__)

BATCH = 100
# A watcher in one of these is still following the task (whatever its state says).
WATCHING = (
    RemoteTask.WatcherStatus.STREAMING,
    RemoteTask.WatcherStatus.RECONNECTING,
    RemoteTask.WatcherStatus.POLLING,
    RemoteTask.WatcherStatus.AWAITING_PUSH,
)


@dataclass
class PruneResult:
    older_than_days: float
    cutoff: datetime
    dry_run: bool
    due: int = 0
    removed: int = 0
    events: int = 0
    exported: int = 0
    alerts: int = 0
    first_id: int | None = None
    last_id: int | None = None
    export_failures: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        count = self.due if self.dry_run else self.removed
        text = f"{verb} {count} settled task(s) older than {self.older_than_days:g} day(s)"
        if not self.dry_run:
            text += f" ({self.events} log rows)"
        if self.first_id is not None:
            text += f", task ids {self.first_id}..{self.last_id}"
        if self.exported:
            text += f"; exported {self.exported} first"
        if self.export_failures:
            text += f"; {len(self.export_failures)} export(s) failed, those tasks were kept"
        if self.alerts:
            text += f"; {self.alerts} alert(s) resolved before then"
        return text


def due(older_than_days: float, now: datetime | None = None) -> QuerySet[RemoteTask]:
    """The tasks a prune with this age would remove (the rule, in one place)."""
    now = now or timezone.now()
    cutoff = now - timedelta(days=older_than_days)
    ended = (
        Q(settled_at__isnull=False, settled_at__lt=cutoff, state__in=TERMINAL_STATES)
        # The agent answered with a message: no task, nothing more comes.
        | Q(phase=RemoteTask.Phase.MESSAGE)
        # Given up here (never watched again), or no longer known to the agent: neither is
        # ever settled, and both stayed for good.
        | Q(abandoned_at__isnull=False, abandoned_at__lt=cutoff)
        | Q(gone_at__isnull=False, gone_at__lt=cutoff)
    )
    return RemoteTask.objects.filter(ended, updated_at__lt=cutoff).exclude(
        Q(lease_expires_at__gt=now)
        | Q(watcher_status__in=WATCHING)
        # An open alert stays, however old (a parked task can be terminal and settled): the
        # task went, and its alert with it, unresolved and never told as resolved.
        | Exists(Alert.objects.filter(task_id=OuterRef("pk"), resolved_at__isnull=True))
    )


def prune(
    older_than_days: float,
    *,
    export_to: Path | None = None,
    dry_run: bool = False,
    actor_id: int | None = None,
    batch: int = BATCH,
    say: Callable[[str], Any] | None = None,
) -> PruneResult:
    """Remove (or, dry, count) the settled tasks older than ``older_than_days``; see the module."""
    if older_than_days <= 0:
        raise ValueError("older_than_days must be more than 0")
    now = timezone.now()
    result = PruneResult(older_than_days, now - timedelta(days=older_than_days), dry_run)
    if export_to is not None and not dry_run:
        export_to = Path(export_to)
        export_to.mkdir(mode=0o700, parents=True, exist_ok=True)
    finished = False
    try:
        after = 0
        while True:
            # Keyset over ids: each batch is read fresh, so memory is one batch of ids.
            pks = list(
                due(older_than_days, now)
                .filter(pk__gt=after)
                .order_by("pk")
                .values_list("pk", flat=True)[:batch]
            )
            if not pks:
                break
            after = pks[-1]
            if dry_run:
                result.due += len(pks)
                _extend_range(result, pks)
                continue
            keep: set[int] = set()
            if export_to is not None:
                for pk in pks:
                    try:
                        task = RemoteTask.objects.select_related(
                            "agent__project", "started_by"
                        ).get(pk=pk)
                        exports.write_atomically(
                            export_to / f"task-{pk}.jsonl", exports.jsonl_chunks(task)
                        )
                        result.exported += 1
                    except (
                        Exception
                    ) as exc:  # one unwritable task must not stop the run; it is kept
                        keep.add(pk)
                        result.export_failures.append(
                            f"task {pk}: {type(exc).__name__}: {exc}"[:300]
                        )
                        log.warning("prune: could not export task %s, keeping it: %s", pk, exc)
            removed = _remove(older_than_days, now, [pk for pk in pks if pk not in keep], result)
            result.due += len(pks)
            if say and removed:
                say(f"removed {removed} task(s) up to id {after}")
        _prune_alerts(result, batch)
        finished = True
    finally:
        # Recorded even when the run stops half-way (Ctrl-C, a lost database, a crash in a
        # batch): the batches already committed are gone, and the log must say so.
        if not dry_run:
            _record_run(result, actor_id, finished)
    return result


def _record_run(result: PruneResult, actor_id: int | None, finished: bool) -> None:
    """The run's one ``prune`` operator-action row; an unfinished one says so."""
    outcome = str(result) if finished else f"interrupted: {result}"
    try:
        OperatorAction.objects.create(
            actor_id=actor_id,
            action="prune",
            payload={
                "older_than_days": result.older_than_days,
                "cutoff": timestamp_text(result.cutoff),
                "tasks": result.removed,
                "events": result.events,
                "first_task_id": result.first_id,
                "last_task_id": result.last_id,
                "exported": result.exported,
                "export_failures": len(result.export_failures),
                "alerts": result.alerts,
                "finished": finished,
            },
            outcome=outcome[:500],
        )
    except DatabaseError:
        if finished:
            raise
        # Stopping anyway: the error that stopped the run is the one to report.
        log.exception("prune: could not record the interrupted run: %s", outcome)


def _remove(older_than_days: float, now: datetime, pks: list[int], result: PruneResult) -> int:
    """Delete one batch in one transaction, checking the rule again under lock."""
    if not pks:
        return 0
    with transaction.atomic():
        still = locked_in_pk_order(due(older_than_days, now).filter(pk__in=pks))
        if not still:
            return 0
        events = TaskEvent.objects.filter(task_id__in=still).count()
        OperatorAction.objects.filter(task_id__in=still).update(task=None)
        RemoteTask.objects.filter(pk__in=still).delete()
    result.removed += len(still)
    result.events += events
    _extend_range(result, still)
    return len(still)


def _prune_alerts(result: PruneResult, batch: int) -> None:
    """Alerts resolved before the cutoff, with their delivery rows, a batch at a time.

    A task's alerts go with the task; an agent's (``agent-unreachable``) stay as long as the
    agent, and an agent whose reachability flaps adds one a time. An open alert is kept,
    however old: it still says something needs a person.
    """
    old = Alert.objects.filter(resolved_at__isnull=False, resolved_at__lt=result.cutoff)
    if result.dry_run:
        result.alerts = old.count()
        return
    while pks := list(old.order_by("pk").values_list("pk", flat=True)[:batch]):
        _, deleted = Alert.objects.filter(pk__in=pks, resolved_at__lt=result.cutoff).delete()
        result.alerts += deleted.get(Alert._meta.label, 0)


def _extend_range(result: PruneResult, pks: list[int]) -> None:
    result.first_id = min(pks) if result.first_id is None else min(result.first_id, *pks)
    result.last_id = max(pks) if result.last_id is None else max(result.last_id, *pks)
