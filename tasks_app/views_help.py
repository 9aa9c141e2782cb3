"""The guides people read while they work, served from the project's own ``docs/``.

The pages link to them ("the export format" next to an export link): an auditor checking
an export offline needs the format, and a link to a file in a clone they may not have is
no help. Only the guides listed here are served, by name; the rest of ``docs/`` is for the
people who run and change the dashboard.
"""

from __future__ import annotations

import functools
from pathlib import Path

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.safestring import SafeString
from django.views.decorators.http import require_GET

from tasks_app.rendering import document_html

# name in the URL -> (file in docs/, title)
GUIDES: dict[str, tuple[str, str]] = {
    "exports": ("exports.md", "Exports, the action log and retention"),
    "answers": ("answers.md", "Answering agents"),
}


@functools.cache
def _rendered(path: Path, modified: float) -> SafeString:
    """One guide as HTML, rendered once per version of its file."""
    return document_html(path.read_text(encoding="utf-8"))


@login_required
@require_GET
def guide(request: HttpRequest, name: str) -> HttpResponse:
    if name not in GUIDES:
        raise Http404("No such guide.")
    filename, title = GUIDES[name]
    path = Path(settings.DOCS_DIR) / filename
    try:
        html = _rendered(path, path.stat().st_mtime)
    except OSError as exc:
        # An installation without the docs folder: say so, not a 500.
        raise Http404(f"This installation does not carry docs/{filename}.") from exc
    return render(request, "tasks_app/guide.html", {"title": title, "body": html, "name": name})
