"""What one request of a reader (the viewer role, the lowest that reads a task) may cost.

Found by an audit of what a logged-in reader can make the web process and the database do:
"verify now" (``verify=1``, posted) on a task page or its event log re-read and re-hashed the whole log on every
request, for anyone who could read the task (100,000 entries, 64 MiB: 2.9 s on SQLite,
3.6 s on PostgreSQL, about a hundred queries, each time, as often and as many at once as
asked). Now an outcome is remembered by the log's head, one check of a task and one of a
person run at once, and a person starts a bounded number an hour; the page still says
truthfully whether the chain verifies, where it breaks, or why it was not checked now.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.test import Client

from tasks_app.models import Agent, Membership, RemoteTask, TaskEvent
from tasks_app.runtime import shared_redis
from tasks_app.services import audit
from tests.bulklog import bulk_log
from tests.people import member

pytestmark = pytest.mark.django_db

ROWS = 30


@pytest.fixture(autouse=True)
def _long_logs(monkeypatch, settings):
    """Logs of more than 10 entries count as too long to check on every load; no check
    remembered or running from another test (the session's Redis database is shared)."""
    monkeypatch.setattr(audit, "VERIFY_ON_PAGE_MAX_ROWS", 10)
    r = shared_redis.client(settings.REDIS_URL)
    for key in r.scan_iter("chain-*"):
        r.delete(key)


@pytest.fixture
def checks(monkeypatch) -> list[int]:
    """The task ids ``audit.verify`` (the full read of a log) was called for."""
    calls: list[int] = []
    real = audit.verify

    def counted(task):
        calls.append(task if isinstance(task, int) else task.pk)
        return real(task)

    monkeypatch.setattr(audit, "verify", counted)
    return calls


def long_task(name: str = "t") -> RemoteTask:
    agent = Agent.objects.get_or_create(name="a", base_url="http://127.0.0.1:1/")[0]
    task = RemoteTask.objects.create(agent=agent, title=name, remote_id=name, context_id="c")
    bulk_log(task, ROWS)
    task.refresh_from_db()
    return task


def viewer(name: str = "viewer") -> Client:
    client = Client()
    client.force_login(member(User.objects.create_user(name), Membership.Role.VIEWER))
    return client


def chain_line(page: bytes) -> str:
    text = page.decode()
    start = text.index('id="chain-status"')
    return text[start : text.index("</p>", start)]


def test_a_repeated_check_of_an_unchanged_long_log_reads_it_once(checks):
    task = long_task()
    client = viewer()
    first = chain_line(client.post(f"/tasks/{task.pk}/", {"verify": "1"}).content)
    assert f"Hash chain verifies ({ROWS} entries)" in first and "checked" not in first
    again = chain_line(client.post(f"/tasks/{task.pk}/events/", {"verify": "1"}).content)
    assert f"Hash chain verified ({ROWS} entries; checked" in again
    assert "no entry was added since" in again and 'value="again"' in again
    # Without asking, a long log's page shows the remembered outcome while it holds.
    plain = chain_line(client.get(f"/tasks/{task.pk}/").content)
    assert f"Hash chain verified ({ROWS} entries; checked" in plain
    assert checks == [task.pk]

    # The log grew: the remembered outcome no longer speaks for it.
    bulk_extra = TaskEvent.objects.filter(task=task, seq=ROWS).get()
    RemoteTask.objects.filter(pk=task.pk).update(last_seq=ROWS + 1, last_hash="f" * 64)
    TaskEvent.objects.create(
        task=task, seq=ROWS + 1, received_at=bulk_extra.received_at, channel="stream",
        kind="statusUpdate", raw={}, hash="f" * 64,
    )  # fmt: skip
    assert "too large to check on every load" in chain_line(
        client.get(f"/tasks/{task.pk}/").content
    )
    broken = chain_line(client.post(f"/tasks/{task.pk}/", {"verify": "1"}).content)
    assert f"Hash chain broken at seq {ROWS + 1}" in broken
    assert checks == [task.pk, task.pk]


def test_a_broken_long_log_is_reported_broken_when_remembered_too(checks):
    task = long_task()
    TaskEvent.objects.filter(task=task, seq=7).update(note="edited")
    client = viewer()
    for _ in range(3):
        line = chain_line(client.post(f"/tasks/{task.pk}/", {"verify": "1"}).content)
        assert "Hash chain broken at seq 7" in line and "chain-broken" in line
    assert "Checked" in line
    assert checks == [task.pk]


def test_check_again_sees_an_earlier_entry_changed_after_a_remembered_check(checks, settings):
    """An outcome is remembered by the log's head, which an edit of an earlier row does not
    move: the page went on saying the chain verifies, for an hour, and "verify now" gave
    the same remembered outcome. It says when it was checked, and "check again" checks."""
    task = long_task()
    client = viewer()
    assert "Hash chain verifies" in chain_line(
        client.post(f"/tasks/{task.pk}/", {"verify": "1"}).content
    )
    TaskEvent.objects.filter(task=task, seq=5).update(note="edited after the check")
    remembered = chain_line(client.post(f"/tasks/{task.pk}/", {"verify": "1"}).content)
    assert "Hash chain verified" in remembered and "shows only in a new check" in remembered
    assert checks == [task.pk]
    for page in (f"/tasks/{task.pk}/", f"/tasks/{task.pk}/events/"):
        again = chain_line(client.post(page, {"verify": "again"}).content)
        assert "Hash chain broken at seq 5" in again, page
    assert checks == [task.pk, task.pk, task.pk]
    # A fresh check counts against the person's hour like any other.
    settings.CHAIN_VERIFY_PER_PERSON_PER_HOUR = 3
    refused = chain_line(client.post(f"/tasks/{task.pk}/", {"verify": "again"}).content)
    assert "this hour" in refused and len(checks) == 3


def test_one_check_of_a_task_and_one_of_a_person_run_at_once(checks, monkeypatch):
    """While a check runs, another asker for that task, or the same person for another
    task, is told so and starts nothing."""
    task, other = long_task("t1"), long_task("t2")
    asker = member(User.objects.create_user("asker"), Membership.Role.VIEWER)
    someone = member(User.objects.create_user("someone"), Membership.Role.VIEWER)
    meanwhile: list[audit.Verification] = []
    real = audit.verify

    def slow_check(target):
        if not meanwhile:
            meanwhile.append(audit.verify_on_request(task, someone.pk))
            meanwhile.append(audit.verify_on_request(other, asker.pk))
        return real(target)

    monkeypatch.setattr(audit, "verify", slow_check)
    outcome = audit.verify_on_request(task, asker.pk)
    assert outcome.ok and outcome.rows == ROWS
    busy_task, busy_person = meanwhile
    assert not busy_task.ok and "a check of this log is running now" in busy_task.not_checked
    assert not busy_person.ok and "one runs at a time per person" in busy_person.not_checked
    # Once it ended, the person may check the other task; the first is remembered.
    assert audit.verify_on_request(other, asker.pk).ok
    assert audit.verify_on_request(task, someone.pk).checked_at is not None

    page = viewer("third")
    line = chain_line(page.post(f"/tasks/{task.pk}/", {"verify": "1"}).content)
    assert "checked" in line


def test_a_person_starts_a_bounded_number_of_checks_an_hour(checks, settings):
    settings.CHAIN_VERIFY_PER_PERSON_PER_HOUR = 2
    tasks = [long_task(f"t{n}") for n in range(3)]
    client = viewer()
    lines = [chain_line(client.post(f"/tasks/{t.pk}/", {"verify": "1"}).content) for t in tasks]
    assert all("Hash chain verifies" in line for line in lines[:2])
    assert "not checked now" in lines[2] and "2 checks of long logs this hour" in lines[2]
    assert "chain-broken" not in lines[2] and "chain-ok" not in lines[2]
    assert checks == [tasks[0].pk, tasks[1].pk]
    # What was checked stays free to see; someone else still has their own allowance.
    assert "checked" in chain_line(client.post(f"/tasks/{tasks[0].pk}/", {"verify": "1"}).content)
    other = chain_line(viewer("other").post(f"/tasks/{tasks[2].pk}/", {"verify": "1"}).content)
    assert "Hash chain verifies" in other
    assert checks == [tasks[0].pk, tasks[1].pk, tasks[2].pk]


def test_only_a_posted_form_checks_a_long_log(checks):
    """ "verify now" was a link, a GET: any other site's page could make a reader's browser
    ask for checks (each reads the whole log) and spend the reader's hour of them. A GET
    now only shows the page; the check is a form's POST, refused without its CSRF token."""
    task = long_task()
    client = viewer()
    for page in (f"/tasks/{task.pk}/", f"/tasks/{task.pk}/events/"):
        for asked in ("1", "again"):
            line = chain_line(client.get(page, {"verify": asked}).content)
            assert "too large to check on every load" in line and 'name="verify"' in line
    assert checks == []
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(User.objects.get(username="viewer"))
    assert strict.post(f"/tasks/{task.pk}/", {"verify": "1"}).status_code == 403
    assert checks == []


def test_without_redis_the_page_says_the_check_was_not_run(checks, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    task = long_task()
    response = viewer().post(f"/tasks/{task.pk}/", {"verify": "1"})
    assert response.status_code == 200
    line = chain_line(response.content)
    assert "not checked now" in line and "unreachable" in line
    assert checks == []


def test_the_page_of_a_huge_entry_shows_its_beginning_without_reading_it_whole():
    """An 8 MB entry made an 8 MB page (56 MB of the web process), for any reader, each time;
    its page shows the first characters now, cut by the database, and links to the whole."""
    from tasks_app import views
    from tasks_app.services.record import record

    agent = Agent.objects.get_or_create(name="a", base_url="http://127.0.0.1:1/")[0]
    task = RemoteTask.objects.create(agent=agent, title="big", remote_id="t-1", context_id="c")
    # 1 MB of a status message without an id: no conversation row holds it, so the log row
    # keeps it whole (a message with one is stored once, in the conversation).
    words = "word " * 200_000
    status = {"state": "TASK_STATE_WORKING",
              "message": {"role": "ROLE_AGENT", "parts": [{"text": words}]}}  # fmt: skip
    record(task, {"statusUpdate": {"taskId": "t-1", "contextId": "c", "status": status}}, "stream")
    record(task, {"statusUpdate": {"taskId": "t-1", "contextId": "c",
                                   "status": {"state": "TASK_STATE_COMPLETED"}}}, "stream")  # fmt: skip
    reader = viewer()
    big = reader.get(f"/tasks/{task.pk}/events/1/")
    assert big.status_code == 200
    assert len(big.content) < views.EVENT_PAGE_JSON_CHARS + 50_000
    assert b'id="raw-cut"' in big.content and b"the whole entry as JSON" in big.content
    whole = reader.get(f"/tasks/{task.pk}/events/1/?format=json")
    assert whole.json()["raw"]["statusUpdate"]["status"]["message"]["parts"][0]["text"] == words
    small = reader.get(f"/tasks/{task.pk}/events/2/").content.decode()
    assert 'id="raw-cut"' not in small
    assert "&quot;state&quot;: &quot;TASK_STATE_COMPLETED&quot;" in small  # indented, whole


def test_a_reader_reloading_a_push_task_asks_the_agent_for_its_configs_once_in_a_while(settings):
    """Each view of a push-followed task's page listed its configs at the agent, with our
    credentials for it: a reader reloading the page made the agent's list call each time.
    The list is remembered for ``LISTING_REMEMBERED_SECONDS``, per task and per state of our
    own configs (a config we register shows at once); without Redis the agent is asked."""
    from django.utils import timezone

    from tasks_app.models import PushConfig
    from tasks_app.services import push
    from tests.serving import json_rpc_peer

    asked: list[str] = []

    def answer(request: dict) -> dict:
        asked.append(request.get("method", ""))
        return {"configs": [{"id": "theirs", "taskId": "t-1", "url": "https://h.test/x"}]}

    with json_rpc_peer(answer) as url:
        agent = Agent.objects.create(
            name="p", base_url=url, interface_url=f"{url}/jsonrpc", binding="JSONRPC",
            protocol_version="1.0", push=True,
        )  # fmt: skip
        task = RemoteTask.objects.create(
            agent=agent, title="p", remote_id="t-1", context_id="c", watch=RemoteTask.Watch.PUSH
        )
        reader = viewer()
        pages = [reader.get(f"/tasks/{task.pk}/push/").content.decode() for _ in range(3)]
        assert len(asked) == 1 and all("theirs" in page for page in pages)
        assert "The agent's list as of" in pages[2]
        PushConfig.objects.create(task=task, config_id="ours-1", registered_at=timezone.now())
        reader.get(f"/tasks/{task.pk}/push/")
        assert len(asked) == 2  # our own config changed: asked again at once
        shared_redis.client(settings.REDIS_URL).delete(
            *shared_redis.client(settings.REDIS_URL).keys(f"push-listing:{task.pk}:*")
        )  # what LISTING_REMEMBERED_SECONDS does
        reader.get(f"/tasks/{task.pk}/push/")
        assert len(asked) == 3
        push.delete_config(task, "theirs")  # the agent's own: none of ours changes
        reader.get(f"/tasks/{task.pk}/push/")
        assert asked[-2:] == ["DeleteTaskPushNotificationConfig", "ListTaskPushNotificationConfigs"]
        asked.remove("DeleteTaskPushNotificationConfig")
        settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
        for _ in range(2):
            assert "theirs" in reader.get(f"/tasks/{task.pk}/push/").content.decode()
        assert len(asked) == 6
    assert set(asked) == {"ListTaskPushNotificationConfigs"}
    assert push.LISTING_REMEMBERED_SECONDS == 30
