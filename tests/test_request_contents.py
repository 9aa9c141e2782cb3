"""A file sent with a task's first message is stored once, in the conversation: not again in
the operator's log entry (a reference) nor in the task's request once the agent has it.

The request is kept to send the same message again while the agent is known not to have
it; after that only its ids are read. A 10 MB file was kept whole in it for as long as the
task was, beside the operator's log entry and the conversation message (and whole in the
log entry too, until the log kept references to what the conversation holds:
tests/test_message_contents.py). A real demo agent, a real worker.
"""

from __future__ import annotations

import base64
import hashlib
import json

import pytest

from tasks_app.models import ConversationMessage, RemoteTask, TaskEvent
from tasks_app.services import tasks as task_services
from tasks_app.services.agents import add_agent
from tasks_app.services.record import STORED, stored_contents, with_content
from tests.test_mirror import settled, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CONTENT = base64.b64encode(bytes(range(256)) * 800).decode()  # 273 KB of base64


@pytest.mark.parametrize(
    ("text", "mode"),
    [("quick", "stream"), ("quick", "return-immediately"), ("hello", "auto")],  # hello: a Message
)
def test_the_request_keeps_a_reference_once_the_agent_has_the_message(
    agent, start_celery_worker, text, mode
):
    start_celery_worker()
    row = add_agent(agent.base_url, name="demo")
    attached = {"raw": CONTENT, "filename": "table.bin", "mediaType": "text/plain"}
    task = task_services.start_task(row, text, mode=mode, files=(attached,))
    message_id = task.request["message"]["messageId"]
    assert task.request["message"]["parts"][1]["raw"] == CONTENT  # kept while it may be resent
    wait_for(lambda: settled(task), timeout=60, what="the task to complete")
    assert (task.phase, task.state) in (("task", "TASK_STATE_COMPLETED"), ("message", "")), (
        task.phase, task.state, task.send_error,
    )  # fmt: skip
    wait_for(lambda: not RemoteTask.objects.get(pk=task.pk).outbox, what="the outbox cleared")

    request = RemoteTask.objects.get(pk=task.pk).request
    part = request["message"]["parts"][1]
    assert "raw" not in part and part["filename"] == "table.bin"
    digest = hashlib.sha256(CONTENT.encode()).hexdigest()
    assert part[STORED] == {"field": "raw", "sha256": digest, "chars": len(CONTENT)}
    assert request["message"]["messageId"] == message_id  # the ids are what is read
    assert len(json.dumps(request)) < 2_000
    # The content is where the conversation keeps it; the operator's log entry refers to it.
    kept = ConversationMessage.objects.get(task=task, message_id=message_id).message
    assert CONTENT in json.dumps(kept)
    first = TaskEvent.objects.filter(task=task, kind="operator").order_by("seq").first()
    assert CONTENT not in json.dumps(first.raw)
    assert first.raw["operator"]["message"]["parts"][1][STORED] == part[STORED]
    restored = with_content(first.raw, stored_contents(task.pk))
    assert restored["operator"]["message"]["parts"][1]["raw"] == CONTENT
    # Nor in any later row (the agent's snapshots repeat the message in their history).
    assert not [e.seq for e in TaskEvent.objects.filter(task=task) if CONTENT in json.dumps(e.raw)]


def test_a_request_that_may_be_sent_again_keeps_its_contents(db):
    """A send that failed before the agent named anything keeps the whole request: a retry
    sends the same message."""
    from tasks_app.models import Agent
    from tasks_app.services.record import record

    row = Agent.objects.create(
        name="down", base_url="http://127.0.0.1:9/down", interface_url="http://127.0.0.1:9/rpc",
        binding="JSONRPC",
    )  # fmt: skip
    attached = {"raw": CONTENT, "filename": "table.bin", "mediaType": "text/plain"}
    message = {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": "hi"}, attached]}
    task = RemoteTask.objects.create(
        agent=row, phase=RemoteTask.Phase.SENDING, request={"message": message}
    )
    record(task, {"system": {"event": "send-failed", "detail": "refused"}}, "operator")
    task.refresh_from_db()
    assert task.phase == RemoteTask.Phase.FAILED
    assert task.request["message"]["parts"][1]["raw"] == CONTENT
