"""``manage.py agents`` and ``manage.py tasks`` against a real agent and worker."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from tasks_app.crypto import decrypt_json
from tasks_app.models import Agent, RemoteTask

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_agents_add_and_list(agent):
    line = run("agents", "add", agent.base_url, "--name", "demo", "--token", "s3cret")
    assert "demo" in line and "JSONRPC" in line
    stored = Agent.objects.get(name="demo")
    assert stored.credentials_encrypted and "s3cret" not in stored.credentials_encrypted
    assert decrypt_json(stored.credentials_encrypted) == {"token": "s3cret"}
    listing = run("agents", "list", "--json")
    row = json.loads(listing.splitlines()[0])
    assert row["name"] == "demo" and row["streaming"] is True and row["credentials"] is True
    assert "s3cret" not in listing and "s3cret" not in run("agents", "list")


def test_agents_add_unreachable_is_one_clear_error():
    with pytest.raises(CommandError, match=r"Could not read an agent card at http://127\.0\.0\.1:9/"):
        run("agents", "add", "http://127.0.0.1:9/")


def test_tasks_start_show_list_and_import(agent, celery_worker):
    run("agents", "add", agent.base_url, "--name", "demo")
    line = run("tasks", "start", "demo", "slow 3 0.05", "--mode", "stream", "--wait", "20")
    pk, remote_id, phase, state = line.strip().split("\t")
    assert (phase, state) == ("task", "completed")
    document = json.loads(run("tasks", "show", pk, "--json"))
    assert document["snapshot"]["id"] == remote_id
    assert document["snapshot"]["status"]["state"] == "TASK_STATE_COMPLETED"
    assert [e["seq"] for e in document["events"]] == list(range(1, document["last_seq"] + 1))
    assert document["events"][0]["kind"] == "operator"
    assert remote_id in run("tasks", "list")
    assert "completed" in run("tasks", "show", remote_id)
    imported = run("tasks", "import", "demo")
    assert imported.splitlines()[0].startswith("page 1: ") and imported.splitlines()[-1].startswith("done: ")
    assert RemoteTask.objects.filter(remote_id=remote_id).count() == 1


def test_tasks_cancel_of_an_ended_task_says_why(agent, celery_worker):
    run("agents", "add", agent.base_url, "--name", "demo")
    pk = run("tasks", "start", "demo", "quick", "--mode", "blocking", "--wait", "20").split("\t")[0]
    with pytest.raises(CommandError, match="will not cancel"):
        run("tasks", "cancel", pk)
    with pytest.raises(CommandError, match="No task"):
        run("tasks", "show", "no-such-task")
