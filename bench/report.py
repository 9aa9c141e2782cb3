"""Result rows, the printed table, and docs/performance.md.

A row carries its value, its goal, the floor where one exists and a PASS/MISS
verdict computed by the code that measured it (goals differ in shape: some are
upper bounds, some ratios, some counts), so the table never re-interprets them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Row:
    """One measured figure."""

    row: str  # "P3", "P1", ...
    measure: str  # what was measured, in words
    value: str  # the figure, formatted
    goal: str  # the goal, formatted
    ok: bool | None  # None: not measured (the note says why)
    floor: str = ""  # the floor, formatted, where one exists
    ratio: str = ""  # value against the floor
    db: str = ""  # "sqlite", "postgres" or "" when the database does not matter
    note: str = ""  # how it was measured, or why it was not
    extra: dict[str, Any] = field(default_factory=dict)  # raw numbers, for tests and docs

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "MISS", None: "n/a"}[self.ok]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Row:
        return cls(**data)


HEADER = ("#", "db", "measure", "value", "goal", "floor", "ratio", "verdict")


def table(rows: list[Row]) -> str:
    """A Markdown table (readable in a terminal too)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        cells = (
            r.row,
            r.db or "-",
            r.measure,
            r.value,
            r.goal,
            r.floor or "-",
            r.ratio or "-",
            r.verdict,
        )
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def notes(rows: list[Row]) -> str:
    out = []
    for r in rows:
        if r.note:
            out.append(f"- **{r.row}{' (' + r.db + ')' if r.db else ''}**: {r.note}")
    return "\n".join(out)


def machine() -> dict[str, str]:
    """What the figures were measured on: they mean little without it."""
    import django

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor()
    memory = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    except OSError:
        pass
    return {
        "nproc": str(os.cpu_count() or "?"),
        "memory": memory,
        "cpu": cpu,
        "python": sys.version.split()[0],
        "django": django.get_version(),
        "platform": platform.platform(),
        # Other work on the machine shows here; latencies measured under load are upper bounds.
        "load": " / ".join(f"{x:.1f}" for x in os.getloadavg()),
    }


def write_docs(
    path: Path, rows: list[Row], command: str, analysis: str, *, keep_machine: bool = False
) -> None:
    """Write docs/performance.md: the machine, the date, the command, the table, the notes.

    ``keep_machine`` (re-rendering rows measured earlier): the page's machine-and-run
    section, and what is written above the table, stay as they were, since they describe
    the run that measured the rows, not today.
    """
    info = machine()
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = f"""# Performance

Measured by `manage.py bench` (`tasks_app/management/commands/bench.py`,
`bench/`). Regenerate this page with:

    {command}

## Machine and run

| | |
|---|---|
| date | {now} |
| command | `{command}` |
| nproc | {info["nproc"]} |
| memory | {info["memory"]} |
| CPU | {info["cpu"]} |
| Python | {info["python"]} |
| Django | {info["django"]} |
| platform | {info["platform"]} |
| load average (1/5/15 min) when written | {info["load"]} |

Agent, Redis, database, Celery worker, daphne and the measuring clients all run on
this one machine, which is shared with other work: latencies are upper bounds.
Floors are measured in the same run, on the same machine, at the same time.

## Results

{table(rows)}

## How each row was measured

{notes(rows)}

{analysis}
{ROWS_MARK}{json.dumps([r.to_json() for r in rows], default=str)} -->
"""
    if keep_machine and path.exists():
        # From the machine section to the table's first line: the machine and run, and any
        # note written above the table (which rows it does not hold yet, and why).
        old, start, end = path.read_text(), "## Machine and run", "\n| # |"
        if start in old and end in old:
            earlier = old[old.index(start) : old.index(end)]
            text = text[: text.index(start)] + earlier + text[text.index(end) :]
    path.write_text(text)


ROWS_MARK = "<!-- bench rows: "


def merge_rows(earlier: list[Row], measured: list[Row]) -> list[Row]:
    """``earlier`` with every (row, database) that ``measured`` holds replaced by its rows, in
    the place of the first one replaced (new ones at the end). Each measured row's note starts
    with when and at what load it was measured, since the page's machine section describes
    another run."""
    info = machine()
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    measured = [
        dataclasses.replace(r, note=f"measured {stamp} (load average {info['load']}): {r.note}")
        for r in measured
    ]
    replaced = {(r.row, r.db) for r in measured}
    merged: list[Row] = []
    placed: set[tuple[str, str]] = set()
    for row in earlier:
        key = (row.row, row.db)
        if key not in replaced:
            merged.append(row)
        elif key not in placed:
            merged.extend(r for r in measured if (r.row, r.db) == key)
            placed.add(key)
    merged.extend(r for r in measured if (r.row, r.db) not in placed)
    return merged


def rows_from_docs(path: Path) -> tuple[list[Row], str]:
    """The rows and command embedded in a docs page written earlier (to re-render its text)."""
    text = path.read_text()
    start = text.index(ROWS_MARK) + len(ROWS_MARK)
    rows = [Row.from_json(d) for d in json.loads(text[start : text.index(" -->", start)])]
    command = next(
        (line.split("`")[1] for line in text.splitlines() if line.startswith("| command |")), ""
    )
    return rows, command
