"""Celery tasks for jobs that are not watchers: importing an agent's tasks, draining push notifications.

Registered by ``dashboard/celery.py`` (autodiscovered like ``tasks_app.watchers``).
The job itself is bounded (page cap, repeated-token guard, deadline, see
``tasks_app.services.imports``); a message the broker delivers twice finds the job
already claimed and does nothing.
"""

from __future__ import annotations

from celery import shared_task

from tasks_app.services import imports


@shared_task(name="tasks_app.jobs.run_import", ignore_result=True)
def run_import(job_pk: int) -> str:
    """Run one import job to its end on this worker; returns its final status."""
    return str(imports.run_job(job_pk).status)


@shared_task(name="tasks_app.jobs.drain_push", ignore_result=True)
def drain_push() -> int:
    """Record the push notifications the webhook queued (``tasks_app.services.push.drain``)."""
    from tasks_app.services import push

    return push.drain()
