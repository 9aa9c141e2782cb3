"""Bounded task pages: a 30 MB artifact shows as a 64 KB preview and downloads whole, streamed.

The artifact is written the way a stream writes it: through ``record_many()``,
as thousands of appended chunks. The memory bound is measured on a real daphne
process (its resident set size, with psutil), not on the test client.
"""

from __future__ import annotations

import base64
import hashlib

import httpx
import psutil
import pytest
from django.conf import settings
from django.urls import reverse

from tasks_app.models import Agent, Artifact, RemoteTask
from tasks_app.services.record import record, record_many
from tests.people import member

pytestmark = pytest.mark.django_db(transaction=True)

MB = 1024 * 1024
TOTAL = 30 * MB
CHUNK = 16 * 1024
PAGE_LIMIT = 200 * 1024
RSS_GROWTH_LIMIT = 60 * MB


def big_text() -> bytes:
    """30 MB of numbered ASCII lines (each line unique, nothing HTML would escape)."""
    lines = []
    size = 0
    n = 0
    while size < TOTAL:
        line = f"line {n:07d} {'abcdefghijklmnopqrstuvwxyz' * 3}\n".encode()
        lines.append(line)
        size += len(line)
        n += 1
    return b"".join(lines)[:TOTAL]


def update(task_id: str, text: str, *, append: bool, last: bool = False) -> dict:
    return {
        "artifactUpdate": {
            "taskId": task_id,
            "contextId": "ctx-big",
            "artifact": {"artifactId": "big", "name": "big.log", "parts": [{"text": text}]},
            "append": append,
            "lastChunk": last,
        }
    }


def big_task(content: bytes) -> RemoteTask:
    agent = Agent.objects.create(
        name="big", base_url="http://127.0.0.1:9", interface_url="http://127.0.0.1:9/jsonrpc"
    )
    task = RemoteTask.objects.create(agent=agent, title="huge output")
    tid = "t-big"
    record(
        task,
        {"task": {"id": tid, "contextId": "ctx-big", "status": {"state": "TASK_STATE_WORKING"}}},
        "stream",
    )
    chunks = [content[i : i + CHUNK].decode() for i in range(0, len(content), CHUNK)]
    events = [update(tid, c, append=i > 0, last=i == len(chunks) - 1) for i, c in enumerate(chunks)]
    for start in range(0, len(events), 64):
        recorded = record_many(task, events[start : start + 64], "stream")
        assert not recorded.over_budget
    artifact = Artifact.objects.get(task=task, artifact_id="big")
    assert artifact.part_count == len(chunks) and artifact.complete
    return task


@pytest.fixture(scope="module")
def content() -> bytes:
    return big_text()


@pytest.fixture
def operator(client, django_user_model):
    user = member(django_user_model.objects.create_user(username="op", password="pw-12345678"))
    client.force_login(user)
    return client


def preview_bounds(content: bytes) -> tuple[str, str]:
    """A line inside the preview and the first line wholly past it."""
    cap = settings.ARTIFACT_PREVIEW_BYTES
    inside = content[:cap].split(b"\n")[-2].decode()
    past = content[cap:].split(b"\n")[1].decode()
    return inside, past


@pytest.mark.slow  # a large artifact
def test_task_page_shows_a_bounded_preview_and_downloads_the_whole(operator, content):
    task = big_task(content)
    artifact = Artifact.objects.get(task=task)
    page = operator.get(reverse("task-detail", args=[task.pk]))
    assert page.status_code == 200
    assert len(page.content) < PAGE_LIMIT, len(page.content)
    html = page.content.decode()
    inside, past = preview_bounds(content)
    assert content[:200].decode() in html and inside in html
    assert past not in html
    assert "Showing the first 64.0\xa0KB of 30.0\xa0MB" in html  # filesizeformat: no-break spaces
    url = reverse("artifact-download-all", args=[task.pk, artifact.pk])
    assert f'href="{url}"' in html

    live = operator.get(reverse("task-live", args=[task.pk]) + "?artifact=big")
    assert len(live.content) < PAGE_LIMIT
    assert live.json()["artifacts"][0]["updated_seq"] == artifact.updated_seq

    download = operator.get(url)
    assert download.status_code == 200 and download.streaming
    assert download["Content-Type"] == "text/plain; charset=utf-8"
    assert download["Content-Disposition"] == 'attachment; filename="big.log"'
    digest = hashlib.sha256()
    size = 0
    largest = 0
    for piece in download.streaming_content:
        digest.update(piece)
        size += len(piece)
        largest = max(largest, len(piece))
    assert size == len(content) and digest.digest() == hashlib.sha256(content).digest()
    assert largest <= 4 * MB  # streamed in pieces, never the whole at once


def test_big_non_text_parts_become_links(operator):
    agent = Agent.objects.create(
        name="mixed", base_url="http://127.0.0.1:9", interface_url="http://127.0.0.1:9/jsonrpc"
    )
    task = RemoteTask.objects.create(agent=agent, title="mixed")
    tid = "t-mixed"
    record(
        task,
        {"task": {"id": tid, "contextId": "c", "status": {"state": "TASK_STATE_WORKING"}}},
        "stream",
    )
    blob = bytes(range(256)) * 1024  # 256 KB
    data = {"rows": [{"n": i, "name": f"row {i}"} for i in range(20_000)]}
    parts = [
        {"text": "# Head\n\nsome *markdown*"},
        {"data": data},
        {
            "raw": base64.b64encode(blob).decode(),
            "filename": "blob.bin",
            "mediaType": "application/octet-stream",
        },
        {"text": "tail text"},
    ]
    record(
        task,
        {
            "artifactUpdate": {
                "taskId": tid,
                "contextId": "c",
                "artifact": {"artifactId": "m", "parts": parts},
            }
        },
        "stream",
    )
    artifact = Artifact.objects.get(task=task)
    page = operator.get(reverse("task-detail", args=[task.pk]))
    html = page.content.decode()
    assert len(page.content) < PAGE_LIMIT
    assert "<h1>Head</h1>" in html and "<em>markdown</em>" in html  # markdown kept for previews
    data_url = reverse("artifact-download", args=[task.pk, artifact.pk, 1])
    file_url = reverse("artifact-download", args=[task.pk, artifact.pk, 2])
    assert f'href="{data_url}"' in html and f'href="{file_url}"' in html
    assert "row 19999" not in html
    got = operator.get(data_url)
    assert got["Content-Type"] == "application/json" and b'"row 19999"' in got.content
    assert operator.get(file_url).content == blob
    whole = b"".join(
        operator.get(
            reverse("artifact-download-all", args=[task.pk, artifact.pk])
        ).streaming_content
    )
    assert whole.startswith(b"# Head\n\nsome *markdown*{") and whole.endswith(blob + b"tail text")


def test_web_process_memory_stays_bounded(operator, content, start_daphne):
    task = big_task(content)
    artifact = Artifact.objects.get(task=task)
    server = start_daphne(ALLOWED_HOSTS="127.0.0.1,localhost")
    cookies = {settings.SESSION_COOKIE_NAME: operator.cookies[settings.SESSION_COOKIE_NAME].value}
    process = psutil.Process(server.pid)
    with httpx.Client(base_url=server.url, cookies=cookies, timeout=120) as http:
        warm = http.get("/tasks/")  # Django, templates and the session warmed up on a small page
        assert warm.status_code == 200 and "huge output" in warm.text
        before = process.memory_info().rss
        peak = before
        sizes = []
        for _ in range(3):
            page = http.get(f"/tasks/{task.pk}/")
            assert page.status_code == 200
            sizes.append(len(page.content))
            peak = max(peak, process.memory_info().rss)
        digest = hashlib.sha256()
        size = 0
        with http.stream("GET", f"/tasks/{task.pk}/artifacts/{artifact.pk}/download") as download:
            assert download.status_code == 200
            for piece in download.iter_bytes():
                digest.update(piece)
                size += len(piece)
                peak = max(peak, process.memory_info().rss)
        after = max(peak, process.memory_info().rss)
    assert all(s < PAGE_LIMIT for s in sizes), sizes
    assert size == len(content) and digest.digest() == hashlib.sha256(content).digest()
    assert after - before < RSS_GROWTH_LIMIT, f"daphne grew by {(after - before) / MB:.1f} MB"
