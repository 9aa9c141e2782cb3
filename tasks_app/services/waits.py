"""PostgreSQL: work this thread does while it waits for the server's reply.

A fast stream's ``record_many()`` call spends about a third of its time waiting on the
database (the COPY of its log rows, the commit's deferred key checks, each statement's
round trip: 21 us an event of 60, measured in-process for P3), and the thread sits idle
meanwhile. The objects of the next call are often known already: a watcher records what
it took from a stream in calls of ``RECORD_CALL_EVENTS``. Parsing them needs nothing
from the database, so it is done in those waits (:func:`meanwhile`), one object at a
time, and the next call finds them parsed; then so is the next call's fold, from the
task as this call leaves it, which the next call takes if the task is still so
(``record._FoldAhead``, :func:`then`). What a call does after its commit (its messages
for the relay) is made in the commit's wait (:func:`first`).

How: each psycopg connection waits through its ``wait()`` method, which drives a
generator that says when it needs the socket readable (the request is out, the reply
has not come). :func:`meanwhile` puts a wrapper on this thread's connection which, at
each such point, does steps of the work until the socket is readable, then lets
psycopg wait as it would. A step is small (one object), so a reply waits at most one
step; the work is done once whichever call does it, so nothing is added, only moved
into time that was idle. Elsewhere (SQLite) :func:`meanwhile` does nothing and the
work is done by the call that needs it.

A step that raises is not retried here: the work is left as it is, for the call that
needs it, which meets the same error where it can say so.
"""

from __future__ import annotations

import contextlib
import select
import weakref
from collections.abc import Generator, Iterator
from typing import Any, Protocol

from django.db import connection
from psycopg.generators import WAIT_R


class Work(Protocol):
    """Work that can be done in steps, a few microseconds each."""

    @property
    def pending(self) -> bool:
        """Whether a step is left to do here (false once done, or once a step failed)."""
        ...

    def step(self) -> None:
        """Do the next step; raise to leave the rest to the work's own caller."""
        ...


@contextlib.contextmanager
def meanwhile(work: Work | None = None) -> Iterator[None]:
    """While inside, this thread's PostgreSQL waits do steps of ``work``, and of what
    :func:`first` and :func:`then` add (see the module)."""
    if connection.vendor != "postgresql":
        yield
        return
    connection.ensure_connection()
    raw = connection.connection
    waiter = raw.__dict__.get("wait")
    if not isinstance(waiter, _Waiter):
        waiter = raw.wait = _Waiter(raw)
    outer = waiter.works
    waiter.works = [work] if work is not None and work.pending else []
    try:
        yield
    finally:
        waiter.works = outer


def first(work: Work) -> None:
    """Inside :func:`meanwhile`, do ``work`` in the waits before what is there already (it
    is needed sooner); elsewhere nothing: its caller does it when it needs it."""
    waiter = _waiter()
    if waiter is not None:
        waiter.works.insert(0, work)  # type: ignore[union-attr]


def then(work: Work) -> bool:
    """Inside :func:`meanwhile`, do ``work`` in the waits after what is there already, and
    say so; elsewhere nothing (False)."""
    waiter = _waiter()
    if waiter is None:
        return False
    waiter.works.append(work)  # type: ignore[union-attr]
    return True


def _waiter() -> _Waiter | None:
    """This thread's connection's waiter inside :func:`meanwhile` (None elsewhere)."""
    if connection.vendor != "postgresql" or connection.connection is None:
        return None
    waiter = connection.connection.__dict__.get("wait")
    return waiter if isinstance(waiter, _Waiter) and waiter.works is not None else None


class _Waiter:
    """A connection's ``wait``, doing the thread's pending work where the reply is awaited."""

    def __init__(self, raw: Any) -> None:
        # Weakly: the connection holds this, and a cycle would outlive a closed connection
        # until the cyclic collector runs (rarely, in a worker).
        self._raw = weakref.ref(raw)
        self._wait = type(raw).wait
        self.works: list[Work] | None = None  # None: outside any meanwhile()

    def __call__(self, gen: Generator, *args: Any, **kwargs: Any) -> Any:
        raw = self._raw()
        if self.works:
            gen = self._working_while_reading(gen, raw.pgconn.socket)
        return self._wait(raw, gen, *args, **kwargs)

    def _working_while_reading(self, gen: Generator, fileno: int) -> Generator:
        """``gen`` as psycopg drives it, with steps of the work before each wait for the
        reply, while nothing has arrived to read.

        An interruption in a step (``KeyboardInterrupt``, ``SystemExit``) is raised once
        the reply is read: raised from here at once, psycopg would be left with a reply
        on the wire that nothing reads.
        """
        interrupted: BaseException | None = None
        try:
            state = next(gen)
            while True:
                if state == WAIT_R and self.works:
                    try:
                        self._work_until_readable(fileno)
                    except BaseException as exc:  # not an Exception: those end their work
                        interrupted = exc
                        self.works.clear()
                ready = yield state
                state = gen.send(ready)
        except StopIteration as stop:
            if interrupted is not None:
                raise interrupted from None
            return stop.value

    def _work_until_readable(self, fileno: int) -> None:
        """Steps of the works, first first, until the reply is there or nothing is left.

        The connection is busy meanwhile: a step that asks the database something would
        wait forever on psycopg's lock of it. Through Django it is refused instead (an
        ``execute_wrapper``, for these steps alone), and that work is dropped here.
        """
        works = self.works
        assert works is not None
        poller = select.poll()
        poller.register(fileno, select.POLLIN)
        connection.execute_wrappers.append(_busy)
        try:
            while works and not poller.poll(0):
                work = works[0]
                if not work.pending:
                    works.pop(0)
                    continue
                try:
                    work.step()
                except Exception:  # the work's own caller meets it again, and says so
                    works.pop(0)
        finally:
            connection.execute_wrappers.remove(_busy)


def _busy(*args: Any) -> None:
    raise ConnectionBusy("the database connection is waiting for a reply")


class ConnectionBusy(RuntimeError):
    """A step of work asked the database while its connection awaited a reply."""
