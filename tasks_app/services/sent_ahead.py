"""PostgreSQL: statements sent now and their results read later, so that the server
works while this thread does.

``record_many()`` sends the first read of a batch (the task's row and artifacts) before
it parses the batch, and takes the results after: the round trip, the planning and the
execution then overlap the parsing, which needs nothing from the database (P3 on
PostgreSQL: the read fell from 6-7 us an event to under 3, measured in-process).

This goes below Django's cursor, on the same connection and in the same thread, so it
is used only where nothing watches statements through a cursor: ``execute_wrapper``
(tests inject a pause by statement) and the debug cursor (``CaptureQueriesContext``,
``DEBUG``) see only what a cursor executes, and with either of them :func:`usable` says
no and the caller reads the usual way. Errors come out as Django's, like a cursor's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import psycopg
from django.db import connection
from psycopg import errors, generators, pq
from psycopg.adapt import Transformer

_STATUS_OK = frozenset({pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK})


def usable() -> bool:
    """Whether statements may be sent ahead on this thread's connection now."""
    return (
        connection.vendor == "postgresql"
        and not connection.execute_wrappers
        and not connection.queries_logged
    )


class SentAhead:
    """One string of statements (separated by ``;``) on its way; :meth:`results` waits.

    Exactly one of :meth:`results` and :meth:`discard` must be called before the
    connection runs anything else: the replies are on the wire until then.
    """

    def __init__(self, sql: str, params: Sequence[Any]) -> None:
        """Send ``sql`` with ``params`` bound the way Django binds them (client side).

        When the transaction has not begun yet (an ``atomic()`` just entered), its
        ``BEGIN`` goes in front: psycopg would otherwise send it as a round trip of its
        own before the first statement.
        """
        connection.ensure_connection()
        connection.validate_no_broken_transaction()  # as a cursor's execute checks
        with connection.wrap_database_errors:
            raw = connection.connection
            self._cursor = connection.create_cursor()  # Django's loaders (time zone, JSON)
            # Django's cursor binds on the client unless its settings say otherwise.
            binder = self._cursor
            if not isinstance(binder, psycopg.ClientCursor):
                binder = psycopg.ClientCursor(raw)
            text = binder.mogrify(sql, params)
            self.began = raw.pgconn.transaction_status == pq.TransactionStatus.IDLE
            if self.began and not raw.autocommit:
                text = f"{_begin(raw)}; {text}"
            else:
                self.began = False
            raw.pgconn.send_query(text.encode())
        self._raw = raw
        self._done = False

    def results(self) -> list[Any]:
        """The results of the statements sent (``BEGIN``'s first when :attr:`began`)."""
        assert not self._done, "results are read once"
        self._done = True
        with connection.wrap_database_errors:
            results = self._raw.wait(generators.fetch_many(self._raw.pgconn))
            for result in results:
                if result.status not in _STATUS_OK:
                    raise errors.error_from_result(result, encoding=self._raw.info.encoding)
        return results

    def discard(self) -> None:
        """Read and drop the replies, errors and all: the caller is failing for a reason of
        its own, which is the one to report."""
        if not self._done:
            with contextlib.suppress(Exception):  # the caller's exception is the one that counts
                self.results()

    def rows(self, result: Any) -> list[tuple]:
        """The rows of one result, loaded as a cursor of this connection loads them."""
        loader = Transformer(self._cursor)
        loader.set_pgresult(result)
        return loader.load_rows(0, result.ntuples, tuple)


def _begin(raw: Any) -> str:
    """The ``BEGIN`` psycopg would send for this connection's transaction settings."""
    words = ["BEGIN"]
    if raw.isolation_level is not None:
        words += [
            "ISOLATION LEVEL",
            psycopg.IsolationLevel(raw.isolation_level).name.replace("_", " "),
        ]
    if raw.read_only is not None:
        words.append("READ ONLY" if raw.read_only else "READ WRITE")
    if raw.deferrable is not None:
        words.append("DEFERRABLE" if raw.deferrable else "NOT DEFERRABLE")
    return " ".join(words)
