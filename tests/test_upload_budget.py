"""Files a person sends to agents are bounded per hour (``tasks_app.upload_budget``).

One file is at most 10 MB, but nothing bounded how many a person sent: each is stored with
its task (the log entry of what was sent, and the conversation), so any operator could grow
the database by 10 MB a click. Real Redis; the pages through Django's test client.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from tasks_app import answers, upload_budget
from tasks_app.models import Agent, Membership, RemoteTask
from tasks_app.runtime import shared_redis
from tests.test_inbox import alpha, asking, people, question  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db

MB = 1024 * 1024
FILE = b"%PDF" + b"x" * (6 * MB // 10)  # 0.6 MB: one fits the budget below, two do not


@pytest.fixture(autouse=True)
def budget(settings):
    """A 1 MB budget, and no count left by another test: the session's Redis database is its
    own, but the tests before this one (uploads in the inbox's tests) charged people whose
    ids this test's people take again."""
    settings.BUDGET_PERSON_UPLOAD_BYTES_PER_HOUR = 1 * MB
    client = shared_redis.client(settings.REDIS_URL)

    def forget_counts() -> None:
        for key in client.scan_iter(match=f"{upload_budget.KEY_PREFIX}*"):
            client.delete(key)

    forget_counts()
    yield
    forget_counts()


@pytest.fixture
def operator(people, django_user_model):  # noqa: F811
    """The operator's logged-in client, and the person."""
    person = django_user_model.objects.get(username=f"{Membership.Role.OPERATOR}-person")
    return people[Membership.Role.OPERATOR], person


def counted(person_id: int) -> int:
    from django.conf import settings

    value = shared_redis.client(settings.REDIS_URL).get(
        upload_budget._key(person_id, int(time.time() // upload_budget.HOUR))
    )
    return int(value or 0)


def answer_with_file(client, task: RemoteTask):
    post = {"question": task.asked_seq, "asked": answers.question_key(task), "text": "here",
            "file": SimpleUploadedFile("contract.pdf", FILE, "application/pdf")}  # fmt: skip
    return client.post(reverse("task-answer", args=[task.pk]), post)


def test_answers_past_the_persons_hourly_bytes_are_refused_next_to_the_file(
    alpha,  # noqa: F811
    operator,
    no_dispatch,
):
    operator, person = operator
    first, second = asking(alpha, "one", question()), asking(alpha, "two", question())
    assert answer_with_file(operator, first).status_code == 302
    assert counted(person.pk) == len(FILE)
    refused = answer_with_file(operator, second)
    page = refused.content.decode()
    assert refused.status_code == 400
    assert "one person may send in an hour" in page and "Send it in" in page
    second.refresh_from_db()
    assert second.outbox is None and second.answered_at is None  # nothing sent
    assert counted(person.pk) == len(FILE)  # the refused file was taken back
    # Without the file the same answer goes.
    post = {"question": second.asked_seq, "asked": answers.question_key(second), "text": "x"}
    assert operator.post(reverse("task-answer", args=[second.pk]), post).status_code == 302


def test_a_new_task_past_the_budget_is_refused_and_a_failed_start_is_refunded(
    alpha,  # noqa: F811
    operator,
    no_dispatch,
):
    operator, person = operator
    Agent.objects.filter(pk=alpha.pk).update(streaming=False)

    def start(mode: str):
        return operator.post(reverse("task-new"), {
            "agent": alpha.pk, "text": "read this", "mode": mode,
            "file": SimpleUploadedFile("a.pdf", FILE, "application/pdf"),
        })  # fmt: skip

    # A start that fails (stream mode on an agent that does not stream) costs nothing.
    failed = start(RemoteTask.Mode.STREAM)
    assert failed.status_code == 400 and counted(person.pk) == 0
    before = RemoteTask.objects.count()
    assert start(RemoteTask.Mode.AUTO).status_code == 302
    refused = start(RemoteTask.Mode.AUTO)
    assert refused.status_code == 400
    assert "one person may send in an hour" in refused.content.decode()
    assert RemoteTask.objects.count() == before + 1
    assert counted(person.pk) == len(FILE)


def test_sends_released_at_once_never_pass_the_budget(django_user_model):
    person = django_user_model.objects.create_user("racer")
    part = {"raw": __import__("base64").b64encode(b"y" * (3 * MB // 10)).decode()}
    barrier = threading.Barrier(8)
    outcomes: list[tuple[int, str]] = []

    def send() -> None:
        barrier.wait()
        outcomes.append(upload_budget.charge(person.pk, [part]))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    charged = [n for n, why in outcomes if not why]
    assert len(outcomes) == 8 and 1 <= len(charged) <= 3  # 3 x 0.3 MB fit in 1 MB, 4 do not
    assert counted(person.pk) == sum(charged) <= MB
