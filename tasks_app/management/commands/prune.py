"""``manage.py prune --older-than DAYS [--export-to DIR] [--dry-run] [--batch N]``.

Removes settled tasks older than DAYS (the rule and its guarantees: ``tasks_app.retention``),
exporting each first as JSON Lines into DIR when asked (``DIR/task-<id>.jsonl``, mode
0600). ``--older-than`` defaults to the ``RETENTION_DAYS`` setting. ``--dry-run`` only
counts. Exits non-zero when an export failed (those tasks were kept).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError, CommandParser

from tasks_app import retention
from tasks_app.management.arguments import int_between
from tasks_app.management.commands._stopping import StoppableCommand

MAX_DAYS = 36_500  # as RETENTION_DAYS


def _days(text: str, source: str) -> float:
    """``text`` as a number of days; ``source`` names where it came from, for the error."""
    try:
        value = float(text)
    except ValueError:
        raise CommandError(f"{source} takes a number of days, not {text!r}.") from None
    # At most a century: far older is before any date the database can compare with.
    if not 0 < value <= MAX_DAYS:
        raise CommandError(f"{source} must be a number of days more than 0, at most {MAX_DAYS:,}.")
    return value


class Command(StoppableCommand):
    help = "Remove settled tasks older than a number of days (exported first with --export-to)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than", default="", metavar="DAYS", help="default: RETENTION_DAYS"
        )
        parser.add_argument(
            "--export-to", default="", metavar="DIR", help="write each task here first (JSON Lines)"
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="count what would be removed, remove nothing"
        )
        parser.add_argument(
            "--batch",
            type=int_between(1, 10_000),
            default=retention.BATCH,
            help="tasks per transaction",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        text = options["older_than"] or (
            str(settings.RETENTION_DAYS) if settings.RETENTION_DAYS else ""
        )
        if not text:
            raise CommandError("Say how old: --older-than DAYS (or set RETENTION_DAYS).")
        days = _days(text, "--older-than" if options["older_than"] else "RETENTION_DAYS")
        export_to = Path(options["export_to"]) if options["export_to"] else None
        try:  # a name the system refuses (too long, say) is said, not a traceback
            not_a_folder = export_to is not None and export_to.exists() and not export_to.is_dir()
        except OSError as exc:
            raise CommandError(f"--export-to cannot be used: {exc.strerror or exc}.") from None
        if not_a_folder:
            raise CommandError(f"--export-to {export_to} is not a folder.")
        if export_to is not None and not options["dry_run"]:
            try:  # made here, so that a folder that cannot be is said before anything is pruned
                export_to.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:
                raise CommandError(
                    f"--export-to {export_to} cannot be made: {exc.strerror or exc}."
                ) from None
        say = self.stdout.write if options["verbosity"] > 1 else None
        result = retention.prune(
            days, export_to=export_to, dry_run=options["dry_run"], batch=options["batch"], say=say
        )
        self.stdout.write(str(result))
        for failure in result.export_failures:
            self.stderr.write(f"export failed: {failure}")
        if result.export_failures:
            raise CommandError(
                f"{len(result.export_failures)} task(s) could not be exported and were kept."
            )
