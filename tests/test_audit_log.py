"""The operator-action log (/audit/): filters, bad filters, keyset paging, who sees what, no secrets."""

from __future__ import annotations

import csv
import io
import re
from datetime import UTC, datetime, timedelta
from urllib.parse import parse_qs, urlparse

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import Client
from django.urls import reverse

from tasks_app.models import Agent, Membership, OperatorAction, Project, RemoteTask
from tests.people import member

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 3, 10, 12, 0, tzinfo=UTC)
SECRETS = (
    "s3cret-token-value",
    "sk-live-apikey-value",
    "hunter2-password",
    "client-secret-value",
    "abc.def.ghi",
)


@pytest.fixture
def world(django_user_model) -> dict:
    alpha, beta = Project.objects.create(name="alpha"), Project.objects.create(name="beta")
    a1 = Agent.objects.create(project=alpha, name="alpha one", base_url="http://127.0.0.1:9/a1")
    a2 = Agent.objects.create(
        project=alpha, name='=HYPERLINK("x")', base_url="http://127.0.0.1:9/a2"
    )
    b1 = Agent.objects.create(project=beta, name="beta one", base_url="http://127.0.0.1:9/b1")
    task = RemoteTask.objects.create(agent=a1, remote_id="t-1", title="alpha task", phase="task")
    users = {}
    for name, role, project in (
        ("ann", Membership.Role.OPERATOR, "alpha"), ("bob", Membership.Role.OPERATOR, "beta"),
        ("auditor", Membership.Role.AUDITOR, "alpha"), ("viewer", Membership.Role.VIEWER, "alpha"),
    ):  # fmt: skip
        users[name] = member(
            django_user_model.objects.create_user(name, password="pw-12345678"), role, project
        )
    users["root"] = django_user_model.objects.create_superuser("root", "", "pw-12345678")

    def act(
        action: str, day: int, *, agent=a1, task=None, actor="ann", payload=None, outcome=""
    ) -> OperatorAction:
        return OperatorAction.objects.create(
            action=action, agent=agent, task=task, actor=users[actor] if actor else None,
            payload=payload or {}, outcome=outcome, created_at=T0 + timedelta(days=day),
        )  # fmt: skip

    rows = {
        "start": act("start", 0, task=task, payload={"mode": "stream"}),
        "cancel": act("cancel", 1, task=task, payload={"reason": "too slow"}, outcome="requested"),
        "creds": act(
            "set-credentials",
            2,
            agent=a2,
            payload={
                "fields": ["token"],
                "token": SECRETS[0],
                "api_key": SECRETS[1],
                "password": SECRETS[2],
                "nested": {"client_secret": SECRETS[3], "kept": "visible-value"},
                "header": "Bearer " + SECRETS[4],
            },
        ),
        "beta": act("start", 3, agent=b1, actor="bob"),
        "member": act(
            "member-add", 4, agent=None, actor=None, payload={"user": "ann", "project": "alpha"}
        ),
        "abandon": act("abandon", 5, task=task, payload={"reason": "gone"}),
    }
    clients = {}
    for name, user in users.items():
        clients[name] = Client()
        clients[name].force_login(user)
    return {
        "rows": rows,
        "clients": clients,
        "a1": a1,
        "a2": a2,
        "b1": b1,
        "alpha": alpha,
        "beta": beta,
    }


def shown(response) -> list[int]:
    return [int(pk) for pk in re.findall(r'data-action="(\d+)"', response.content.decode())]


def ids(world, *names: str) -> list[int]:
    return [world["rows"][n].pk for n in names]


def test_an_auditor_sees_their_projects_actions_only_newest_first(world) -> None:
    response = world["clients"]["auditor"].get(reverse("audit"))
    assert response.status_code == 200
    assert shown(response) == ids(
        world, "abandon", "creds", "cancel", "start"
    )  # not beta's, not the member change
    body = response.content.decode()
    assert "alpha task" in body and "too slow" in body and "visible-value" in body
    root = world["clients"]["root"].get(reverse("audit"))
    assert shown(root) == ids(world, "abandon", "member", "beta", "creds", "cancel", "start")
    assert 'href="/audit/"' in body  # the navigation link, for people who audit


def test_people_who_audit_nowhere_are_refused(world) -> None:
    for name in ("viewer", "ann"):
        before = OperatorAction.objects.filter(action="forbidden").count()
        response = world["clients"][name].get(reverse("audit"))
        assert response.status_code == 403
        assert OperatorAction.objects.filter(action="forbidden").count() == before + 1
        assert world["clients"][name].get(reverse("audit-csv")).status_code == 403
        assert (
            'href="/audit/"' not in world["clients"][name].get(reverse("overview")).content.decode()
        )
    assert Client().get(reverse("audit")).status_code == 302


def test_each_filter_and_combined(world) -> None:
    client = world["clients"]["root"]
    a1, alpha = world["a1"], world["alpha"]
    cases = {
        "person=ann": ids(world, "abandon", "creds", "cancel", "start"),
        "person=bob": ids(world, "beta"),
        "action=start": ids(world, "beta", "start"),
        "action=member-add": ids(world, "member"),
        f"agent={a1.pk}": ids(world, "abandon", "cancel", "start"),
        f"project={alpha.pk}": ids(world, "abandon", "creds", "cancel", "start"),
        "since=2026-03-12": ids(world, "abandon", "member", "beta", "creds"),
        "until=2026-03-11": ids(world, "cancel", "start"),  # a bare date includes that whole day
        "since=2026-03-11T00:00&until=2026-03-12T12:00:01": ids(world, "creds", "cancel"),
        f"person=ann&action=start&project={alpha.pk}&since=2026-03-01&until=2026-03-31": ids(
            world, "start"
        ),
        f"person=bob&project={alpha.pk}": [],
    }
    for query, expected in cases.items():
        response = client.get(reverse("audit") + "?" + query)
        assert response.status_code == 200, query
        assert shown(response) == expected, query
        csv_rows = list(
            csv.reader(
                io.StringIO(
                    b"".join(
                        client.get(reverse("audit-csv") + "?" + query).streaming_content
                    ).decode()
                )
            )
        )
        assert [int(r[0]) for r in csv_rows[1:]] == expected, query


@pytest.mark.parametrize(
    ("query", "field", "message"),
    [
        ("since=yesterday-ish", "since", "is not a date"),
        ("until=2026-13-45", "until", "is not a date"),
        # A moment no database compares (year 1 at +05:00 is before any UTC time): a
        # message, not a 500. (9999-12-31, whose next midnight overflows, is a date: see
        # tests/test_form_messages.py.)
        ("since=0001-01-01T00:00:00%2B05:00", "since", "is not a date"),
        ("since=2026-03-12&until=2026-03-01", "until", "must be after"),
        ("person=nobody-here", "person", "No person named"),
        ("action=launch-missiles", "action", "Unknown action"),
        # A "%" in the filter is text, not a format directive of the message (was a 500).
        ("action=50%25%E2%80%9D+off", "action", "Unknown action “50%” off”"),
        ("person=100%25%E2%80%9D", "person", "No person named “100%””"),
        ("agent=abc", "agent", "No such agent"),
        ("agent=999999", "agent", "No such agent"),
        ("project=999999", "project", "No such project"),
    ],
)
def test_bad_filters_give_a_message_next_to_the_filter(world, query, field, message) -> None:
    response = world["clients"]["root"].get(reverse("audit") + "?" + query)
    assert response.status_code == 400
    body = response.content.decode()
    errors = re.search(rf'<ul class="errorlist" id="id_{field}_error">(.*?)</ul>', body, re.S)
    assert errors and message in errors.group(1), body[:3000]
    assert shown(response) == []
    bad_csv = world["clients"]["root"].get(reverse("audit-csv") + "?" + query)
    assert bad_csv.status_code == 400 and message.encode() in bad_csv.content


def test_an_auditor_cannot_filter_on_another_projects_agent(world) -> None:
    response = world["clients"]["auditor"].get(reverse("audit") + f"?agent={world['b1'].pk}")
    assert response.status_code == 400 and "No such agent" in response.content.decode()


def test_an_auditor_learns_nothing_of_people_outside_the_projects_they_audit(world) -> None:
    """bob is a member of beta only: to alpha's auditor he is no person, in the same words
    as a name nobody has (and the action only beta's log holds is unknown the same way)."""
    from django.contrib.auth import get_user_model

    auditor = world["clients"]["auditor"]

    def person_error(name: str) -> str:
        response = auditor.get(reverse("audit") + f"?person={name}")
        assert response.status_code == 400
        found = re.search(
            r'<ul class="errorlist" id="id_person_error">(.*?)</ul>',
            response.content.decode(),
            re.S,
        )
        assert found, response.content.decode()[:2000]
        return found.group(1).replace(name, "NAME")

    assert person_error("bob") == person_error("nobody-here")
    assert "No person named" in person_error("bob")
    # A superuser who acted in alpha, and alpha's own members, can be filtered on.
    get_user_model().objects.create_superuser("admin2", "", "pw-12345678")
    OperatorAction.objects.create(
        action="cancel", agent=world["a1"], actor=get_user_model().objects.get(username="admin2")
    )
    for name in ("ann", "admin2"):
        assert auditor.get(reverse("audit") + f"?person={name}").status_code == 200
    # An unknown action that only beta's log holds is as unknown as one nobody took.
    OperatorAction.objects.create(action="beta-only", agent=world["b1"])
    refused = auditor.get(reverse("audit") + "?action=beta-only")
    assert refused.status_code == 400 and "Unknown action" in refused.content.decode()
    assert world["clients"]["root"].get(reverse("audit") + "?action=beta-only").status_code == 200


def test_naming_a_person_reads_that_persons_actions_not_the_whole_log(world) -> None:
    """Whether the person named is one this auditor may name (a member, or someone who acted
    in the audited projects) is asked of that person alone: asked as "anyone among all the
    log's actors", it read the whole audited log on every filtered page (125 ms of the
    page's 190 for 100,000 actions). On SQLite each query the page sends is checked to
    search the action table through an index, never to scan it."""
    from django.contrib.auth import get_user_model
    from django.test.utils import CaptureQueriesContext

    from tasks_app.runtime import sqlite_stats

    carol = get_user_model().objects.create_user("carol", password="pw-12345678")  # no member
    ann = get_user_model().objects.get(username="ann")
    OperatorAction.objects.bulk_create(
        [OperatorAction(action="cancel", agent=world["a1"], actor=ann,
                        created_at=T0 + timedelta(seconds=i)) for i in range(3000)]
        + [OperatorAction(action="start", agent=world["a1"], actor=carol, created_at=T0)],
        batch_size=1000,
    )  # fmt: skip
    sqlite_stats.refresh()  # as up and beat keep the planner's statistics (no-op on PostgreSQL)
    with CaptureQueriesContext(connection) as queries:
        response = world["clients"]["auditor"].get(reverse("audit") + "?person=carol")
    assert response.status_code == 200
    (carols,) = OperatorAction.objects.filter(actor=carol)
    assert shown(response) == [carols.pk]
    table = OperatorAction._meta.db_table
    read = [q["sql"] for q in queries.captured_queries if f'"{table}"' in q["sql"]]
    assert read, "the page read no action"
    if connection.vendor != "sqlite":
        return  # PostgreSQL's planner scans a table this small whatever the query
    for sql in read:
        # The table, under its name or an alias a subquery gives it ("tasks_app_x" U0).
        names = {table, *re.findall(rf'"{table}" (?:AS )?(\w+)', sql)}
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN QUERY PLAN " + sql)
            plan = [str(row[-1]) for row in cursor.fetchall()]
        scans = [step for step in plan if step.split(" ")[:2] in (["SCAN", n] for n in names)]
        assert not scans, (sql, plan)


def test_a_broken_cursor_is_a_message(world) -> None:
    response = world["clients"]["root"].get(reverse("audit") + "?cursor=not-a-cursor!!")
    assert response.status_code == 400 and 'id="audit-bad-cursor"' in response.content.decode()


def test_an_action_found_in_the_log_is_a_valid_filter(world) -> None:
    OperatorAction.objects.create(action="brand-new-kind", agent=world["a1"], created_at=T0)
    response = world["clients"]["root"].get(reverse("audit") + "?action=brand-new-kind")
    assert response.status_code == 200 and len(shown(response)) == 1


def test_keyset_paging_has_no_duplicates_and_no_gaps_when_rows_share_a_timestamp(world) -> None:
    same = T0 + timedelta(days=30)
    OperatorAction.objects.bulk_create(
        [OperatorAction(action="refresh-card", agent=world["a1"], created_at=same) for _ in range(123)]
        + [OperatorAction(action="refresh-card", agent=world["a1"], created_at=same - timedelta(microseconds=1)) for _ in range(7)]
    )  # fmt: skip
    expected = list(
        OperatorAction.objects.filter(action="refresh-card")
        .order_by("-created_at", "-id")
        .values_list("pk", flat=True)
    )
    client, url, seen, pages = (
        world["clients"]["auditor"],
        reverse("audit") + "?action=refresh-card",
        [],
        0,
    )
    while url:
        response = client.get(url)
        assert response.status_code == 200
        seen += shown(response)
        pages += 1
        found = re.search(r'href="(\?[^"]*cursor=[^"]*)" id="next-page"', response.content.decode())
        url = reverse("audit") + found.group(1).replace("&amp;", "&") if found else ""
        if found:
            assert parse_qs(urlparse(url).query)["action"] == [
                "refresh-card"
            ]  # filters carried along
    assert pages == 3 and len(seen) == 130 and len(set(seen)) == 130 and seen == expected


def test_secrets_are_never_shown_or_exported(world) -> None:
    client = world["clients"]["root"]
    page = client.get(reverse("audit")).content.decode()
    exported = b"".join(client.get(reverse("audit-csv")).streaming_content).decode()
    out = io.StringIO()
    call_command("audit", "actions", "--csv", stdout=out)
    plain = io.StringIO()
    call_command("audit", "actions", stdout=plain)
    for text in (page, exported, out.getvalue(), plain.getvalue()):
        for secret in SECRETS:
            assert secret not in text
        assert "visible-value" in text and "not shown" in text


def test_csv_cells_never_start_a_formula(world) -> None:
    rows = list(
        csv.reader(
            io.StringIO(
                b"".join(
                    world["clients"]["root"].get(reverse("audit-csv")).streaming_content
                ).decode()
            )
        )
    )
    assert rows[0][:4] == ["id", "created_at", "person", "action"]
    agent_cells = [row[6] for row in rows[1:] if row[5] == str(world["a2"].pk)]
    assert agent_cells == ['\'=HYPERLINK("x")']
    assert all(not cell.startswith(("=", "+", "@")) for row in rows for cell in row)


def test_the_command_lists_with_the_same_filters(world) -> None:
    out = io.StringIO()
    call_command(
        "audit",
        "actions",
        "--csv",
        "--person",
        "ann",
        "--project",
        "alpha",
        "--until",
        "2026-03-11",
        stdout=out,
    )
    rows = list(csv.reader(io.StringIO(out.getvalue())))
    assert [int(r[0]) for r in rows[1:]] == ids(world, "cancel", "start")
    plain = io.StringIO()
    call_command("audit", "actions", "--agent", "beta one", stdout=plain)
    assert plain.getvalue().count("\n") == 1 and "bob" in plain.getvalue()
    with pytest.raises(CommandError, match="is not a date"):
        call_command("audit", "actions", "--since", "soon", stdout=io.StringIO())
    with pytest.raises(CommandError, match="No person named"):
        call_command("audit", "actions", "--person", "ghost", stdout=io.StringIO())


def test_an_action_with_text_no_page_can_hold_is_stored_clean_and_old_rows_are_shown(
    world,
) -> None:
    """A reason typed with a byte that is not UTF-8 (``manage.py tasks cancel --reason``)
    reaches Python as a lone surrogate: the audit page answered 500 for every row page that
    held it, the CSV stopped midway, and PostgreSQL refused the row."""
    odd = OperatorAction.objects.create(
        action="cancel", agent=world["a1"], payload={"reason": "\udcff bad"}, outcome="no\ud800"
    )
    odd.refresh_from_db()
    assert odd.payload == {"reason": "\ufffd bad"} and odd.outcome == "no\ufffd"
    # A row written before, straight to the table: SQLite kept the JSON escape (PostgreSQL
    # refuses it), and it reads back as a lone surrogate.
    if connection.vendor == "sqlite":
        OperatorAction.objects.filter(pk=odd.pk).update(payload={"reason": "old\udcff"})
    root = world["clients"]["root"]
    page = root.get(reverse("audit"))
    assert page.status_code == 200 and odd.pk in shown(page)
    rows = list(
        csv.reader(io.StringIO(b"".join(root.get(reverse("audit-csv")).streaming_content).decode()))
    )
    assert len(rows) == 1 + len(world["rows"]) + 1
