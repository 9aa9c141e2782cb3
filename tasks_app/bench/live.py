"""End-to-end rows (P1, P2, P6, P7): written next."""

from __future__ import annotations

from tasks_app.bench.report import Row


def _todo(name: str, db: str) -> list[Row]:
    return [Row(name, "not implemented yet", "-", "-", None, db=db)]


def p1(db: str, quick: bool) -> list[Row]:
    return _todo("P1", db)


def p2(db: str, quick: bool) -> list[Row]:
    return _todo("P2", db)


def p6(db: str, quick: bool) -> list[Row]:
    return _todo("P6", db)


def p7(db: str, quick: bool) -> list[Row]:
    return _todo("P7", db)
