"""``manage.py audit verify [TASK_ID | --all]`` and ``manage.py audit replay TASK_ID | --all``.

``verify`` recomputes each task's hash chain and names the first row that
does not match; ``replay`` folds the stored log from scratch and compares it
with the stored view. Both exit non-zero when anything is wrong.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Q

from tasks_app.models import RemoteTask
from tasks_app.services.audit import replay, verify


class Command(BaseCommand):
    help = "Check the event log: the hash chain (verify) and that replaying it gives the view (replay)."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        for name, text in (("verify", "check the hash chain"), ("replay", "replay the log, compare the view")):
            command = sub.add_parser(name, help=text)
            command.add_argument("task", nargs="?", default="", help="local id or the agent's task id")
            command.add_argument("--all", action="store_true", help="every task")

    def handle(self, *args: Any, **options: Any) -> None:
        if bool(options["task"]) == bool(options["all"]):
            raise CommandError("Name one task, or pass --all.")
        tasks = RemoteTask.objects.order_by("pk").values_list("pk", flat=True)
        if not options["all"]:
            pks = list(tasks.filter(_lookup(options["task"]))[:2])
            if len(pks) != 1:
                found = "no task" if not pks else "several tasks"
                raise CommandError(f"{found} match {options['task']!r}; use the local id.")
            tasks = pks  # type: ignore[assignment]
        check = verify if options["action"] == "verify" else replay
        failed = 0
        for pk in tasks.iterator() if hasattr(tasks, "iterator") else tasks:
            result = check(pk)
            if not result.ok:
                failed += 1
                self.stdout.write(str(result))
            elif not options["all"] or options["verbosity"] > 1:
                self.stdout.write(str(result))
        if failed:
            raise CommandError(f"{failed} task(s) failed the {options['action']}.")
        if options["all"]:
            self.stdout.write(f"every task passed the {options['action']}")


def _lookup(text: str) -> Q:
    query = Q(remote_id=text)
    if text.isdigit():
        query |= Q(pk=int(text))
    return query
