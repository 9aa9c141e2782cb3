"""Keeping the default log readable: routine periodic tasks say nothing at INFO.

Celery beat runs the reconciler every ``RECONCILE_EVERY_SECONDS`` (2 s by default), and at
INFO beat logs "Sending due task" for it while the worker logs "Task ... received" and
"Task ... succeeded": three lines every tick, which bury everything else. This filter drops
exactly those INFO records for the tasks it is given; ``LOGGING`` puts it on the loggers
that write them (``celery.beat``, ``celery.worker.strategy``, ``celery.app.trace``). Anything at WARNING or above (a failed
or retried tick, a lost connection) still reaches the log, and so does every other task.

Imported by ``dashboard/settings.py``'s ``LOGGING`` while Django configures logging, so it
must import nothing from Django or the app.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping


class QuietRoutineTasks(logging.Filter):
    """Drop INFO (and lower) records about one run of a routine task; keep the rest."""

    def __init__(self, tasks: Iterable[str] = ()) -> None:
        super().__init__()
        self.tasks = frozenset(tasks)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or not self.tasks:
            return True
        return not self._names_routine_task(record.args)

    def _names_routine_task(self, args: object) -> bool:
        # celery.app.trace and the worker's strategy log with a mapping ({"name": ..., "id": ...});
        # beat logs with a tuple (entry name, task name).
        if isinstance(args, Mapping):
            return args.get("name") in self.tasks
        if isinstance(args, tuple):
            return any(isinstance(arg, str) and arg in self.tasks for arg in args)
        return False
