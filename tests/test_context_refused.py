"""An agent that refuses a contextId the client chose (A2A 1.0 section 3.4.1).

The dashboard gives each first send a contextId of its own, to find the task by it when
the reply is lost. An agent that cannot take one must refuse the request; every task
started on such an agent failed, and retrying sent the same contextId again. The agent
here is the official a2a-sdk server, its handler refusing a new task's client contextId.
"""

from __future__ import annotations

import json
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from tasks_app.models import Agent, RemoteTask, TaskEvent
from tasks_app.services import audit
from tasks_app.services import tasks as task_services
from tasks_app.services.agents import add_agent
from tests.test_a2ui_negotiation import (
    in_process_holders,  # noqa: F401 (a fixture)
    wait_for_state,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

REFUSAL = "this agent makes its own contextId for a new task: send none"


def refusing_agent() -> Any:
    """An a2a-sdk agent on 127.0.0.1 that asks once and completes on the answer, refusing
    a message that starts a task with a contextId; yields (base URL, executor)."""
    from a2a.server.request_handlers import DefaultRequestHandler
    from a2a.types import a2a_pb2 as pb
    from a2a.utils.errors import InvalidParamsError

    from tests import a2ui_agents

    class Refusing(DefaultRequestHandler):
        refused = 0

        def _refuse(self, params: Any) -> None:
            if params.message.context_id and not params.message.task_id:
                type(self).refused += 1
                raise InvalidParamsError(REFUSAL)

        async def on_message_send(self, params: Any, context: Any) -> Any:
            self._refuse(params)
            return await super().on_message_send(params, context)

        async def on_message_send_stream(self, params: Any, context: Any) -> Any:
            self._refuse(params)
            async for event in super().on_message_send_stream(params, context):
                yield event

    executor = a2ui_agents.RecordingExecutor(None)
    skill = pb.AgentSkill(id="ask", name="ask", description="asks", tags=["test"])
    served = a2ui_agents.on_loopback(
        "context-refusing", "refuses a client's contextId", [], skill, executor, Refusing
    )
    return served, executor, Refusing


@pytest.mark.parametrize("mode", ["stream", "blocking"])
def test_a_refused_context_is_sent_again_without_one_and_never_given_again(
    mode: str,
    in_process_holders: None,  # noqa: F811
    django_user_model: Any,
) -> None:
    served, executor, handler = refusing_agent()
    client = Client()
    client.force_login(django_user_model.objects.create_superuser("root", password="pw-12345678"))
    with served as base:
        agent = add_agent(base, name="refuses contexts")
        assert agent.takes_client_context
        page = client.get(reverse("agent-detail", args=[agent.pk])).content.decode()
        assert "agent-context-refused" not in page
        task = task_services.start_task(agent, "hello", mode=mode)
        chosen = task.request["message"]["contextId"]
        wait_for_state(task, "TASK_STATE_INPUT_REQUIRED", "the question")
        task.refresh_from_db()
        assert handler.refused == 1
        # The same message went again, without the contextId, and started the task.
        (first,) = [seen["message"] for seen in executor.seen]
        sent = task.request["message"]
        assert "contextId" not in sent and task.outbox is None  # taken by the agent
        assert first["messageId"] == sent["messageId"]
        assert first.get("contextId") and first["contextId"] != chosen  # the agent's own
        assert task.context_id == first["contextId"]  # adopted, not the one refused
        notes = list(task.events.filter(kind=TaskEvent.Kind.SYSTEM).values_list("note", flat=True))
        assert any(note.startswith("context-refused: ") and REFUSAL in note for note in notes)
        assert not Agent.objects.get(pk=agent.pk).takes_client_context
        page = client.get(reverse("agent-detail", args=[agent.pk])).content.decode()
        assert 'id="agent-context-refused"' in page
        listed = StringIO()
        call_command("agents", "list", "--json", stdout=listed)
        assert json.loads(listed.getvalue())["takes_client_context"] is False

        # The answer goes in the agent's context, and the task ends.
        task_services.answer_task(task, "Ann")
        wait_for_state(task, "TASK_STATE_COMPLETED", "the end")
        answer = executor.seen[1]["message"]
        assert answer["contextId"] == task.context_id and answer["taskId"] == task.remote_id
        assert audit.replay(task).ok, audit.replay(task)

        # The next task on that agent carries no contextId from the start: nothing refused.
        agent.refresh_from_db()
        second = task_services.start_task(agent, "again", mode=mode)
        assert "contextId" not in second.request["message"]
        wait_for_state(second, "TASK_STATE_INPUT_REQUIRED", "the second question")
        assert handler.refused == 1
        assert not second.events.filter(note__startswith="context-refused").exists()


def test_another_refusal_of_the_first_send_fails_it_as_before() -> None:
    """Only an error naming the context sends again: a bad part, an unsupported mode, or a
    message that carried no contextId fail the send as they did."""
    from tasks_app.a2a import ContentTypeNotSupportedError, InvalidParamsError, TaskNotFoundError

    ours = {"messageId": "m-1", "contextId": "c-1", "role": "ROLE_USER", "parts": []}
    refused = InvalidParamsError("the contextId c-1 is not one this agent made")
    assert task_services.refuses_our_context(refused, ours)
    assert not task_services.refuses_our_context(refused, {**ours, "contextId": ""})
    assert not task_services.refuses_our_context(InvalidParamsError("bad part"), ours)
    assert not task_services.refuses_our_context(ContentTypeNotSupportedError("no"), ours)
    assert not task_services.refuses_our_context(TaskNotFoundError("no task"), ours)
    assert not task_services.refuses_our_context(ValueError("context"), ours)


def test_the_message_loses_its_context_once_and_only_for_the_holder_of_its_send() -> None:
    """``send_without_context`` is one compare-and-set: a holder whose lease moved on, the
    same refusal handled twice, or a send withdrawn meanwhile change nothing."""
    agent = Agent.objects.create(name="refuses", base_url="http://127.0.0.1:9/refuses")
    message = {"messageId": "m-1", "contextId": "ours", "role": "ROLE_USER",
               "parts": [{"text": "hello"}]}  # fmt: skip
    task = RemoteTask.objects.create(
        agent=agent,
        phase=RemoteTask.Phase.SENDING,
        request={"message": message, "metadata": {}},
        outbox={"message": message, "metadata": {}},
        context_id="ours",
        lease_token="holder",
        send_attempted_at=timezone.now(),
    )
    refused = task.events.filter(note__startswith="context-refused")

    assert not task_services.send_without_context(task.pk, "late", message, "no")
    task.refresh_from_db()
    assert task.outbox["message"]["contextId"] == "ours" and not refused.exists()
    assert Agent.objects.get(pk=agent.pk).takes_client_context

    assert task_services.send_without_context(task.pk, "holder", message, REFUSAL)
    task.refresh_from_db()
    without = {key: value for key, value in message.items() if key != "contextId"}
    assert task.outbox["message"] == without == task.request["message"]
    assert task.send_attempted_at is None and task.context_id == ""
    assert refused.count() == 1 and not Agent.objects.get(pk=agent.pk).takes_client_context

    # The same refusal again: the outbox no longer holds the message with that context.
    assert not task_services.send_without_context(task.pk, "holder", message, REFUSAL)
    assert refused.count() == 1

    # A send withdrawn meanwhile (its outbox emptied) is not put back.
    other = RemoteTask.objects.create(
        agent=agent, phase=RemoteTask.Phase.SENDING, request={"message": message},
        outbox=None, lease_token="holder",
    )  # fmt: skip
    assert not task_services.send_without_context(other.pk, "holder", message, REFUSAL)
    other.refresh_from_db()
    assert other.outbox is None and other.request["message"]["contextId"] == "ours"
