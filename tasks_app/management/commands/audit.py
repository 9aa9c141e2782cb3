"""``manage.py audit verify|replay|export|actions``.

* ``verify [TASK_ID | --all]`` recomputes each task's hash chain and names the first
  row that does not match; ``replay TASK_ID | --all`` folds the stored log from scratch
  and compares it with the stored view. Both exit non-zero when anything is wrong.
* ``export TASK_ID [--format jsonl|json] [--output FILE]``: the task's history (the
  format is docs/exports.md), streamed; a file is written atomically with mode 0600.
* ``actions [--csv] [--person NAME] [--action A] [--agent ID|NAME] [--project ID|NAME]
  [--since DATE] [--until DATE] [--output FILE]``: the operator-action log, newest
  first, with the audit page's filters (a command-line admin sees every row).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db.models import Q

from tasks_app import actionlog, exports
from tasks_app.a2a.safejson import whole_number
from tasks_app.management.arguments import require_reference, shown
from tasks_app.management.commands._stopping import StoppableCommand
from tasks_app.models import Agent, Project, RemoteTask
from tasks_app.services.audit import replay, verify


class Command(StoppableCommand):
    help = "Check the event log: the hash chain (verify) and that replaying it gives the view (replay)."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        for name, text in (
            ("verify", "check the hash chain"),
            ("replay", "replay the log, compare the view"),
        ):
            command = sub.add_parser(name, help=text)
            command.add_argument(
                "task", nargs="?", default="", help="local id or the agent's task id"
            )
            command.add_argument("--all", action="store_true", help="every task")
        export = sub.add_parser("export", help="a task's history as JSON Lines or JSON")
        export.add_argument("task", help="local id or the agent's task id")
        export.add_argument("--format", choices=("jsonl", "json"), default="jsonl")
        export.add_argument(
            "--output", default="", help="file to write (atomically, mode 0600); default stdout"
        )
        actions = sub.add_parser("actions", help="the operator-action log, newest first")
        actions.add_argument(
            "--csv", action="store_true", help="CSV (the audit page's download); else one line each"
        )
        for name in ("person", "action", "agent", "project", "since", "until"):
            # dest prefixed: "action" is the subcommand's own dest.
            actions.add_argument(f"--{name}", dest=f"filter_{name}", default="")
        actions.add_argument(
            "--output", default="", help="file to write (atomically, mode 0600); default stdout"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["action"] == "export":
            return self._export(options)
        if options["action"] == "actions":
            return self._actions(options)
        if bool(options["task"]) == bool(options["all"]):
            raise CommandError("Name one task, or pass --all.")
        tasks = RemoteTask.objects.order_by("pk").values_list("pk", flat=True)
        if not options["all"]:
            pks = list(tasks.filter(_lookup(options["task"]))[:2])
            if len(pks) != 1:
                raise _no_one_task(options["task"], pks)
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

    def _export(self, options: dict[str, Any]) -> None:
        task = _one_task(options["task"])
        try:
            self._write(exports.task_chunks(task, options["format"]), options["output"])
        except exports.ExportIncomplete as exc:  # a file is not left; stdout stops short
            raise CommandError(f"The export is not whole: {exc}.") from exc

    def _actions(self, options: dict[str, Any]) -> None:
        data = {
            k: options[f"filter_{k}"]
            for k in ("person", "action", "since", "until")
            if options[f"filter_{k}"]
        }
        if options["filter_agent"]:
            data["agent"] = str(_named(Agent, options["filter_agent"], "agent"))
        if options["filter_project"]:
            data["project"] = str(_named(Project, options["filter_project"], "project"))
        form = actionlog.ActionFilterForm(data, user=None)
        if not form.is_valid():
            raise CommandError(
                "; ".join(f"--{k}: {_in_flags(' '.join(v))}" for k, v in form.errors.items())
            )
        rows = actionlog.apply_filters(actionlog.OperatorAction.objects.all(), form.cleaned_data)
        if options["csv"]:
            chunks = exports.csv_chunks(rows)
        else:
            chunks = (_line(row) for row in exports.action_rows(rows))
        self._write(chunks, options["output"])

    def _write(self, chunks: Iterator[bytes], output: str) -> None:
        if output:
            written = _write_file(Path(output), chunks)
            self.stderr.write(f"wrote {written} bytes to {output}")
            return
        out = getattr(self.stdout, "_out", sys.stdout)
        binary = getattr(out, "buffer", None)
        for chunk in chunks:
            if binary is not None:
                binary.write(chunk)
            else:
                out.write(chunk.decode("utf-8"))
        (binary or out).flush()


def _write_file(path: Path, chunks: Iterator[bytes]) -> int:
    """``--output``: the file, or a CommandError saying what is wrong with where it goes."""
    folder = path.parent
    # Checked before the first row is read: an operator's typo, not a traceback.
    if not folder.is_dir():
        missing = "does not exist" if not folder.exists() else "is not a folder"
        raise CommandError(f"Cannot write --output {path}: the folder {folder} {missing}.")
    if path.is_dir():
        raise CommandError(f"Cannot write --output {path}: it is a folder; name a file in it.")
    try:
        return exports.write_atomically(path, chunks)
    except OSError as exc:  # no permission to write in the folder, a full disk
        raise CommandError(
            f"Cannot write --output {path}: {exc.strerror or exc} (in the folder {folder})."
        ) from exc


def _line(row: Any) -> bytes:
    cells = exports.action_csv_row(row)
    when, person, action, agent, task, outcome, details = (
        cells[1],
        cells[2],
        cells[3],
        cells[6],
        cells[7],
        cells[9],
        cells[10],
    )
    text = f"{when}  {person or 'system'}  {action}"
    text += f"  agent={agent}" if agent else ""
    text += f"  task={task}" if task else ""
    text += f"  {outcome}" if outcome else ""
    text += f"  {details}" if details not in ("", "{}") else ""
    return (text + "\n").encode("utf-8")


def _named(model: type, text: str, what: str) -> int:
    """An agent or project by id or exact name."""
    require_reference(text, what)
    pk = whole_number(text)
    query = Q(name=text) | (Q(pk=pk) if pk is not None else Q())
    pks = list(model.objects.filter(query).values_list("pk", flat=True)[:2])
    if len(pks) != 1:
        raise CommandError(f"{'no' if not pks else 'more than one'} {what} matches {shown(text)}.")
    return pks[0]


def _in_flags(message: str) -> str:
    """The web form's words for its fields, as the command line names them."""
    message = message.replace("“To”", "--until").replace("“From”", "--since")
    return message.replace(
        "choose one from the list", "known actions: " + ", ".join(sorted(actionlog.KNOWN_ACTIONS))
    )


def _no_one_task(text: str, pks: list[int]) -> CommandError:
    """No task, or several, for ``text`` ("use the local id" was said of a local id too)."""
    if not pks:
        return CommandError(
            f"No task {shown(text)}: neither a local id nor a remote task id (see 'manage.py tasks list')."
        )
    return CommandError(
        f"Several tasks have the remote id {shown(text)} (of several agents): use the local id."
    )


def _one_task(text: str) -> RemoteTask:
    pks = list(RemoteTask.objects.filter(_lookup(text)).values_list("pk", flat=True)[:2])
    if len(pks) != 1:
        raise _no_one_task(text, pks)
    return RemoteTask.objects.select_related("agent__project", "started_by").get(pk=pks[0])


def _lookup(text: str) -> Q:
    require_reference(text, "task")
    query = Q(remote_id=text)
    pk = whole_number(text)
    if pk is not None:
        query |= Q(pk=pk)
    return query
