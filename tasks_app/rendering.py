"""The one place where agent content becomes HTML.

Everything an agent sends (text, names, artifacts, messages) is untrusted.
Text parts are rendered as markdown (raw HTML disabled) and the result is
sanitized again with nh3: a small tag set, links http(s)/mailto only with
``rel="noopener noreferrer"``, no images, no relative URLs. Data parts are
pretty JSON, escaped. File parts are never rendered inline: inline bytes
become a download link (served as an attachment), ``url`` parts are links only
when they are http(s).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any
from urllib.parse import urlsplit

import nh3
from django.utils.html import escape, format_html
from django.utils.safestring import SafeString, mark_safe
from markdown_it import MarkdownIt

from tasks_app.a2a import a2ui

ALLOWED_TAGS = {
    "a", "abbr", "b", "blockquote", "br", "code", "del", "em", "h1", "h2", "h3", "h4",
    "h5", "h6", "hr", "i", "kbd", "li", "ol", "p", "pre", "s", "strong", "sub", "sup",
    "table", "tbody", "td", "th", "thead", "tr", "ul",
}  # fmt: skip
ALLOWED_ATTRIBUTES = {"a": {"href", "title"}, "abbr": {"title"}, "th": {"align"}, "td": {"align"}}
URL_SCHEMES = {"http", "https", "mailto"}
# Whole elements (with their content) that never survive.
CLEAN_CONTENT_TAGS = {"script", "style", "iframe", "object", "embed", "template", "noscript"}

# Media types a download may keep; anything else is served as application/octet-stream.
SAFE_DOWNLOAD_TYPES = {
    "text/plain",
    "text/csv",
    "application/json",
    "application/pdf",
    "application/zip",
    "application/gzip",
    "image/png",
    "image/jpeg",
    "image/gif",
    "image/webp",
    "audio/mpeg",
    "audio/wav",
    "video/mp4",
}

_md = MarkdownIt("commonmark", {"html": False, "linkify": False, "breaks": True}).enable(
    ["table", "strikethrough"]
)


def sanitize_html(html: str) -> SafeString:
    """Sanitize an HTML fragment; the result may be inserted into a page."""
    cleaned = nh3.clean(
        html,
        tags=ALLOWED_TAGS,
        clean_content_tags=CLEAN_CONTENT_TAGS,
        attributes=ALLOWED_ATTRIBUTES,
        url_schemes=URL_SCHEMES,
        url_relative="deny",
        link_rel="noopener noreferrer",
        set_tag_attribute_values={"a": {"target": "_blank"}},
        strip_comments=True,
    )
    return mark_safe(cleaned)  # sanitized just above


MARKDOWN_CACHE_SIZE = 256
# Past this size text is shown as plain (escaped) text: rendering markdown costs
# about 5 ms per KB, and a long machine output is rarely meant as markdown.
MARKDOWN_MAX_CHARS = 20_000
_markdown_cache: OrderedDict[bytes, SafeString] = OrderedDict()
_markdown_lock = threading.Lock()
# Markdown characters one page may render (not counting what the cache holds): the limit
# above is per text, and a page of a hundred messages, each of runs of ``![`` (~15 us a
# character against ~2 for prose), took 100 s. The slowest pattern found since, ``[`` and a
# line break repeated, costs 45-80 us a character here: 100,000 were 3-8 s a view. 20,000
# keep the worst page near a second and hold pages of ordinary messages. Past it, plain text.
PAGE_MARKDOWN_CHARS = 20_000
_page_markdown: ContextVar[list[int] | None] = ContextVar("page_markdown", default=None)


@contextmanager
def markdown_budget(chars: int | None = None) -> Iterator[None]:
    """Within this block, markdown rendered in all costs at most ``chars`` characters
    (``PAGE_MARKDOWN_CHARS`` by default)."""
    token = _page_markdown.set([PAGE_MARKDOWN_CHARS if chars is None else chars])
    try:
        yield
    finally:
        _page_markdown.reset(token)


def markdown_budgeted(view: Callable[..., Any]) -> Callable[..., Any]:
    """A view whose whole response (its template included) renders within one budget."""

    @functools.wraps(view)
    def budgeted(*args: Any, **kwargs: Any) -> Any:
        with markdown_budget():
            return view(*args, **kwargs)

    return budgeted


# The project's own guides: their source is wrapped at a line length, so a line break is not
# a break (an agent's message, above, keeps its line breaks).
_md_document = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable(
    ["table", "strikethrough"]
)


def document_html(text: str) -> SafeString:
    """One of the project's own guides (trusted, long): markdown to sanitized HTML, no budget."""
    return sanitize_html(_md_document.render(text))


def markdown_html(text: str) -> SafeString:
    """Markdown (raw HTML disabled) -> sanitized HTML; remembered for repeated views."""
    text = text or ""
    if len(text) > MARKDOWN_MAX_CHARS:
        return plain_text_html(text)
    key = hashlib.sha256(text.encode()).digest()
    with _markdown_lock:
        if key in _markdown_cache:
            _markdown_cache.move_to_end(key)
            return _markdown_cache[key]
    budget = _page_markdown.get()
    if budget is not None:
        if budget[0] < len(text):
            return plain_text_html(text)
        budget[0] -= len(text)
    html = sanitize_html(_md.render(text))
    with _markdown_lock:
        _markdown_cache[key] = html
        while len(_markdown_cache) > MARKDOWN_CACHE_SIZE:
            _markdown_cache.popitem(last=False)
    return html


def plain_text_html(text: str) -> SafeString:
    """Text shown as it is (escaped), keeping its line breaks."""
    return format_html('<pre class="plain-text">{}</pre>', text)


# Characters JSON may carry raw that change how the text around them is drawn (bidi
# overrides and isolates, zero-width characters, line separators, C1 controls): an agent's
# right-to-left override reversed the rest of a line of its raw card.
_DRAWN_WRONG = re.compile("[\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def pretty_json(value: Any) -> str:
    """Indented JSON text (not HTML: the template or textContent escapes it). The characters
    above are written as escapes: the same JSON value, shown as what it holds."""
    try:
        text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False)
    except (TypeError, ValueError):
        return repr(value)
    if _DRAWN_WRONG.search(text):
        text = _DRAWN_WRONG.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return text


def safe_http_url(url: Any) -> str | None:
    """The URL if it is an absolute http(s) URL, else None."""
    if not isinstance(url, str):
        return None
    url = url.strip()
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if (
        parts.scheme.lower() in ("http", "https")
        and parts.netloc
        and not any(c in url for c in "\r\n\t")
    ):
        return url
    return None


# What of an agent's file name or media type is read (its end) and shown: past these, text an
# agent chose makes a page of megabytes (or seconds of filtering) on every view.
FILENAME_READ_CHARS = 1_000
MEDIA_TYPE_CHARS = 100


def shown_media_type(media: Any, default: str = "application/octet-stream") -> str:
    """An agent's media type as shown: text, at most MEDIA_TYPE_CHARS characters."""
    text = media if isinstance(media, str) and media else default
    return text if len(text) <= MEDIA_TYPE_CHARS else text[: MEDIA_TYPE_CHARS - 1] + "…"


def safe_filename(name: Any, default: str = "download") -> str:
    """A file name without path separators, quotes or control characters."""
    if not isinstance(name, str) or not name.strip():
        return default
    # Cut first: an agent's name of megabytes was filtered a character at a time on every view.
    name = name[-FILENAME_READ_CHARS:].replace("\\", "/").rsplit("/", 1)[-1]
    cleaned = "".join(ch for ch in name if ch.isprintable() and ch not in '"<>:;|?*')
    cleaned = cleaned.strip(" .")[:150]
    return cleaned or default


def download_content_type(media_type: Any) -> str:
    media = (
        (media_type or "").split(";", 1)[0].strip().lower() if isinstance(media_type, str) else ""
    )
    return media if media in SAFE_DOWNLOAD_TYPES else "application/octet-stream"


def decode_raw(part: dict) -> bytes | None:
    raw = part.get("raw")
    if not isinstance(raw, str):
        return None
    # ProtoJSON bytes are standard or URL-safe base64, padded or not. The lenient decoder
    # (it skips line breaks) would also skip "-" and "_" and decode URL-safe text wrongly.
    if "-" in raw or "_" in raw:
        raw = raw.translate(_URL_SAFE)
    try:
        return base64.b64decode(raw + "=" * (-len(raw) % 4), validate=False)
    except (binascii.Error, ValueError):
        return None


_URL_SAFE = str.maketrans("-_", "+/")


def _raw_size(part: dict) -> int:
    raw = part.get("raw")
    return (len(raw) * 3) // 4 if isinstance(raw, str) else 0


def _human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def part_kind(part: Any) -> str:
    if not isinstance(part, dict):
        return "unknown"
    for key in ("text", "data", "raw", "url"):
        if key in part:
            return key
    return "unknown"


def parts_html(
    parts: Iterable[Any],
    download_url: Callable[[int], str] | None = None,
    *,
    max_chars: int | None = None,
) -> SafeString:
    """Render a list of parts. Consecutive text parts are one markdown document

    (a streamed artifact's chunks split words and lines anywhere).

    ``max_chars``: at most about this many characters of text and data are shown, and at
    most ``PARTS_SHOWN`` parts; what is left out is counted (the log and the export hold
    it). Artifact previews come cut to their byte budget already.
    """
    out: list[str] = []
    text_run: list[str] = []
    left = max_chars
    parts = list(parts)

    def shown(text: str) -> str:
        nonlocal left
        if left is None:
            return text
        cut, left = text[: max(left, 0)], max(left - len(text), 0)
        return cut

    def flush() -> None:
        if text_run:
            text = "".join(text_run)
            kept = shown(text)
            out.append(format_html('<div class="md">{}</div>', markdown_html(kept)))
            if len(kept) < len(text):
                out.append(_left_out(f"{len(text) - len(kept):,} more characters"))
            text_run.clear()

    limit = len(parts) if max_chars is None else min(len(parts), PARTS_SHOWN)
    for index, part in enumerate(parts[:limit]):
        kind = part_kind(part)
        if kind == "text":
            text_run.append(str(part.get("text") or ""))
            continue
        flush()
        if kind == "data" and a2ui.is_a2ui_part(part):
            # The surface is drawn from the fold (tasks_app/a2ui_render.py); its JSON is kept
            # one click away rather than above the form it describes.
            data = pretty_json(part.get("data"))
            kept = shown(data)  # counted like any data part: it is the agent's text too
            out.append(
                format_html(
                    '<details class="a2ui-json"><summary>A2UI message (drawn as a form)</summary>'
                    '<pre class="json">{}</pre></details>',
                    kept,
                )
            )
            if len(kept) < len(data):
                out.append(_left_out(f"{len(data) - len(kept):,} more characters"))
        elif kind == "data":
            data = pretty_json(part.get("data"))
            kept = shown(data)
            out.append(format_html('<pre class="json">{}</pre>', kept))
            if len(kept) < len(data):
                out.append(_left_out(f"{len(data) - len(kept):,} more characters"))
        elif kind == "raw":
            name = safe_filename(part.get("filename"), f"part-{index}")
            media = shown_media_type(part.get("mediaType"))
            size = _human_size(_raw_size(part))
            if download_url is not None:
                out.append(
                    format_html(
                        '<p class="file"><a class="download" href="{}" download="{}">Download {}</a>'
                        ' <span class="muted">({}, {})</span></p>',
                        download_url(index),
                        name,
                        name,
                        media,
                        size,
                    )
                )
            else:
                out.append(
                    format_html(
                        '<p class="file">File {} <span class="muted">({}, {})</span></p>',
                        name,
                        media,
                        size,
                    )
                )
        elif kind == "url":
            url = safe_http_url(part.get("url"))
            label = safe_filename(part.get("filename"), "") or str(part.get("url"))[:200]
            if url:
                out.append(
                    format_html(
                        '<p class="file"><a href="{}" rel="noopener noreferrer" target="_blank">{}</a>'
                        ' <span class="muted">(link)</span></p>',
                        url,
                        label,
                    )
                )
            else:
                out.append(
                    format_html(
                        '<p class="file">Link not shown (not http/https): <code>{}</code></p>',
                        str(part.get("url"))[:300],
                    )
                )
        else:
            out.append(
                format_html('<pre class="json unknown-part">{}</pre>', shown(pretty_json(part)))
            )
    flush()
    if limit < len(parts):
        out.append(_left_out(f"{len(parts) - limit:,} more parts"))
    return mark_safe("".join(str(x) for x in out))  # every piece escaped/sanitized


# What one message shows (parts_html's ``max_chars``, and at most PARTS_SHOWN parts): an
# agent's message of 8 MB was a page of 8 MB.
MESSAGE_SHOWN_CHARS = 64_000
PARTS_SHOWN = 500


def _left_out(what: str) -> SafeString:
    return format_html(
        '<p class="muted small left-out">… {} not shown here (the log and the export hold '
        "them)</p>",
        what,
    )


def message_html(message: Any, download_url: Callable[[int], str] | None = None) -> SafeString:
    if not isinstance(message, dict):
        text = pretty_json(message)
        return format_html('<pre class="json">{}</pre>', text[:MESSAGE_SHOWN_CHARS])
    parts = message.get("parts") if isinstance(message.get("parts"), list) else []
    return parts_html(parts, download_url, max_chars=MESSAGE_SHOWN_CHARS)


def message_text(message: Any, limit: int = 300) -> str:
    """Plain text of a message's text parts (for titles and summaries)."""
    if not isinstance(message, dict):
        return ""
    texts = [
        str(p.get("text"))
        for p in message.get("parts") or []
        if isinstance(p, dict) and isinstance(p.get("text"), str)
    ]
    text = " ".join(t.strip() for t in texts if t.strip())
    return text[:limit]


def plain(value: Any) -> str:
    """Escaped text for places where a template is not used."""
    return escape(str(value))
