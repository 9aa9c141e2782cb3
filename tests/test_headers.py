"""Who may see what on the edges of the site (issue 11): ``/healthz`` answers ok / not ok to
anyone and details to staff only, within a bounded time; the security headers.

Everything real: the views through Django's test client, a real Redis, and a loopback
server that accepts connections and never answers, to stand for a hung dependency.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from django.test import Client

from tasks_app import health

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

    started = time.monotonic()
    first = staff.get("/healthz").json()["checks"]
    assert time.monotonic() - started < 0.5 + health.GRACE_SECONDS + 0.5
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
    assert third["stuck"] == {**third["stuck"], "ok": False, "message": "it hung (ConnectionRefusedError)"}
