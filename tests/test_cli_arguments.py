"""Numbers and names given to the management commands: out of bounds is one sentence, never a
traceback, and nothing is changed.

Before: ``tasks list --limit -3`` ended in a ValueError, ``prune --batch`` past a bigint and
``members add`` with a 400-character project in PostgreSQL's DataError, ``up --port 99999`` in
an OverflowError, ``prune --older-than 99999999999`` in another. ``call_command`` turns an
argparse refusal into a CommandError; from the command line it is ``manage.py …: error: …``
and exit 2.
"""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from tasks_app.models import OperatorAction, Project


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["tasks", "list", "--limit", "-3"], "argument --limit: from 1 to 10,000, not -3"),
        (["tasks", "list", "--limit", "9" * 20], "argument --limit: from 1 to 10,000"),
        (["tasks", "list", "--limit", "ten"], "argument --limit: a whole number is needed"),
        (["tasks", "import", "any", "--page-size", "0"], "argument --page-size: from 1 to 100"),
        (["tasks", "start", "any", "hi", "--wait", "nan"], "argument --wait: from 0 to 86,400"),
        (["tasks", "start", "any", "hi", "--wait", "-1"], "argument --wait: from 0 to 86,400"),
        (["prune", "--batch", "9" * 20, "--older-than", "5"], "argument --batch: from 1 to"),
        (["prune", "--older-than", "99999999999"], "at most 36,500"),
        (["up", "--port", "99999"], "argument --port: from 1 to 65,535, not 99999"),
        (
            ["a2a", "get", "http://127.0.0.1:9/", "t", "--timeout", "1e999"],
            "argument --timeout: more than 0 and at most 3,600, not 1e999",
        ),
        (["a2a", "get", "http://127.0.0.1:9/", "t", "--timeout", "0"], "more than 0"),
        (["a2a", "list", "http://127.0.0.1:9/", "--page-size", "101"], "from 1 to 100"),
        (["a2a", "get", "http://127.0.0.1:9/", "t", "--history-length", "-1"], "from 0 to"),
    ],
)
def test_a_number_out_of_bounds_is_one_sentence(args: list[str], said: str) -> None:
    with pytest.raises(CommandError) as refused:
        call_command(*args, stdout=io.StringIO(), stderr=io.StringIO())
    assert said in str(refused.value)
    assert "\n" not in str(refused.value).strip()


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["p" * 101, "", "   "])
def test_adding_a_member_to_a_project_no_project_can_be_named_changes_nothing(
    django_user_model, name: str
) -> None:
    django_user_model.objects.create_user("pat")
    with pytest.raises(CommandError, match="A project name is 1 to 100 characters"):
        call_command("members", "add", "pat", name, "viewer", stdout=io.StringIO())
    assert not Project.objects.filter(name=name).exists()
    assert not OperatorAction.objects.filter(action="member-add").exists()
    # At the limit, the project is made as before.
    call_command("members", "add", "pat", "p" * 100, "viewer", stdout=io.StringIO())
    assert Project.objects.filter(name="p" * 100).exists()


def test_an_address_not_on_this_machine_is_not_a_port_in_use() -> None:
    """``up --host`` with an address this machine does not have said the port was in use."""
    import socket

    from tasks_app.runtime.net import bind_problem

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert bind_problem("127.0.0.1", port) == "in use"
    problem = bind_problem("192.0.2.1", port)  # TEST-NET-1: binding sends nothing
    assert problem and problem != "in use"


@pytest.mark.django_db
def test_an_export_folder_that_cannot_be_made_is_one_sentence(tmp_path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(CommandError, match=r"--export-to .* cannot be made"):
        call_command("prune", "--older-than", "1", "--export-to", str(a_file / "inside"))


@pytest.mark.postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_web_part_waiting_for_the_migration_lock_hears_a_stop() -> None:
    """``up --only web`` waited for another web part's migration lock with a blocking call:
    SIGTERM and SIGINT went unheard until the other part finished."""
    import threading

    import psycopg
    from django.db import connection

    from tasks_app.management.commands.up import MIGRATE_LOCK_KEY, _one_web_part_at_a_time

    params = connection.get_connection_params()
    with psycopg.connect(**params) as other:  # another web part, migrating
        other.execute("SELECT pg_advisory_lock(%s)", [MIGRATE_LOCK_KEY])
        stopping, said, turns = threading.Event(), [], []
        threading.Timer(0.5, stopping.set).start()
        with _one_web_part_at_a_time(stopping, said.append) as turn:
            turns.append(turn)
        assert turns == [False] and said == ["Waiting for another web part to finish migrating ..."]
        other.execute("SELECT pg_advisory_unlock(%s)", [MIGRATE_LOCK_KEY])
    with _one_web_part_at_a_time(threading.Event(), said.append) as turn:
        assert turn is True  # free again: taken at once
