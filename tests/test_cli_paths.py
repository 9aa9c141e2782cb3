"""``manage.py audit export|actions --output PATH``: a bad place to write is a sentence, not a traceback."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from tasks_app.models import Agent, Project, RemoteTask
from tests.infra import REPO_ROOT


@pytest.mark.django_db
@pytest.mark.parametrize("action", ["export", "actions"])
def test_output_into_a_missing_folder_names_the_folder(tmp_path: Path, action: str) -> None:
    agent = Agent.objects.create(
        project=Project.objects.create(name="p"), name="a", base_url="http://127.0.0.1:9/"
    )
    task = RemoteTask.objects.create(agent=agent, remote_id="t-1", context_id="c-1")
    folder = tmp_path / "no" / "such"
    target = folder / "out.jsonl"
    args = ["export", str(task.pk)] if action == "export" else ["actions"]
    with pytest.raises(CommandError) as refused:
        call_command("audit", *args, "--output", str(target), stdout=io.StringIO())
    assert (
        str(refused.value) == f"Cannot write --output {target}: the folder {folder} does not exist."
    )
    assert not (tmp_path / "no").exists()


@pytest.mark.django_db
def test_output_under_a_file_or_onto_a_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    under_a_file = tmp_path / "plain" / "out.csv"
    with pytest.raises(CommandError, match=r"the folder .*plain is not a folder\.$"):
        call_command("audit", "actions", "--output", str(under_a_file), stdout=io.StringIO())
    with pytest.raises(CommandError, match=r"it is a folder; name a file in it\.$"):
        call_command("audit", "actions", "--output", str(tmp_path), stdout=io.StringIO())
    assert [p.name for p in tmp_path.iterdir()] == ["plain"]  # no temporary file left


def test_the_command_line_shows_one_line_and_exit_status_1(
    child_env: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    """As an operator sees it: Django's "CommandError: ..." on stderr, no traceback."""
    target = tmp_path / "missing" / "actions.csv"
    result = subprocess.run(
        [sys.executable, "manage.py", "audit", "actions", "--csv", "--output", str(target)],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"CommandError: Cannot write --output {target}: "
        f"the folder {tmp_path / 'missing'} does not exist."
    ]
