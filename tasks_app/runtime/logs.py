"""Keeping the default log readable: routine periodic tasks say nothing at INFO.

Celery beat runs the reconciler every ``RECONCILE_EVERY_SECONDS`` (2 s by default), and at
INFO beat logs "Sending due task" for it while the worker logs "Task ... received" and
"Task ... succeeded": three lines every tick, which bury everything else. This filter drops
exactly those INFO records for the tasks it is given; ``LOGGING`` puts it on the loggers
that write them (``celery.beat``, ``celery.worker.strategy``, ``celery.app.trace``). Anything at WARNING or above (a failed
or retried tick, a lost connection) still reaches the log, and so does every other task.

Agents are untrusted, and what they say reaches log lines (an error's text, a task id, a
reason phrase): :class:`SafeText`, the text format, escapes control characters in the
message and in exception text, so no agent can start a line of its own, move the cursor or
colour a terminal; both formats cut an over-long message (see ``MESSAGE_LIMIT``).

Imported by ``dashboard/settings.py``'s ``LOGGING`` while Django configures logging, so it
must import nothing from Django or the app.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any


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


class FailureSpell:
    """A spell of the same failure logged once: the first with its traceback, the rest counted
    until something works again, then one line with the count and how long it lasted.

    With Redis down, a traceback per relay send or per webhook delivery was a log line per
    message or per request (the relay's sends, the push webhook's checks).
    """

    def __init__(
        self, logger: logging.Logger, first: str, again: str, *, traceback: bool = True
    ) -> None:
        """``first``: the message of the first failure (its arguments are ``failed``'s);
        ``again``: the message when it works again, given the count and the seconds;
        ``traceback``: False for failures whose message says all (Redis down)."""
        self.logger, self.first, self.again = logger, first, again
        self.traceback = traceback
        self.count = 0
        self.since: float | None = None

    def failed(self, *args: object) -> None:
        """Called in an ``except`` block (the first failure logs its traceback)."""
        self.count += 1
        if self.since is None:
            self.since = time.monotonic()
            if self.traceback:
                self.logger.exception(self.first, *args)
            else:
                self.logger.warning(self.first, *args)

    def worked(self) -> None:
        if self.since is not None:
            self.logger.warning(self.again, self.count, time.monotonic() - self.since)
            self.count, self.since = 0, None


class RefusedRequests(logging.Filter):
    """Requests refused with a 4xx, as Django logs them: one line per kind a minute, no traceback.

    Django logs every refused request: a ``SuspiciousOperation`` (a Host header not in
    ``ALLOWED_HOSTS``, a form over the upload limits) at ERROR with our own traceback
    (``django.security.*``), and every 4xx at WARNING (``django.request``). Anyone who can
    reach the port chooses how many: a scanner's thousand bad Host headers made a thousand
    tracebacks. Here the traceback is dropped (it shows our stack, nothing of the client's),
    and of each kind (logger and status) the first in ``window`` seconds is logged; the next
    one logged after it says how many were left out. Every other record passes untouched.

    On the console handler, not on the loggers: a logger's filters do not see its children's
    records (``django.security.DisallowedHost``).
    """

    def __init__(self, window: float = 60.0) -> None:
        super().__init__()
        self.window = window
        self._lock = threading.Lock()  # the web process logs from several threads
        self._spells: dict[tuple[str, object], list[float]] = {}  # kind -> [since, left out]

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        if not record.name.startswith("django.security.") and not (
            record.name == "django.request" and isinstance(status, int) and status < 500
        ):
            return True
        # A refusal's traceback (a 403's PermissionDenied too) is our stack, not news.
        record.exc_info, record.exc_text = None, None
        kind = (record.name, status)  # a few logger names and status codes: a small dict
        now = time.monotonic()
        with self._lock:
            spell = self._spells.get(kind)
            if spell is not None and now - spell[0] < self.window:
                spell[1] += 1
                return False
            left_out = int(spell[1]) if spell is not None else 0
            self._spells[kind] = [now, 0]
        if left_out:
            record.msg = f"{record.getMessage()} ({left_out} more like it not logged)"
            record.args = None
        return True


# Bounds of one record: its message, and its exception text (a traceback is ours, but an
# exception's own text may be an agent's). Past them the text is cut, with a marker.
MESSAGE_LIMIT = 4096
EXCEPTION_LIMIT = 32768

# What must never reach a text line as it is: C0 and C1 control characters (newline, carriage
# return, ESC of an ANSI sequence, backspace, ...), DEL, the Unicode line and paragraph
# separators, the bidirectional controls that reorder what a terminal shows, and the
# zero-width characters that hide text (or a name) in plain sight.
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2060\ufeff\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)
_UNSAFE_BUT_NEWLINE = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2060\ufeff\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)
# What a command's own layout uses (lines and tab-separated columns): kept by terminal_text.
_UNSAFE_BUT_LAYOUT = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2060\ufeff\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(char: str) -> str:
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def _escape(text: str, pattern: re.Pattern[str] = _UNSAFE) -> str:
    return pattern.sub(lambda match: _escaped(match.group()), text)


def _marker(cut: int) -> str:
    return f"\u2026 [{cut} more characters cut]"


def one_line(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """``text`` as one safe line of at most about ``limit`` characters.

    Control characters are escaped (a newline becomes ``\\n``, ESC ``\\x1b``); past
    ``limit`` (counted after escaping) the rest is cut, and a marker says how much.
    """
    head = text[:limit]
    line = _escape(head) if _UNSAFE.search(head) else head
    kept = len(head)
    if len(line) > limit:  # escapes made it longer: keep the characters whose escapes fit
        size = kept = 0
        for char in head:
            size += len(_escaped(char)) if _UNSAFE.match(char) else 1
            if size > limit:
                break
            kept += 1
        line = _escape(head[:kept])
    cut = len(text) - kept
    return line if not cut else line + _marker(cut)


def cut(text: str, limit: int) -> str:
    """``text`` with its middle cut to keep it near ``limit`` characters (head and tail kept:
    a traceback's last line names the error)."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return text[:half] + _marker(len(text) - 2 * half) + text[-half:]


def _chain(te: traceback.TracebackException) -> Iterator[traceback.TracebackException]:
    seen: set[int] = set()
    todo = [te]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        todo.extend(n for n in (node.__cause__, node.__context__) if n is not None)
        todo.extend(getattr(node, "exceptions", None) or ())


def terminal_text(text: str) -> str:
    """``text`` for a terminal: control characters escaped but the newline and the tab of a
    command's own layout (an agent's text in each field is passed through :func:`one_line`).

    Each as ``\\uXXXX``, which a JSON string reads back as the same character: a command's
    ``--json`` output stays JSON (DEL, C1 and bidi controls are raw there).
    """
    if not _UNSAFE_BUT_LAYOUT.search(text):
        return text
    return _UNSAFE_BUT_LAYOUT.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


class SafeText(logging.Formatter):
    """The text format: one line per record, whatever its message holds.

    The message is escaped and cut (:func:`one_line`). A traceback keeps its lines, but the
    text of each exception in it (and its notes) is escaped and cut the same way, and no other
    control character than the newlines between its lines is left; the whole is cut at
    ``EXCEPTION_LIMIT``. So every line that starts with a time is the start of a record of ours.
    """

    def format(self, record: logging.LogRecord) -> str:
        # As logging.Formatter.format, but the exception text is never taken from the record's
        # cache (another handler may have put the raw text there).
        record.message = one_line(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        if record.exc_info:
            extra = self.formatException(record.exc_info)
        else:
            extra = _escape(cut(record.exc_text or "", EXCEPTION_LIMIT), _UNSAFE_BUT_NEWLINE)
        if extra:
            line = f"{line}\n{extra}"
        if record.stack_info:
            stack = cut(self.formatStack(record.stack_info), EXCEPTION_LIMIT)
            line = f"{line}\n{_escape(stack, _UNSAFE_BUT_NEWLINE)}"
        return line

    def formatException(self, ei: Any) -> str:
        try:
            te = traceback.TracebackException(ei[0], ei[1], ei[2], compact=True)
        except Exception:  # an exception that cannot even be described: logging's own way
            text = super().formatException(ei)
        else:
            for node in _chain(te):
                if isinstance(getattr(node, "_str", None), str):
                    node._str = one_line(node._str)
                notes = getattr(node, "__notes__", None)
                if isinstance(notes, list | tuple):
                    node.__notes__ = [one_line(str(note)) for note in notes]
            text = "".join(te.format()).rstrip("\n")
        return _escape(cut(text, EXCEPTION_LIMIT), _UNSAFE_BUT_NEWLINE)


def json_formatter(**options: Any) -> logging.Formatter:
    """The JSON format (``pythonjsonlogger``), with the message and exception text cut as in
    the text format (the encoder escapes control characters itself)."""
    from pythonjsonlogger.json import JsonFormatter

    class Bounded(JsonFormatter):
        def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
            message = log_data.get("message")
            if isinstance(message, str) and len(message) > MESSAGE_LIMIT:
                log_data["message"] = message[:MESSAGE_LIMIT] + _marker(
                    len(message) - MESSAGE_LIMIT
                )
            for name in ("exc_info", "stack_info"):
                if isinstance(log_data.get(name), str):
                    log_data[name] = cut(log_data[name], EXCEPTION_LIMIT)
            request = log_data.get("request")
            if request is not None and not isinstance(request, str):
                # Django's request log records carry the request, whose repr holds the query
                # string (``?token=...``): its method and path only, as the text format says.
                method, path = getattr(request, "method", ""), getattr(request, "path", "")
                log_data["request"] = one_line(f"{method} {path}")
            return super().process_log_record(log_data)

    return Bounded(**options)


FORMATS = ("text", "json")


def formatter_config(log_format: str) -> dict[str, object]:
    """``LOGGING["formatters"]`` entry for ``LOG_FORMAT`` (text: one line; json: one object)."""
    if log_format == "json":
        return {
            "()": "tasks_app.runtime.logs.json_formatter",
            "fmt": "%(levelname)s %(name)s %(message)s",
            "rename_fields": {"levelname": "level", "name": "logger"},
            # ISO 8601 in UTC ("2026-12-02T21:09:09.747714+00:00"): asctime was local time
            # with a comma and no zone.
            "timestamp": "time",
        }
    return {
        "()": "tasks_app.runtime.logs.SafeText",
        "format": "%(asctime)s %(levelname)s %(name)s: %(message)s",
    }
