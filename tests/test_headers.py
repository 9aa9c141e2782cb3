"""Who may see what on the edges of the site (issue 11): ``/healthz`` answers ok / not ok to
anyone and details to staff only, within a bounded time; the security headers.

Everything real: the views through Django's test client, a real Redis, and a loopback
server that accepts connections and never answers, to stand for a hung dependency.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from django.conf import settings as django_settings
from django.test import Client

from tasks_app import health
from tasks_app.runtime.net import free_port
from tests import pages
from tests.ui_stack import chromium

# --- 1. /healthz ----------------------------------------------------------------------------


@pytest.fixture
def black_hole() -> Iterator[socket.socket]:
    """A loopback listener whose connections the kernel establishes and nobody answers."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    try:
        yield server
    finally:
        server.close()  # the waiting connections are reset: a check stuck on one ends


def client_for(django_user_model, **flags: bool) -> Client:
    user = django_user_model.objects.create_user(
        username=f"u{len(flags)}{sorted(flags)}", password="pw-12345678", **flags
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.django_db
def test_anonymous_and_non_staff_get_only_ok(django_user_model) -> None:
    for client in (Client(), client_for(django_user_model)):
        answer = client.get("/healthz")
        assert answer.status_code in {200, 503}
        assert answer.json() == {"ok": answer.status_code == 200}
        assert "no-store" in answer["Cache-Control"] or "no-cache" in answer["Cache-Control"]


@pytest.mark.django_db
def test_staff_see_each_check(django_user_model) -> None:
    answer = client_for(django_user_model, is_staff=True).get("/healthz")
    body = answer.json()
    assert set(body) == {"ok", "checks"}
    assert set(body["checks"]) == {check.name for check in health.CHECKS}
    for name in ("database", "redis", "channel_layer"):  # real, and running for the tests
        assert body["checks"][name]["ok"] is True and body["checks"][name]["message"] == "ok"
    assert answer.status_code == (200 if body["ok"] else 503)
    assert body["ok"] == all(check["ok"] for check in body["checks"].values())


@pytest.fixture
def hung_redis(settings, black_hole: socket.socket) -> Iterator[str]:
    """Redis and the channel layer pointed at the black hole, with a password in the URL."""
    from channels.layers import channel_layers

    url = f"redis://:planted-redis-password@127.0.0.1:{black_hole.getsockname()[1]}/0"
    settings.REDIS_URL = url
    layer = dict(settings.CHANNEL_LAYERS["default"])
    layer["CONFIG"] = {**layer["CONFIG"], "hosts": [{"address": url, "socket_timeout": None}]}
    settings.CHANNEL_LAYERS = {"default": layer}
    channel_layers.backends = {}
    yield url
    channel_layers.backends = {}


@pytest.mark.django_db
@pytest.mark.timeout(60)
def test_a_hung_dependency_is_not_ok_within_the_deadline(django_user_model, hung_redis) -> None:
    staff = client_for(django_user_model, is_staff=True)
    started = time.monotonic()
    answer = staff.get("/healthz")
    took = time.monotonic() - started
    assert took < health.HEALTH_DEADLINE_SECONDS + 0.5, took
    assert answer.status_code == 503
    checks = answer.json()["checks"]
    assert checks["database"]["ok"] is True
    assert checks["redis"] == {**checks["redis"], "ok": False,
                               "message": "Redis did not answer (TimeoutError)"}  # fmt: skip
    assert checks["channel_layer"]["ok"] is False
    text = answer.content.decode()
    port = hung_redis.rsplit(":", 1)[1].split("/")[0]
    for leak in ("planted-redis-password", port, "127.0.0.1", "redis://"):
        assert leak not in text, (leak, text)

    started = time.monotonic()
    assert Client().get("/healthz").json() == {"ok": False}
    assert time.monotonic() - started < health.HEALTH_DEADLINE_SECONDS + 0.5


def _hang_on(port: int) -> None:
    """A check without its own bound: it waits as long as the peer stays silent."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.settimeout(30)
        sock.recv(1)


@pytest.mark.django_db
@pytest.mark.timeout(60)
def test_a_check_that_ignores_its_timeout_is_cut_off_and_not_started_twice(
    django_user_model, monkeypatch, black_hole: socket.socket
) -> None:
    port = black_hole.getsockname()[1]
    stuck = health.Check("stuck", lambda timeout: _hang_on(port), 0.5, "it hung")
    database = next(check for check in health.CHECKS if check.name == "database")
    monkeypatch.setattr(health, "CHECKS", (stuck, database))
    staff = client_for(django_user_model, is_staff=True)

    first = staff.get("/healthz").json()["checks"]
    # Cut off, not left hanging (it would hang until the test closes the socket). Timed by the
    # check's own clock (from its start to the verdict), not around the whole request, whose
    # login and session work once took the wall time 0.07 s past this bound under parallel load.
    assert first["stuck"]["ms"] < (0.5 + health.GRACE_SECONDS + 0.5) * 1000
    assert first["stuck"]["ok"] is False
    assert first["stuck"]["message"] == f"no answer within {0.5 + health.GRACE_SECONDS:.1f} s"
    assert first["database"]["ok"] is True

    # Still hanging: the next poll does not start a second thread for it.
    second = staff.get("/healthz").json()["checks"]
    assert second["stuck"] == {"ok": False, "message": "an earlier check has not finished yet",
                               "ms": 0.0}  # fmt: skip
    assert second["database"]["ok"] is True
    in_flight = health._running["stuck"]
    assert not in_flight.done()

    black_hole.close()  # the peer goes away: the stuck thread ends, and the check runs again
    with pytest.raises(OSError):
        in_flight.result(timeout=10)
    third = staff.get("/healthz").json()["checks"]
    assert third["stuck"] == {
        **third["stuck"],
        "ok": False,
        "message": "it hung (ConnectionRefusedError)",
    }


def _switchable_check(state: dict[str, bool]) -> health.Check:
    """A check that passes or fails as ``state["up"]`` says, with a fixed sentence."""

    def run(timeout: float) -> None:
        if not state["up"]:
            raise health.CheckFailed("the part is down")

    return health.Check("part", run, 0.5, "the part failed")


@pytest.mark.django_db
def test_health_is_logged_once_per_change_and_polls_are_not(monkeypatch, caplog) -> None:
    state = {"up": False}
    database = next(check for check in health.CHECKS if check.name == "database")
    monkeypatch.setattr(health, "CHECKS", (_switchable_check(state), database))
    monkeypatch.setattr(health, "_last_ok", None)  # a process that has not answered yet
    monkeypatch.setattr(health, "_been_ok", False)
    caplog.set_level(logging.INFO)

    def poll_and_take_log(expected_status: int) -> list[tuple[str, int, str]]:
        caplog.clear()
        assert Client().get("/healthz").status_code == expected_status
        return [(r.name, r.levelno, r.getMessage()) for r in caplog.records]

    # Not ok before anything was: a part still starting (INFO), and Django's request logger
    # does not add an ERROR for the 503.
    assert poll_and_take_log(503) == [
        ("tasks_app.health", logging.INFO, "Health: not ready yet (part: the part is down)")
    ]
    assert poll_and_take_log(503) == []  # unchanged: nothing, however often it is polled
    state["up"] = True
    assert poll_and_take_log(200) == [("tasks_app.health", logging.INFO, "Health: ready")]
    assert poll_and_take_log(200) == []
    state["up"] = False  # down after having been up: a warning, once
    assert poll_and_take_log(503) == [
        ("tasks_app.health", logging.WARNING, "Health: not ok (part: the part is down)")
    ]
    assert poll_and_take_log(503) == []
    state["up"] = True
    assert poll_and_take_log(200) == [
        ("tasks_app.health", logging.INFO, "Health: every check answers again")
    ]


@pytest.mark.django_db
def test_a_driver_error_is_said_once_with_its_class_not_once_per_poll(
    monkeypatch, caplog, settings
) -> None:
    """Redis refusing connections: one WARNING naming the check and the error's class."""
    database = next(check for check in health.CHECKS if check.name == "database")
    redis_check = next(check for check in health.CHECKS if check.name == "redis")
    monkeypatch.setattr(health, "CHECKS", (database, redis_check))
    monkeypatch.setattr(health, "_last_ok", True)  # a process that has answered ok
    monkeypatch.setattr(health, "_been_ok", True)
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    caplog.set_level(logging.INFO)
    for _ in range(3):
        assert Client().get("/healthz").status_code == 503
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("tasks_app.health", logging.WARNING,
         "Health: not ok (redis: Redis did not answer (ConnectionError))"),
    ]  # fmt: skip


@pytest.mark.django_db
def test_a_redis_that_answers_and_refuses_is_said_to_refuse(
    django_user_model, monkeypatch, settings
) -> None:
    """The real Redis, asked for a database it does not have: it answers, with an error.
    It was said not to answer, which sends an operator after the network."""
    checks = tuple(check for check in health.CHECKS if check.name in ("database", "redis"))
    monkeypatch.setattr(health, "CHECKS", checks)
    settings.REDIS_URL = urlsplit(settings.REDIS_URL)._replace(path="/99999").geturl()
    answer = client_for(django_user_model, is_staff=True).get("/healthz")
    assert answer.status_code == 503
    said = answer.json()["checks"]
    assert said["redis"]["message"] == "Redis refused the command (ResponseError)"
    assert said["database"]["message"] == "ok"


@pytest.mark.django_db
def test_a_first_answer_that_is_ok_logs_nothing(monkeypatch, caplog) -> None:
    database = next(check for check in health.CHECKS if check.name == "database")
    monkeypatch.setattr(health, "CHECKS", (database,))
    monkeypatch.setattr(health, "_last_ok", None)
    monkeypatch.setattr(health, "_been_ok", False)
    caplog.set_level(logging.INFO)
    assert Client().get("/healthz").status_code == 200
    assert [r for r in caplog.records if r.name.startswith(("tasks_app", "django"))] == []


# --- 2. headers -----------------------------------------------------------------------------

POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' {admin_style}; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'; "
    "object-src 'none'"
)
INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)(?![^>]*type=\"application/json\")[^>]*>", re.I)
INLINE_HANDLER = re.compile(r"<[^>]+\son[a-z]+\s*=", re.I)
INLINE_STYLE = re.compile(r"<[^>]+\sstyle\s*=|<style", re.I)
ADMIN_CHANGELIST_STYLE = django_settings.ADMIN_CHANGELIST_STYLE
ADMIN_CHANGELIST_STYLE_HASH = django_settings.ADMIN_CHANGELIST_STYLE_HASH


@pytest.fixture
def superuser_client(django_user_model) -> Client:
    user = django_user_model.objects.create_superuser("root", password="pw-12345678")
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def site(superuser_client, django_user_model) -> pages.Site:
    return pages.build_site(django_user_model.objects.get(username="root"))


def test_the_policy_is_the_one_asked_for(settings) -> None:
    from tasks_app.middleware import serialize_policy

    assert serialize_policy(settings.CONTENT_SECURITY_POLICY) == POLICY.format(
        admin_style=ADMIN_CHANGELIST_STYLE_HASH
    )


@pytest.mark.django_db
def test_every_page_has_the_policy_and_no_inline_code(superuser_client, site) -> None:
    """What a superuser can GET: the header on each answer; pages free of inline script,
    handlers and style (the admin's one style block excepted: it is allowed by its hash)."""
    seen = 0
    site_policy = POLICY.format(admin_style=ADMIN_CHANGELIST_STYLE_HASH)
    for name, url in {**pages.app_urls(site), **pages.admin_urls()}.items():
        answer = superuser_client.get(url)
        policy = answer["Content-Security-Policy"]
        if not answer["Content-Type"].startswith("text/html") or answer.streaming:
            # Downloads bring their own, stricter policy; the rest get the site's.
            assert policy in {site_policy, "default-src 'none'; sandbox"}, (name, policy)
            continue
        assert policy == site_policy, name
        html = answer.content.decode()
        seen += 1
        assert not INLINE_SCRIPT.search(html), (name, INLINE_SCRIPT.search(html))
        assert not INLINE_HANDLER.search(html), (name, INLINE_HANDLER.search(html))
        if name.startswith("admin:"):
            html = html.replace(f"<style>{ADMIN_CHANGELIST_STYLE}</style>", "")
        assert not INLINE_STYLE.search(html), (name, INLINE_STYLE.search(html))
    assert seen >= 20, seen
    login = Client().get("/accounts/login/")
    assert "Content-Security-Policy" in login and not INLINE_SCRIPT.search(login.content.decode())


@pytest.mark.django_db
def test_what_a_user_gets_is_not_stored(superuser_client, site) -> None:
    """Pages, fragments, JSON and downloads for a logged-in user: no-store (or the view's own
    no-store); static files keep their cache lifetime; the anonymous login page is never_cache."""
    for name, url in pages.app_urls(site).items():
        answer = superuser_client.get(url)
        if answer.status_code == 405:
            continue  # POST only: nothing to cache
        assert "no-store" in answer["Cache-Control"], (
            name,
            answer.status_code,
            answer["Cache-Control"],
        )
    for url in pages.admin_urls().values():
        assert "no-store" in superuser_client.get(url)["Cache-Control"], url
    static = superuser_client.get("/static/dashboard/app.css")
    assert static.status_code == 200 and "no-store" not in static.get("Cache-Control", "")
    assert "no-store" in Client().get("/accounts/login/")["Cache-Control"]
    # Django's own headers through SecurityMiddleware, on every answer.
    answer = Client().get("/accounts/login/")
    assert answer["X-Content-Type-Options"] == "nosniff"
    assert answer["Referrer-Policy"] == "same-origin"
    assert answer["X-Frame-Options"] == "DENY"
    assert "Strict-Transport-Security" not in answer  # local (not production) runs


PRODUCTION_PROBE = """
import json, django
django.setup()
from django.conf import settings
from django.test import Client
plain = Client().get("/accounts/login/")
tls = Client().get("/accounts/login/", secure=True)
proxied = Client().get("/accounts/login/", headers={"X-Forwarded-Proto": "https"})
print(json.dumps({
    "proxy": settings.SECURE_PROXY_SSL_HEADER, "redirect": settings.SECURE_SSL_REDIRECT,
    "cookies": [settings.SESSION_COOKIE_SECURE, settings.CSRF_COOKIE_SECURE],
    "plain": plain.get("Strict-Transport-Security"), "tls": tls.get("Strict-Transport-Security"),
    "proxied": proxied.get("Strict-Transport-Security"), "status": plain.status_code,
}))
"""


def run_settings_probe(tmp_path, **env: str) -> subprocess.CompletedProcess[str]:
    from tests.infra import REPO_ROOT

    drop = {"DASHBOARD_PRODUCTION", "SECRET_KEY", "ALLOWED_HOSTS", "SECURE_PROXY_SSL_HEADER",
            "SECURE_HSTS_SECONDS", "SECURE_SSL_REDIRECT", "DATABASE_URL", "DATA_DIR"}  # fmt: skip
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full.update(DJANGO_SETTINGS_MODULE="dashboard.settings", DATA_DIR=str(tmp_path), **env)
    return subprocess.run([sys.executable, "-c", PRODUCTION_PROBE], cwd=REPO_ROOT, env=full,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


PRODUCTION = {"DASHBOARD_PRODUCTION": "1", "SECRET_KEY": "k" * 50, "ALLOWED_HOSTS": "testserver"}


@pytest.mark.subprocess
def test_production_mode_sends_hsts_and_trusts_the_proxy_header_only_when_told(tmp_path) -> None:
    year = 365 * 24 * 3600
    bare = run_settings_probe(tmp_path, **PRODUCTION)
    assert bare.returncode == 0, bare.stderr
    seen = json.loads(bare.stdout.splitlines()[-1])
    assert seen["proxy"] is None and seen["redirect"] is False and seen["cookies"] == [True, True]
    assert seen["status"] == 200  # no redirect to https: the proxy in front does that
    assert seen["plain"] is None and seen["tls"] == f"max-age={year}"
    assert seen["proxied"] is None  # X-Forwarded-Proto is not believed without the setting

    behind = run_settings_probe(tmp_path, **PRODUCTION, SECURE_HSTS_SECONDS="600",
                                SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto,https")  # fmt: skip
    assert behind.returncode == 0, behind.stderr
    seen = json.loads(behind.stdout.splitlines()[-1])
    assert seen["proxy"] == ["HTTP_X_FORWARDED_PROTO", "https"]
    assert seen["proxied"] == "max-age=600" and seen["plain"] is None

    # No value; a name no request can carry; a value with a comma (it was read as "https,x").
    for value in ("X-Forwarded-Proto", "X Forwarded,https", "X-Forwarded-Proto,https,x"):
        wrong = run_settings_probe(tmp_path, **PRODUCTION, SECURE_PROXY_SSL_HEADER=value)
        assert wrong.returncode != 0, value
        assert 'SECURE_PROXY_SSL_HEADER must be "HEADER,value"' in wrong.stderr


# --- 2b. the policy in a real browser -------------------------------------------------------

# Collected in the page from its first script on (an init script is not subject to the policy).
COLLECT_VIOLATIONS = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__csp.push(e.violatedDirective + " " + (e.blockedURI || "inline") + " " + e.sourceFile + ":" + e.lineNumber);
});
"""


def html_pages(base_url: str, cookie: str, urls: dict[str, str]) -> dict[str, str]:
    """The URLs that answer a full HTML page (not JSON, a fragment download or a 405)."""
    import httpx

    found = {}
    with httpx.Client(base_url=base_url, cookies={"sessionid": cookie}, timeout=30) as client:
        for name, url in urls.items():
            answer = client.get(url)
            html = answer.headers["content-type"].startswith("text/html")
            if answer.status_code == 200 and html and "<html" in answer.text[:200]:
                found[name] = url
    return found


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_no_page_reports_a_policy_violation_in_chromium(
    live_server_daphne, django_user_model
) -> None:
    root = django_user_model.objects.create_superuser("csp-root", password="pw-12345678")
    site = pages.build_site(root)
    client = Client()
    client.force_login(root)
    cookie = client.cookies["sessionid"].value
    urls = html_pages(live_server_daphne, cookie, {**pages.app_urls(site), **pages.admin_urls()})
    assert {"overview", "task-list", "task-detail", "agent-detail", "task-new",
            "admin:index", "admin:tasks_app_taskevent_changelist"} <= set(urls), urls  # fmt: skip

    with chromium() as browser:
        context = browser.new_context(base_url=live_server_daphne)
        context.add_cookies([{"name": "sessionid", "value": cookie, "url": live_server_daphne}])
        context.add_init_script(COLLECT_VIOLATIONS)
        reported: dict[str, list[str]] = {}
        page = context.new_page()
        console: list[str] = []
        page.on("console", lambda message: console.append(message.text))
        try:
            for name, url in urls.items():
                console.clear()
                answer = page.goto(url)
                assert answer is not None and answer.status == 200, (name, url)
                assert "default-src 'self'" in answer.headers["content-security-policy"]
                if page.locator("#live-status").count():  # a live page: its socket must open
                    page.wait_for_selector("#live-status[data-state=open]", timeout=10_000)
                page.wait_for_timeout(150)
                found = page.evaluate("window.__csp") + [
                    text for text in console if "Content Security Policy" in text
                ]
                if found:
                    reported[name] = found
            # The listener does hear a violation: an inline script added by the page itself.
            page.evaluate("""() => { const s = document.createElement("script");
                s.textContent = "window.ran = 1"; document.body.append(s); }""")
            page.wait_for_timeout(150)
            assert page.evaluate("window.ran") is None
            assert any(v.startswith("script-src") for v in page.evaluate("window.__csp"))

            # The login page, as someone not logged in sees it, and logging in through it.
            anonymous = browser.new_context(base_url=live_server_daphne)
            anonymous.add_init_script(COLLECT_VIOLATIONS)
            login = anonymous.new_page()
            login.goto("/accounts/login/")
            login.wait_for_timeout(150)
            if login.evaluate("window.__csp"):
                reported["login"] = login.evaluate("window.__csp")
            login.fill("#id_username", "csp-root")
            login.fill("#id_password", "pw-12345678")
            login.click("button[type=submit]")
            login.wait_for_url(f"{live_server_daphne}/")
            anonymous.close()
        finally:
            context.close()
    assert reported == {}, reported


@pytest.mark.django_db
def test_a_staff_session_that_cannot_be_read_gets_the_plain_answer_not_a_500(
    django_user_model, monkeypatch
) -> None:
    """The staff's session is read from the database, which may be the part that is down."""
    from django.db import connection

    database = next(check for check in health.CHECKS if check.name == "database")
    monkeypatch.setattr(health, "CHECKS", (database,))
    staff = client_for(django_user_model, is_staff=True)
    assert "checks" in staff.get("/healthz").json()
    with connection.cursor() as cursor:  # as when the session's table cannot be read
        cursor.execute("ALTER TABLE django_session RENAME TO django_session_away")
    answer = staff.get("/healthz")
    assert answer.status_code in (200, 503)
    assert "checks" not in answer.json()


@pytest.mark.django_db
def test_an_expired_form_gets_the_sites_page_with_a_way_back(django_user_model) -> None:
    """A form sent after a sign-in in another tab (its CSRF token then stale) got Django's
    bare "CSRF verification failed" page, its inline style refused by the site's policy,
    and no link back."""
    user = django_user_model.objects.create_user("tabs", password="pw-12345678")
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    response = client.post("/tasks/new", {"text": "hi"})
    body = response.content.decode()
    assert response.status_code == 403
    assert "This form has expired" in body and "Go back, reload the page" in body
    assert 'href="/"' in body and "<style" not in body and "CSRF verification failed" not in body


@pytest.mark.django_db
def test_a_host_name_the_site_does_not_serve_is_named_among_the_reasons(client) -> None:
    """An administrator whose ALLOWED_HOSTS or proxy was wrong was told of upload sizes."""
    response = client.get("/", HTTP_HOST="not-served.example")
    assert response.status_code == 400
    assert "host name the site does not answer to" in response.content.decode()
