"""Work done while a thread waits on PostgreSQL (``tasks_app.services.waits``).

On PostgreSQL the steps run while a statement's reply is awaited, and only inside
``meanwhile``; a step that raises ends the work and not the statement. On SQLite nothing
is done ahead: the work is left to its own caller.
"""

from __future__ import annotations

import pytest
from django.db import connection

from tasks_app.services import waits

pytestmark = pytest.mark.django_db


class Steps:
    """Work of ``total`` steps, each noted; the step numbered ``fail_at`` raises."""

    def __init__(self, total: int = 1_000_000, fail_at: int | None = None) -> None:
        self.total, self.fail_at, self.done = total, fail_at, 0

    @property
    def pending(self) -> bool:
        return self.done < self.total

    def step(self) -> None:
        self.done += 1
        if self.done == self.fail_at:
            raise RuntimeError("this step broke")


def slept(seconds: float) -> int:
    """A statement the server takes ``seconds`` over (SQLite: none), and its answer."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT pg_sleep(%s), 7", [seconds])
            return cursor.fetchone()[1]
        cursor.execute("SELECT 7")
        return cursor.fetchone()[0]


def test_work_is_done_while_a_reply_is_awaited_and_only_inside_the_block():
    work = Steps()
    with waits.meanwhile(work):
        assert slept(0.05) == 7
        inside = work.done
    assert slept(0.05) == 7
    if connection.vendor == "postgresql":
        # At least one step while the server slept; none once the block was left.
        assert 0 < inside < work.total
    else:
        assert inside == 0
    assert work.done == inside


def test_a_step_that_raises_ends_the_work_not_the_statement():
    work = Steps(fail_at=3)
    with waits.meanwhile(work):
        assert slept(0.05) == 7
        assert slept(0.05) == 7  # the work is not taken up again in the same block
    assert work.done == (3 if connection.vendor == "postgresql" else 0)
    with waits.meanwhile(Steps(total=0)):  # nothing pending: nothing to do
        assert slept(0) == 7


def test_the_block_left_by_an_exception_leaves_no_work_behind():
    work = Steps()
    with pytest.raises(ZeroDivisionError), waits.meanwhile(work):
        slept(0.01)
        1 / 0  # noqa: B018 - the block ends by an exception
    done = work.done
    assert slept(0.05) == 7
    assert work.done == done


def test_work_put_first_is_done_first():
    order: list[str] = []

    class Named(Steps):
        def __init__(self, name: str) -> None:
            super().__init__(total=3)
            self.name = name

        def step(self) -> None:
            super().step()
            order.append(self.name)

    later, sooner = Named("later"), Named("sooner")
    with waits.meanwhile(later):
        waits.first(sooner)
        assert slept(0.05) == 7
    if connection.vendor == "postgresql":
        assert order == ["sooner"] * 3 + ["later"] * 3
    else:
        assert order == []
    waits.first(Named("outside"))  # outside any block: left to its caller
    assert slept(0.01) == 7 and "outside" not in order


def test_a_step_that_asks_the_database_is_refused_rather_than_left_waiting():
    """The connection is busy while its reply is awaited: a step that queries through Django
    is refused (through psycopg it would wait on the connection's lock for ever), its work
    dropped, and the statement's reply read."""
    from tasks_app.models import Agent

    refused: list[Exception] = []

    class Asks(Steps):
        def step(self) -> None:
            super().step()
            try:
                Agent.objects.count()
            except waits.ConnectionBusy as exc:
                refused.append(exc)
                raise

    work = Asks()
    with waits.meanwhile(work):
        assert slept(0.05) == 7
        assert slept(0.05) == 7
    postgres = connection.vendor == "postgresql"
    assert (work.done, len(refused)) == ((1, 1) if postgres else (0, 0))
    assert Agent.objects.count() == 0  # the connection goes on


def test_an_interruption_in_a_step_is_raised_once_the_reply_is_read():
    """``KeyboardInterrupt`` in a step comes out of the statement after its reply is read,
    so the connection has nothing left on the wire and the next statement runs."""

    class Interrupts(Steps):
        def step(self) -> None:
            super().step()
            raise KeyboardInterrupt

    work = Interrupts()
    postgres = connection.vendor == "postgresql"
    with waits.meanwhile(work):
        if postgres:
            with pytest.raises(KeyboardInterrupt):
                slept(0.05)
        else:
            assert slept(0.05) == 7
    assert work.done == (1 if postgres else 0)
    assert slept(0) == 7
