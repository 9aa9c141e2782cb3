"""``manage.py bench [NAME ...] [--quick] [--db sqlite|postgres|both] [--write-docs|--merge-docs]``.

Runs the performance rows of docs/performance.md (P1-P10, P2x) and prints one table row
per figure: value, goal, floor and ratio where a floor exists, PASS/MISS.

Why it is built this way: each row runs in its own child process
(``bench.child``) against its own scratch database - a temporary
SQLite file or a scratch PostgreSQL database, dropped afterwards - and one
private Redis for the whole run, so nothing touches real data or the shared
Redis other processes use. Every process started is stopped on exit, Ctrl-C
included.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from bench import procs
from bench.report import Row, merge_rows, notes, rows_from_docs, table, write_docs
from tasks_app.outbound import with_loopback
from tasks_app.runtime.net import redact_url

ALL_ROWS = ("P3", "P8", "P4", "P5", "P1", "P6", "P7", "P2", "P2x", "P9", "P10")
DOCS_PATH = procs.REPO_ROOT / "docs" / "performance.md"
ANALYSIS_PATH = procs.REPO_ROOT / "bench" / "analysis.md"


def run_rows(
    names: list[str],
    databases: list[str],
    *,
    quick: bool,
    log: Any = None,
    timeout: float | None = None,
    parallel: int = 1,
) -> list[Row]:
    """Run ``names`` on each of ``databases``; returns the rows (a failed child gives a MISS row).

    ``parallel`` > 1 runs that many rows at once (the smoke test does, to stay quick;
    measurements should not). Each child gets its own Redis database number, so
    channel groups (``task-<pk>``) of two scratch databases never meet.
    """
    jobs = [(name, db) for db in databases for name in names]
    with procs.workdir() as work, procs.private_redis(work) as redis_url:
        base = redis_url.rsplit("/", 1)[0]

        def one(index: int) -> list[Row]:
            name, db = jobs[index]
            if log:
                log(f"-- {name} on {db}{' (quick)' if quick else ''}")
            with procs.scratch_database(db, work) as database_url:
                return _run_child(
                    name, db, database_url, f"{base}/{index % 16}", work, quick, log, timeout
                )

        if parallel <= 1:
            return [row for index in range(len(jobs)) for row in one(index)]
        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            return [row for rows in pool.map(one, range(len(jobs))) for row in rows]


def _run_child(
    name: str,
    db: str,
    database_url: str,
    redis_url: str,
    work: Path,
    quick: bool,
    log: Any,
    timeout: float | None,
) -> list[Row]:
    data_dir = work / f"data-{name}-{db}"
    data_dir.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update(
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        DATA_DIR=str(data_dir),
        CELERY_QUEUE=f"bench-{uuid.uuid4().hex[:8]}",
        DJANGO_SETTINGS_MODULE="dashboard.settings",
        DASHBOARD_TEST_DB_FILE=str(data_dir / "unused-test.sqlite3"),
        LOG_LEVEL=env.get("BENCH_LOG_LEVEL", "WARNING"),
        # The bench's browsers (up to 1,000 sockets) share one person's session: each stands
        # for a person of their own, so the per-person socket cap is lifted for the bench.
        BUDGET_PERSON_SOCKETS="100000",
    )
    env.pop("CELERY_BROKER_URL", None)
    # The bench agents listen on 127.0.0.1: the outbound guard is told so, for the bench only.
    env["OUTBOUND_ALLOW"] = with_loopback(env.get("OUTBOUND_ALLOW", ""))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(procs.REPO_ROOT), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "bench.child", name, "--db-label", db]
    if quick:
        argv.append("--quick")
    # A guard against a hang, not a speed goal. The longest quick row (P9) took 30 s alone on a
    # quiet machine here; three at once (the smoke test) on a machine three times slower can
    # take it past 150 s with nothing hung (a likely cause of a CI run's unnamed failures).
    limit = timeout or (300 if quick else 1200)
    err_path = work / f"child-{name}-{db}.err"
    started = time.monotonic()
    with open(err_path, "wb") as err:
        child = subprocess.Popen(argv, cwd=procs.REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=err,
                                 stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        proc = procs.Proc(name, child)
        try:
            out, _ = child.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            out = b""
        finally:
            # The child's own children live in their own groups and are stopped by it: give it
            # time for that (each takes up to 10 s) before it is killed.
            proc.stop(timeout=60)
    rows = []
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("BENCHROW "):
            rows.append(Row.from_json(json.loads(line[len("BENCHROW ") :])))
    if not rows:
        tail = err_path.read_text(errors="replace")[-1500:]
        rows.append(Row(name, "error", "error", "", False, db=db,
                        note=f"the child exited with {child.returncode} after {time.monotonic() - started:.0f}s "
                             f"without a result: {tail}"))  # fmt: skip
    elif log:
        for row in rows:
            log(f"   {row.row} {row.db}: {row.value} [{row.verdict}]")
        log(f"   ({time.monotonic() - started:.0f}s)")
    if log and os.environ.get("BENCH_SHOW_STDERR"):
        log(err_path.read_text(errors="replace")[-3000:])
    return rows


class Command(BaseCommand):
    help = "Run the performance benchmarks (P1-P10) and print value, goal, floor, PASS/MISS."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "names", nargs="*", help=f"rows to run (default: all of {' '.join(ALL_ROWS)})"
        )
        parser.add_argument(
            "--quick", action="store_true", help="every row at a small scale (smoke test)"
        )
        parser.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both",
                            help="database(s) to run the rows on (default: both)")  # fmt: skip
        parser.add_argument("--write-docs", action="store_true", help="write docs/performance.md")
        parser.add_argument("--merge-docs", action="store_true",
                            help="replace only the rows measured now in docs/performance.md "
                                 "(the others, and the page's machine section, stay)")  # fmt: skip
        parser.add_argument("--rewrite-docs", action="store_true",
                            help="re-render docs/performance.md from the rows it holds (after editing "
                                 "bench/analysis.md), without measuring")  # fmt: skip

    def handle(self, *args: Any, **options: Any) -> None:
        # Cleanup (child processes, scratch databases, the private Redis) runs in finally
        # blocks: make SIGTERM, and SIGINT even where a background shell ignores it, unwind.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if options["rewrite_docs"]:
            rows, command = rows_from_docs(DOCS_PATH)
            analysis = ANALYSIS_PATH.read_text() if ANALYSIS_PATH.exists() else ""
            write_docs(DOCS_PATH, rows, command, analysis, keep_machine=True)
            self.stdout.write(table(rows))
            return
        canonical = {n.upper(): n for n in ALL_ROWS}  # "p2x" and "P2X" name the row P2x
        names = [canonical.get(n.upper(), n) for n in options["names"]] or list(ALL_ROWS)
        unknown = [n for n in names if n not in ALL_ROWS]
        if unknown:
            raise CommandError(f"unknown rows {unknown}; choose from {', '.join(ALL_ROWS)}")
        databases = ["sqlite", "postgres"] if options["db"] == "both" else [options["db"]]
        if "postgres" in databases:
            why = procs.postgres_available()
            if why:
                if options["db"] == "postgres":
                    raise CommandError(
                        f"PostgreSQL is not reachable at {redact_url(procs.PG_ADMIN_URL)}: {why}"
                    )
                self.stderr.write(f"PostgreSQL not reachable ({why}); running on SQLite only")
                databases = ["sqlite"]
        rows = run_rows(
            names, databases, quick=options["quick"], log=lambda s: self.stderr.write(s)
        )
        self.stdout.write(table(rows))
        self.stdout.write("")
        self.stdout.write(notes(rows))
        if options["write_docs"]:
            command = "manage.py bench " + " ".join(
                [
                    *options["names"],
                    *(["--quick"] if options["quick"] else []),
                    f"--db {options['db']}",
                    "--write-docs",
                ]
            )
            analysis = ANALYSIS_PATH.read_text() if ANALYSIS_PATH.exists() else ""
            write_docs(DOCS_PATH, rows, command.replace("  ", " "), analysis)
            self.stderr.write(f"wrote {DOCS_PATH}")
        elif options["merge_docs"]:
            earlier, command = rows_from_docs(DOCS_PATH)
            analysis = ANALYSIS_PATH.read_text() if ANALYSIS_PATH.exists() else ""
            merged = merge_rows(earlier, rows)
            write_docs(DOCS_PATH, merged, command, analysis, keep_machine=True)
            self.stderr.write(f"replaced {len(rows)} rows in {DOCS_PATH}")
