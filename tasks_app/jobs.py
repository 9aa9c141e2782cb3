"""Celery tasks for jobs that are not watchers: importing an agent's tasks, draining push notifications.

Registered by ``dashboard/celery.py`` (autodiscovered like ``tasks_app.watchers``).
The job itself is bounded (page cap, tasks per page and per job, repeated-token guard,
deadline, see ``tasks_app.services.imports``); a message the broker delivers twice finds
the job already claimed and does nothing.
"""

from __future__ import annotations

import logging

from celery import shared_task

from tasks_app.models import ImportJob
from tasks_app.services import imports

log = logging.getLogger(__name__)


@shared_task(name="tasks_app.jobs.run_import", ignore_result=True)
def run_import(job_pk: int) -> str:
    """Run one import job to its end on this worker; returns its final status.

    A job deleted before a worker took it (its agent with it, a database restored from
    before it) is "gone": nothing to do, and no traceback in the worker's log.
    """
    try:
        return str(imports.run_job(job_pk).status)
    except ImportJob.DoesNotExist:
        log.info("import job %s is gone; nothing to do", job_pk)
        return "gone"


@shared_task(name="tasks_app.jobs.drain_push", ignore_result=True)
def drain_push() -> int:
    """Record the push notifications the webhook queued (``tasks_app.services.push.drain``)."""
    from tasks_app.services import push

    return push.drain()


@shared_task(name="tasks_app.jobs.forget_push_configs", ignore_result=True)
def forget_push_configs(task_pk: int, note: str) -> int:
    """Delete a task's live push configs, at the agent and here (push.forget_later)."""
    from tasks_app.services import push

    return push.forget_configs_now(task_pk, note)


@shared_task(name="tasks_app.jobs.prune_settled", ignore_result=True)
def prune_settled() -> str:
    """Retention on the beat schedule: settled tasks older than RETENTION_DAYS (``tasks_app.retention``)."""
    from pathlib import Path

    from django.conf import settings

    from tasks_app import retention

    if not settings.RETENTION_DAYS:
        return "retention is off"
    export_to = Path(settings.RETENTION_EXPORT_DIR) if settings.RETENTION_EXPORT_DIR else None
    return str(retention.prune(settings.RETENTION_DAYS, export_to=export_to))


@shared_task(name="tasks_app.jobs.evaluate_alerts", ignore_result=True)
def evaluate_alerts() -> str:
    """Open and resolve alerts, and deliver what changed (``tasks_app.alerts``); every ALERT_EVERY_SECONDS."""
    from tasks_app import alerts

    return str(alerts.evaluate())


@shared_task(name="tasks_app.jobs.refresh_sqlite_stats", ignore_result=True)
def refresh_sqlite_stats() -> bool:
    """The query planner's statistics on SQLite (see tasks_app/runtime/sqlite_stats.py)."""
    from tasks_app.runtime import sqlite_stats

    return sqlite_stats.refresh()
