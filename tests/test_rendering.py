"""rendering.py (the one sanitizing path) and the SVG timeline."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta

from tasks_app.demo_agent import MARKDOWN_SAMPLE
from tasks_app.rendering import (
    download_content_type,
    markdown_html,
    message_text,
    parts_html,
    safe_filename,
    safe_http_url,
    sanitize_html,
)
from tasks_app.svg import timeline_svg


def test_markdown_is_rendered_and_sanitized():
    html = str(markdown_html(MARKDOWN_SAMPLE))
    assert "<h1>Demo report</h1>" in html and "<strong>bold</strong>" in html
    assert (
        '<a href="https://example.org/" target="_blank" rel="noopener noreferrer">safe link</a>'
        in html
    )
    assert "<script" not in html and "<img" not in html
    assert 'href="javascript' not in html
    assert "&lt;script&gt;" in html  # raw HTML is shown as text


def test_sanitizer_drops_dangerous_markup_even_if_given_html():
    dirty = (
        '<p onclick="x()">hi</p><script>alert(1)</script><a href="javascript:alert(1)">j</a>'
        '<a href="/admin/">rel</a><a href="data:text/html,x">d</a><iframe src="https://e.org"></iframe>'
        '<style>body{}</style><b>ok</b><a href="https://e.org">e</a>'
    )
    html = str(sanitize_html(dirty))
    for bad in (
        "onclick",
        "<script",
        "alert(1)</",
        "javascript:",
        'href="/admin/"',
        "data:",
        "<iframe",
        "<style",
    ):
        assert bad not in html, bad
    assert "<b>ok</b>" in html
    assert '<a href="https://e.org" target="_blank" rel="noopener noreferrer">e</a>' in html


def test_markdown_link_schemes():
    html = str(
        markdown_html(
            "[a](javascript:alert(1)) [b](vbscript:x) [c](mailto:a@b.c) [d](http://e.org)"
        )
    )
    assert 'href="javascript' not in html
    assert 'href="vbscript' not in html
    assert 'href="mailto:a@b.c"' in html and 'href="http://e.org"' in html


def test_consecutive_text_parts_are_one_document():
    html = str(parts_html([{"text": "**bo"}, {"text": "ld** and "}, {"text": "more"}]))
    assert html.count('<div class="md">') == 1
    assert "<strong>bold</strong>" in html


def test_data_url_and_raw_parts():
    html = str(
        parts_html(
            [
                {"data": {"k": "<b>v</b>"}},
                {"url": "javascript:alert(1)"},
                {"url": "https://files.example.org/a.pdf", "filename": "a.pdf"},
                {
                    "raw": base64.b64encode(b"x").decode(),
                    "filename": "../../etc/passwd",
                    "mediaType": "text/html",
                },
            ],
            lambda i: f"/dl/{i}",
        )
    )
    assert "&lt;b&gt;v&lt;/b&gt;" in html and "<b>v" not in html
    assert 'href="javascript' not in html and "Link not shown" in html
    assert (
        '<a href="https://files.example.org/a.pdf" rel="noopener noreferrer" target="_blank">a.pdf</a>'
        in html
    )
    assert 'href="/dl/3" download="passwd"' in html


def test_download_helpers():
    assert safe_filename('../a/"b<c>.txt') == "bc.txt"
    assert safe_filename("", "x") == "x" and safe_filename(None, "y") == "y"
    assert download_content_type("text/html") == "application/octet-stream"
    assert download_content_type("image/svg+xml") == "application/octet-stream"
    assert download_content_type("text/plain; charset=utf-8") == "text/plain"
    assert safe_http_url("https://e.org/x") == "https://e.org/x"
    assert safe_http_url("javascript:alert(1)") is None
    assert safe_http_url("//e.org/x") is None
    assert safe_http_url("http://e.org/\nx") is None


def test_message_text():
    message = {"parts": [{"text": " a "}, {"data": {}}, {"text": "b"}]}
    assert message_text(message) == "a b"
    assert message_text(None) == ""


def test_timeline_segments_and_escaping():
    t0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    events = [
        (1, t0, ""),
        (2, t0 + timedelta(seconds=1), "TASK_STATE_WORKING"),
        (3, t0 + timedelta(seconds=2), "TASK_STATE_WORKING"),
        (4, t0 + timedelta(seconds=5), "TASK_STATE_INPUT_REQUIRED"),
        (5, t0 + timedelta(seconds=9), "TASK_STATE_COMPLETED"),
    ]
    svg = str(timeline_svg(events))
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert svg.count("<rect") == 4  # sending, working, input-required, completed
    assert "st-working" in svg and "st-input-required" in svg and "st-completed" in svg
    assert svg.count("tl-tick") == 5
    hostile = str(
        timeline_svg(
            [(1, t0, '<script>"x'), (2, t0 + timedelta(seconds=1), "TASK_STATE_WORKING")],
            now=t0 + timedelta(seconds=3),
        )
    )
    assert "<script" not in hostile
    assert "No events yet" in str(timeline_svg([]))


def test_long_text_is_shown_plain_and_escaped():
    from tasks_app.rendering import MARKDOWN_MAX_CHARS, markdown_html

    text = "# title\n<script>alert(1)</script>\n" + "x" * MARKDOWN_MAX_CHARS
    html = str(markdown_html(text))
    assert html.startswith('<pre class="plain-text">')
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "<h1>" not in html


def test_markdown_rendering_is_remembered():
    from tasks_app.rendering import markdown_html

    assert markdown_html("**same**") is markdown_html("**same**")
