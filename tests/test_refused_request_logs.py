"""What a client that is refused can make our logs do: Django logs every refused request (a
forged Host header at ERROR with a traceback, each 4xx at WARNING); a flood of them writes
one line of each kind a minute, then says how many it left out."""

from __future__ import annotations

import io
import logging

import pytest
from django.conf import settings
from django.test import Client
from django.utils.module_loading import import_string

from tasks_app.runtime import logs
from tests.test_log_bounds import OURS, text_formatter


@pytest.fixture
def console():
    """A handler like ``LOGGING``'s console (the text format, the refused-requests filter)
    on the root logger, writing to a buffer; the filter, to move its clock."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(text_formatter())
    refused = logs.RefusedRequests()
    handler.addFilter(refused)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield buffer, refused
    finally:
        root.removeHandler(handler)


def test_the_console_handler_carries_the_filter() -> None:
    config = settings.LOGGING
    assert "refused_requests" in config["handlers"]["console"]["filters"]
    assert import_string(config["filters"]["refused_requests"]["()"]) is logs.RefusedRequests


def records_of(text: str) -> list[str]:
    """The records in the buffer: each starts with a line of ours, the rest are its lines."""
    records: list[str] = []
    for line in text.splitlines():
        if OURS.match(line):
            records.append(line)
        else:
            assert records, line
            records[-1] += "\n" + line
    return records


@pytest.mark.django_db
def test_a_flood_of_forged_host_headers_logs_one_line_without_a_traceback(console) -> None:
    buffer, refused = console
    client = Client(HTTP_HOST="evil.example")
    for _ in range(200):
        assert client.get("/login/").status_code == 400
    records = records_of(buffer.getvalue())
    security = [r for r in records if "django.security.DisallowedHost" in r]
    assert len(security) == 1, records
    assert "Traceback" not in security[0] and "\n" not in security[0]
    assert "evil.example" in security[0]
    # Every record of the flood is within 2 of the kinds it makes (security + request).
    assert len(records) <= 2, records

    # After the window, the next one says how many were left out.
    for spell in refused._spells.values():
        spell[0] -= refused.window + 1
    assert client.get("/login/").status_code == 400
    later = records_of(buffer.getvalue())[len(records) :]
    again = [r for r in later if "django.security.DisallowedHost" in r]
    assert len(again) == 1 and "(199 more like it not logged)" in again[0], later


@pytest.mark.django_db
def test_not_found_pages_are_counted_per_status_and_errors_pass(console) -> None:
    buffer, _ = console
    client = Client()
    for i in range(50):
        assert client.get(f"/no-such-page-{i}/").status_code == 404
    records = records_of(buffer.getvalue())
    assert len(records) == 1 and "Not Found: /no-such-page-0/" in records[0], records

    # Records of other kinds are untouched: a server error keeps its traceback, every time.
    logger = logging.getLogger("django.request")
    for _ in range(3):
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.error("Internal Server Error: /x", exc_info=True, extra={"status_code": 500})
    for _ in range(3):
        logging.getLogger("tasks_app.watchers").warning("a warning of ours")
    records = records_of(buffer.getvalue())[1:]
    assert sum("Internal Server Error" in r and "Traceback" in r for r in records) == 3
    assert sum("a warning of ours" in r for r in records) == 3


@pytest.mark.django_db
def test_a_refused_permission_is_one_line_without_a_traceback(console, django_user_model) -> None:
    """A person without the role a page needs: Django logged "Forbidden (Permission denied)"
    with the whole stack of the refusal, 30 lines for each click."""
    buffer, _ = console
    client = Client()
    client.force_login(django_user_model.objects.create_user("nobody"))
    assert client.get("/audit/").status_code == 403
    records = records_of(buffer.getvalue())
    forbidden = [r for r in records if "Forbidden (Permission denied)" in r]
    assert len(forbidden) == 1, records
    assert "Traceback" not in forbidden[0] and "\n" not in forbidden[0]
