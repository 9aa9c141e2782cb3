"""Views through Django's test client: permissions, forms with bad input, sanitizing,
downloads, pagination. Views call services; here services that would talk to a
worker are stubbed where noted (the browser tests run the real thing)."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from html.parser import HTMLParser

import pytest
from django.urls import reverse
from django.utils import timezone

from tasks_app.demo_agent import MARKDOWN_SAMPLE
from tasks_app.models import Agent, OperatorAction, RemoteTask, TaskEvent
from tasks_app.services import tasks as task_services
from tasks_app.services.record import record
from tests.people import member

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _no_dispatch(no_dispatch: list[int]) -> list[int]:
    """No watcher messages into the shared broker from these tests."""
    return no_dispatch


@pytest.fixture
def user(django_user_model):
    return member(django_user_model.objects.create_user(username="op", password="pw-12345678"))


@pytest.fixture
def client_in(client, user):
    client.force_login(user)
    return client


@pytest.fixture
def demo_agent_row(db) -> Agent:
    return Agent.objects.create(
        name="Demo <b>agent</b>",
        base_url="http://127.0.0.1:9/",
        interface_url="http://127.0.0.1:9/jsonrpc",
        binding="JSONRPC",
        streaming=True,
        card={
            "name": "Demo <script>alert(1)</script>",
            "description": "Does <i>things</i>",
            "capabilities": {"streaming": True, "pushNotifications": False},
            "skills": [{"id": "echo", "name": "Echo", "description": "echoes", "tags": ["t"]}],
            "supportedInterfaces": [
                {
                    "url": "http://127.0.0.1:9/jsonrpc",
                    "protocolBinding": "JSONRPC",
                    "protocolVersion": "1.0",
                }
            ],
            "securitySchemes": {"bearer": {"httpAuthSecurityScheme": {"scheme": "Bearer"}}},
        },
    )


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def assert_safe_html(html: str) -> None:
    """No script but our own static files, no event handlers, no javascript: URLs."""
    parser = _Tags()
    parser.feed(html)
    for tag, attrs in parser.tags:
        if tag == "script":
            assert (attrs.get("src") or "").startswith("/static/"), attrs
        assert tag not in ("iframe", "object", "embed", "img", "style"), tag
        for name, value in attrs.items():
            assert not name.startswith("on"), (tag, name)
            if name in ("href", "src", "action", "formaction"):
                assert not (value or "").strip().lower().startswith(("javascript:", "data:")), (
                    tag,
                    value,
                )
        if tag == "a" and (attrs.get("href") or "").startswith("http"):
            assert attrs.get("rel") == "noopener noreferrer", attrs


def artifact_chunk(
    task_id: str, parts: list, *, aid: str, name: str, append=False, last=True
) -> dict:
    return {
        "artifactUpdate": {
            "taskId": task_id,
            "contextId": "c-1",
            "artifact": {"artifactId": aid, "name": name, "parts": parts},
            "append": append,
            "lastChunk": last,
        }
    }


@pytest.fixture
def rich_task(demo_agent_row) -> RemoteTask:
    """A task with markdown, data and file artifacts, in its log through record()."""
    task = RemoteTask.objects.create(agent=demo_agent_row, title="rich <script>x</script>")
    tid = "t-rich"
    record(
        task,
        {"task": {"id": tid, "contextId": "c-1", "status": {"state": "TASK_STATE_WORKING"}}},
        "stream",
    )
    record(
        task,
        artifact_chunk(
            tid,
            [{"text": MARKDOWN_SAMPLE, "mediaType": "text/markdown"}],
            aid="md",
            name="report.md",
        ),
        "stream",
    )
    record(
        task,
        artifact_chunk(
            tid, [{"data": {"answer": 42, "html": "<b>x</b>"}}], aid="data", name="data.json"
        ),
        "stream",
    )
    record(
        task,
        artifact_chunk(
            tid,
            [{"raw": base64.b64encode(b"<html><script>alert(1)</script></html>").decode(),
              "filename": '../../evil "name".html', "mediaType": "text/html"}],
            aid="file", name="evil.html",
        ),
        "stream",
    )  # fmt: skip
    record(
        task,
        artifact_chunk(
            tid,
            [{"url": "javascript:alert(1)"}, {"url": "https://example.org/f.pdf"}],
            aid="links",
            name="links",
        ),
        "stream",
    )
    record(
        task,
        {"statusUpdate": {"taskId": tid, "contextId": "c-1", "status": {
            "state": "TASK_STATE_INPUT_REQUIRED",
            "message": {"messageId": "q1", "role": "ROLE_AGENT", "parts": [{"text": "Your **name**? <script>bad()</script>"}]},
        }}},
        "stream",
    )  # fmt: skip
    task.refresh_from_db()
    return task


# Permissions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,args",
    [
        ("overview", []),
        ("agent-list", []),
        ("agent-add", []),
        ("agent-detail", [1]),
        ("task-list", []),
        ("task-new", []),
        ("task-detail", [1]),
        ("task-live", [1]),
        ("task-row", [1]),
        ("task-events", [1]),
        ("event-detail", [1, 1]),
        ("artifact-download", [1, 1, 0]),
        ("message-download", [1, 1, 0]),
    ],
)
def test_anonymous_is_sent_to_login(client, name, args):
    url = reverse(name, args=args)
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/?next=")


@pytest.mark.parametrize(
    "name,args",
    [("task-cancel", [1]), ("task-refresh", [1]), ("task-retry", [1]), ("task-answer", [1]),
     ("agent-credentials", [1]), ("agent-refresh", [1]), ("agent-import", [1])],
)  # fmt: skip
def test_anonymous_posts_are_sent_to_login(client, name, args):
    response = client.post(reverse(name, args=args))
    assert response.status_code == 302
    assert "/accounts/login/" in response["Location"]


def test_login_page_and_login(client, user):
    page = client.get("/accounts/login/")
    assert page.status_code == 200
    assert b'name="username"' in page.content
    response = client.post("/accounts/login/", {"username": "op", "password": "pw-12345678"})
    assert response.status_code == 302
    assert client.get("/").status_code == 200


def test_bad_login_keeps_username(client, user):
    response = client.post("/accounts/login/", {"username": "op", "password": "wrong"})
    assert response.status_code == 200
    assert b'value="op"' in response.content


# Overview and lists --------------------------------------------------------------------------


def test_overview_counts(client_in, demo_agent_row):
    for state in ["TASK_STATE_WORKING", "TASK_STATE_INPUT_REQUIRED", "TASK_STATE_INPUT_REQUIRED"]:
        RemoteTask.objects.create(agent=demo_agent_row, state=state, watcher_status="streaming")
    # An abandoned question: in the table's counts, not in "need input" (nobody can answer it).
    RemoteTask.objects.create(
        agent=demo_agent_row, state="TASK_STATE_INPUT_REQUIRED", abandoned_at=timezone.now()
    )
    page = client_in.get("/")
    html = page.content.decode()
    assert page.status_code == 200
    assert re.search(r'href="/inbox/" id="needs-input">\s*<span class="num">2<', html)
    assert "<b>3</b> streaming" in html
    assert "Demo &lt;b&gt;agent&lt;/b&gt;" in html
    fragment = client_in.get("/?fragment=1")
    assert b"<html" not in fragment.content and b"needs-input" in fragment.content


def test_task_list_filters_and_keyset_pages(
    client_in, demo_agent_row, django_assert_max_num_queries
):
    other = Agent.objects.create(name="other", base_url="http://127.0.0.1:8/")
    base = timezone.now()
    for i in range(120):
        RemoteTask.objects.create(
            agent=demo_agent_row if i % 2 else other,
            title=f"job {i}",
            remote_id=f"r-{i}",
            context_id="ctx-a" if i < 10 else "ctx-b",
            state="TASK_STATE_COMPLETED" if i % 3 else "TASK_STATE_WORKING",
            updated_at=base - timedelta(seconds=i),
        )
    with django_assert_max_num_queries(10):
        page = client_in.get("/tasks/")
    html = page.content.decode()
    assert "120 tasks match" in html
    assert html.count('class="badge') == 50
    titles = re.findall(r">job (\d+)<", html)
    assert titles[:3] == ["0", "1", "2"]
    next_url = (
        re.search(r'href="(\?[^"]*cursor=[^"]+)" id="next-page"', html)
        .group(1)
        .replace("&amp;", "&")
    )
    page2 = client_in.get("/tasks/" + next_url).content.decode()
    assert re.findall(r">job (\d+)<", page2)[:2] == ["50", "51"]
    next2 = (
        re.search(r'href="(\?[^"]*cursor=[^"]+)" id="next-page"', page2)
        .group(1)
        .replace("&amp;", "&")
    )
    page3 = client_in.get("/tasks/" + next2).content.decode()
    rows3 = re.findall(r">job (\d+)<", page3)
    assert rows3[0] == "100" and rows3[-1] == "119" and 'id="next-page"' not in page3

    filtered = client_in.get(
        f"/tasks/?agent={demo_agent_row.pk}&state=TASK_STATE_WORKING&sort=created"
    ).content.decode()
    numbers = [int(n) for n in re.findall(r">job (\d+)<", filtered)]
    assert numbers and all(n % 2 == 1 and n % 3 == 0 for n in numbers)
    assert numbers == sorted(numbers)  # oldest first

    just_one = client_in.get("/tasks/?q=job 119").content.decode()
    assert "1 task matches<" in just_one and "1 task match<" not in just_one

    by_context = client_in.get("/tasks/?context=ctx-a").content.decode()
    assert sorted(int(n) for n in re.findall(r">job (\d+)<", by_context)) == list(range(10))
    by_text = client_in.get("/tasks/?q=job 11").content.decode()
    assert sorted(re.findall(r">job (\d+)<", by_text)) == [
        "11",
        "110",
        "111",
        "112",
        "113",
        "114",
        "115",
        "116",
        "117",
        "118",
        "119",
    ]
    by_remote = client_in.get("/tasks/?q=r-7").content.decode()
    assert "job 7<" in by_remote
    # A page link cut short: 400, no rows (they would pass for page 2), a link to page 1
    # that keeps the filters.
    cut = client_in.get("/tasks/" + next_url[:-6])
    cut_html = cut.content.decode()
    assert cut.status_code == 400 and 'id="task-bad-cursor"' in cut_html
    assert not re.findall(r">job (\d+)<", cut_html)
    assert "No tasks listed: the page link is broken." in cut_html and ".." not in cut_html
    assert 'href="/tasks/?">start again from the first page' in cut_html
    filtered_cut = client_in.get(f"/tasks/?context=ctx-b&cursor={next_url[8:-6]}")
    assert filtered_cut.status_code == 400
    assert 'href="/tasks/?context=ctx-b">start again' in filtered_cut.content.decode()
    bad = client_in.get("/tasks/?state=nonsense&cursor=%%%")
    assert bad.status_code == 400  # the filter cannot be applied, as on the audit page
    assert 'id="task-bad-filter"' in bad.content.decode()
    assert "No tasks listed: a filter is not valid." in bad.content.decode()
    assert "valid.." not in bad.content.decode()


def test_the_new_task_page_is_found_with_a_slash_too(client_in, demo_agent_row):
    """Every other page's address ends with a slash; /tasks/new/ was a 404."""
    answer = client_in.get(f"/tasks/new/?agent={demo_agent_row.pk}")
    assert (
        answer.status_code == 302 and answer["Location"] == f"/tasks/new?agent={demo_agent_row.pk}"
    )
    assert 'id="task-new-form"' in client_in.get(answer["Location"]).content.decode()


def test_task_list_count_is_bounded(client_in, demo_agent_row, monkeypatch):
    import tasks_app.views as views

    monkeypatch.setattr(views, "COUNT_LIMIT", 5)
    for i in range(8):
        RemoteTask.objects.create(agent=demo_agent_row, title=f"t{i}")
    assert "More than 5 tasks match" in client_in.get("/tasks/").content.decode()


# Agents --------------------------------------------------------------------------------------


def test_add_agent_rejects_a_bad_url_and_keeps_it(client_in):
    response = client_in.post(
        "/agents/add/", {"url": "not a url", "name": "mine", "action": "preview"}
    )
    html = response.content.decode()
    assert response.status_code == 200
    assert 'id="id_url_error"' in html
    assert 'value="not a url"' in html and 'value="mine"' in html


def test_add_agent_unreachable_shows_the_reason(client_in):
    response = client_in.post("/agents/add/", {"url": "http://127.0.0.1:9/", "action": "preview"})
    html = response.content.decode()
    assert "Could not read an agent card" in html
    assert 'value="http://127.0.0.1:9/"' in html
    assert not Agent.objects.exists()


def test_add_agent_preview_then_save(client_in, agent):
    preview = client_in.post("/agents/add/", {"url": agent.base_url, "action": "preview"})
    html = preview.content.decode()
    assert 'id="card-preview"' in html and "The card is valid." in html
    assert 'value="save"' in html
    assert not Agent.objects.exists()  # a preview saves nothing
    saved = client_in.post("/agents/add/", {"url": agent.base_url, "action": "save"})
    row = Agent.objects.get()
    assert saved.status_code == 302 and saved["Location"] == f"/agents/{row.pk}/"
    assert OperatorAction.objects.filter(action="add-agent", agent=row).exists()
    detail = client_in.get(saved["Location"]).content.decode()
    assert row.name in detail and "Skills" in detail


def test_add_agent_preview_lists_card_problems(client_in, bad_server):
    response = client_in.post(
        "/agents/add/", {"url": bad_server.url_for("card03"), "action": "preview"}
    )
    html = response.content.decode()
    # The card was read (a 0.3 card): its preview lists what is wrong with it.
    assert "Could not read" not in html
    assert "<h2>Card preview: Old Agent</h2>" in html
    problems = re.search(
        r'<div class="problems" role="alert">\s*<h3>Problems found</h3>\s*<ul>(.*?)</ul>',
        html,
        re.S,
    )
    assert problems, "no list of problems in the preview"
    items = re.findall(r"<li>(.*?)</li>", problems.group(1))
    assert (
        "agent speaks A2A 0.3 (top-level url/preferredTransport, no supportedInterfaces); "
        "0.3 is not supported yet"
    ) in items
    assert "No interface this dashboard speaks: the agent cannot be saved." in html
    assert 'value="save"' not in html


def test_agent_page_escapes_card_text(client_in, demo_agent_row):
    html = client_in.get(f"/agents/{demo_agent_row.pk}/").content.decode()
    assert "<script>alert(1)" not in html
    assert "Demo &lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "httpAuthSecurityScheme" in html
    assert 'id="credentials-status" class="muted">not set<' in html


def test_credentials_are_never_shown_back(client_in, demo_agent_row):
    missing = client_in.post(
        f"/agents/{demo_agent_row.pk}/credentials/", {"kind": "bearer", "token": ""}
    )
    assert missing.status_code == 400
    assert 'id="id_token_error"' in missing.content.decode()
    secret = "s3cr3t-token-value"
    done = client_in.post(
        f"/agents/{demo_agent_row.pk}/credentials/", {"kind": "bearer", "token": secret}
    )
    assert done.status_code == 302
    demo_agent_row.refresh_from_db()
    assert (
        demo_agent_row.credentials_encrypted and secret not in demo_agent_row.credentials_encrypted
    )
    html = client_in.get(f"/agents/{demo_agent_row.pk}/").content.decode()
    assert secret not in html
    assert ">set<" in html
    api = client_in.post(
        f"/agents/{demo_agent_row.pk}/credentials/",
        {"kind": "api-key", "api_key": "k-123", "api_key_location": "query"},
    )
    assert api.status_code == 302
    assert "k-123" not in client_in.get(f"/agents/{demo_agent_row.pk}/").content.decode()


# Starting a task -----------------------------------------------------------------------------


def test_new_task_bad_json_keeps_everything(
    client_in, demo_agent_row, no_dispatch, django_capture_on_commit_callbacks
):
    upload = __import__(
        "django.core.files.uploadedfile", fromlist=["SimpleUploadedFile"]
    ).SimpleUploadedFile("notes.txt", b"hello file", content_type="text/plain")
    response = client_in.post(
        "/tasks/new",
        {
            "agent": demo_agent_row.pk,
            "text": "my long message",
            "data": '{"a": 1,',
            "mode": "auto",
            "file": upload,
        },
    )
    html = response.content.decode()
    assert response.status_code == 400
    assert 'id="id_data_error"' in html and "Not valid JSON" in html
    assert "my long message" in html and "{&quot;a&quot;: 1," in html
    assert "Kept from before: <b>notes.txt</b>" in html
    kept = re.search(r'name="kept_file" value="([^"]+)"', html).group(1)
    assert "hello file" not in html and len(kept) < 100  # a token: the file waits in Redis
    assert not RemoteTask.objects.exists()
    # Fix the JSON: the kept file goes with the message.
    with django_capture_on_commit_callbacks(execute=True):
        fixed = client_in.post(
            "/tasks/new",
            {"agent": demo_agent_row.pk, "text": "my long message", "data": '{"a": 1}', "mode": "auto",
             "kept_file": kept, "kept_file_name": "notes.txt"},
        )  # fmt: skip
    task = RemoteTask.objects.get()
    assert fixed.status_code == 302 and fixed["Location"] == f"/tasks/{task.pk}/"
    parts = task.request["message"]["parts"]
    assert parts[0] == {"text": "my long message"}
    assert parts[1]["data"] == {"a": 1}
    assert (
        parts[2]["filename"] == "notes.txt" and base64.b64decode(parts[2]["raw"]) == b"hello file"
    )
    assert task.mode == "stream" and task.started_by_id is not None
    assert no_dispatch == [task.pk]


def test_new_task_needs_some_content(client_in, demo_agent_row):
    response = client_in.post(
        "/tasks/new", {"agent": demo_agent_row.pk, "text": "  ", "mode": "auto"}
    )
    assert response.status_code == 400
    assert 'id="id_text_error"' in response.content.decode()


def test_new_task_stream_mode_on_a_non_streaming_agent(client_in, demo_agent_row):
    Agent.objects.filter(pk=demo_agent_row.pk).update(streaming=False)
    response = client_in.post(
        "/tasks/new", {"agent": demo_agent_row.pk, "text": "hi", "mode": "stream"}
    )
    html = response.content.decode()
    assert response.status_code == 400
    assert 'id="id_mode_error"' in html and "does not declare streaming" in html
    assert "hi</textarea>" in html


def test_new_task_shows_skills_of_the_card(client_in, demo_agent_row):
    html = client_in.get(f"/tasks/new?agent={demo_agent_row.pk}").content.decode()
    assert f'data-agent="{demo_agent_row.pk}"' in html and ">Echo<" in html


# Task page: sanitizing, downloads, actions ---------------------------------------------------


def test_task_page_sanitizes_agent_content(client_in, rich_task):
    response = client_in.get(f"/tasks/{rich_task.pk}/")
    html = response.content.decode()
    assert response.status_code == 200
    # Nothing from the agent becomes a script or a javascript: link.
    assert_safe_html(html)
    assert "<p>&lt;script&gt;alert('xss')&lt;/script&gt;</p>" in html  # shown as text, not run
    assert (
        '<a href="https://example.org/" target="_blank" rel="noopener noreferrer">safe link</a>'
        in html
    )
    assert '<a href="https://example.org/f.pdf" rel="noopener noreferrer" target="_blank">' in html
    assert "Link not shown (not http/https)" in html
    assert "<strong>name</strong>" in html  # the question, as markdown
    assert "&quot;answer&quot;: 42" in html  # pretty JSON data part
    assert 'id="answer-form"' in html  # INPUT_REQUIRED: answer form
    # One block per artifact.
    assert html.count('class="artifact"') == 4
    # The log and its raw JSON, escaped.
    assert html.count('<tr data-seq="') == rich_task.last_seq
    # The raw JSON keeps the agent's text, escaped (quotes too): the markdown artifact...
    assert (
        "&quot;text&quot;: &quot;# Demo report\\n\\nSome **bold** text and a [safe link]"
        "(https://example.org/).\\n\\n&lt;script&gt;alert(&#x27;xss&#x27;)&lt;/script&gt;\\n"
    ) in html
    # ... and the question of the status update.
    assert "&quot;text&quot;: &quot;Your **name**? &lt;script&gt;bad()&lt;/script&gt;&quot;" in html


def test_live_fragments_are_sanitized(client_in, rich_task):
    data = client_in.get(f"/tasks/{rich_task.pk}/live/?artifact=md").json()
    assert data["summary"]["state"] == "TASK_STATE_INPUT_REQUIRED"
    assert [a["artifact_id"] for a in data["artifacts"]] == ["md"]
    for html in [*data["html"].values(), *(a["html"] for a in data["artifacts"])]:
        assert_safe_html(html)
    assert "<svg" in data["html"]["timeline"]
    every = client_in.get(f"/tasks/{rich_task.pk}/live/?all_artifacts=1").json()
    assert len(every["artifacts"]) == 4


def test_file_part_download_is_an_attachment(client_in, rich_task):
    html = client_in.get(f"/tasks/{rich_task.pk}/").content.decode()
    href = re.search(r'<a class="download" href="([^"]+)"', html).group(1)
    response = client_in.get(href)
    assert response.status_code == 200
    assert (
        response["Content-Type"] == "application/octet-stream"
    )  # text/html is never served as such
    assert response["Content-Disposition"] == 'attachment; filename="evil name.html"'
    assert response["X-Content-Type-Options"] == "nosniff"
    assert "sandbox" in response["Content-Security-Policy"]
    assert response.content == b"<html><script>alert(1)</script></html>"
    assert client_in.get(href.replace("/parts/0/", "/parts/9/")).status_code == 404


def test_safe_media_types_are_kept_for_downloads(client_in, demo_agent_row):
    task = RemoteTask.objects.create(agent=demo_agent_row, title="f")
    record(task, {"task": {"id": "t-f", "status": {"state": "TASK_STATE_WORKING"}}}, "stream")
    record(
        task,
        artifact_chunk(
            "t-f",
            [
                {
                    "raw": base64.b64encode(b"hi\n").decode(),
                    "filename": "hello.txt",
                    "mediaType": "text/plain",
                }
            ],
            aid="f",
            name="f",
        ),
        "stream",
    )
    artifact = task.artifacts.get()
    response = client_in.get(reverse("artifact-download", args=[task.pk, artifact.pk, 0]))
    assert response["Content-Type"] == "text/plain"
    assert response["Content-Disposition"] == 'attachment; filename="hello.txt"'


def test_message_file_download(client_in, demo_agent_row):
    task = RemoteTask.objects.create(agent=demo_agent_row, title="m")
    msg = {
        "messageId": "u1",
        "role": "ROLE_USER",
        "parts": [{"text": "x"}, {"raw": base64.b64encode(b"abc").decode(), "filename": "a.bin"}],
    }
    record(task, {"operator": {"action": "start", "message": msg}}, "operator")
    message = task.messages.get()
    response = client_in.get(reverse("message-download", args=[task.pk, message.pk, 1]))
    assert (
        response.content == b"abc"
        and response["Content-Disposition"] == 'attachment; filename="a.bin"'
    )
    # A text part is a download too (a message too big for the page offers its parts so).
    text = client_in.get(reverse("message-download", args=[task.pk, message.pk, 0]))
    assert text.content == b"x" and text["Content-Type"] == "text/plain; charset=utf-8"
    assert text["Content-Disposition"] == f'attachment; filename="message-{message.pk}-0.txt"'
    assert (
        client_in.get(reverse("message-download", args=[task.pk, message.pk, 2])).status_code == 404
    )


def test_event_detail_escapes_raw_json(client_in, rich_task):
    seq = TaskEvent.objects.get(
        task=rich_task, kind="artifactUpdate", raw__artifactUpdate__artifact__artifactId="md"
    ).seq
    html = client_in.get(f"/tasks/{rich_task.pk}/events/{seq}/").content.decode()
    assert "<script>alert" not in html and "&lt;script&gt;alert" in html
    as_json = client_in.get(f"/tasks/{rich_task.pk}/events/{seq}/?format=json").json()
    assert as_json["raw"]["artifactUpdate"]["artifact"]["artifactId"] == "md"


def test_every_time_shown_says_its_zone(client_in, rich_task):
    """Bare times such as "10:30:43" on the task page and the list read as a browser's local
    time; the event log and the audit page said "UTC", these did not."""
    pages = [client_in.get(url).content.decode() for url in ("/tasks/", f"/tasks/{rich_task.pk}/")]
    for html in pages:
        shown = re.findall(r"<time [^>]*>([^<]*)</time>", html)
        clock = [text for text in shown if re.search(r"\d\d:\d\d:\d\d", text)]
        assert clock and all(text.endswith(" UTC") for text in clock), clock
    timeline = re.findall(r"<title>[^<]*\d\d:\d\d:\d\d[^<]*</title>", pages[1])
    assert timeline and all(" UTC<" in title for title in timeline), timeline[:3]


def test_full_log_pages(client_in, rich_task, monkeypatch):
    import tasks_app.views as views

    monkeypatch.setattr(views, "EVENTS_ON_PAGE", 2)
    first = client_in.get(f"/tasks/{rich_task.pk}/events/").content.decode()
    assert re.findall(r'<tr data-seq="(\d+)"', first) == ["1", "2"]
    second = client_in.get(f"/tasks/{rich_task.pk}/events/?after=2").content.decode()
    assert re.findall(r'<tr data-seq="(\d+)"', second) == ["3", "4"]
    # A way back as well as forward (a page past the first had only "Later entries").
    assert 'id="earlier-entries"' not in first
    assert re.search(r'href="\?" id="earlier-entries"', second)
    third = client_in.get(f"/tasks/{rich_task.pk}/events/?after=4").content.decode()
    assert re.search(r'href="\?after=2" id="earlier-entries"', third)  # the page of 3 and 4
    kinds = client_in.get(f"/tasks/{rich_task.pk}/events/?after=4&kind=artifactUpdate")
    back = re.search(r'href="([^"]*)" id="earlier-entries"', kinds.content.decode())
    assert back and "kind=artifactUpdate" in back.group(1)  # the filter is kept


def test_cancel_error_is_shown_plainly(client_in, rich_task, monkeypatch):
    def refuse(task, *, reason="", actor_id=None):
        assert reason == "not needed"
        raise task_services.TaskActionError(
            "The agent will not cancel this task (-32002 TASK_NOT_CANCELABLE): Task cannot be canceled"
        )

    monkeypatch.setattr(task_services, "cancel_task", refuse)
    response = client_in.post(
        f"/tasks/{rich_task.pk}/cancel/", {"reason": "not needed"}, follow=True
    )
    html = response.content.decode()
    assert "The agent will not cancel this task (-32002 TASK_NOT_CANCELABLE)" in html
    assert 'class="flash-error"' in html


def test_a_stale_answer_form_says_who_answered_and_keeps_the_text(
    client_in, rich_task, no_dispatch, django_user_model
):
    """Two people saw the same question; the second one to send is told who won, and when."""
    first = member(django_user_model.objects.create_user("grace", password="pw-123456789"))
    question = rich_task.asked_seq
    assert question == rich_task.last_seq  # the input-required status asked it
    task_services.answer_task(rich_task, "Grace", actor_id=first.pk, question_seq=question)
    response = client_in.post(
        f"/tasks/{rich_task.pk}/answer/", {"text": "Ada Lovelace", "question": question}
    )
    html = response.content.decode()
    assert response.status_code == 400
    assert "Already answered by grace at " in html and "Ada Lovelace</textarea>" in html
    rich_task.refresh_from_db()
    assert rich_task.outbox["message"]["parts"] == [{"text": "Grace"}]


def test_answer_goes_through_the_service(
    client_in, rich_task, no_dispatch, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        response = client_in.post(
            f"/tasks/{rich_task.pk}/answer/", {"text": "Ada", "question": rich_task.asked_seq}
        )
    assert response.status_code == 302
    rich_task.refresh_from_db()
    assert rich_task.outbox["message"]["parts"] == [{"text": "Ada"}]
    assert no_dispatch == [rich_task.pk]


def test_retry_only_when_the_send_failed(
    client_in, demo_agent_row, no_dispatch, django_capture_on_commit_callbacks
):
    task = RemoteTask.objects.create(
        agent=demo_agent_row,
        title="r",
        phase="failed",
        send_error="boom",
        request={"message": {"messageId": "m1"}},
    )
    page = client_in.get(f"/tasks/{task.pk}/").content.decode()
    assert 'id="retry-button"' in page and "Send failed: boom" in page
    with django_capture_on_commit_callbacks(execute=True):
        response = client_in.post(f"/tasks/{task.pk}/retry/", follow=True)
    task.refresh_from_db()
    assert task.phase == "sending" and no_dispatch == [task.pk]
    again = client_in.post(f"/tasks/{task.pk}/retry/", follow=True).content.decode()
    assert "Only a send that failed" in again
    assert response.status_code == 200


def test_task_row_fragment(client_in, rich_task):
    html = client_in.get(f"/tasks/{rich_task.pk}/row/").content.decode()
    assert html.lstrip().startswith("<tr") and "rich &lt;script&gt;" in html


def test_admin_lists_the_mirror(client, django_user_model, rich_task):
    admin = django_user_model.objects.create_superuser("root", "r@example.org", "pw-12345678")
    client.force_login(admin)
    for model in (
        "agent",
        "remotetask",
        "taskevent",
        "artifact",
        "conversationmessage",
        "operatoraction",
    ):
        assert client.get(f"/admin/tasks_app/{model}/").status_code == 200
    assert (
        "credentials_encrypted"
        not in client.get(f"/admin/tasks_app/agent/{rich_task.agent_id}/change/").content.decode()
    )


def test_an_admin_edit_keeps_credentials_cleared_while_it_was_saved(
    client, django_user_model, rich_task, monkeypatch
):
    """The admin saved the whole row read at the start of its request: credentials an agent
    admin cleared meanwhile (a leaked token) came back with the new name."""
    from tasks_app.admin import AgentAdmin
    from tasks_app.crypto import encrypt_json
    from tasks_app.models import Agent
    from tasks_app.services import agents as agent_services

    pk = rich_task.agent_id
    Agent.objects.filter(pk=pk).update(
        credentials_encrypted=encrypt_json({"token": "leaked"}),
        credential_origins=["http://127.0.0.1:9"],
    )
    admin = django_user_model.objects.create_superuser("root", "r@example.org", "pw-12345678")
    client.force_login(admin)
    page = client.get(f"/admin/tasks_app/agent/{pk}/change/")
    form = page.context["adminform"].form
    posted: dict = {}
    for name, field in form.fields.items():  # the form as drawn, sent back
        value = form[name].value()
        if hasattr(field.widget, "widgets"):  # a date and a time
            parts = field.widget.decompress(value)
            posted.update({f"{name}_{i}": "" if p is None else str(p) for i, p in enumerate(parts)})
        elif value is not False:
            posted[name] = "" if value is None else value
    posted["name"] = "renamed"
    real_get_object = AgentAdmin.get_object

    def read_then_cleared(
        self, request, object_id, from_field=None
    ):  # the other writer, in the window
        agent = real_get_object(self, request, object_id, from_field)
        agent_services.set_credentials(Agent.objects.get(pk=pk), {})
        return agent

    monkeypatch.setattr(AgentAdmin, "get_object", read_then_cleared)
    answer = client.post(f"/admin/tasks_app/agent/{pk}/change/", posted)
    assert answer.status_code == 302, answer.context["adminform"].form.errors
    fresh = Agent.objects.get(pk=pk)
    assert fresh.name == "renamed"
    assert fresh.credentials_encrypted == "" and fresh.credential_origins == []


def test_the_admin_shows_retirement_and_does_not_edit_it(client, django_user_model, rich_task):
    """Retiring checks the agent's tasks and wipes its credentials: an admin form that set
    ``retired_at`` would skip both, and the action log."""
    admin = django_user_model.objects.create_superuser("root", "r@example.org", "pw-12345678")
    client.force_login(admin)
    page = client.get(f"/admin/tasks_app/agent/{rich_task.agent_id}/change/")
    assert {"retired_at", "retired_by"}.isdisjoint(page.context["adminform"].form.fields)
    assert "Retired at" in page.content.decode()  # shown, read-only
    listing = client.get("/admin/tasks_app/agent/?retired_at__isempty=1")
    from django.utils.html import escape

    assert listing.status_code == 200
    assert escape(rich_task.agent.name) in listing.content.decode()  # in service: "empty"
    retired = client.get("/admin/tasks_app/agent/?retired_at__isempty=0").content.decode()
    assert escape(rich_task.agent.name) not in retired


def test_the_admin_does_not_show_a_message_waiting_to_be_sent(client, django_user_model, rich_task):
    """The outbox holds the message as the agent gets it: a password typed into a form too."""
    from tasks_app.models import RemoteTask

    RemoteTask.objects.filter(pk=rich_task.pk).update(
        outbox={"message": {"parts": [{"text": "S3CRET-PIN"}]}}
    )
    admin = django_user_model.objects.create_superuser("root", "r@example.org", "pw-12345678")
    client.force_login(admin)
    page = client.get(f"/admin/tasks_app/remotetask/{rich_task.pk}/change/")
    assert page.status_code == 200 and "S3CRET-PIN" not in page.content.decode()


# Both backends take %s parameters here, so a literal % is written %%.
STATE_CASE = """CASE i %% 4 WHEN 0 THEN 'TASK_STATE_COMPLETED' WHEN 1 THEN 'TASK_STATE_WORKING'
                   WHEN 2 THEN 'TASK_STATE_FAILED' ELSE 'TASK_STATE_INPUT_REQUIRED' END"""
COLUMNS = """remote_id, context_id, title, phase, mode, state, metadata, request, send_error,
             watch, watcher_status, watcher_note, lease_token, lease_owner, last_seq,
             created_at, updated_at, agent_id"""
BULK_TASKS_SQL = {
    # 100,000 rows in one statement (Django's bulk_create would take half a minute).
    # SQLite compares the stored text, so it is written as Django writes the same moment (a
    # cursor's bound is compared with it): "...:05.250000". Django writes a whole second as
    # "...:05"; stored as "...:05.000000" it sorted after that bound, and the last row of a page
    # of an oldest-first list came back on the next page.
    "sqlite": f"""
        WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 99999)
        INSERT INTO tasks_app_remotetask ({COLUMNS})
        SELECT '', '', 'bulk ' || i, 'task', 'auto', {STATE_CASE},
            '{{}}', '{{}}', '', 'none', 'idle', '', '', '', 0,
            strftime('%%Y-%%m-%%d %%H:%%M:%%S', 'now', '-' || i || ' seconds') || '.250000',
            strftime('%%Y-%%m-%%d %%H:%%M:%%S', 'now', '-' || i || ' seconds') || '.250000',
            CASE i %% 2 WHEN 1 THEN %s ELSE %s END
        FROM n""",
    "postgresql": f"""
        INSERT INTO tasks_app_remotetask ({COLUMNS})
        SELECT '', '', 'bulk ' || i, 'task', 'auto', {STATE_CASE},
            '{{}}', '{{}}', '', 'none', 'idle', '', '', '', 0,
            now() - i * interval '1 second', now() - i * interval '1 second',
            CASE i %% 2 WHEN 1 THEN %s ELSE %s END
        FROM generate_series(0, 99999) AS i""",
}


@pytest.mark.slow
def test_task_list_pages_through_100k_tasks(client_in, demo_agent_row):
    """Keyset pages and a bounded count over a large table (speed itself: see the P5 benchmark)."""
    from django.db import connection

    other = Agent.objects.create(name="other", base_url="http://127.0.0.1:8/")
    with connection.cursor() as cursor:
        cursor.execute(BULK_TASKS_SQL[connection.vendor], [demo_agent_row.pk, other.pk])
    assert RemoteTask.objects.count() == 100_000
    # Task i ("bulk i"): state by i % 4 (STATE_CASE), the demo agent's when i is odd, updated
    # and created i seconds ago. So each list's order is known: the newest first (i up), or
    # with sort=created the oldest first (i down).
    states = ["TASK_STATE_COMPLETED", "TASK_STATE_WORKING", "TASK_STATE_FAILED",
              "TASK_STATE_INPUT_REQUIRED"]  # fmt: skip
    demo, other_name = "Demo &lt;b&gt;agent&lt;/b&gt;", "other"

    def row(i: int) -> tuple[int, str, str]:
        return i, demo if i % 2 else other_name, states[i % 4]

    newest_first, oldest_first = range(100_000), range(99_999, -1, -1)
    lists = [
        ("/tasks/", newest_first, lambda i: True),
        ("/tasks/?state=TASK_STATE_INPUT_REQUIRED", newest_first, lambda i: i % 4 == 3),
        (f"/tasks/?agent={demo_agent_row.pk}&state=TASK_STATE_WORKING", newest_first,
         lambda i: i % 4 == 1),
        ("/tasks/?sort=created", oldest_first, lambda i: True),
    ]  # fmt: skip
    for url, order, matches in lists:
        html = client_in.get(url).content.decode()
        assert "More than 1000 tasks match" in html
        next_url = (
            re.search(r'href="(\?[^"]*cursor=[^"]+)" id="next-page"', html)
            .group(1)
            .replace("&amp;", "&")
        )
        page2 = client_in.get("/tasks/" + next_url).content.decode()
        first, second = list_rows(html), list_rows(page2)
        assert first and second, url
        # Page 2 goes on where page 1 stopped: the next matching tasks, in order, no repeats.
        expected = [row(i) for i in order if matches(i)][: len(first) + len(second)]
        assert first + second == expected, url
        assert not {r[0] for r in first} & {r[0] for r in second}, url
        if url == "/tasks/":
            assert [r[0] for r in second[:2]] == [50, 51]
    assert client_in.get("/").status_code == 200


def list_rows(html: str) -> list[tuple[int, str, str]]:
    """(n, agent, state) of each "bulk n" row of the task list, as the page shows them."""
    rows = []
    for chunk in html.split('<tr id="task-row-')[1:]:
        chunk = chunk.split("</tr>", 1)[0]
        found = re.search(
            r'<td><a href="/tasks/\d+/">bulk (\d+)</a>.*?</td>\s*<td>(.*?)</td>\s*'
            r'<td class="state-cell"><span [^>]*data-state="([A-Z_]+)"',
            chunk,
            re.S,
        )
        assert found, f"a task row without title, agent or state: {chunk[:300]}"
        rows.append((int(found.group(1)), found.group(2), found.group(3)))
    return rows


# Cards with wrongly typed fields (an agent's JSON, stored as it came) -----------------------

ODD_CARD = {
    "name": "Odd card",
    "description": "types all wrong",
    "version": "1",
    "provider": "x",
    "capabilities": [],
    "supportedInterfaces": "x",
    "defaultInputModes": 4,
    "securitySchemes": [1],
    "securityRequirements": 7,
    "skills": [1, "x", {"id": "fine", "name": "Fine skill", "tags": 5, "examples": 7}],
}
ODD_CARDS = [
    ODD_CARD,
    {**ODD_CARD, "skills": 1, "supportedInterfaces": 1, "provider": {"organization": ["o"]}},
    {**ODD_CARD, "capabilities": {"extensions": 3, "streaming": "yes"}, "skills": {"a": 1}},
    {**ODD_CARD, "supportedInterfaces": [1, {"url": 5, "protocolBinding": ["JSONRPC"]}]},
    [1, 2],
    "a card",
]


def odd_agent(card: object) -> Agent:
    # card_problems empty: as if stored before they were checked (or edited by hand).
    n = Agent.objects.count()
    return Agent.objects.create(
        name=f"odd {n}",
        base_url=f"http://127.0.0.1:9/{n}/",
        interface_url="",
        binding="",
        card=card,
    )


@pytest.mark.parametrize("card", ODD_CARDS)
def test_agent_page_shows_a_wrongly_typed_card_and_its_problems(client_in, card):
    agent = odd_agent(card)
    response = client_in.get(f"/agents/{agent.pk}/")
    assert response.status_code == 200
    html = response.content.decode()
    assert_safe_html(html)
    assert "Card problems" in html
    if isinstance(card, dict):
        assert "Odd card" in html
        if isinstance(card["skills"], list):
            # The one well-formed skill is shown; the items of the wrong type are skipped.
            assert "Fine skill" in html and "skills[0]: must be an object, got int" in html
            assert "skills[2].tags: must be an array of strings, got int" in html
        else:
            assert "skills: must be an array" in html
    else:
        assert "agent card must be a JSON object" in html


def test_agent_page_keeps_the_stored_problems_and_adds_the_card_own(client_in):
    agent = odd_agent({**ODD_CARD, "skills": 1})
    agent.card_problems = ["interface http://x/: refused", "skills: must be an array"]
    agent.save()
    html = client_in.get(f"/agents/{agent.pk}/").content.decode()
    assert "interface http://x/: refused" in html and "provider: must be an object" in html
    assert html.count("skills: must be an array") == 1  # once, though both lists have it


def test_new_task_page_skips_skills_of_the_wrong_type(client_in):
    odd_agent({**ODD_CARD, "skills": 1})
    odd_agent(ODD_CARD)
    odd_agent([1, 2])
    response = client_in.get("/tasks/new")
    assert response.status_code == 200 and "Fine skill" in response.content.decode()


@pytest.fixture
def odd_card_server() -> Iterator[Callable[[object], str]]:
    """A card server on 127.0.0.1 whose card is whatever the test sets; gives its URL."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tests.serving import serve_in_thread, stop_serving

    served: dict[str, object] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # keep test output quiet
            pass

        def do_GET(self) -> None:
            data = json.dumps(served["card"]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    serve_in_thread(server)

    def serve(card: object) -> str:
        served["card"] = card
        return f"http://127.0.0.1:{server.server_address[1]}/"

    yield serve
    stop_serving(server)


@pytest.mark.parametrize("card", [c for c in ODD_CARDS if isinstance(c, dict)])
def test_card_preview_shows_a_wrongly_typed_card_and_its_problems(client_in, odd_card_server, card):
    url = odd_card_server(card)
    response = client_in.post("/agents/add/", {"url": url, "action": "preview"})
    assert response.status_code == 200
    html = response.content.decode()
    assert_safe_html(html)
    assert 'id="card-preview"' in html and "Problems found" in html
    assert "supportedInterfaces: must be an array" in html or "supportedInterfaces[0]" in html
    assert 'value="save"' not in html  # no interface: nothing to save
    if isinstance(card["skills"], list):
        assert "Fine skill" in html
    assert not Agent.objects.exists()


def test_agent_page_bounds_the_problems_of_a_card(client_in):
    from tasks_app.a2a import validate_card

    card = {**ODD_CARD, "skills": list(range(5000))}
    problems = len(validate_card(card))
    assert problems > 5000
    agent = odd_agent(card)
    html = client_in.get(f"/agents/{agent.pk}/").content.decode()
    shown = re.search(r'id="card-problems">(.*?)</div>', html, re.S).group(1)
    assert shown.count("<li>") == 101 and "skills[0]: must be an object, got int" in shown
    assert f"… and {problems - 100} more problems" in shown


def test_agent_page_shows_the_head_of_a_big_card_and_offers_it_whole(client_in):
    """A card goes up to a megabyte, and every view of the agent page drew it whole, indented."""
    import html as html_module

    from tasks_app import views

    card = {**ODD_CARD, "description": "d" * 300_000}
    agent = odd_agent(card)
    html = client_in.get(f"/agents/{agent.pk}/").content.decode()
    shown = re.search(r'id="card-raw">(.*?)</pre>', html, re.S).group(1)
    assert len(html_module.unescape(shown)) == views.CARD_RAW_SHOWN
    whole = views.pretty_json(card)
    assert f"… and {len(whole) - views.CARD_RAW_SHOWN} more characters" in html
    download = client_in.get(reverse("agent-card", args=[agent.pk]))
    assert download.status_code == 200 and download["Content-Disposition"].startswith("attachment")
    assert json.loads(download.content) == card
    small = odd_agent(ODD_CARD)
    html = client_in.get(f"/agents/{small.pk}/").content.decode()
    assert "more characters" not in html and 'id="card-download"' in html


@pytest.mark.parametrize(
    ("data", "said"),
    [
        ("[" * 5000 + "]" * 5000, "nested deeper than 256 levels"),  # was a RecursionError: 500
        ('{"score": NaN}', "NaN and Infinity are not JSON numbers"),
        ("[Infinity]", "NaN and Infinity are not JSON numbers"),
        ('{"big": 1e999}', "NaN and Infinity are not JSON numbers"),
        ("[" * 256 + "]" * 256, None),  # as deep as is taken
    ],
)
def test_new_task_json_data_is_standard_json_within_a_depth(
    client_in, demo_agent_row, no_dispatch, data, said
):
    response = client_in.post(
        "/tasks/new", {"agent": demo_agent_row.pk, "text": "", "data": data, "mode": "auto"}
    )
    if said is None:
        assert response.status_code == 302 and RemoteTask.objects.count() == 1
        return
    html = response.content.decode()
    assert response.status_code == 400 and 'id="id_data_error"' in html and said in html
    assert not RemoteTask.objects.exists()


def test_raw_json_shows_invisible_and_direction_characters_as_escapes(client_in):
    """An agent's right-to-left override in its card reversed the rest of the raw card's line
    on the agent page (and in any raw view); the same JSON value, shown as what it holds."""
    from tasks_app import views

    card = {**ODD_CARD, "name": "\u202eEvil\u200b", "description": "h\u00e9llo \u05d0"}
    shown = views.pretty_json(card)
    assert '"name": "\\u202eEvil\\u200b"' in shown and "h\u00e9llo \u05d0" in shown
    assert json.loads(shown) == card
    html = client_in.get(f"/agents/{odd_agent(card).pk}/").content.decode()
    raw = re.search(r'id="card-raw">(.*?)</pre>', html, re.S).group(1)
    assert "\u202e" not in raw and "\\u202eEvil" in raw
