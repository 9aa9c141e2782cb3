"""The protocol's state sets and transition rules (pure; the fold that applies them is record())."""

from __future__ import annotations

import pytest

from tasks_app.a2a import (
    ACTIVE_STATES,
    INTERRUPTED_STATES,
    TERMINAL_STATES,
    is_active,
    is_interrupted,
    is_terminal,
    parse_timestamp,
    transition_problem,
)


def test_state_sets_are_disjoint_and_complete() -> None:
    assert {
        "TASK_STATE_COMPLETED", "TASK_STATE_FAILED", "TASK_STATE_CANCELED", "TASK_STATE_REJECTED",
    } == TERMINAL_STATES  # fmt: skip
    assert {"TASK_STATE_INPUT_REQUIRED", "TASK_STATE_AUTH_REQUIRED"} == INTERRUPTED_STATES
    assert {"TASK_STATE_SUBMITTED", "TASK_STATE_WORKING"} == ACTIVE_STATES
    assert not (TERMINAL_STATES & INTERRUPTED_STATES) and not (TERMINAL_STATES & ACTIVE_STATES)


@pytest.mark.parametrize("state", sorted(TERMINAL_STATES))
def test_every_terminal_state_is_final(state: str) -> None:
    assert is_terminal(state) and not is_interrupted(state) and not is_active(state)
    assert transition_problem("TASK_STATE_WORKING", state) is None
    assert "illegal transition" in (transition_problem(state, "TASK_STATE_WORKING") or "")
    assert transition_problem(state, state) is None  # a duplicate delivery is fine


@pytest.mark.parametrize("state", sorted(INTERRUPTED_STATES))
def test_every_interrupted_state_can_resume(state: str) -> None:
    assert is_interrupted(state) and not is_terminal(state)
    assert transition_problem("TASK_STATE_WORKING", state) is None
    assert transition_problem(state, "TASK_STATE_WORKING") is None


def test_transition_problem() -> None:
    assert transition_problem(None, "TASK_STATE_SUBMITTED") is None
    assert "UNSPECIFIED" in (
        transition_problem("TASK_STATE_WORKING", "TASK_STATE_UNSPECIFIED") or ""
    )
    assert "UNSPECIFIED" in (transition_problem("TASK_STATE_WORKING", None) or "")
    assert "unknown" in (transition_problem("TASK_STATE_WORKING", "working") or "")


def test_parse_timestamp_variants() -> None:
    a = parse_timestamp("2026-08-20T09:00:00Z")
    b = parse_timestamp("2026-08-20T09:00:00.000Z")
    c = parse_timestamp("2026-08-20T09:00:00.123456789Z")
    assert a == b and c is not None and a is not None and c > a
    assert parse_timestamp("garbage") is None and parse_timestamp(None) is None
