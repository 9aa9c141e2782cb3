"""Importing an agent's tasks (ListTasks, page by page) as a job with progress.

Why a job: a ListTasks walk lasts as long as the agent makes it, and an agent
may repeat its ``nextPageToken`` forever. So the web request only creates an
``ImportJob``; a worker runs it (``tasks_app.jobs.run_import``), or the command
line runs it in its own process. Bounds stop any walk: a page cap
(``IMPORT_MAX_PAGES``), a guard against a token the agent already gave, a cap on
tasks per import (``MAX_TASKS_PER_IMPORT``), and a deadline for the whole walk
(``IMPORT_DEADLINE_SECONDS``, which bounds each request and is checked between
tasks too). The agent may ignore ``pageSize``: at most the size asked for (never
above ``MAX_TASKS_PER_PAGE``) is taken from one page, and the job says how many it
dropped. Progress is saved after every page, so the agent page can show it.

At most one import per agent runs at a time: a job is claimed by compare-and-set
(queued -> running), and a claimer that then finds another running job of the
same agent steps back. Every listed task goes through ``record()``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Callable
from datetime import timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from tasks_app import outbound
from tasks_app.a2a import A2AError, ProtocolError, check_task, safejson
from tasks_app.a2a.errors import ConnectError
from tasks_app.access import Perm, require
from tasks_app.models import Agent, ImportJob, OperatorAction, RemoteTask
from tasks_app.services import agents as agent_services
from tasks_app.services.chain import canonical_json
from tasks_app.services.record import RecordError, id_problem, record, settle_if_ended
from tasks_app.services.tasks import TaskActionError, dispatch

log = logging.getLogger(__name__)

Status = ImportJob.Status
ACTIVE = (Status.QUEUED, Status.RUNNING)
# A job still queued or running this long after its deadline lost its worker.
STALE_GRACE_SECONDS = 60
PAGE_SIZE = 100
# Tasks taken from one ListTasks page (and the most pageSize asked for): an agent may
# ignore pageSize and send one 32 MB page of ~600k tasks, each a row and a watcher.
MAX_TASKS_PER_PAGE = 1000
# Tasks one import job records in all (IMPORT_MAX_PAGES pages of PAGE_SIZE by default).
MAX_TASKS_PER_IMPORT = 20_000

Progress = Callable[[ImportJob], None]


def _stale_after() -> timedelta:
    return timedelta(seconds=settings.IMPORT_DEADLINE_SECONDS + STALE_GRACE_SECONDS)


def expire_stale(agent_id: int) -> int:
    """Fail the agent's jobs that can no longer be alive, so they never block a new import.

    A running job ends by its deadline; one still "running" well after it lost
    its worker (killed). A queued job that old was never picked up.
    """
    cutoff = timezone.now() - _stale_after()
    now = timezone.now()
    running = ImportJob.objects.filter(
        agent_id=agent_id, status=Status.RUNNING, started_at__lt=cutoff
    ).update(
        status=Status.FAILED,
        finished_at=now,
        error="The worker running this import stopped before it ended.",
    )
    queued = ImportJob.objects.filter(
        agent_id=agent_id, status=Status.QUEUED, created_at__lt=cutoff
    ).update(
        status=Status.FAILED,
        finished_at=now,
        error="No worker picked this import up (is a worker running?).",
    )
    return running + queued


def active_job(agent: Agent) -> ImportJob | None:
    """The agent's queued or running import, if any."""
    return ImportJob.objects.filter(agent=agent, status__in=ACTIVE).order_by("-id").first()


def latest_job(agent: Agent) -> ImportJob | None:
    return ImportJob.objects.filter(agent=agent).order_by("-id").first()


def create_job(agent: Agent, *, actor_id: int | None = None) -> ImportJob:
    """A queued job, unless the agent already has one queued or running, or is retired."""
    expire_stale(agent.pk)
    existing = active_job(agent)
    if existing is None:
        try:
            with transaction.atomic():  # the index decides between two clicks at once
                # Ordered against a retire by the agent's row (see hold_in_service).
                if not agent_services.hold_in_service(agent.pk):
                    raise TaskActionError(f"{agent.name} is retired: its tasks cannot be imported.")
                return ImportJob.objects.create(agent=agent, actor_id=actor_id)
        except IntegrityError:
            existing = active_job(agent)
    raise TaskActionError(
        f"An import of {agent.name} is already "
        + (f"{existing.status} (job {existing.pk})." if existing else "queued.")
    )


def start_import(agent: Agent, *, actor_id: int | None = None) -> ImportJob:
    """Create a job and hand it to a worker after commit; returns at once."""
    require(actor_id, agent.project_id, Perm.OPERATE)
    job = create_job(agent, actor_id=actor_id)
    transaction.on_commit(lambda: _dispatch(job.pk))
    return job


def _dispatch(job_pk: int) -> None:
    from tasks_app.jobs import run_import

    try:
        run_import.delay(job_pk)
    except Exception as exc:  # a broker outage must not leave a job queued with no worker
        log.warning("could not queue import job %s: %s", job_pk, type(exc).__name__)
        _finish(job_pk, Status.FAILED, "The task queue could not be reached; try again.", ACTIVE)


def cancel_job(job: ImportJob, *, actor_id: int | None = None) -> bool:
    """Stop a queued or running job; the walk notices at its next page."""
    require(actor_id, job.agent.project_id, Perm.OPERATE)
    with transaction.atomic():  # the cancel and its audit entry together
        done = ImportJob.objects.filter(pk=job.pk, status__in=ACTIVE).update(
            status=Status.CANCELED, finished_at=timezone.now(), error="Canceled by an operator."
        )
        if done:
            OperatorAction.objects.create(
                agent_id=job.agent_id,
                actor_id=actor_id,
                action="import-cancel",
                payload={"job": job.pk},
            )
    return bool(done)


def claim(job_pk: int) -> bool:
    """Queued -> running by compare-and-set; step back if another import of the agent runs.

    The database decides: a partial unique index allows one running job per agent
    (``one_active_import``, queued or running), so of concurrent claimers exactly one goes on, whatever
    their clocks say or however long one pauses between its look and its write (a
    claim ordered by ``started_at`` let a paused claimer, or one whose clock was behind,
    run beside another).

    1. Fail the agent's stale jobs (a dead worker's "running" job must not block).
    2. Queued -> running in one guarded update; the index refuses a second running job.
    3. Refused: this job fails, naming the one that runs.
    """
    agent_id = ImportJob.objects.filter(pk=job_pk).values_list("agent_id", flat=True).first()
    if agent_id is None:
        return False
    expire_stale(agent_id)
    try:
        with transaction.atomic():
            taken = ImportJob.objects.filter(pk=job_pk, status=Status.QUEUED).update(
                status=Status.RUNNING, started_at=timezone.now()
            )
    except IntegrityError:
        other = (
            ImportJob.objects.filter(agent_id=agent_id, status=Status.RUNNING)
            .values_list("pk", flat=True)
            .first()
        )
        _finish(
            job_pk, Status.FAILED, f"Another import of this agent is running (job {other}).", ACTIVE
        )
        return False
    return bool(taken)  # False: already taken (a redelivered message), canceled or expired


def _finish(job_pk: int, status: str, error: str, from_statuses: tuple = (Status.RUNNING,)) -> bool:
    """End a job; a job canceled meanwhile stays canceled."""
    return bool(
        ImportJob.objects.filter(pk=job_pk, status__in=from_statuses).update(
            status=status, error=error[:2000], finished_at=timezone.now()
        )
    )


def run_job(
    job_pk: int, *, page_size: int = PAGE_SIZE, progress: Progress | None = None
) -> ImportJob:
    """Claim the job and walk the agent's ListTasks pages; returns the job as it ended.

    A job that cannot be claimed (taken, canceled, another import running) is
    returned as it is. Nothing here raises for what the agent does: every way
    the walk stops is written into the job's ``error``.
    """
    if not claim(job_pk):
        return ImportJob.objects.get(pk=job_pk)
    job = ImportJob.objects.select_related("agent").get(pk=job_pk)
    walk = _Walk(job, page_size, progress)
    try:
        error = walk.run()
    except Exception as exc:  # a bug must not leave the job "running" until it goes stale
        log.exception("import job %s stopped", job_pk)
        error = (
            f"The import stopped on an internal error ({type(exc).__name__}); see the worker log."
        )
    except BaseException as exc:
        # Ctrl-C on the command line, a worker's process stopping: a job left "running"
        # refused every import of this agent until it went stale (IMPORT_DEADLINE_SECONDS
        # and a minute). What was mirrored so far is kept.
        _finish(job_pk, Status.CANCELED, f"The import was stopped ({type(exc).__name__}).")
        raise
    # The job's end and its audit entry in one transaction: nobody sees an ended import
    # without its entry (a page, a test), and a crash between them cannot lose the entry.
    with transaction.atomic():
        _finish(job_pk, Status.FAILED if error else Status.DONE, error or "")
        job.refresh_from_db()
        OperatorAction.objects.create(
            agent_id=job.agent_id,
            actor_id=job.actor_id,
            action="import",
            payload={
                "job": job.pk,
                "pages": job.pages,
                "seen": job.seen,
                "created": job.created,
                "changed": job.changed,
                # listed by the agent but not imported, by why (see the job's error)
                "dropped": walk.dropped,
            },
            outcome=(job.error or job.status)[:500],
        )
    return job


def import_tasks(
    agent: Agent,
    *,
    page_size: int = PAGE_SIZE,
    actor_id: int | None = None,
    progress: Progress | None = None,
) -> ImportJob:
    """Run an import in this process (command line, tests); raise if it did not complete."""
    job = run_job(create_job(agent, actor_id=actor_id).pk, page_size=page_size, progress=progress)
    if job.status != Status.DONE:
        raise TaskActionError(f"Import from {agent.name} failed: {job.error or job.status}")
    return job


def job_document(job: ImportJob) -> dict:
    """A job as plain JSON (command line ``--json``, the agent page's poll)."""
    return {
        "id": job.pk,
        "agent": job.agent_id,
        "status": job.status,
        "active": job.status in ACTIVE,
        "pages": job.pages,
        "seen": job.seen,
        "created": job.created,
        "changed": job.changed,
        "error": job.error,
        "created_at": job.created_at.isoformat() if job.created_at else None,
        "started_at": job.started_at.isoformat() if job.started_at else None,
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
    }


def _short(token: str) -> str:
    """A page token as shown in an error: escaped (repr) and cut."""
    return repr(token[:60] + ("…" if len(token) > 60 else ""))


class _Walk:
    """ListTasks page by page; ``run()`` returns "" when the listing ended, else why it stopped.

    ``dropped`` counts tasks the agent listed that were not imported, by reason.
    """

    def __init__(self, job: ImportJob, page_size: int, progress: Progress | None) -> None:
        self.job = job
        self.progress = progress
        # What we ask for is what we take: a page never brings more rows than this.
        self.per_page = max(1, min(page_size, MAX_TASKS_PER_PAGE))
        self.limit = settings.IMPORT_DEADLINE_SECONDS
        self.deadline = time.monotonic() + self.limit
        self.dropped: dict[str, int] = {}
        self.oversized: list[int] = []  # pages that ignored pageSize

    def so_far(self) -> str:
        job = self.job
        return f"{job.seen} tasks listed in {job.pages} pages were imported"

    def at_deadline(self, where: str = "") -> str:
        said = f"Stopped at the deadline ({self.limit:g} s, IMPORT_DEADLINE_SECONDS)"
        return f"{said} {where}" if where else said

    def run(self) -> str:
        reason = self._pages()
        if not self.oversized:
            return reason
        pages = ", ".join(str(n) for n in self.oversized[:5])
        if len(self.oversized) > 5:
            pages += f" and {len(self.oversized) - 5} more"
        note = (
            f"The agent ignored pageSize: it listed more than the {self.per_page} tasks asked "
            f"for on {len(self.oversized)} page(s) ({pages}); the "
            f"{self.dropped['over-page-size']} tasks beyond that were not imported."
        )
        return f"{reason} {note}" if reason else f"{note} {self.so_far()}."

    def _drop(self, why: str, count: int) -> None:
        if count > 0:
            self.dropped[why] = self.dropped.get(why, 0) + count

    def _pages(self) -> str:
        job, agent = self.job, self.job.agent
        max_pages = settings.IMPORT_MAX_PAGES
        # sha256 of each token given -> the page that gave it: a token may be up to a reply's
        # size, and kept whole for every page they were gigabytes (2 MiB tokens, 200 pages).
        given: dict[str, int] = {}
        token: str | None = None

        async def page(http, token: str | None) -> dict:
            client = outbound.client_for(agent, http)
            return await client.list_tasks(
                page_size=self.per_page, page_token=token, include_artifacts=True, check=False
            )

        while True:
            if job.pages >= max_pages:
                return (
                    f"Stopped at the page cap ({max_pages} pages, IMPORT_MAX_PAGES) while the "
                    f"agent still offered more; {self.so_far()}."
                )
            if job.seen >= MAX_TASKS_PER_IMPORT:
                return (
                    f"Stopped at the task cap ({MAX_TASKS_PER_IMPORT} tasks per import, "
                    f"MAX_TASKS_PER_IMPORT) while the agent still offered more; {self.so_far()}."
                )
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                return f"{self.at_deadline()}; {self.so_far()}."
            try:
                listing = outbound.run(
                    lambda http, token=token, remaining=remaining: asyncio.wait_for(
                        page(http, token), remaining
                    )
                )
            except TimeoutError:
                return f"{self.at_deadline(f'waiting for page {job.pages + 1}')}; {self.so_far()}."
            except A2AError as exc:
                if isinstance(exc, ConnectError):  # as a watcher's failed call says it
                    agent_services.mark_unreachable(job.agent_id, str(exc))
                return f"ListTasks failed on page {job.pages + 1}: {exc}; {self.so_far()}."
            tasks = listing.get("tasks") or []
            if len(tasks) > self.per_page:
                self.oversized.append(job.pages + 1)
                self._drop("over-page-size", len(tasks) - self.per_page)
                tasks = tasks[: self.per_page]
            # Never more than the job's cap, however the page's items turn out.
            room = MAX_TASKS_PER_IMPORT - job.seen
            over_cap = max(0, len(tasks) - room)
            self._drop("over-task-cap", over_cap)
            batch = tasks[:room] if over_cap else tasks
            # Each task checked on its own: one the agent got wrong is dropped (counted),
            # not the page and the rest of the walk with it.
            valid = [remote for remote in batch if _valid(remote, job.pages + 1)]
            self._drop("invalid-task", len(batch) - len(valid))
            usable = [remote for remote in valid if _usable(remote)]
            self._drop("unusable-id", len(valid) - len(usable))
            fitting = [remote for remote in usable if _fits(remote)]
            self._drop("too-large", len(usable) - len(fitting))
            batch = fitting
            taken, vanished = _record_page(job, batch, self.deadline)
            self._drop("vanished", vanished)
            self._drop("at-deadline", len(batch) - taken)
            job.pages += 1
            counts = {
                "pages": job.pages, "seen": job.seen, "created": job.created,
                "changed": job.changed,
            }  # fmt: skip
            if not ImportJob.objects.filter(pk=job.pk, status=Status.RUNNING).update(**counts):
                # Canceled meanwhile: it keeps its own status and reason, and what this page
                # did is still counted (its tasks exist; the job and its audit entry said 0).
                ImportJob.objects.filter(pk=job.pk).update(**counts)
                return ""
            if self.progress is not None:
                self.progress(job)
            if taken < len(batch):
                return (
                    f"{self.at_deadline(f'while recording page {job.pages}')}: "
                    f"{len(batch) - taken} of its tasks were not imported; {self.so_far()}."
                )
            if over_cap:
                return (
                    f"Stopped at the task cap ({MAX_TASKS_PER_IMPORT} tasks per import, "
                    f"MAX_TASKS_PER_IMPORT): {over_cap} tasks of page {job.pages} were not "
                    f"imported; {self.so_far()}."
                )
            following = listing.get("nextPageToken")
            if following is None or following == "":
                return ""
            if not isinstance(following, str):  # 0, false, {} too: not the listing's end
                return (
                    f"ListTasks page {job.pages} gave a nextPageToken that is not a string; "
                    f"{self.so_far()}."
                )
            seen_as = hashlib.sha256(following.encode("utf-8", "surrogatepass")).hexdigest()
            if seen_as in given:
                return (
                    f"The agent repeated nextPageToken {_short(following)} (given on page "
                    f"{given[seen_as]}, again on page {job.pages}): following it would loop "
                    f"forever; {self.so_far()}."
                )
            given[seen_as] = job.pages
            token = following


def _record_page(job: ImportJob, tasks: list, deadline: float = math.inf) -> tuple[int, int]:
    """Mirror listed tasks, each through ``record()``; returns how many were taken, and how
    many of those vanished meanwhile (deleted here, say by retention, while the page was
    recorded: skipped, not the end of the import).

    Stops early at the deadline: one page must not outlast the whole import.
    """
    agent = job.agent
    vanished = 0
    for taken, remote in enumerate(tasks):
        if time.monotonic() >= deadline:
            return taken, vanished
        job.seen += 1
        task, created = _ours_unnamed(agent, remote), False
        if task is None:
            task, created = RemoteTask.objects.get_or_create(
                agent=agent,
                remote_id=remote["id"],
                defaults={
                    "mode": RemoteTask.Mode.IMPORTED,
                    "phase": RemoteTask.Phase.TASK,
                    "context_id": remote.get("contextId")
                    if isinstance(remote.get("contextId"), str)
                    else "",
                    "title": _title_of(remote),
                    "watch": RemoteTask.Watch.STREAM if agent.streaming else RemoteTask.Watch.POLL,
                },
            )
        job.created += created
        try:
            if not record(task, {"task": remote}, "poll", actor_id=job.actor_id).duplicate:
                job.changed += 1
            settle_if_ended(task, remote, note="reconciled with the agent's ListTasks")
            task.refresh_from_db()
        except (RecordError, RemoteTask.DoesNotExist):
            if RemoteTask.objects.filter(pk=task.pk).exists():
                raise  # not a vanished task: a real failure, said as one
            vanished += 1
            continue
        if not task.is_terminal and task.state != "TASK_STATE_INPUT_REQUIRED":
            dispatch(task.pk)
    return len(tasks), vanished


def _valid(remote: object, page: int) -> bool:
    """Whether a listed task is a Task as A2A defines it (``check_task``)."""
    try:
        check_task(remote, f"ListTasks page {page}")
    except ProtocolError:
        return False
    return True


def _fits(remote: dict) -> bool:
    """Whether a listed task is within WATCH_MAX_EVENT_BYTES, the bound of one event, measured
    as ``record()`` measures an entry (its canonical text), so that no task passes here that
    record() would then refuse on a row made for it."""
    try:
        size = len(canonical_json({"task": remote}))
    except (TypeError, ValueError, RecursionError):
        return True  # not JSON as it is: record() cleans it and decides
    return size <= settings.WATCH_MAX_EVENT_BYTES


def _usable(remote: object) -> bool:
    """Whether a listed task can be mirrored: an object whose ``id`` (and ``contextId``, when
    given) is text the task's columns keep as it is.

    An id over ``record.MAX_ID_CHARS`` characters, or holding a NUL or a lone surrogate, made
    PostgreSQL refuse the task's row and stopped the whole import; cleaned or cut, it would
    no longer name the agent's task. Such tasks are counted as dropped (``unusable-id``).
    """
    if not isinstance(remote, dict):
        return False
    ids = (remote.get("id"), remote.get("contextId"))
    if id_problem(ids[0], "id") or id_problem(ids[1], "contextId", required=False):
        return False
    return all(not value or safejson.clean_text(value) == value for value in ids)


def _ours_unnamed(agent: Agent, remote: dict) -> RemoteTask | None:
    """A task this dashboard started whose reply is not recorded yet (or was lost).

    Its first message carried a contextId we chose (one per started task), so
    a listed task in that context is that task: the import records into that
    row rather than creating a second one for the same remote task. Anything
    else (an id already mirrored, another client's task) is found by its id.
    """
    context = remote.get("contextId")
    if not isinstance(context, str) or not context:
        return None
    if RemoteTask.objects.filter(agent=agent, remote_id=remote["id"]).exists():
        return None
    return (
        RemoteTask.objects.filter(agent=agent, remote_id="", context_id=context)
        .exclude(mode=RemoteTask.Mode.IMPORTED)
        .order_by("pk")
        .first()
    )


def _title_of(remote: dict) -> str:
    for message in remote.get("history") or []:
        if isinstance(message, dict) and message.get("role") == "ROLE_USER":
            for part in message.get("parts") or []:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    text = safejson.clean_text(part["text"]).strip()  # no NUL for the column
                    return text.splitlines()[0][:300] if text else ""
    return ""
