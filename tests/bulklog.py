"""A task's log made in bulk for tests: rows chained exactly as ``record()`` chains them.

Appending 10,000 rows through ``record()`` one at a time would take most of a test's
time; ``bulk_create`` with hashes from ``tasks_app.services.chain`` gives the same rows,
and ``services.audit.verify`` checks that they chain (the tests assert it).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from tasks_app.models import RemoteTask, TaskEvent
from tasks_app.services.chain import content_digest, event_hash


def raw_event(task: RemoteTask, i: int) -> dict[str, Any]:
    """Half status updates, half text chunks; non-ASCII and a float, so encoding is tested too."""
    if i % 2:
        return {"statusUpdate": {"taskId": task.remote_id, "contextId": task.context_id,
                                 "status": {"state": "TASK_STATE_WORKING"}, "metadata": {"i": i, "p": i / 7}}}  # fmt: skip
    return {"artifactUpdate": {"taskId": task.remote_id, "artifact": {"artifactId": "out",
            "parts": [{"text": f"chunk {i} é 漢 \u2028"}]}, "append": i > 0}}  # fmt: skip


def bulk_log(task: RemoteTask, n: int, *, actor_id: int | None = None, chunk: int = 2000) -> str:
    """Append ``n`` chained rows to ``task``'s (empty) log; returns the last hash."""
    previous = ""
    start = timezone.now() - timedelta(seconds=n)
    for first in range(1, n + 1, chunk):
        rows = []
        for seq in range(first, min(n, first + chunk - 1) + 1):
            raw = raw_event(task, seq)
            kind = next(iter(raw))
            event = TaskEvent(
                task_id=task.pk, seq=seq, received_at=start + timedelta(milliseconds=seq),
                channel="stream", kind=kind, raw=raw, state_after="TASK_STATE_WORKING",
                note="" if seq % 10 else "a note", actor_id=actor_id if seq == 1 else None,
            )  # fmt: skip
            digest, _ = content_digest(raw)
            event.digest = digest
            event.hash = previous = event_hash(previous, event, digest)
            rows.append(event)
        with transaction.atomic():
            TaskEvent.objects.bulk_create(rows, batch_size=500)
    RemoteTask.objects.filter(pk=task.pk).update(last_seq=n, last_hash=previous)
    return previous
