"""The Celery app: watchers run here (see tasks_app/watchers.py)."""

import os
from pathlib import Path
from typing import Any

from celery import Celery
from celery.beat import PersistentScheduler
from celery.signals import setup_logging

from tasks_app.runtime.files import PRIVATE_UMASK, narrow_family, private_dir

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")


class PrivateScheduler(PersistentScheduler):
    """Celery's file-backed schedule, owner-only from the first byte.

    The schedule is a dbm (or, on Python 3.13, SQLite) store that ``shelve`` creates with
    mode 0666 less the umask, in files whose names depend on the backend. So beat's process
    takes ``PRIVATE_UMASK`` before the store is opened (it creates nothing else anyone needs
    to read), and files an older version left wider are narrowed.
    """

    def _open_schedule(self) -> Any:
        os.umask(PRIVATE_UMASK)
        path = Path(self.schedule_filename).resolve()
        private_dir(path.parent)
        narrow_family(path)
        return super()._open_schedule()


@setup_logging.connect
def _django_logging(**_: Any) -> None:
    """Workers and beat log through Django's ``LOGGING`` (one format, LOG_FORMAT=json included),
    instead of Celery's own root handler."""
    import logging.config

    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)


app = Celery("dashboard")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Any `celery -A dashboard beat` (manage.py up, tests, a production supervisor) uses it.
app.conf.beat_scheduler = "dashboard.celery:PrivateScheduler"
app.autodiscover_tasks(["tasks_app"], related_name="watchers")
app.autodiscover_tasks(["tasks_app"], related_name="jobs")  # import jobs


def _beat_schedule() -> dict:
    from django.conf import settings

    schedule = {
        "reconcile-watchers": {
            "task": "tasks_app.watchers.reconcile",
            "schedule": settings.RECONCILE_EVERY_SECONDS,
        },
    }
    if settings.ALERT_EVERY_SECONDS > 0:  # alerts: each rule can be off (tasks_app/alerts.py)
        schedule["evaluate-alerts"] = {
            "task": "tasks_app.jobs.evaluate_alerts",
            "schedule": settings.ALERT_EVERY_SECONDS,
        }
    if settings.DATABASES["default"]["ENGINE"].endswith("sqlite3"):  # its planner's statistics
        schedule["refresh-sqlite-stats"] = {
            "task": "tasks_app.jobs.refresh_sqlite_stats",
            "schedule": settings.SQLITE_ANALYZE_EVERY_SECONDS,
        }
    if settings.RETENTION_DAYS:  # retention is off unless a number of days is set
        schedule["prune-settled"] = {
            "task": "tasks_app.jobs.prune_settled",
            "schedule": settings.RETENTION_EVERY_SECONDS,
        }
    return schedule


@app.on_after_finalize.connect
def _setup_periodic(sender: Celery, **kwargs: object) -> None:
    sender.conf.beat_schedule = _beat_schedule()


@app.task(name="dashboard.ping")
def ping() -> str:
    """Answers health checks: proves a worker is consuming the queue."""
    return "pong"
