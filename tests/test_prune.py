"""Retention: ``manage.py prune`` removes exactly the settled, old, unwatched tasks, exporting them first."""

from __future__ import annotations

import io
import json
import os
import stat
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from tasks_app import jobs
from tasks_app.models import Agent, Artifact, ArtifactPart, OperatorAction, RemoteTask, TaskEvent
from tasks_app.services import audit
from tests.bulklog import bulk_log
from tests.test_exports import verify_offline

pytestmark = pytest.mark.django_db

DAY = timedelta(days=1)


@pytest.fixture
def tasks(db) -> dict[str, RemoteTask]:
    agent = Agent.objects.create(name="retention agent", base_url="http://127.0.0.1:9/r")
    now = timezone.now()
    old, recent = now - 40 * DAY, now - 5 * DAY

    def make(
        name: str, *, state="TASK_STATE_COMPLETED", settled=old, updated=old, events=20, **extra
    ) -> RemoteTask:
        task = RemoteTask.objects.create(
            agent=agent,
            remote_id=name,
            title=name,
            phase="task",
            state=state,
            settled_at=settled,
            **extra,
        )
        bulk_log(task, events)
        RemoteTask.objects.filter(pk=task.pk).update(
            updated_at=updated
        )  # after the log, which touches nothing else
        return task

    made = {
        "old-completed": make("old-completed", events=300),
        "old-failed": make("old-failed", state="TASK_STATE_FAILED"),
        "old-canceled": make("old-canceled", state="TASK_STATE_CANCELED"),
        "not-settled": make("not-settled", settled=None),
        "not-terminal": make("not-terminal", state="TASK_STATE_WORKING"),
        "recent": make("recent", settled=recent, updated=recent),
        "updated-lately": make("updated-lately", updated=recent),
        "leased": make(
            "leased", lease_expires_at=now + timedelta(minutes=5), lease_owner="worker-1"
        ),
        "polling": make("polling", watcher_status=RemoteTask.WatcherStatus.POLLING),
    }
    artifact = Artifact.objects.create(task=made["old-completed"], artifact_id="out")
    ArtifactPart.objects.create(artifact=artifact, index=0, part={"text": "result"})
    OperatorAction.objects.create(
        task=made["old-completed"], agent=agent, action="cancel", outcome="requested"
    )
    return made


REMOVED = ("old-completed", "old-failed", "old-canceled")


def remaining() -> set[str]:
    return set(RemoteTask.objects.values_list("remote_id", flat=True))


def test_prune_removes_exactly_the_settled_old_unwatched_tasks_and_exports_them_first(
    tasks, tmp_path
) -> None:
    out = io.StringIO()
    call_command(
        "prune",
        "--older-than",
        "30",
        "--export-to",
        str(tmp_path / "exports"),
        "--batch",
        "2",
        stdout=out,
    )
    assert remaining() == set(tasks) - set(REMOVED)
    removed_pks = sorted(tasks[name].pk for name in REMOVED)
    assert not TaskEvent.objects.filter(task_id__in=removed_pks).exists()
    assert not ArtifactPart.objects.filter(artifact__task_id__in=removed_pks).exists()
    for name in set(tasks) - set(REMOVED):  # what stays is untouched
        assert audit.verify(tasks[name].pk).ok, name

    files = sorted((tmp_path / "exports").iterdir())
    assert [f.name for f in files] == sorted(
        f"task-{pk}.jsonl" for pk in removed_pks
    )  # no temporary files left
    for path in files:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        lines = path.read_text().splitlines()
        header, events = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
        name = header["task"]["remote_id"]
        assert name in REMOVED and len(events) == (300 if name == "old-completed" else 20)
        verify_offline(events)  # the whole log, as it was before it was removed

    run = OperatorAction.objects.get(action="prune")
    assert run.task_id is None and run.agent_id is None
    assert (
        run.payload["tasks"] == 3 and run.payload["events"] == 340 and run.payload["exported"] == 3
    )
    assert (run.payload["first_task_id"], run.payload["last_task_id"]) == (
        removed_pks[0],
        removed_pks[-1],
    )
    assert "removed 3 settled task(s)" in out.getvalue() and "removed 3" in run.outcome
    # The operator's action on a removed task stays in the log, without its task link.
    kept = OperatorAction.objects.get(action="cancel")
    assert kept.task_id is None and kept.agent_id == tasks["old-completed"].agent_id


def test_a_dry_run_counts_and_removes_nothing(tasks, tmp_path) -> None:
    out = io.StringIO()
    call_command(
        "prune", "--older-than", "30", "--dry-run", "--export-to", str(tmp_path / "x"), stdout=out
    )
    assert "would remove 3 settled task(s)" in out.getvalue()
    assert remaining() == set(tasks)
    assert (
        not (tmp_path / "x").exists() and not OperatorAction.objects.filter(action="prune").exists()
    )


def test_alerts_resolved_before_the_cutoff_go_and_open_ones_stay(tasks) -> None:
    """Alert rows were never removed: an agent whose reachability flaps adds one (and its
    deliveries) each time, for ever."""
    from tasks_app.models import Alert, AlertDelivery

    agent = tasks["recent"].agent
    now = timezone.now()

    def alert(n: int, resolved, opened=now - 60 * DAY) -> Alert:
        made = Alert.objects.create(
            rule=Alert.Rule.AGENT_UNREACHABLE, agent=agent, key=f"agent-unreachable:agent:{n}",
            message="unreachable", since=opened, opened_at=opened, last_seen_at=opened,
            resolved_at=resolved,
        )  # fmt: skip
        AlertDelivery.objects.create(
            alert=made, channel="email", event="opened", target="ops@example.test",
            outcome="sent",
        )  # fmt: skip
        return made

    gone = [alert(n, now - 40 * DAY) for n in range(5)]
    kept = [alert(10, now - 5 * DAY), alert(11, None)]  # resolved lately; still open
    out = io.StringIO()
    call_command("prune", "--older-than", "30", "--dry-run", stdout=out)
    assert "5 alert(s) resolved before then" in out.getvalue()
    assert Alert.objects.count() == 7
    call_command("prune", "--older-than", "30", stdout=out)
    assert set(Alert.objects.values_list("pk", flat=True)) == {a.pk for a in kept}
    assert not AlertDelivery.objects.filter(alert_id__in=[a.pk for a in gone]).exists()
    run = OperatorAction.objects.get(action="prune")
    assert run.payload["alerts"] == 5 and "5 alert(s)" in run.outcome


def test_nothing_is_due_within_the_age(tasks) -> None:
    call_command("prune", "--older-than", "45", stdout=io.StringIO())
    assert remaining() == set(tasks)
    assert (
        OperatorAction.objects.get(action="prune").payload["tasks"] == 0
    )  # the run is recorded all the same


def test_a_task_whose_export_fails_is_kept(tasks, tmp_path) -> None:
    folder = tmp_path / "exports"
    folder.mkdir()
    (
        folder / f"task-{tasks['old-failed'].pk}.jsonl"
    ).mkdir()  # a folder where the file must go: rename fails
    with pytest.raises(CommandError, match="could not be exported and were kept"):
        call_command(
            "prune",
            "--older-than",
            "30",
            "--export-to",
            str(folder),
            stdout=io.StringIO(),
            stderr=io.StringIO(),
        )
    assert remaining() == set(tasks) - {"old-completed", "old-canceled"}
    assert not [p for p in folder.iterdir() if p.name.endswith(".part")]


@pytest.mark.parametrize("value", ["abc", "0", "-3", "nan", "inf"])
def test_bad_ages_are_refused(tasks, value) -> None:
    with pytest.raises(CommandError, match="older-than"):
        call_command("prune", "--older-than", value, stdout=io.StringIO())
    assert remaining() == set(tasks)


def test_without_an_age_or_a_setting_nothing_happens(tasks, settings) -> None:
    settings.RETENTION_DAYS = None
    with pytest.raises(CommandError, match="--older-than DAYS"):
        call_command("prune", stdout=io.StringIO())
    assert remaining() == set(tasks)


def test_the_beat_job_follows_the_setting(tasks, settings, tmp_path) -> None:
    from dashboard.celery import _beat_schedule

    settings.RETENTION_DAYS = None
    assert "prune-settled" not in _beat_schedule()
    assert jobs.prune_settled() == "retention is off" and remaining() == set(tasks)

    settings.RETENTION_DAYS = 30.0
    settings.RETENTION_EVERY_SECONDS = 3600.0
    settings.RETENTION_EXPORT_DIR = str(tmp_path / "kept")
    entry = _beat_schedule()["prune-settled"]
    assert entry == {"task": "tasks_app.jobs.prune_settled", "schedule": 3600.0}
    assert "removed 3" in jobs.prune_settled()
    assert remaining() == set(tasks) - set(REMOVED)
    assert len(list((tmp_path / "kept").iterdir())) == 3


def test_message_replies_abandoned_and_gone_tasks_are_pruned_too(db) -> None:
    """Only settled terminal tasks were ever due: a message reply, an abandoned task and a
    task gone at the agent are never settled, and stayed for good (found by driving the
    dashboard with RETENTION_DAYS set)."""
    agent = Agent.objects.create(name="retention agent", base_url="http://127.0.0.1:9/r2")
    now = timezone.now()
    old, recent = now - 40 * DAY, now - 5 * DAY

    def make(name: str, updated=old, **fields) -> RemoteTask:
        task = RemoteTask.objects.create(agent=agent, remote_id=name, title=name, **fields)
        bulk_log(task, 3)
        RemoteTask.objects.filter(pk=task.pk).update(updated_at=updated)
        return task

    make("message-reply", phase="message")
    make("abandoned", phase="task", state="TASK_STATE_WORKING", abandoned_at=old,
         watcher_status=RemoteTask.WatcherStatus.ABANDONED)  # fmt: skip
    make("gone", phase="task", state="TASK_STATE_WORKING", gone_at=old)
    # Not yet: abandoned or gone lately, a message reply updated lately, a working task.
    make("abandoned-lately", phase="task", state="TASK_STATE_WORKING", abandoned_at=recent,
         updated=recent)  # fmt: skip
    make("gone-lately", phase="task", state="TASK_STATE_WORKING", gone_at=recent, updated=recent)
    make("message-lately", phase="message", updated=recent)
    make("working", phase="task", state="TASK_STATE_WORKING")
    call_command("prune", "--older-than", "30", stdout=io.StringIO())
    assert remaining() == {"abandoned-lately", "gone-lately", "message-lately", "working"}
