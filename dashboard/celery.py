"""The Celery app: watchers run here (see tasks_app/watchers.py)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")

app = Celery("dashboard")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["tasks_app"], related_name="watchers")
app.autodiscover_tasks(["tasks_app"], related_name="jobs")  # import jobs


def _beat_schedule() -> dict:
    from django.conf import settings

    return {
        "reconcile-watchers": {
            "task": "tasks_app.watchers.reconcile",
            "schedule": settings.RECONCILE_EVERY_SECONDS,
        },
    }


@app.on_after_finalize.connect
def _setup_periodic(sender: Celery, **kwargs: object) -> None:
    sender.conf.beat_schedule = _beat_schedule()


@app.task(name="dashboard.ping")
def ping() -> str:
    """Answers health checks: proves a worker is consuming the queue."""
    return "pong"
