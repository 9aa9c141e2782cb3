"""What an agent's content may cost one task page: its artifacts, messages and markdown.

Found by an audit of what agents can make us do: a task of 2,000 artifacts made a 2.8 s page
(every artifact previewed); a message of two hundred runs of ``![`` separated by data parts
took 100 s to render (the markdown limit was per run of text); a message of 8 MB made a
page of 8 MB. Each is bounded now, and what is left out is said.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client

from tasks_app import rendering, views
from tasks_app.models import Agent, Membership, RemoteTask
from tasks_app.services.record import record
from tests.people import member

pytestmark = pytest.mark.django_db


@pytest.fixture
def task() -> RemoteTask:
    agent = Agent.objects.create(name="a", base_url="http://127.0.0.1:1/")
    task = RemoteTask.objects.create(agent=agent, title="t")
    record(task, {"task": {"id": "t-1", "contextId": "c-1", "status": {"state": "TASK_STATE_WORKING"}}}, "stream")  # fmt: skip
    return task


def client_as(role: str) -> Client:
    client = Client()
    client.force_login(member(User.objects.create_user(f"u-{role}"), role))
    return client


def say(task: RemoteTask, parts: list[dict], mid: str = "m-1") -> None:
    message = {"messageId": mid, "role": "ROLE_AGENT", "contextId": "c-1", "parts": parts}
    record(task, {"message": message}, "stream")


def test_a_task_page_previews_its_first_artifacts_and_counts_the_rest(task, monkeypatch):
    monkeypatch.setattr(views, "ARTIFACTS_ON_PAGE", 10)
    artifacts = [{"artifactId": f"a-{n:03d}", "parts": [{"text": f"body {n}"}]} for n in range(13)]
    snapshot = {"id": "t-1", "contextId": "c-1", "status": {"state": "TASK_STATE_WORKING"}}
    record(task, {"task": {**snapshot, "artifacts": artifacts}}, "poll")

    page = client_as(Membership.Role.VIEWER).get(f"/tasks/{task.pk}/").content.decode()
    assert page.count('<article class="artifact"') == 10
    assert "… and 3 more artifacts, not shown here." in page  # a viewer may not export
    auditor_page = client_as(Membership.Role.AUDITOR).get(f"/tasks/{task.pk}/").content.decode()
    assert f'<a href="/tasks/{task.pk}/export/">export</a> holds them all' in auditor_page

    live = client_as(Membership.Role.OPERATOR).get(
        f"/tasks/{task.pk}/live/", {"all_artifacts": "1", "artifact": ["a-001"] * 50}
    )
    assert len(live.json()["artifacts"]) == 10


def test_markdown_on_one_page_costs_at_most_its_budget(task, monkeypatch):
    """Runs of text split by other parts are each a markdown document: two hundred of them
    each took the whole per-text allowance. One page now has one budget; past it, plain text."""
    monkeypatch.setattr(rendering, "PAGE_MARKDOWN_CHARS", 1_000)
    rendering._markdown_cache.clear()
    runs = []
    for n in range(20):
        runs += [{"text": f"**bold {n:02d}** " + "x" * 580}, {"data": {"n": n}}]
    say(task, runs)
    rendered = []
    monkeypatch.setattr(
        rendering._md,
        "render",
        lambda text, real=rendering._md.render: rendered.append(text) or real(text),
    )
    page = client_as(Membership.Role.VIEWER).get(f"/tasks/{task.pk}/").content.decode()
    assert sum(len(text) for text in rendered) <= 1_000 and len(rendered) == 1
    assert "<strong>bold 00</strong>" in page  # the first run fits, as markdown
    assert "**bold 19**" in page  # the others are shown as they are, escaped
    assert page.count('<pre class="plain-text">') >= 19


def test_a_huge_message_is_shown_cut_with_what_was_left_out(task, monkeypatch):
    monkeypatch.setattr(rendering, "MESSAGE_SHOWN_CHARS", 5_000)
    monkeypatch.setattr(rendering, "PARTS_SHOWN", 30)
    say(task, [{"text": "y" * 12_000}], mid="m-big")
    say(task, [{"data": {"k": "z" * 9_000}}], mid="m-data")
    say(task, [{"url": f"https://example.test/{n}"} for n in range(45)], mid="m-many")
    page = client_as(Membership.Role.VIEWER).get(f"/tasks/{task.pk}/").content.decode()
    longest_run = max(len(run) for run in re.findall(r"y+", page))
    assert longest_run == 5_000 and "… 7,000 more characters not shown here" in page
    assert "z" * 5_000 not in page and "more characters not shown here" in page
    assert page.count('href="https://example.test/') == 30
    assert "… 15 more parts not shown here" in page


def test_agent_text_outside_the_message_bounds_is_cut_too(task):
    """Text the bounds above did not count: an artifact's description, an A2UI part's JSON, a
    file part's media type (shown, and in a too-big placeholder), each 2 MB, made a 2 MB page;
    a file name of megabytes was filtered a character at a time on every view."""
    import time

    huge = 2_000_000
    record(task, {"artifactUpdate": {"taskId": "t-1", "artifact": {
        "artifactId": "a-d", "description": "d" * huge, "parts": [{"text": "x"}]}}}, "stream")  # fmt: skip
    record(task, {"artifactUpdate": {"taskId": "t-1", "artifact": {
        "artifactId": "a-m", "parts": [{"raw": "QUJD" * 100_000, "mediaType": "m" * huge}]}}},
        "stream")  # fmt: skip
    say(task, [{"data": {"k": "z" * huge}, "mediaType": "application/json+a2ui"}], mid="m-a")
    say(task, [{"raw": "QUJD", "filename": "f", "mediaType": "m" * huge}], mid="m-b")
    say(task, [{"raw": "QUJD", "filename": "f" * huge, "mediaType": "text/plain"}], mid="m-c")
    viewer = client_as(Membership.Role.VIEWER)
    started = time.monotonic()
    page = viewer.get(f"/tasks/{task.pk}/").content
    took = time.monotonic() - started
    assert len(page) < 600_000, len(page)
    assert took < 5, took
    assert rendering.shown_media_type("m" * 500).endswith("…")
    assert len(rendering.shown_media_type("m" * 500)) == rendering.MEDIA_TYPE_CHARS
    assert rendering.safe_filename("a/" + "b" * 5000) == "b" * 150


def test_the_compact_log_lists_the_first_artifacts_and_counts_the_rest(task, monkeypatch):
    monkeypatch.setattr(views, "ARTIFACTS_ON_PAGE", 10)
    artifacts = [{"artifactId": f"a-{n:03d}", "parts": [{"text": f"body {n}"}]} for n in range(13)]
    snapshot = {"id": "t-1", "contextId": "c-1", "status": {"state": "TASK_STATE_WORKING"}}
    record(task, {"task": {**snapshot, "artifacts": artifacts}}, "poll")
    page = client_as(Membership.Role.VIEWER).get(f"/tasks/{task.pk}/events/", {"view": "compact"})
    body = page.content.decode()
    assert page.status_code == 200 and body.count("<tr><td>a-0") == 10
    assert "… and 3 more artifacts, not listed here." in body


def _chunk(parts: list[dict], append: bool, artifact_id: str = "a-1") -> dict:
    return {"artifactUpdate": {"taskId": "t-1", "contextId": "c-1", "append": append,
                               "artifact": {"artifactId": artifact_id, "parts": parts}}}  # fmt: skip


def _preview_queries(task: RemoteTask) -> tuple[str, int]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from tasks_app.models import Artifact
    from tasks_app.previews import artifact_preview

    artifact = Artifact.objects.get(task=task)
    with CaptureQueriesContext(connection) as queries:
        preview = artifact_preview(artifact, lambda index: f"/part/{index}")
    return preview, len(queries)


def test_a_preview_of_empty_parts_looks_at_a_bounded_number_of_them(task):
    """An empty text part costs the preview's byte budget nothing: an agent's artifact of
    millions of them (about 12 bytes each of its storage budget) made every view of the
    task page read them all, 16 a query. The parts looked at are bounded, and the page says
    how many of how many it shows."""
    from tasks_app.previews import PREVIEW_BATCH, PREVIEW_MAX_PARTS

    for n in range(3):
        record(task, _chunk([{"text": ""}] * 2_000, n > 0), "stream")
    preview, queries = _preview_queries(task)
    assert preview["truncated"] and preview["shown_parts"] == PREVIEW_MAX_PARTS == 4096
    assert preview["total_parts"] == 6_000
    assert queries <= PREVIEW_MAX_PARTS // PREVIEW_BATCH + 2  # the batches, then the totals
    page = client_as(Membership.Role.VIEWER).get(f"/tasks/{task.pk}/").content.decode()
    assert "(its first 4096 parts of 6000)" in page


def test_a_streamed_artifact_of_small_parts_is_previewed_whole_in_few_queries(task):
    """Tokens streamed one part each (a few characters): the whole text is shown, read a
    batch of 512 parts a query, where it took a query per 16."""
    words = [{"text": f"w{n} "} for n in range(1_500)]
    for start in range(0, len(words), 100):
        record(task, _chunk(words[start : start + 100], start > 0), "stream")
    preview, queries = _preview_queries(task)
    assert not preview["truncated"] and preview["shown_parts"] is None
    assert "w0 w1 w2" in str(preview["html"]) and "w1499" in str(preview["html"])
    assert queries <= 3


def test_long_texts_and_data_parts_are_read_with_their_batch_up_to_the_budget(task, settings):
    """Parts longer than a batch's heads, and data parts, come in one query more each per
    batch, and only as far as the budget reaches: the preview is what it was, text cut at
    the budget, a data part too big to show a link."""
    settings.ARTIFACT_PREVIEW_BYTES = 20_000
    parts = [{"text": "a" * 5_000}, {"data": {"n": 1}}, {"text": "b" * 5_000},
             {"data": {"big": "x" * 30_000}}, {"text": "c" * 9_000}, {"text": "d" * 9_000},
             {"data": {"n": 2}}]  # fmt: skip
    record(task, _chunk(parts, False), "stream")
    preview, queries = _preview_queries(task)
    html = str(preview["html"])
    assert "a" * 5_000 in html and "b" * 5_000 in html and "&quot;n&quot;: 1" in html
    assert "too big to show here" in html  # the 30 KB data part
    assert "c" * 9_000 in html and "d" * 500 in html and "d" * 1_000 not in html  # cut at 20 KB
    assert "&quot;n&quot;: 2" not in html
    assert preview["truncated"] and preview["shown_bytes"] <= 20_000
    assert queries <= 4  # the batch, longer texts, data parts, the totals


def test_the_data_parts_read_with_a_batch_add_up_to_the_budget_at_most(task, settings, monkeypatch):
    """Data parts each under the budget but together far over it: each counts the budget
    only the placeholder's bytes until its turn, and a batch read all of their values."""
    import json

    from tasks_app import previews

    settings.ARTIFACT_PREVIEW_BYTES = 20_000
    record(task, _chunk([{"data": {"blob": "y" * 15_000}}] * 40, False), "stream")
    read: list[int] = []
    real = previews._preview_extras

    def counted(rows, room):
        heads, data = real(rows, room)
        read.extend(len(json.dumps(value)) for value in data.values())
        return heads, data

    monkeypatch.setattr(previews, "_preview_extras", counted)
    preview, _ = _preview_queries(task)
    assert preview["truncated"] and "too big to show here" in str(preview["html"])
    assert str(preview["html"]).count("y" * 15_000) == 1  # one fits; the next is a link
    assert len(read) == 1 and sum(read) <= 20_000


def test_a_page_reads_big_messages_only_as_far_as_it_shows_them(task, monkeypatch):
    """Six 4 MB messages made each view of the task page peak at 55 MB: a hundred messages
    were read whole to show at most 64,000 characters of each. A big message is now read as
    the heads of its first text parts, cut by the database; its parts are downloads."""
    import tracemalloc

    from tasks_app import previews

    # A tenth of each bound, and messages of a megabyte: the same reads, a faster test. A
    # message shows 5,000 characters (not 64,000): what the view costs is then its reads.
    monkeypatch.setattr(rendering, "MESSAGE_SHOWN_CHARS", 5_000)
    monkeypatch.setattr(previews, "MESSAGE_LOADED_CHARS", previews.MESSAGE_LOADED_CHARS // 10)
    monkeypatch.setattr(
        previews, "CONVERSATION_LOADED_CHARS", previews.CONVERSATION_LOADED_CHARS // 10
    )
    big = 1024 * 1024
    say(task, [{"text": "a small one, read whole"}], mid="m-small")
    client = client_as(Membership.Role.VIEWER)
    client.get(f"/tasks/{task.pk}/")  # first view: imports, caches

    def view_peak() -> tuple[int, Any]:
        tracemalloc.start()
        try:
            response = client.get(f"/tasks/{task.pk}/")
            return tracemalloc.get_traced_memory()[1], response
        finally:
            tracemalloc.stop()

    small_peak, _ = view_peak()
    for n in range(4):
        parts = [{"text": f"start {n} " + "b" * big}, {"data": {"n": n}}]
        say(task, parts + [{"text": "more"}] * (5 if n == 0 else 1), mid=f"m-big-{n}")
    peak, response = view_peak()
    page = response.content.decode()
    assert response.status_code == 200
    # Four 1 MB messages more cost the view less than half of one of them (it was 8.4 MB).
    assert peak - small_peak < big / 2, f"the page peaked at {peak:,} bytes, {small_peak:,} before"
    assert "a small one, read whole" in page
    for n in range(4):
        assert f"start {n} bbbb" in page
    longest = max(len(run) for run in re.findall(r"b{1000,}", page))
    assert longest < rendering.MESSAGE_SHOWN_CHARS
    assert page.count("more than a page reads") == 4
    assert page.count("(it has more: the log and the export hold them)") == 1  # seven parts
    first = task.messages.get(message_id="m-big-0")
    download = f"/tasks/{task.pk}/messages/{first.pk}/parts/1/download"
    assert f'href="{download}"' in page
    part = client.get(download)
    assert part.status_code == 200 and json.loads(b"".join(part)) == {"n": 0}


def test_list_pages_do_not_read_the_agents_json_of_each_row():
    """Every list row read its task's metadata, status message, request and outbox (each as
    big as the task's byte budget) and its agent's card (up to 1 MB), to show a title and a
    state: the task list of 60 tasks peaked at 200 MB, the alerts page of 500 alerts at
    676 MB. The lists now leave those columns unread, with no query more per row."""
    import tracemalloc

    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from tasks_app.models import Alert

    agent = Agent.objects.create(name="listed", base_url="http://127.0.0.1:1/listed/")
    tasks = [
        RemoteTask.objects.create(
            agent=agent, title=f"t{n}", remote_id=f"r-{n}", state="TASK_STATE_INPUT_REQUIRED"
        )
        for n in range(20)
    ]
    for n, task in enumerate(tasks):
        Alert.objects.create(
            rule=Alert.Rule.QUESTION_WAITING, task=task, agent=agent, key=f"k-{n}",
            message=f"task t{n} waits", opened_at=timezone.now(),
        )  # fmt: skip
    reader = client_as(Membership.Role.VIEWER)
    routes = ["/tasks/", "/", f"/agents/{agent.pk}/", "/agents/", "/alerts/"]

    def costs(routes: list[str]) -> dict[str, tuple[int, int]]:
        seen = {}
        for route in routes:
            reader.get(route)  # caches, sessions
            with CaptureQueriesContext(connection) as queries:
                tracemalloc.start()
                try:
                    assert reader.get(route).status_code == 200, route
                    peak = tracemalloc.get_traced_memory()[1]
                finally:
                    tracemalloc.stop()
            seen[route] = (peak, len(queries))
        return seen

    small = costs(routes)
    big = "x" * 200_000  # 0.2 MB of each column, 20 rows: 4 MB a column a page
    RemoteTask.objects.filter(agent=agent).update(
        metadata={"m": big}, status_message={"parts": [{"text": big}]},
        request={"message": {"parts": [{"text": big}]}}, outbox={"parts": [{"text": big}]},
    )  # fmt: skip
    large = costs(routes)
    Agent.objects.filter(pk=agent.pk).update(card={"name": "listed", "description": big * 2})
    lists = [route for route in routes if route != f"/agents/{agent.pk}/"]  # it shows the card
    large.update(costs(lists))
    for route in routes:
        (before, queries_before), (after, queries_after) = small[route], large[route]
        assert queries_after == queries_before, route  # nothing read row by row instead
        assert after - before < 1_000_000, f"{route}: {before:,} -> {after:,} bytes"


def test_a_timeline_of_many_state_changes_reads_a_bounded_number_of_them(monkeypatch):
    """An agent switching states to and fro made every change a row the task page read and
    drew (50,000 of them: 47 MB and 8.7 s a view, and its live redraws the same). Past
    TIMELINE_TICKS changes, the first of each span of the log is read; both states still show."""
    from datetime import timedelta

    from django.utils import timezone

    from tasks_app.models import TaskEvent

    agent = Agent.objects.create(name="flip", base_url="http://127.0.0.1:1/flip/")
    task = RemoteTask.objects.create(agent=agent, title="flip", remote_id="r-flip")
    n = 4_000
    start = timezone.now() - timedelta(seconds=n)
    states = ["TASK_STATE_WORKING", "TASK_STATE_SUBMITTED"]

    def row(seq: int) -> TaskEvent:
        return TaskEvent(
            task=task, seq=seq, received_at=start + timedelta(seconds=seq), channel="stream",
            kind="statusUpdate", raw={}, state_after=states[seq % 2], state_changed=True,
        )  # fmt: skip

    TaskEvent.objects.bulk_create([row(seq) for seq in range(1, n + 1)], batch_size=500)
    RemoteTask.objects.filter(pk=task.pk).update(last_seq=n, state=states[n % 2])
    drawn: list[int] = []
    real = views.timeline_svg
    monkeypatch.setattr(
        views, "timeline_svg", lambda rows, **kw: drawn.append(len(rows)) or real(rows, **kw)
    )
    page = client_as(Membership.Role.VIEWER).get(f"/tasks/{task.pk}/").content.decode()
    assert drawn and max(drawn) <= 2 * views.TIMELINE_TICKS + 2, drawn
    svg = page[page.index('<svg class="timeline"') :]
    svg = svg[: svg.index("</svg>")]
    assert "st-working" in svg and "st-submitted" in svg
    assert "more changes" in svg  # the label names the first states, and counts the rest


def test_a_tasks_routes_do_not_read_its_merged_metadata():
    """A task's metadata is merged from every status update, up to the task's byte budget,
    and no page shows it: each poll of the page's live view and each row redraw read it."""
    import tracemalloc

    agent = Agent.objects.create(name="meta", base_url="http://127.0.0.1:1/meta/")
    task = RemoteTask.objects.create(agent=agent, title="m", remote_id="r-m")
    reader = client_as(Membership.Role.VIEWER)
    routes = [f"/tasks/{task.pk}/", f"/tasks/{task.pk}/live/", f"/tasks/{task.pk}/row/"]

    def peaks() -> list[int]:
        seen = []
        for route in routes:
            reader.get(route)
            tracemalloc.start()
            try:
                assert reader.get(route).status_code == 200, route
                seen.append(tracemalloc.get_traced_memory()[1])
            finally:
                tracemalloc.stop()
        return seen

    before = peaks()
    RemoteTask.objects.filter(pk=task.pk).update(
        metadata={f"k{n}": "v" * 100_000 for n in range(40)}
    )
    after = peaks()
    for route, small, large in zip(routes, before, after, strict=True):
        assert large - small < 1_000_000, f"{route}: {small:,} -> {large:,} bytes"
