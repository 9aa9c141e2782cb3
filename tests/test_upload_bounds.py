"""What a logged-in person's uploads can make the web process hold, and the answers they get.

Django's own upload handlers wrote every file over 2.5 MB whole to the temporary folder
before the form refused one over 10 MB, and a temporary folder that could not be written
made any such upload a 500. A request could carry 100 files, and the form's 1,000,000
characters of JSON were refused by Django's 2.5 MB before the form saw them.
"""

from __future__ import annotations

import base64
import json
import re

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client, RequestFactory

from tasks_app import answers, kept_uploads
from tasks_app.forms import MAX_UPLOAD_BYTES
from tests.people import member

pytestmark = pytest.mark.django_db

OVER = MAX_UPLOAD_BYTES + 2 * 1024 * 1024  # 12 MB
UNDER = 3 * 1024 * 1024  # over Django's 2.5 MB in memory: it went to a temporary file


@pytest.fixture
def agent():
    from tasks_app.models import Agent

    return Agent.objects.create(
        name="files", base_url="http://127.0.0.1:9/files", interface_url="http://127.0.0.1:9/rpc",
        binding="JSONRPC", streaming=True,
    )  # fmt: skip


@pytest.fixture
def operator(django_user_model):
    from tasks_app.models import Membership

    user = member(django_user_model.objects.create_user("ann"), Membership.Role.OPERATOR)
    client = Client()
    client.force_login(user)
    client.user = user
    return client


@pytest.fixture
def no_temp_dir(settings, tmp_path):
    """A temporary folder that cannot be written (missing here; full or read-only in life)."""
    settings.FILE_UPLOAD_TEMP_DIR = str(tmp_path / "missing")


def start(client, agent, **fields):
    return client.post("/tasks/new", {"agent": agent.pk, "text": "hi", "mode": "auto", **fields})


def test_an_upload_is_held_up_to_the_limit_and_only_counted_past_it():
    """No byte past the limit is kept (it was written whole to a temporary file)."""
    over = (
        RequestFactory()
        .post("/tasks/new", {"file": SimpleUploadedFile("big.bin", b"x" * OVER)})
        .FILES["file"]
    )
    assert over.size == OVER
    assert over.read() == b""
    under = (
        RequestFactory()
        .post("/tasks/new", {"file": SimpleUploadedFile("ok.bin", b"y" * UNDER)})
        .FILES["file"]
    )
    assert (under.size, under.read()) == (UNDER, b"y" * UNDER)


def test_a_file_over_the_limit_is_refused_with_a_sentence_when_no_temporary_file_can_be_written(
    operator, agent, no_temp_dir, no_dispatch
):
    from tasks_app.models import RemoteTask

    answer = start(operator, agent, file=SimpleUploadedFile("big.bin", b"x" * OVER))
    assert answer.status_code == 400
    assert "The file is larger than 10 MB." in answer.content.decode()
    assert not RemoteTask.objects.exists() and no_dispatch == []


def test_a_file_under_the_limit_goes_to_the_agent_when_no_temporary_file_can_be_written(
    operator, agent, no_temp_dir, no_dispatch, django_capture_on_commit_callbacks
):
    """A 3 MB file was a 500 (the temporary folder); it goes, and is kept after a form error."""
    from tasks_app.models import RemoteTask

    content = bytes(range(256)) * (UNDER // 256)
    first = start(operator, agent, data="{bad", file=SimpleUploadedFile("a.bin", content))
    html = first.content.decode()
    assert first.status_code == 400 and "Kept from before: <b>a.bin</b>" in html
    token = re.search(r'name="kept_file" value="([^"]+)"', html).group(1)
    with django_capture_on_commit_callbacks(execute=True):
        sent = start(operator, agent, data="{}", kept_file=token, kept_file_name="a.bin")
    assert sent.status_code == 302
    task = RemoteTask.objects.get()
    assert base64.b64decode(task.request["message"]["parts"][-1]["raw"]) == content
    assert no_dispatch == [task.pk]


def test_an_answer_with_a_file_over_the_limit_is_refused_with_a_sentence_and_nothing_sent(
    operator, agent, no_temp_dir, no_dispatch
):
    from tasks_app.models import RemoteTask

    task = RemoteTask.objects.create(
        agent=agent, title="t", phase="task", remote_id="r-1", asked_seq=1,
        state="TASK_STATE_INPUT_REQUIRED",
        status_message={"messageId": "q-1", "role": "ROLE_AGENT", "parts": [{"text": "?"}]},
    )  # fmt: skip
    fields = {"text": "here", "question": 1, "asked": answers.question_key(task)}
    answer = operator.post(
        f"/tasks/{task.pk}/answer/", {**fields, "file": SimpleUploadedFile("b.bin", b"z" * OVER)}
    )
    assert answer.status_code in (200, 400)
    assert "The file is larger than 10 MB." in answer.content.decode()
    task.refresh_from_db()
    assert task.answered_seq == 0 and not task.outbox and no_dispatch == []


def test_a_request_carries_no_more_files_than_a_form_takes(operator, agent, no_dispatch):
    """Each file may hold up to 10 MB in memory: 100 of them were a gigabyte."""
    from tasks_app.models import RemoteTask

    files = [SimpleUploadedFile(f"f{i}.bin", b"x") for i in range(3)]
    answer = Client(raise_request_exception=False)
    answer.force_login(operator.user)
    refused = answer.post("/tasks/new", {"agent": agent.pk, "text": "hi", "mode": "auto",
                                          "file": files})  # fmt: skip
    assert refused.status_code == 400 and b"task-new-form" not in refused.content
    # A page that says what the site takes (it was Django's bare "Bad Request (400)").
    assert b"at most 2 files of 10 MB each" in refused.content
    assert not RemoteTask.objects.exists()
    ok = start(operator, agent, file=SimpleUploadedFile("one.bin", b"x"))
    assert ok.status_code == 302


def test_the_longest_message_the_form_allows_is_taken(operator, agent, no_dispatch):
    """1,000,000 characters of JSON and 100,000 of text, 4 bytes each: Django's 2.5 MB for
    the fields refused them with a bare 400 before the form could judge them."""
    from tasks_app.models import RemoteTask

    data = json.dumps("\U0001f600" * 999_998, ensure_ascii=False)
    assert len(data) == 1_000_000
    answer = start(operator, agent, data=data, text="\U0001f600" * 100_000,
                   file=SimpleUploadedFile("a.txt", b"a"))  # fmt: skip
    assert answer.status_code == 302
    assert RemoteTask.objects.get().request["message"]["parts"][1]["data"] == "\U0001f600" * 999_998


def test_removing_the_kept_file_lets_it_go_at_once(operator, agent, no_dispatch):
    """Ticked "remove it" on a form that failed again: Redis held the file for the hour."""
    first = start(operator, agent, data="{bad", file=SimpleUploadedFile("a.bin", b"k" * 1000))
    token = re.search(r'name="kept_file" value="([^"]+)"', first.content.decode()).group(1)
    assert kept_uploads.take(operator.user.id, token) is not None
    again = start(operator, agent, data="{bad", kept_file=token, kept_file_name="a.bin",
                  drop_kept_file="on")  # fmt: skip
    assert again.status_code == 400
    assert "Kept from before" not in again.content.decode()
    assert kept_uploads.take(operator.user.id, token) is None
