"""``manage.py tasks start|import|show|list|cancel|refresh|abandon|watch``: the mirror from the command line."""

from __future__ import annotations

import json
import time
from typing import Any

from django.core.management.base import CommandError, CommandParser

from tasks_app.a2a.card import registration_url
from tasks_app.a2a.safejson import whole_number
from tasks_app.management.arguments import (
    float_between,
    int_between,
    require_reference,
    shown,
)
from tasks_app.management.commands._stopping import StoppableCommand
from tasks_app.models import Agent, ImportJob, RemoteTask
from tasks_app.runtime.logs import one_line
from tasks_app.services import imports
from tasks_app.services import tasks as task_services
from tasks_app.services.snapshot import task_document

MODES = ["auto", "stream", "return-immediately", "blocking", "push"]


def _one(ref: str, what: str, *candidates: Any) -> Any:
    """The single row the first query with a match finds; two (a URL or a remote id is
    unique per project or agent, a name is not unique at all) is refused, not guessed."""
    for queryset in candidates:
        found = list(queryset[:2])
        if len(found) > 1:
            raise CommandError(
                f"{shown(ref)} names more than one {what}: give its number "
                f"(see 'manage.py {what}s list')."
            )
        if found:
            return found[0]
    return None


def find_agent(ref: str, *, retired_first: bool = False) -> Agent:
    """The agent ``ref`` names: its number, else its name or URL, looked for among the agents
    in service before the retired ones (a retired agent's URL may be registered again, and
    its name is often the same); ``retired_first`` the other way round, for ``restore``."""
    require_reference(ref, "agent")
    pk = whole_number(ref)
    in_service = Agent.objects.filter(retired_at__isnull=True)
    retired = Agent.objects.exclude(retired_at=None)
    groups = (retired, in_service) if retired_first else (in_service, retired)
    agent = (
        Agent.objects.filter(pk=pk).first()
        if pk is not None
        else _one(
            ref,
            "agent",
            *(
                query
                for agents in groups
                for query in (
                    agents.filter(name=ref),
                    agents.filter(base_url__in={ref, registration_url(ref)}),
                )
            ),
        )
    )
    if agent is None:
        raise CommandError(f"No agent {shown(ref)}: see 'manage.py agents list'.")
    return agent


def find_task(ref: str) -> RemoteTask:
    require_reference(ref, "task")
    pk = whole_number(ref)
    task = RemoteTask.objects.filter(pk=pk).first() if pk is not None else None
    task = task or _one(ref, "task", RemoteTask.objects.filter(remote_id=ref).order_by("pk"))
    if task is None:
        raise CommandError(f"No task {shown(ref)}.")
    return task


def _settled(task: RemoteTask) -> bool:
    """What ``tasks start --wait`` waits for: an end, a question, a plain reply or a failed send."""
    return task.phase in ("message", "failed") or task.is_terminal or task.is_interrupted


class Command(StoppableCommand):
    help = "Start, import, show and act on mirrored A2A tasks."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        start = sub.add_parser("start", help="send a message to an agent (a worker watches it)")
        start.add_argument("agent", help="agent id, name or base URL")
        start.add_argument("text")
        start.add_argument("--mode", choices=MODES, default="auto")
        start.add_argument(
            "--wait",
            type=float_between(0, 86400),
            default=0,
            help="seconds to wait for it to settle",
        )
        imp = sub.add_parser("import", help="mirror the tasks an agent lists (ListTasks)")
        imp.add_argument("agent")
        imp.add_argument("--json", action="store_true", help="print the finished job as JSON")
        imp.add_argument("--page-size", type=int_between(1, 100), default=100)  # A2A: 1-100
        show = sub.add_parser("show", help="a task's snapshot and event log")
        show.add_argument("task", help="local id or remote task id")
        show.add_argument("--json", action="store_true")
        listing = sub.add_parser("list", help="newest tasks")
        listing.add_argument("--limit", type=int_between(1, 10_000), default=20)
        cancel = sub.add_parser("cancel", help="ask the agent to cancel a task (CancelTask)")
        cancel.add_argument("task")
        cancel.add_argument("--reason", default="")
        refresh = sub.add_parser(
            "refresh", help="GetTask now (a task not named yet: look it up by contextId)"
        )
        refresh.add_argument("task")
        abandon = sub.add_parser("abandon", help="give a task up locally: never watched again")
        abandon.add_argument("task")
        abandon.add_argument("--reason", default="")
        again = sub.add_parser("watch", help="watch a parked (needs attention) task again")
        again.add_argument("task")

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"]
        try:
            getattr(self, "do_" + action)(options)
        except task_services.TaskActionError as exc:
            raise CommandError(str(exc)) from exc

    def do_start(self, options: dict) -> None:
        agent = find_agent(options["agent"])
        task = task_services.start_task(agent, options["text"], mode=options["mode"])
        self.interrupted_note = f"task {task.pk} was started and goes on (tasks show {task.pk})."
        if getattr(task, "handed_off", True) is False:
            # Saved, not lost, and not failed: a script must not start it again.
            self.stderr.write(
                f"Task {task.pk} is saved but no worker was asked to send it: the broker "
                "(CELERY_BROKER_URL / REDIS_URL) did not take the message. It is sent once "
                f"the broker and a worker are up (the reconciler asks again); see "
                f"'manage.py tasks show {task.pk}'."
            )
        deadline = time.monotonic() + options["wait"]
        settled = False
        while time.monotonic() < deadline:
            task.refresh_from_db()
            if settled := _settled(task):
                break
            time.sleep(0.2)
        task.refresh_from_db()
        self.stdout.write(
            f"{task.pk}\t{one_line(task.remote_id or '-')}\t{task.phase}\t{task.state_label}"
        )
        if options["wait"] and not (settled or _settled(task)):
            # The line above looks the same whether it settled or not: say which.
            self.stderr.write(
                f"Task {task.pk} had not settled after {options['wait']:g} s; it goes on "
                f"(manage.py tasks show {task.pk})."
            )
        if task.phase == RemoteTask.Phase.FAILED:
            # A script's `tasks start ... --wait` must see that nothing was started.
            raise CommandError(f"Task {task.pk}: the send failed: {task.send_error}")

    def do_import(self, options: dict) -> None:
        """The same bounded job a worker runs, run here, with a line per page."""
        agent = find_agent(options["agent"])
        job = imports.create_job(agent)

        def progress(j: ImportJob) -> None:
            if not options["json"]:
                self.stdout.write(
                    f"page {j.pages}: {j.seen} listed, {j.created} new, {j.changed} changed"
                )

        try:
            job = imports.run_job(job.pk, page_size=max(1, options["page_size"]), progress=progress)
        except KeyboardInterrupt:  # run_job marked the job canceled
            self.interrupted_note = (
                f"import job {job.pk} is canceled; the tasks it mirrored so far are kept."
            )
            raise
        if options["json"]:
            self.stdout.write(json.dumps(imports.job_document(job), indent=2))
        else:
            self.stdout.write(
                f"{job.status}: {job.pages} pages, seen {job.seen}, new {job.created}, changed {job.changed}"
            )
        if job.status != ImportJob.Status.DONE:
            raise CommandError(f"Import from {agent.name} {job.status}: {job.error}")

    def do_show(self, options: dict) -> None:
        task = find_task(options["task"])
        document = task_document(task)
        if options["json"]:
            self.stdout.write(json.dumps(document, indent=2, default=str))
            return
        self.stdout.write(
            f"task {task.pk} ({one_line(task.remote_id or task.unnamed_label)}) on {one_line(task.agent.name)}: "
            f"{task.state_label}"
        )
        since = f" since {task.watcher_since:%Y-%m-%d %H:%M:%S}" if task.watcher_since else ""
        self.stdout.write(
            f"watch {task.watch}, watcher {task.watcher_status}{since} {one_line(task.watcher_note)}"
        )
        if task.gone_at:
            self.stdout.write(f"gone at the agent since {task.gone_at:%Y-%m-%d %H:%M:%S}")
        for event in document["events"]:
            note = f"  ({one_line(event['note'])})" if event["note"] else ""
            self.stdout.write(
                f"  #{event['seq']:>4} {event['received_at']} {event['channel']:<13} {event['kind']:<15} {event['state']}{note}"
            )

    def do_list(self, options: dict) -> None:
        for task in RemoteTask.objects.select_related("agent")[: options["limit"]]:
            self.stdout.write(
                f"{task.pk}\t{one_line(task.agent.name)}\t{one_line(task.remote_id or '-')}\t"
                f"{task.state_label}\t{one_line(task.title)}"
            )

    def do_cancel(self, options: dict) -> None:
        task = task_services.cancel_task(find_task(options["task"]), reason=options["reason"])
        self.stdout.write(f"{task.pk}\t{task.state_label}")

    def do_refresh(self, options: dict) -> None:
        task = task_services.refresh_task(find_task(options["task"]))
        self.stdout.write(f"{task.pk}\t{task.state_label}\t{task.watcher_status}")

    def do_abandon(self, options: dict) -> None:
        task = task_services.abandon_task(
            find_task(options["task"]), reason=options["reason"], actor_name="the command line"
        )
        self.stdout.write(f"{task.pk}\t{task.state_label}\tabandoned")

    def do_watch(self, options: dict) -> None:
        task = task_services.watch_again(find_task(options["task"]))
        self.stdout.write(f"{task.pk}\t{task.state_label}\twatching again")
