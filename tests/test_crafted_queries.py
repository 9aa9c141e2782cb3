"""Every page, given any query string or form a person can craft: an answer, never a 500.

The routes, the people and the objects they name come from ``tests/test_access_matrix.py``
(every route of the URL conf). Each GET route is asked with every query parameter the views
and filter forms read, and each POST route is sent every field the views and forms read, set
to values a form or a hand-edited URL can hold: bytes that are not UTF-8, a NUL, text longer
than any field, numbers past any column, a parameter given twice. None of the values is a URL
a guard would have to refuse: the agents named here listen nowhere (127.0.0.1:9).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.http import HttpResponseBase
from django.test import Client
from django.urls import reverse

from tests.test_access_matrix import RULES, app_routes, url_for, world  # noqa: F401 (fixture)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

# What the views read from ``request.GET`` and the filter forms' fields (tasks, events, audit).
PARAMETERS = (
    "cursor", "after", "format", "text", "agent", "artifact", "verify", "v", "url", "place",
    "next", "fragment", "all_artifacts", "state", "phase", "context", "q", "sort", "kind",
    "channel", "view", "person", "action", "project", "since", "until", "page",
)  # fmt: skip

# Raw (already percent-encoded) values: the test client would refuse to encode some of them.
VALUES = (
    "%ED%A0%80%FF",  # a lone surrogate's bytes and a byte no UTF-8 has
    "%00",
    "x" * 1000,  # past every field's max_length
    "-1",
    "9" * 40,
    "1e999",
    "%25",
    "..%2F..%2Fetc%2Fpasswd",
    "%5B%5D%7B%7D",  # []{}
    "0001-01-01T00%3A00%3A00%2B05%3A00",
)


# What the views read from ``request.POST`` and the forms' fields (agents, tasks, answers).
FIELDS = (
    "next", "watch", "username", "password", "surface", "source", "seq", "origin", "action",
    "url", "name", "project", "kind", "token", "api_key", "api_key_name", "api_key_location",
    "agent", "skill", "text", "data", "mode", "kept_file", "kept_file_name", "drop_kept_file",
    "reason", "question",
)  # fmt: skip


def _queries(names: tuple[str, ...]) -> list[str]:
    queries = ["&".join(f"{name}={value}" for name in names) for value in VALUES]
    # Each parameter twice, with two different values.
    queries.append("&".join(f"{name}=1&{name}=%00" for name in names))
    return queries


Asker = Callable[[Client, str, str], HttpResponseBase]


def _ask_every_route(
    client: Client, objects: dict, wanted: Callable[[str], bool], ask: Asker, names: tuple[str, ...]
) -> None:
    """Ask every route ``wanted`` takes with each crafted query or body: none answers 500."""
    errors: list[str] = []
    asked = 0
    for name, pattern in app_routes():
        if not wanted(name):
            continue
        url = url_for(name, pattern, objects)
        for crafted in _queries(names):
            response = ask(client, url, crafted)
            asked += 1
            if response.status_code >= 500:
                errors.append(f"{name} {crafted[:80]}…: {response.status_code}")
    assert asked > 100  # the routes were found and asked
    assert not errors, "\n".join(errors)
    assert client.get(reverse("overview")).status_code == 200  # asked as this person throughout


def _get(client: Client, url: str, query: str) -> HttpResponseBase:
    return client.get(f"{url}?{query}")


def _post(client: Client, url: str, body: str) -> HttpResponseBase:
    return client.post(url, body, content_type="application/x-www-form-urlencoded")


def _page(name: str) -> bool:
    # /healthz reads no parameter, and answers 503 here by design (no worker runs).
    return RULES[name].method == "GET" and name not in ("logout", "healthz")


def _form(name: str) -> bool:
    # The forms of three GET pages are posted to the same route; the webhook takes JSON
    # (tests/test_push_webhook.py); logging out would end the session for what follows.
    rule = RULES[name]
    posted = rule.method == "POST" or name in ("agent-add", "task-new", "login")
    return posted and not rule.json and name != "logout"


@pytest.mark.parametrize("person", ["agent admin", "auditor"])
def test_every_page_answers_any_query_string_without_an_error(world, person) -> None:  # noqa: F811
    _ask_every_route(world["people"][person], world, _page, _get, PARAMETERS)


@pytest.mark.parametrize("person", ["agent admin", "auditor"])
def test_every_form_answers_any_crafted_body_without_an_error(world, person) -> None:  # noqa: F811
    _ask_every_route(world["people"][person], world, _form, _post, FIELDS)
