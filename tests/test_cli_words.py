"""What the command line says about a task, in the cases where its words were wrong or missing."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command

from tasks_app.models import Agent, RemoteTask

pytestmark = pytest.mark.django_db


def _agent() -> Agent:
    url = "http://127.0.0.1:9/words"
    return Agent.objects.create(
        name="Words", base_url=url, interface_url=url + "/rpc", binding="JSONRPC"
    )


def test_a_message_reply_is_shown_as_one_not_as_unsent() -> None:
    """An agent that answered with a plain Message named no task: "(unsent)" said the
    message never went, which the log below it contradicted."""
    agent = _agent()
    reply = RemoteTask.objects.create(agent=agent, phase="message", title="hi")
    failed = RemoteTask.objects.create(agent=agent, phase="failed", title="no")
    out = io.StringIO()
    call_command("tasks", "show", str(reply.pk), stdout=out)
    assert out.getvalue().startswith(f"task {reply.pk} (message reply, no task) on Words: message")
    out = io.StringIO()
    call_command("tasks", "show", str(failed.pk), stdout=out)
    assert f"task {failed.pk} (send failed, no task)" in out.getvalue()
    assert "unsent" not in str(reply) and str(reply) == f"(message reply, no task #{reply.pk})"


def test_start_says_when_its_wait_ran_out_before_the_task_settled(no_dispatch) -> None:
    """The line printed after ``--wait`` looked the same whether the task had settled or
    the wait had run out; a script could not tell."""
    agent = _agent()
    out, err = io.StringIO(), io.StringIO()
    call_command("tasks", "start", str(agent.pk), "hello", "--wait", "0.3", stdout=out, stderr=err)
    task = RemoteTask.objects.get(agent=agent)
    assert out.getvalue().split("\t")[2] == "sending"  # nobody sent it: no worker here
    assert err.getvalue().strip() == (
        f"Task {task.pk} had not settled after 0.3 s; it goes on (manage.py tasks show {task.pk})."
    )
    # Without --wait nothing was promised, and nothing is said.
    err = io.StringIO()
    call_command("tasks", "start", str(agent.pk), "again", stdout=io.StringIO(), stderr=err)
    assert err.getvalue() == ""
