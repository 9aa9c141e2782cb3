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
from contextvars import ContextVar


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


# The task and agent a piece of code works for, in its own context (each watcher holder is
# an asyncio task with a copy of the context, so holders never see each other's ids).
_task_id: ContextVar[int | None] = ContextVar("log_task_id", default=None)
_agent_id: ContextVar[int | None] = ContextVar("log_agent_id", default=None)


def bind(*, task: int | None = None, agent: int | None = None) -> None:
    """Name the task and/or agent the current context works for; its log lines carry them."""
    if task is not None:
        _task_id.set(task)
    if agent is not None:
        _agent_id.set(agent)


class ContextIds(logging.Filter):
    """Add ``task_id`` and ``agent_id`` to records made where they were bound (see ``bind``).

    Ids given explicitly (``extra={"task_id": ...}``) are kept. The JSON format writes them
    as fields; the text format ignores them.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        for name, var in (("task_id", _task_id), ("agent_id", _agent_id)):
            if getattr(record, name, None) is None:
                value = var.get()
                if value is not None:
                    setattr(record, name, value)
        return True


FORMATS = ("text", "json")


def formatter_config(log_format: str) -> dict[str, object]:
    """``LOGGING["formatters"]`` entry for ``LOG_FORMAT`` (text: one line; json: one object)."""
    if log_format == "json":
        return {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": "%(levelname)s %(name)s %(message)s",
            "rename_fields": {"levelname": "level", "name": "logger"},
            # ISO 8601 in UTC ("2026-12-02T21:09:09.747714+00:00"): asctime was local time
            # with a comma and no zone.
            "timestamp": "time",
        }
    return {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}
