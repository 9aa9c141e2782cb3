"""How this app's commands end when stopped from outside: Ctrl-C, or a reader that left.

Django's ``BaseCommand`` lets these end in a traceback: ``KeyboardInterrupt`` from Ctrl-C
(``a2a subscribe`` is documented as stopped that way), and ``BrokenPipeError`` when the
reader of the output closed it early (``manage.py audit actions | head -1``). Here Ctrl-C
is one line on stderr and exit status 130 (128 + SIGINT, as a shell reports it); a closed
output ends the command quietly with status 1, Python's advice for SIGPIPE. A database
that cannot be used (``DATABASE_URL`` naming a server that is down, a file that is no
database, migrations not applied) is one sentence and status 1 as well. Only
``run_from_argv`` (the command line) changes: ``call_command`` still raises, for callers
that want to handle it themselves.

Nothing is half-written either way: files are written atomically, rows in transactions;
a command with work of its own to wind up (``tasks import``'s job) does it before this
runs. The module's name starts with ``_``, so Django does not take it for a command.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys

from django.core.management.base import BaseCommand, OutputWrapper
from django.db import DatabaseError, OperationalError

from tasks_app.runtime.logs import terminal_text

INTERRUPTED_STATUS = 130
CLOSED_OUTPUT_STATUS = 1


def stdout_closed() -> bool:
    """Whether standard output is a pipe or socket whose reader has gone away.

    A ``BrokenPipeError`` may come from elsewhere (a socket to a peer): only this one is
    the reader's choice; any other is still reported as it was.
    """
    try:
        fd = sys.__stdout__.fileno() if sys.__stdout__ else 1
        poller = select.poll()
        poller.register(fd, 0)  # POLLERR and POLLHUP are reported whatever is asked
        return any(event & (select.POLLERR | select.POLLHUP) for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def database_problem(exc: DatabaseError) -> str:
    """One sentence for a database that cannot be used. The driver's first line names host,
    port, user and database, never a password (psycopg and sqlite3 both)."""
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    said = said.rstrip(".")
    # A missing table (SQLite) or relation (PostgreSQL): the schema is not there yet.
    unmigrated = "no such table" in said or ("relation" in said and "does not exist" in said)
    hint = " (has 'manage.py migrate' run?)" if unmigrated else ""
    where = "DATABASE_URL, or the SQLite file in DATA_DIR"
    return f"The database ({where}) cannot be used: {said}{hint}."


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null: the interpreter's last flush at exit would fail again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno() if sys.__stdout__ else 1)
        os.close(devnull)


class TerminalSafeOutput(OutputWrapper):
    """A command's output, whose text cannot drive the terminal it is read on.

    Agents' names, ids, titles and notes reach command output, and an escape sequence in
    one cleared the operator's screen, set its title or forged lines. Control characters are
    escaped here, before any colour of our own is added, but for the newline and the tab of
    the command's layout; each agent's field is written through ``one_line`` as well, so a
    newline or a tab in it cannot forge a line or a column.
    """

    def write(self, msg: str = "", style_func: object = None, ending: str | None = None) -> None:
        super().write(terminal_text(msg), style_func, ending)


class StoppableCommand(BaseCommand):
    """A command whose Ctrl-C and closed output end it in a line, not a traceback, and whose
    output escapes what could drive a terminal (:class:`TerminalSafeOutput`)."""

    # What the stopped command leaves behind, said after Ctrl-C (one sentence).
    interrupted_note = "nothing was left half-written."

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        style = self.stderr.style_func
        self.stdout = TerminalSafeOutput(self.stdout._out)
        self.stderr = TerminalSafeOutput(self.stderr._out)
        self.stderr.style_func = style

    def execute(self, *args: object, **options: object) -> object:
        # call_command's own streams: BaseCommand.execute would wrap them plainly.
        for name in ("stdout", "stderr"):
            stream = options.pop(name, None)
            if stream:
                setattr(self, name, TerminalSafeOutput(stream))
        return super().execute(*args, **options)

    def run_from_argv(self, argv: list[str]) -> None:
        try:
            super().run_from_argv(argv)
            sys.stdout.flush()  # here, not at exit, where a closed reader is a stray message
        except KeyboardInterrupt:
            with contextlib.suppress(OSError):
                sys.stderr.write(f"Stopped by Ctrl-C; {self.interrupted_note}\n")
                sys.stderr.flush()
            raise SystemExit(INTERRUPTED_STATUS) from None
        except DatabaseError as exc:
            # DATABASE_URL (or DATA_DIR's file) that cannot be used, found at the first query.
            # Not IntegrityError and its kin: those are this program's to explain.
            if type(exc) not in (DatabaseError, OperationalError):
                raise
            with contextlib.suppress(OSError):
                sys.stderr.write(f"{database_problem(exc)}\n")
            raise SystemExit(1) from None
        except BrokenPipeError:
            if not stdout_closed():
                raise
            _silence_stdout()
            raise SystemExit(CLOSED_OUTPUT_STATUS) from None
