"""What the artifacts an agent makes cost us: reads that do not grow with the artifacts a task
holds, and a cap on how many one task may hold (``BUDGET_TASK_ARTIFACTS``).

Measured before the change (SQLite, this machine): a task holding 10,000 artifacts took
264 ms to record one artifact chunk (every artifact of the task was read, for each batch), and
a stream of chunks with fresh artifact ids was bounded only by the task's bytes (64 MiB:
about 400,000 artifacts).
"""

from __future__ import annotations

import pytest

from tasks_app.models import Agent, Artifact, ArtifactPart, RemoteTask, TaskEvent
from tasks_app.services.record import record, record_many
from tasks_app.services.snapshot import task_view

pytestmark = pytest.mark.django_db


def chunk(aid: str, text: str, *, append: bool = False) -> dict:
    return {
        "artifactUpdate": {
            "taskId": "t-1",
            "contextId": "c-1",
            "artifact": {"artifactId": aid, "parts": [{"text": text}]},
            "append": append,
        }
    }


def snapshot(*aids: str) -> dict:
    return {
        "task": {
            "id": "t-1",
            "contextId": "c-1",
            "status": {"state": "TASK_STATE_WORKING"},
            "artifacts": [{"artifactId": aid, "parts": [{"text": aid}]} for aid in aids],
        }
    }


@pytest.fixture
def task(db) -> RemoteTask:
    agent = Agent.objects.create(name="a", base_url="http://127.0.0.1:1/")
    task = RemoteTask.objects.create(agent=agent, title="t")
    record(task, {"statusUpdate": {"taskId": "t-1", "contextId": "c-1",
                                   "status": {"state": "TASK_STATE_WORKING"}}}, "stream")  # fmt: skip
    return task


@pytest.fixture
def artifacts_built(monkeypatch) -> list[str]:
    """The artifact rows read back as instances while the test runs (their ids)."""
    built: list[str] = []
    original = Artifact.from_db.__func__  # type: ignore[attr-defined]

    def counting(cls, db, field_names, values):
        instance = original(cls, db, field_names, values)
        built.append(instance.artifact_id)
        return instance

    monkeypatch.setattr(Artifact, "from_db", classmethod(counting))
    return built


def hold(task: RemoteTask, count: int) -> None:
    """``count`` artifacts on ``task``, as rows (recording them one by one would take minutes)."""
    Artifact.objects.bulk_create(
        Artifact(task=task, artifact_id=f"held-{i}", position=i) for i in range(count)
    )


def kinds(task: RemoteTask) -> list[tuple[str, str]]:
    return list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("kind", "note"))


def test_a_chunk_reads_only_the_artifact_it_names(task, artifacts_built, settings):
    settings.BUDGET_TASK_ARTIFACTS = 10_000
    hold(task, 3_000)
    record_many(task, [chunk("held-5", "one", append=True), chunk("held-7", "two")], "stream")
    assert sorted(artifacts_built) == ["held-5", "held-7"]
    assert list(
        ArtifactPart.objects.filter(artifact__task=task).values_list(
            "artifact__artifact_id", "part"
        )
    ) == [("held-5", {"text": "one"}), ("held-7", {"text": "two"})]


def test_a_new_artifact_is_placed_after_those_held_without_reading_them(
    task, artifacts_built, settings
):
    settings.BUDGET_TASK_ARTIFACTS = 10_000
    hold(task, 2_000)
    record(task, chunk("fresh", "x"), "stream")
    assert artifacts_built == []
    assert Artifact.objects.get(task=task, artifact_id="fresh").position == 2_000


def test_a_new_artifact_past_the_cap_is_logged_and_not_kept(task, settings):
    settings.BUDGET_TASK_ARTIFACTS = 3
    record_many(task, [chunk("a", "1"), chunk("b", "1"), chunk("c", "1")], "stream")
    # In one batch: the fourth new id is refused, an append to one held goes on.
    result = record_many(task, [chunk("d", "1"), chunk("b", "2", append=True)], "stream")
    assert result.kinds == ["protocol-error", "artifactUpdate"]
    assert "BUDGET_TASK_ARTIFACTS" in result.notes[0]
    assert sorted(Artifact.objects.filter(task=task).values_list("artifact_id", flat=True)) == [
        "a",
        "b",
        "c",
    ]
    view = task_view(RemoteTask.objects.get(pk=task.pk))
    assert [a["artifactId"] for a in view["artifacts"]] == ["a", "b", "c"]
    assert [p["text"] for p in view["artifacts"][1]["parts"]] == ["1", "2"]
    # The refused chunk is in the log with the agent's content, as every refused entry is.
    refused = TaskEvent.objects.get(task=task, kind="protocol-error")
    assert refused.raw == chunk("d", "1")


def test_the_cap_counts_what_the_same_batch_made_and_what_a_snapshot_removed(task, settings):
    settings.BUDGET_TASK_ARTIFACTS = 2
    result = record_many(task, [chunk("a", "1"), chunk("b", "1"), chunk("c", "1")], "stream")
    assert result.kinds == ["artifactUpdate", "artifactUpdate", "protocol-error"]
    # A snapshot that holds one artifact removes the others: room for one more again.
    record(task, snapshot("a"), "poll")
    assert list(Artifact.objects.filter(task=task).values_list("artifact_id", flat=True)) == ["a"]
    assert record(task, chunk("z", "1"), "stream").kinds == ["artifactUpdate"]
    assert record(task, chunk("y", "1"), "stream").kinds == ["protocol-error"]


def test_a_snapshot_with_more_artifacts_than_the_cap_is_not_applied(task, settings):
    settings.BUDGET_TASK_ARTIFACTS = 2
    result = record(task, snapshot("a", "b", "c"), "poll")
    assert result.kinds == ["protocol-error"]
    assert "BUDGET_TASK_ARTIFACTS" in result.notes[0]
    assert not Artifact.objects.filter(task=task).exists()
    assert record(task, snapshot("a", "b"), "poll").kinds == ["task"]
    assert Artifact.objects.filter(task=task).count() == 2


def test_the_same_entries_one_by_one_and_in_one_batch_leave_the_same_artifacts(db, settings):
    settings.BUDGET_TASK_ARTIFACTS = 2
    entries = [chunk("a", "1"), chunk("b", "1"), chunk("c", "1"), chunk("a", "2", append=True)]
    views = []
    for batched in (True, False):
        # An agent each: one remote task is mirrored by one row of its agent only.
        agent = Agent.objects.create(name=f"b{batched}", base_url=f"http://127.0.0.1:1/{batched}/")
        task = RemoteTask.objects.create(agent=agent, title="t")
        if batched:
            record_many(task, entries, "stream")
        else:
            for entry in entries:
                record(task, entry, "stream")
        views.append((kinds(task), task_view(RemoteTask.objects.get(pk=task.pk))["artifacts"]))
    assert views[0] == views[1]
    assert [a["artifactId"] for a in views[0][1]] == ["a", "b"]
