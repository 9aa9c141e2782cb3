"""A2UI negotiation against real a2a-sdk agents on 127.0.0.1.

An agent whose card declares the A2UI extension gets it activated on every request (the
``A2A-Extensions`` header, which the SDK hands the executor as ``requested_extensions``)
and our renderer's capabilities in the metadata of every message (the start and the
answer); an agent that does not declare it gets neither. The declaring agents answer
with A2UI surfaces built by the A2UI project's own SDK models, and the dashboard folds
them through the real watcher and record().
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tasks_app import eventloop, relay, watchers
from tasks_app.a2a import a2ui
from tasks_app.models import RemoteTask, Surface
from tasks_app.services import tasks as task_services
from tasks_app.services.agents import add_agent
from tests.test_mirror import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def in_process_holders(monkeypatch) -> Iterator[None]:
    """Watchers run on this process's shared loop (instead of a Celery worker) and stop after."""
    monkeypatch.setattr(task_services, "dispatch", lambda pk: watchers.watch(pk))
    yield
    if eventloop.running():
        eventloop.submit(watchers.registry.shutdown()).result(timeout=15)
        eventloop.stop()
    relay.use_loop(None)


def wait_for_state(task: RemoteTask, state: str, what: str, *, released: bool = True) -> None:
    """Wait until ``task`` is in ``state`` (and its holder let it go, when ``released``); on
    timeout, fail saying where it is and what its log holds."""
    held = {"lease_token": ""} if released else {}
    try:
        wait_for(
            lambda: RemoteTask.objects.filter(pk=task.pk, state=state, **held).exists(),
            timeout=60,
            what=what,
        )
    except AssertionError:
        task.refresh_from_db()
        rows = list(task.events.order_by("seq").values_list("kind", "channel", "note"))
        raise AssertionError(
            f"{task.phase} {task.state} {task.watcher_status} {task.watcher_note}: {rows}"
        ) from None


def ask_and_answer(base: str, name: str) -> RemoteTask:
    agent = add_agent(base, name=name)
    task = task_services.start_task(agent, "hello", mode="stream")
    # The question is recorded and its holder has let the task go: the answer's dispatch
    # then starts a holder here (no reconciler runs in this test to catch a later one).
    wait_for_state(task, "TASK_STATE_INPUT_REQUIRED", "the question")
    task.refresh_from_db()
    task_services.answer_task(task, "Ann")
    wait_for_state(task, "TASK_STATE_COMPLETED", "the end", released=False)
    return task


@pytest.mark.parametrize(
    ("version", "surface", "capabilities"),
    [
        ("0.9.1", "question_091", {"v0.9": {"supportedCatalogIds": [a2ui.V091_CATALOG, a2ui.V09_CATALOG]}}),
        ("0.8", "question_08", {"supportedCatalogIds": [a2ui.V08_CATALOG]}),
    ],
)  # fmt: skip
def test_only_the_declaring_agent_gets_the_extension(
    version, surface, capabilities, in_process_holders
):
    # The a2a-sdk server and the A2UI SDK, imported when the test runs: every run collects
    # this module, the fast tier too, and the imports cost each process about half a second.
    from tests import a2ui_agents

    uri = a2ui.EXTENSION_URIS[version]
    with (
        a2ui_agents.negotiating_agent(version, getattr(a2ui_agents, surface)()) as (ui_base, ui),
        a2ui_agents.negotiating_agent(None, None) as (plain_base, plain),
    ):
        ui_task = ask_and_answer(ui_base, "ui")
        plain_task = ask_and_answer(plain_base, "plain")

    assert len(ui.seen) == 2 and len(plain.seen) == 2  # the start and the answer
    for seen in ui.seen:
        assert seen["extensions"] == {uri}
        assert seen["message"]["metadata"]["a2uiClientCapabilities"] == capabilities
        assert uri in seen["message"]["extensions"]
    for seen in plain.seen:
        assert seen["extensions"] == set()
        assert "a2uiClientCapabilities" not in seen["message"].get("metadata", {})
        assert "extensions" not in seen["message"]

    surface_row = Surface.objects.get(task=ui_task, surface_id="form")
    assert (surface_row.version, surface_row.ready, surface_row.problem) == (version, True, "")
    assert surface_row.components["root"]["component"] == "Column"
    assert not Surface.objects.filter(task=plain_task).exists()
