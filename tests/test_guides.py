"""The guides the pages link to are served to people, from the project's own docs."""

from __future__ import annotations

import re
from html import unescape

import pytest
from django.conf import settings
from django.test import Client
from django.urls import reverse

from tasks_app import views_help
from tasks_app.models import DEFAULT_PROJECT, Agent, Membership, Project, RemoteTask
from tests.people import member

pytestmark = pytest.mark.django_db


@pytest.fixture
def viewer(django_user_model) -> Client:
    client = Client()
    client.force_login(member(django_user_model.objects.create_user("vic"), Membership.Role.VIEWER))
    return client


@pytest.mark.parametrize("name", sorted(views_help.GUIDES))
def test_each_guide_is_its_docs_file_rendered(viewer, name):
    filename, title = views_help.GUIDES[name]
    text = (settings.DOCS_DIR / filename).read_text()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)  # not code's "#"
    answer = viewer.get(reverse("guide", args=[name]))
    html = answer.content.decode()
    assert answer.status_code == 200 and f"<title>{title}" in html
    # The file's headings, in order, are the page's headings (markdown rendered, not shown raw).
    article = html.split(f'id="guide-{name}"', 1)[1].split("</article>", 1)[0]
    shown = [
        (int(level), unescape(re.sub(r"<[^>]+>", "", inner)))
        for level, inner in re.findall(r"<h([1-6])>(.*?)</h\1>", article, re.DOTALL)
    ]
    written = [
        (len(marks), re.sub(r"[`*]", "", heading).strip())
        for marks, heading in re.findall(r"^(#{1,6}) (.+)$", prose, re.MULTILINE)
    ]
    assert written and shown == written
    assert "| --- |" not in article and "|---|" not in article  # the tables are tables


def test_the_export_links_and_the_inbox_link_to_their_guide(viewer, django_user_model):
    auditor = Client()
    auditor.force_login(
        member(django_user_model.objects.create_user("aud"), Membership.Role.AUDITOR)
    )
    agent = Agent.objects.create(
        project=Project.objects.get(name=DEFAULT_PROJECT), name="a", base_url="http://127.0.0.1:9/"
    )
    task = RemoteTask.objects.create(agent=agent, title="t", remote_id="r-1")
    page = auditor.get(reverse("task-events", args=[task.pk])).content.decode()
    assert f'href="{reverse("guide", args=["exports"])}" id="export-format"' in page
    assert "docs/exports.md" not in page
    inbox = viewer.get(reverse("inbox")).content.decode()
    assert f'href="{reverse("guide", args=["answers"])}"' in inbox


def test_an_unknown_guide_and_a_missing_docs_folder_are_404(viewer, settings, tmp_path):
    assert viewer.get(reverse("guide", args=["architecture"])).status_code == 404
    settings.DOCS_DIR = tmp_path  # an installation that does not carry docs/
    answer = viewer.get(reverse("guide", args=["exports"]))
    assert answer.status_code == 404


def test_a_guide_needs_a_login():
    answer = Client().get(reverse("guide", args=["exports"]))
    assert answer.status_code == 302 and "/login" in answer["Location"]


def test_a_guides_wrapped_lines_are_one_paragraph(viewer):
    """The docs are wrapped at a line length: each line was a ``<br>`` (as in an agent's
    message, where a line break is meant), so every paragraph broke mid-sentence."""
    html = viewer.get(reverse("guide", args=["exports"])).content.decode()
    article = html.split('id="guide-exports"', 1)[1].split("</article>", 1)[0]
    assert "<p>" in article and "<br" not in article
