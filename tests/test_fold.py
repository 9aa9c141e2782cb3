"""Unit tests of the task state machine and the fold (pure functions, no I/O)."""

from __future__ import annotations

import pytest

from tasks_app.a2a import (
    ACTIVE_STATES,
    FOLD_KEY,
    INTERRUPTED_STATES,
    TERMINAL_STATES,
    StreamEvent,
    artifact_complete,
    artifact_text,
    fold,
    fold_all,
    is_interrupted,
    is_terminal,
    parse_stream_response,
    parse_timestamp,
    task_json,
    transition_problem,
)

T = "task-1"
C = "ctx-1"


def task(state: str = "TASK_STATE_SUBMITTED", ts: str | None = None, **extra: object) -> dict:
    status: dict = {"state": state}
    if ts:
        status["timestamp"] = ts
    return {"task": {"id": T, "contextId": C, "status": status, **extra}}


def status(state: str, ts: str | None = None, task_id: str = T) -> dict:
    st: dict = {"state": state}
    if ts:
        st["timestamp"] = ts
    return {"statusUpdate": {"taskId": task_id, "contextId": C, "status": st}}


def art(
    artifact_id: str, text: str, *, append: bool = False, last: bool = False, task_id: str = T
) -> dict:
    ev: dict = {
        "taskId": task_id,
        "contextId": C,
        "artifact": {"artifactId": artifact_id, "parts": [{"text": text}]},
    }
    if append:
        ev["append"] = True
    if last:
        ev["lastChunk"] = True
    return {"artifactUpdate": ev}


def test_state_sets_are_disjoint_and_complete() -> None:
    assert {
        "TASK_STATE_COMPLETED", "TASK_STATE_FAILED", "TASK_STATE_CANCELED", "TASK_STATE_REJECTED",
    } == TERMINAL_STATES  # fmt: skip
    assert {"TASK_STATE_INPUT_REQUIRED", "TASK_STATE_AUTH_REQUIRED"} == INTERRUPTED_STATES
    assert {"TASK_STATE_SUBMITTED", "TASK_STATE_WORKING"} == ACTIVE_STATES
    assert not (TERMINAL_STATES & INTERRUPTED_STATES) and not (TERMINAL_STATES & ACTIVE_STATES)


@pytest.mark.parametrize("state", sorted(TERMINAL_STATES))
def test_every_terminal_state(state: str) -> None:
    assert is_terminal(state) and not is_interrupted(state)
    view = fold(None, task("TASK_STATE_WORKING")).view
    res = fold(view, status(state))
    assert res.view["status"]["state"] == state and res.problems == [] and res.changed
    # Leaving a terminal state is reported but still rendered.
    again = fold(res.view, status("TASK_STATE_WORKING"))
    assert again.view["status"]["state"] == "TASK_STATE_WORKING"
    assert any("illegal transition" in p for p in again.problems)
    # The same terminal state again (a duplicate delivery) is fine.
    assert fold(res.view, status(state)).problems == []


@pytest.mark.parametrize("state", sorted(INTERRUPTED_STATES))
def test_every_interrupted_state(state: str) -> None:
    assert is_interrupted(state) and not is_terminal(state)
    view = fold(None, task("TASK_STATE_WORKING")).view
    res = fold(view, status(state))
    assert res.view["status"]["state"] == state and res.problems == []
    back = fold(res.view, status("TASK_STATE_WORKING"))
    assert back.problems == [] and back.view["status"]["state"] == "TASK_STATE_WORKING"


def test_transition_problem() -> None:
    assert transition_problem(None, "TASK_STATE_SUBMITTED") is None
    assert transition_problem("TASK_STATE_WORKING", "TASK_STATE_COMPLETED") is None
    assert "illegal" in (transition_problem("TASK_STATE_COMPLETED", "TASK_STATE_FAILED") or "")
    assert "UNSPECIFIED" in (
        transition_problem("TASK_STATE_WORKING", "TASK_STATE_UNSPECIFIED") or ""
    )
    assert "UNSPECIFIED" in (transition_problem("TASK_STATE_WORKING", None) or "")
    assert "unknown" in (transition_problem("TASK_STATE_WORKING", "working") or "")


def test_unspecified_state_is_reported_and_rendered() -> None:
    view = fold(None, task("TASK_STATE_WORKING")).view
    res = fold(view, {"statusUpdate": {"taskId": T, "contextId": C, "status": {}}})
    assert res.view["status"]["state"] == "TASK_STATE_UNSPECIFIED"
    assert res.problems


def test_snapshot_replaces_view() -> None:
    view = fold_all([task("TASK_STATE_WORKING"), art("a", "one"), art("b", "x", last=True)]).view
    snap = task(
        "TASK_STATE_WORKING",
        artifacts=[{"artifactId": "b", "parts": [{"text": "server copy"}]}],
        history=[{"messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "hi"}]}],
    )
    res = fold(view, snap)
    assert [a["artifactId"] for a in res.view["artifacts"]] == ["b"]
    assert artifact_text(res.view["artifacts"][0]) == "server copy"
    assert res.view["history"][0]["messageId"] == "m1"
    # completion flag survives for an artifact still present
    assert artifact_complete(res.view, "b")
    assert task_json(res.view) == snap["task"]


def test_terminal_snapshot_marks_all_artifacts_complete() -> None:
    snap = task("TASK_STATE_COMPLETED", artifacts=[{"artifactId": "r", "parts": [{"text": "x"}]}])
    view = fold(None, snap).view
    assert artifact_complete(view, "r")


def test_artifact_append_replace_and_last_chunk() -> None:
    view = fold(None, task("TASK_STATE_WORKING")).view
    view = fold(view, art("a", "1")).view
    assert not artifact_complete(view, "a")
    view = fold(view, art("a", "2", append=True)).view
    res = fold(view, art("a", "3", append=True, last=True))
    view = res.view
    assert artifact_text(view["artifacts"][0]) == "123"
    assert artifact_complete(view, "a") and res.problems == []
    # replace (append absent) resets content and completion
    view = fold(view, art("a", "new")).view
    assert artifact_text(view["artifacts"][0]) == "new" and not artifact_complete(view, "a")
    # a second artifact is added beside the first
    view = fold(view, art("b", "other", last=True)).view
    assert [a["artifactId"] for a in view["artifacts"]] == ["a", "b"]


def test_append_to_unknown_artifact_is_reported() -> None:
    view = fold(None, task("TASK_STATE_WORKING")).view
    res = fold(view, art("zzz", "x", append=True))
    assert res.view["artifacts"][0]["artifactId"] == "zzz"
    assert any("unknown artifact" in p for p in res.problems)


def test_append_after_last_chunk_is_reported() -> None:
    view = fold_all([task("TASK_STATE_WORKING"), art("a", "1", last=True)]).view
    res = fold(view, art("a", "2", append=True))
    assert artifact_text(res.view["artifacts"][0]) == "12"
    assert any("after its last chunk" in p for p in res.problems)


def test_status_update_first_builds_minimal_view() -> None:
    # SDK follow-up streams (answer to input-required) start with a statusUpdate.
    res = fold(None, status("TASK_STATE_WORKING"))
    assert res.view["id"] == T and res.view["contextId"] == C
    assert res.view["status"]["state"] == "TASK_STATE_WORKING" and res.problems == []
    res2 = fold(None, art("a", "x"))
    assert res2.view["id"] == T and res2.view["artifacts"][0]["artifactId"] == "a"


def test_events_for_another_task_are_ignored() -> None:
    view = fold(None, task("TASK_STATE_WORKING")).view
    for ev in (
        status("TASK_STATE_COMPLETED", task_id="other"),
        art("a", "x", task_id="other"),
        {"task": {"id": "other", "status": {"state": "TASK_STATE_WORKING"}}},
    ):
        res = fold(view, ev)
        assert res.view is view and not res.changed
        assert res.problems and "other" in res.problems[0]


def test_stale_status_is_reported_and_not_applied() -> None:
    view = fold(None, task("TASK_STATE_WORKING", ts="2026-08-20T09:00:05.000Z")).view
    res = fold(view, status("TASK_STATE_SUBMITTED", ts="2026-08-20T09:00:01Z"))
    assert res.view["status"]["state"] == "TASK_STATE_WORKING" and not res.changed
    assert "stale" in res.problems[0]
    newer = fold(view, status("TASK_STATE_COMPLETED", ts="2026-08-20T09:00:06Z"))
    assert newer.view["status"]["state"] == "TASK_STATE_COMPLETED"
    stale_snap = fold(newer.view, task("TASK_STATE_WORKING", ts="2026-08-20T09:00:00Z"))
    assert stale_snap.view["status"]["state"] == "TASK_STATE_COMPLETED" and stale_snap.problems


def test_fold_does_not_mutate_input() -> None:
    view = fold(None, task("TASK_STATE_WORKING")).view
    before = repr(view)
    fold(view, art("a", "x"))
    fold(view, status("TASK_STATE_COMPLETED"))
    assert repr(view) == before


def test_fold_accepts_stream_events_and_messages() -> None:
    ev = parse_stream_response(task("TASK_STATE_WORKING"))
    assert isinstance(ev, StreamEvent) and ev.task_id == T and ev.state == "TASK_STATE_WORKING"
    view = fold(None, ev).view
    msg = {
        "message": {
            "messageId": "m9",
            "role": "ROLE_AGENT",
            "taskId": T,
            "contextId": C,
            "parts": [{"text": "hi"}],
        }
    }
    res = fold(view, msg)
    assert res.view["history"][-1]["messageId"] == "m9"
    assert fold(res.view, msg).changed is False  # duplicate messageId
    # a task-less Message reply has nothing to fold
    solo = fold(
        None, {"message": {"messageId": "m1", "role": "ROLE_AGENT", "parts": [{"text": "x"}]}}
    )
    assert solo.view is None and solo.problems == []


def test_fold_key_is_the_only_extra_key() -> None:
    view = fold_all([task("TASK_STATE_WORKING"), art("a", "x", last=True)]).view
    assert set(view) - set(task_json(view)) == {FOLD_KEY}


def test_parse_timestamp_variants() -> None:
    a = parse_timestamp("2026-08-20T09:00:00Z")
    b = parse_timestamp("2026-08-20T09:00:00.000Z")
    c = parse_timestamp("2026-08-20T09:00:00.123456789Z")
    assert a == b and c is not None and c > a
    assert parse_timestamp("garbage") is None and parse_timestamp(None) is None
