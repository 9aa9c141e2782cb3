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


def test_agents_add_and_list(agent, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    line = run("agents", "add", agent.base_url, "--name", "demo", "--token-file", str(token_file))
    assert "demo" in line and "JSONRPC" in line
    stored = Agent.objects.get(name="demo")
    assert stored.credentials_encrypted and "s3cret" not in stored.credentials_encrypted
    assert decrypt_json(stored.credentials_encrypted) == {"token": "s3cret"}
    listing = run("agents", "list", "--json")
    row = json.loads(listing.splitlines()[0])
    assert row["name"] == "demo" and row["streaming"] is True and row["credentials"] is True
    assert "s3cret" not in listing and "s3cret" not in run("agents", "list")


def test_agents_add_api_key_from_stdin(agent):
    out = StringIO()
    call_command("agents", "add", agent.base_url, "--name", "keyed", "--api-key-file", "-",
                 stdin=StringIO("k3y-from-stdin\n"), stdout=out)  # fmt: skip
    stored = Agent.objects.get(name="keyed")
    # The placement is pinned when saved (a later card cannot move the key).
    assert decrypt_json(stored.credentials_encrypted) == {
        "api_key": "k3y-from-stdin",
        "api_key_location": "header",
        "api_key_name": "X-API-Key",
    }
    assert "k3y-from-stdin" not in out.getvalue()


@pytest.mark.parametrize(
    ("flag", "file_flag"), [("--token", "--token-file"), ("--api-key", "--api-key-file")]
)
def test_agents_add_refuses_a_secret_in_argv(flag, file_flag):
    """A secret on the command line is in the process list: refused, pointing at the file option."""
    with pytest.raises(CommandError) as refused:
        run("agents", "add", "http://127.0.0.1:9/", flag, "hunter2")
    message = str(refused.value)
    assert f"{flag} is refused" in message and "process list" in message
    assert f"{file_flag} PATH" in message and f"{file_flag} -" in message
    assert "hunter2" not in message
    assert not Agent.objects.exists()


def test_agents_add_secret_file_problems_are_clear(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CommandError, match=r"Cannot read --token-file .*nope: No such file"):
        run("agents", "add", "http://127.0.0.1:9/", "--token-file", str(missing))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(CommandError, match=r"--api-key-file: .*empty is empty"):
        run("agents", "add", "http://127.0.0.1:9/", "--api-key-file", str(empty))
    two = tmp_path / "two"
    two.write_text("secret-one\nsecret-two\n")
    with pytest.raises(CommandError, match="more than one line") as refused:
        run("agents", "add", "http://127.0.0.1:9/", "--token-file", str(two))
    assert "secret-one" not in str(refused.value)
    with pytest.raises(CommandError, match="Only one of"):
        run("agents", "add", "http://127.0.0.1:9/", "--token-file", "-", "--api-key-file", "-")
    assert not Agent.objects.exists()


def test_agents_add_unreachable_is_one_clear_error():
    with pytest.raises(
        CommandError, match=r"Could not read an agent card at http://127\.0\.0\.1:9/"
    ):
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
    assert imported.splitlines()[0].startswith("page 1: ") and imported.splitlines()[-1].startswith(
        "done: "
    )
    assert RemoteTask.objects.filter(remote_id=remote_id).count() == 1


def test_tasks_start_exits_non_zero_when_the_send_failed(agent, celery_worker):
    """It printed the failed task's line and exited 0: a script could not tell."""
    run("agents", "add", agent.base_url, "--name", "demo")
    Agent.objects.filter(name="demo").update(interface_url="http://127.0.0.1:9/gone")  # closed
    out = StringIO()
    with pytest.raises(CommandError, match=r"the send failed: .+") as failed:
        call_command("tasks", "start", "demo", "hello", "--wait", "20", stdout=out)
    pk, remote_id, phase, _state = out.getvalue().strip().split("\t")
    assert (remote_id, phase) == ("-", "failed")
    assert f"Task {pk}:" in str(failed.value)
    assert RemoteTask.objects.get(pk=pk).phase == RemoteTask.Phase.FAILED


def test_tasks_cancel_of_an_ended_task_says_why(agent, celery_worker):
    run("agents", "add", agent.base_url, "--name", "demo")
    pk = run("tasks", "start", "demo", "quick", "--mode", "blocking", "--wait", "20").split("\t")[0]
    with pytest.raises(CommandError, match="cannot be canceled: it has ended"):
        run("tasks", "cancel", pk)
    with pytest.raises(CommandError, match="No task"):
        run("tasks", "show", "no-such-task")
