"""``manage.py up``, run the way the README says: as a process, with nothing configured."""

from __future__ import annotations

import io
import logging
import os
import queue
import re
import shelve
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import httpx
import psutil
import pytest
import redis
from celery.app import trace

from tasks_app.management.commands import up as up_command
from tasks_app.management.commands.up import Runner, StartupError
from tasks_app.runtime.admin import PASSWORD_FILE, ensure_admin
from tasks_app.runtime.net import free_port
from tasks_app.runtime.supervisor import Backoff, Supervisor
from tests.infra import REPO_ROOT

URL_LINE = re.compile(r"Dashboard running at (http://\S+)")
RECONCILE = "tasks_app.watchers.reconcile"
# Nearly every test here runs manage.py up or the supervisor's children; the ones that bring
# the whole stack up are marked with what it starts, too.
pytestmark = pytest.mark.subprocess
# The demo agent is written separately; until it exists, --demo must say so clearly.


def up_env(data_dir: Path, **extra: str) -> dict[str, str]:
    """A clean local environment: no Redis, no database configured, data in ``data_dir``."""
    drop = {"REDIS_URL", "DATABASE_URL", "CELERY_BROKER_URL", "CELERY_QUEUE", "SECRET_KEY",
            "DASHBOARD_PRODUCTION", "DASHBOARD_TEST_DB_FILE", "ALLOWED_HOSTS"}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1", **extra)
    return env


def run_up(
    args: list[str], env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "up", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class Lines:
    """Collects a process's output lines in a thread, so waiting for one never blocks."""

    def __init__(self, stream: IO[str]) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str] | None:
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                return None
            if line is None:
                return None
            self.seen.append(line)
            if match := pattern.search(line):
                return match
        return None

    def rest(self, timeout: float = 5) -> list[str]:
        self.wait_for(re.compile(r"(?!)"), timeout)
        return self.seen


def log_in(client: httpx.Client, username: str, password: str) -> None:
    """Through the login form, as a browser would (CSRF token and Referer included)."""
    page = client.get("/accounts/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert token, page.text
    answer = client.post(
        "/accounts/login/",
        data={"username": username, "password": password, "csrfmiddlewaretoken": token.group(1)},
        headers={"Referer": f"{client.base_url}accounts/login/"},
    )
    assert answer.status_code == 302, answer.text


@pytest.fixture
def up_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Lines, Path]]:
    data_dir = tmp_path / "data"
    demo = ["--demo"]
    process = subprocess.Popen(
        [sys.executable, "manage.py", "up", "--port", str(free_port()), *demo],
        cwd=REPO_ROOT,
        env=up_env(data_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield process, Lines(process.stdout), data_dir
    finally:
        if process.poll() is None:  # the test failed half-way: do not leave it running
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
        process.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.worker
@pytest.mark.agent
def test_up_runs_everything_and_leaves_nothing_behind(up_process) -> None:
    process, lines, data_dir = up_process
    match = lines.wait_for(URL_LINE, timeout=90)
    assert match, "\n".join(lines.seen)
    url = match.group(1).rstrip("/")

    login = next(line for line in lines.seen if line.startswith("Log in as admin / "))
    password = login.removeprefix("Log in as admin / ")
    stored = data_dir / PASSWORD_FILE
    assert stored.read_text().strip() == password
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600

    assert any(
        line.startswith("Demo agent running at") and "registered" in line for line in lines.seen
    ), "\n".join(lines.seen)

    # Anyone gets ok / not ok only; the admin it created sees every check.
    response = httpx.get(f"{url}/healthz", timeout=10)
    assert (response.status_code, response.json()) == (200, {"ok": True}), response.text
    with httpx.Client(base_url=url, timeout=10) as admin:
        log_in(admin, "admin", password)
        checks = admin.get("/healthz").json()["checks"]
    assert set(checks) == {"database", "redis", "channel_layer", "worker"}, checks
    assert all(check["ok"] and check["message"] == "ok" for check in checks.values()), checks

    descendants = psutil.Process(process.pid).children(recursive=True)
    names = " ".join(" ".join(p.cmdline()) for p in descendants)
    for part in ["redis-server", "worker", "beat", "daphne", "tasks_app.demo_agent"]:
        assert part in names, names

    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 0, "\n".join(lines.rest())
    _gone, alive = psutil.wait_procs(descendants, timeout=5)
    assert not alive, f"left running: {alive}"

    # Everything it left in DATA_DIR is its owner's alone: database, keys, beat's schedule,
    # the private Redis's folder (the test process's umask is the usual 022).
    found = {p.relative_to(data_dir).as_posix(): (p.is_dir(), stat.S_IMODE(p.stat().st_mode))
             for p in [data_dir, *data_dir.rglob("*")]}  # fmt: skip
    assert any(name.startswith("celerybeat-schedule") for name in found), found
    assert found["redis"] == (True, 0o700), found
    wide = {name: oct(mode) for name, (is_dir, mode) in found.items()
            if mode != (0o700 if is_dir else 0o600)}  # fmt: skip
    assert wide == {}, wide


IDLE_SECONDS = 10
# What one reconcile tick used to print: beat's "Sending due task", the worker's received/succeeded.
TICK_LINE = re.compile(r"Sending due task|tasks_app\.watchers\.reconcile\[")


def _children_named(process: subprocess.Popen[str], part: str) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(process.pid).children(recursive=True):
        try:
            if part in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def _healthy(url: str) -> bool:
    try:
        response = httpx.get(f"{url}/healthz", timeout=10)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and response.json() == {"ok": True}


def _kill_and_see_it_come_back(
    process: subprocess.Popen[str], lines: Lines, url: str, name: str, part: str
) -> list[psutil.Process]:
    """SIGKILL the child whose command line holds ``part``; return the processes seen."""
    (victim,) = [p for p in _children_named(process, part) if p.ppid() == process.pid]
    victim.send_signal(signal.SIGKILL)
    said = re.compile(
        rf"^{name} \(pid {victim.pid}\) was killed by SIGKILL; restarting it in 1 s\.$"
    )
    assert lines.wait_for(said, timeout=30), "\n".join(lines.seen)
    assert lines.wait_for(re.compile(rf"^{name} restarted \(pid \d+\)\.$"), timeout=30)

    deadline = time.monotonic() + 90
    while not _healthy(url):
        assert process.poll() is None, "\n".join(lines.rest())
        assert time.monotonic() < deadline, "\n".join(lines.rest(timeout=0.5))
        time.sleep(0.5)
    successors = [p for p in _children_named(process, part) if p.ppid() == process.pid]
    assert successors and victim.pid not in {p.pid for p in successors}
    return [victim, *successors]


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.worker
@pytest.mark.agent
def test_up_restarts_a_killed_child_and_stays_quiet_while_idle(up_process) -> None:
    process, lines, data_dir = up_process
    match = lines.wait_for(URL_LINE, timeout=90)
    assert match, "\n".join(lines.seen)
    url = match.group(1).rstrip("/")

    # Idle: beat keeps ticking (counted below, from its schedule file), the output stays quiet.
    lines.rest(timeout=IDLE_SECONDS)
    ticks = [line for line in lines.seen if TICK_LINE.search(line)]
    assert not ticks, ticks
    seen = psutil.Process(process.pid).children(recursive=True)

    seen += _kill_and_see_it_come_back(process, lines, url, "worker", "celery -A dashboard worker")
    seen += _kill_and_see_it_come_back(process, lines, url, "redis", "redis-server")
    assert process.poll() is None
    seen += psutil.Process(process.pid).children(recursive=True)

    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 0, "\n".join(lines.rest())
    _gone, alive = psutil.wait_procs(seen, timeout=5)
    assert not alive, f"left running: {alive}"

    # Beat saved its schedule on the way out: the reconcile task did run while nothing showed.
    with shelve.open(str(data_dir / "celerybeat-schedule"), flag="r") as schedule:
        runs = schedule["entries"]["reconcile-watchers"].total_run_count
    assert runs >= IDLE_SECONDS // 4, runs


def _tend_until(supervisor: Supervisor, done: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "deadline passed"
        supervisor.tend()
        time.sleep(0.02)


def test_a_child_that_keeps_dying_is_restarted_less_and_less_often(tmp_path: Path) -> None:
    output = io.StringIO()
    backoff = Backoff(first=0.1, maximum=0.4, stable_after=60)
    crashing = [sys.executable, "-c", "import sys; sys.exit(3)"]
    with Supervisor(output=output) as supervisor:
        child = supervisor.start("crasher", crashing, env=dict(os.environ), cwd=tmp_path,
                                 restart=backoff)  # fmt: skip
        _tend_until(supervisor, lambda: child.restarts >= 4)
    lines = output.getvalue().splitlines()
    deaths = [line for line in lines if "restarting it in" in line]
    delays = [line.rsplit("restarting it in ", 1)[1] for line in deaths]
    assert delays == ["0.1 s.", "0.2 s.", "0.4 s.", "0.4 s."], lines
    assert all(line.startswith("crasher (pid ") and "exited with code 3" in line for line in deaths)
    assert sum(line.startswith("crasher restarted (pid ") for line in lines) == 4


def test_a_child_that_stayed_up_comes_back_after_the_first_delay(tmp_path: Path) -> None:
    output = io.StringIO()
    backoff = Backoff(first=0.1, maximum=5, stable_after=0.3)
    # Up for about a second each time: longer than stable_after, so no death counts as "in a row".
    lives_a_while = [sys.executable, "-c", "import time; time.sleep(1); raise SystemExit(2)"]
    with Supervisor(output=output) as supervisor:
        child = supervisor.start("sleeper", lives_a_while, env=dict(os.environ), cwd=tmp_path,
                                 restart=backoff)  # fmt: skip
        _tend_until(supervisor, lambda: child.restarts >= 3)
        last = psutil.Process(child.pid)
    lines = output.getvalue().splitlines()
    deaths = [line for line in lines if "restarting it in" in line]
    assert len(deaths) == 3, lines
    assert all(line.endswith("exited with code 2; restarting it in 0.1 s.") for line in deaths)
    assert not last.is_running()  # leaving the block stopped the current incarnation


def test_a_child_that_cannot_be_started_again_is_retried(tmp_path: Path) -> None:
    script = tmp_path / "child.sh"
    script.write_text("#!/bin/sh\nexit 4\n")
    script.chmod(0o755)
    output = io.StringIO()
    with Supervisor(output=output) as supervisor:
        child = supervisor.start("gone", [str(script)], env=dict(os.environ), cwd=tmp_path,
                                 restart=Backoff(first=0.1, maximum=0.2))  # fmt: skip
        child.popen.wait(timeout=30)
        script.unlink()  # the next start fails with an OSError, not a traceback
        _tend_until(supervisor, lambda: "could not be started" in output.getvalue())
        script.write_text("#!/bin/sh\nsleep 30\n")
        script.chmod(0o755)
        _tend_until(supervisor, lambda: child.restarts == 1 and child.alive())
    lines = output.getvalue().splitlines()
    assert lines[0].endswith("exited with code 4; restarting it in 0.1 s."), lines
    assert any(
        line.startswith("gone could not be started (") and line.endswith("restarting it in 0.2 s.")
        for line in lines
    ), lines
    assert lines[-1].startswith("gone restarted (pid ")


def test_a_child_without_restart_policy_is_only_reported(tmp_path: Path) -> None:
    output = io.StringIO()
    with Supervisor(output=output) as supervisor:
        child = supervisor.start("once", [sys.executable, "-c", "pass"], env=dict(os.environ),
                                 cwd=tmp_path)  # fmt: skip
        child.popen.wait(timeout=30)
        supervisor.tend()
        assert supervisor.first_exited() is child
        assert child.restarts == 0
    assert output.getvalue() == ""


@pytest.mark.parametrize(
    ("logger", "log", "shown"),
    [
        ("celery.beat", lambda lg: lg.info("Scheduler: Sending due task %s (%s)", "reconcile-watchers", RECONCILE), False),
        ("celery.worker.strategy", lambda lg: lg.info(trace.LOG_RECEIVED, {"name": RECONCILE, "id": "1", "args": "()", "kwargs": "{}", "eta": None}), False),
        ("celery.app.trace", lambda lg: lg.info(trace.LOG_SUCCESS, {"name": RECONCILE, "id": "1", "runtime": 0.01, "return_value": 0}), False),
        # The push drain, once per delivery burst (half a busy log's lines).
        ("celery.worker.strategy", lambda lg: lg.info(trace.LOG_RECEIVED, {"name": "tasks_app.jobs.drain_push", "id": "3", "args": "()", "kwargs": "{}", "eta": None}), False),
        ("celery.app.trace", lambda lg: lg.info(trace.LOG_SUCCESS, {"name": "tasks_app.jobs.drain_push", "id": "3", "runtime": 0.01, "return_value": 4}), False),
        # A failing tick, and every other task, still show.
        ("celery.app.trace", lambda lg: lg.error(trace.LOG_FAILURE, {"name": RECONCILE, "id": "1", "exc": "boom", "description": "raised unexpected"}), True),
        ("celery.beat", lambda lg: lg.info("Scheduler: Sending due task %s (%s)", "other", "tasks_app.watchers.watch"), True),
        ("celery.app.trace", lambda lg: lg.info(trace.LOG_SUCCESS, {"name": "tasks_app.watchers.watch", "id": "2", "runtime": 0.01, "return_value": None}), True),
    ],
)  # fmt: skip
def test_the_reconcile_tick_says_nothing_at_info(
    caplog: pytest.LogCaptureFixture,
    logger: str,
    log: Callable[[logging.Logger], None],
    shown: bool,
) -> None:
    """The filter configured in settings.LOGGING, on the loggers celery really uses."""
    with caplog.at_level(logging.INFO):
        log(logging.getLogger(logger))
    assert bool(caplog.records) is shown, caplog.records


def test_port_in_use_is_reported_with_the_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_up(["--port", str(port)], up_env(tmp_path))
    assert result.returncode == 1
    assert f"Port {port} on 127.0.0.1 is already in use; pass --port" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.fixture
def demo_port_taken_meanwhile(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[Runner, int, io.StringIO]]:
    """A runner whose demo agent's port (the web port + 1) was free when checked and is
    taken before the agent binds it; yields the runner, that port and what ``up`` said."""
    output = io.StringIO()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        wanted = taken.getsockname()[1]
        runner = Runner(host="127.0.0.1", port=wanted - 1, demo=True)
        runner.supervisor = Supervisor(output=output)
        monkeypatch.setattr(up_command, "port_available", lambda host, port: True)
        try:
            yield runner, wanted, output
        finally:
            runner.supervisor.stop_all()


@pytest.mark.agent
def test_the_demo_agent_moves_to_another_port_when_its_port_is_taken_meanwhile(
    tmp_path: Path, demo_port_taken_meanwhile: tuple[Runner, int, io.StringIO]
) -> None:
    runner, wanted, output = demo_port_taken_meanwhile
    url = runner._start_demo(up_env(tmp_path))
    card = httpx.get(f"{url}.well-known/agent-card.json", timeout=10)
    assert url != f"http://127.0.0.1:{wanted}/" and card.status_code == 200, output.getvalue()
    assert f"The demo agent could not listen on port {wanted}; trying another port." in (
        output.getvalue()
    )


@pytest.mark.agent
def test_the_demo_agent_gives_up_after_its_last_try_naming_that_port(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    demo_port_taken_meanwhile: tuple[Runner, int, io.StringIO],
) -> None:
    runner, wanted, output = demo_port_taken_meanwhile
    monkeypatch.setattr(up_command, "PORT_TRIES", 1)
    with pytest.raises(
        StartupError, match=rf"^The demo agent did not start listening on port {wanted}\.$"
    ):
        runner._start_demo(up_env(tmp_path))
    assert "trying another port" not in output.getvalue()


@pytest.mark.subprocess
def test_the_private_redis_moves_to_another_port_when_its_port_is_taken_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings
) -> None:
    """The kernel's free port is taken before redis-server binds it: the next try serves."""
    output = io.StringIO()
    settings.DATA_DIR = tmp_path
    applied: list[str] = []
    monkeypatch.setattr(up_command, "apply_redis_url", applied.append)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        wanted = taken.getsockname()[1]
        ports = iter([wanted])
        monkeypatch.setattr(up_command, "free_port", lambda: next(ports, None) or free_port())
        runner = Runner(host="127.0.0.1", port=free_port(), demo=False)
        runner.supervisor = Supervisor(output=output)
        try:
            runner._start_redis()
            (url,) = applied
            assert url != f"redis://127.0.0.1:{wanted}/0"
            assert redis.Redis.from_url(url, socket_timeout=5).ping()
        finally:
            runner.supervisor.stop_all()
    assert f"The private Redis could not listen on port {wanted}; trying another port." in (
        output.getvalue()
    )


def test_unreachable_redis_is_one_sentence(tmp_path: Path) -> None:
    port = free_port()
    env = up_env(tmp_path, REDIS_URL=f"redis://:hunter2@127.0.0.1:{port}/0")
    result = run_up(["--port", str(free_port())], env)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: Cannot reach Redis at REDIS_URL")
    assert "hunter2" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("nonsense://what", "Configuration error: DATABASE_URL is not a valid database URL"),
        (
            "postgres://someone:pw@127.0.0.1:{port}/nothing",
            "Error: Cannot connect to the database at DATABASE_URL",
        ),
    ],
)
def test_bad_database_url_is_one_sentence(tmp_path: Path, url: str, expected: str) -> None:
    env = up_env(tmp_path, DATABASE_URL=url.format(port=free_port()))
    result = run_up(["--port", str(free_port())], env)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(expected)
    assert ":pw@" not in result.stderr


def test_production_without_settings_is_one_line(tmp_path: Path) -> None:
    result = run_up(["--port", str(free_port())], up_env(tmp_path, DASHBOARD_PRODUCTION="1"))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "Configuration error: SECRET_KEY must be set when DASHBOARD_PRODUCTION is on."
    ]


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.worker
@pytest.mark.timeout(150)
def test_production_settings_pass_ups_own_health_check(tmp_path: Path) -> None:
    """ALLOWED_HOSTS naming only the public host, and https redirects behind a TLS proxy: up's
    own /healthz probe still gets its answer (Django refuses other Host names with 400)."""
    env = up_env(
        tmp_path,
        DASHBOARD_PRODUCTION="1",
        SECRET_KEY="p" * 50,
        ALLOWED_HOSTS="dash.example.org",
        SECURE_SSL_REDIRECT="1",
        SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto,https",
    )
    process = subprocess.Popen(
        [sys.executable, "manage.py", "up", "--port", str(free_port())],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines = Lines(process.stdout)
    try:
        assert lines.wait_for(URL_LINE, timeout=120), "\n".join(lines.seen)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.wait(timeout=10)


@pytest.mark.django_db
def test_admin_password_is_shown_again_only_while_it_works(tmp_path: Path) -> None:
    first = ensure_admin(tmp_path)
    password = first.removeprefix("Log in as admin / ")
    assert first.startswith("Log in as admin / ") and len(password) >= 12
    assert ensure_admin(tmp_path) == first

    from django.contrib.auth import get_user_model

    admin = get_user_model().objects.get(username="admin")
    assert admin.is_superuser
    admin.set_password("changed-by-the-operator")
    admin.save()
    again = ensure_admin(tmp_path)
    assert password not in again
    assert "Log in as admin" not in again


@pytest.mark.django_db
def test_in_production_the_admin_password_is_shown_once(tmp_path: Path) -> None:
    """Each start's line reaches the log collector (compose logs, the journal): the password
    was in it on every start until changed. Shown when made; later starts name its file."""
    first = ensure_admin(tmp_path, show_again=False)
    password = first.removeprefix("Log in as admin / ")
    assert first.startswith("Log in as admin / ") and len(password) >= 12
    later = ensure_admin(tmp_path, show_again=False)
    assert password not in later
    assert (
        later
        == f"Log in as admin: the password is in {tmp_path / PASSWORD_FILE} until it is changed"
    )


# --- one role per process (up --only) --------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "extra", "expected"),
    [
        (["--only", "web,cache"], {"REDIS_URL": "redis://127.0.0.1:1/0"}, "Error: Unknown role cache for --only; the roles are web, worker, beat, webhook."),
        (["--only", "worker"], {}, "Error: --only needs REDIS_URL: parts on different machines must share one Redis"),
        # Every role named is still a part: a private Redis per machine would split the work.
        (["--only", "web,worker,beat"], {}, "Error: --only needs REDIS_URL: parts on different machines must share one Redis"),
        (["--only", "web,worker,beat", "--demo"], {"REDIS_URL": "redis://127.0.0.1:1/0"}, "Error: --demo starts every part on this machine; leave out --only."),
        (["--only", "web", "--demo"], {"REDIS_URL": "redis://127.0.0.1:1/0"}, "Error: --demo starts every part on this machine; leave out --only."),
        (["--only", ","], {"REDIS_URL": "redis://127.0.0.1:1/0"}, "Error: --only needs a role; the roles are web, worker, beat, webhook."),
        (["--only", "worker"], {"REDIS_URL": "redis://:hunter2@127.0.0.1:1/0"}, "Error: Cannot reach Redis at REDIS_URL (redis://:***@127.0.0.1:1/0): "),
        (["--only", "beat"], {"REDIS_URL": "redis://127.0.0.1:1/0"}, "Error: Cannot reach Redis at REDIS_URL"),
        (["--only", "worker"], {"REDIS_URL": "redis://127.0.0.1:6379/15", "CELERY_BROKER_URL": "redis://:hunter2@127.0.0.1:1/0"},
         "Error: Cannot reach the Celery broker at CELERY_BROKER_URL (redis://:***@127.0.0.1:1/0): "),
        (["--only", "worker"], {"REDIS_URL": "redis://127.0.0.1:1/0", "DATABASE_URL": "postgres://someone:hunter2@127.0.0.1:1/nothing"},
         "Error: Cannot connect to the database at DATABASE_URL (postgres://someone:***@127.0.0.1:1/nothing): "),
    ],
)  # fmt: skip
def test_only_with_a_bad_role_or_setting_is_one_sentence(
    tmp_path: Path, args, extra, expected
) -> None:
    result = run_up(["--port", str(free_port()), *args], up_env(tmp_path, **extra))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), result.stderr
    assert "Traceback" not in result.stderr and "hunter2" not in result.stderr + result.stdout


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.worker
@pytest.mark.timeout(180)
def test_web_and_worker_on_their_own_processes_work_together(
    tmp_path: Path, redis_url: str
) -> None:
    """``up --only web`` and ``up --only worker,beat`` (as on two machines, with their own data
    folders) share one database and one Redis: the web part is healthy only when a worker
    answers its ping, and each stops cleanly on SIGINT."""
    shared = {
        "REDIS_URL": redis_url,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'shared.sqlite3'}",
        "CELERY_QUEUE": f"only-{free_port()}",
        "SECRET_KEY": "s" * 50,
    }
    port = free_port()
    processes = []
    for name, args in (
        ("web", ["--only", "web"]),
        ("parts", ["--only", "worker", "--only", "beat"]),
    ):
        env = up_env(tmp_path / name, **shared)
        processes.append(subprocess.Popen(
            [sys.executable, "manage.py", "up", "--port", str(port), *args],
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))  # fmt: skip
    web, parts = processes
    web_lines, part_lines = Lines(web.stdout), Lines(parts.stdout)
    try:
        assert part_lines.wait_for(re.compile(r"Running worker and beat"), timeout=60), (
            part_lines.seen
        )
        match = web_lines.wait_for(URL_LINE, timeout=90)
        assert match, "\n".join(web_lines.seen)
        health = httpx.get(match.group(1).rstrip("/") + "/healthz", timeout=10)
        assert health.status_code == 200 and health.json() == {"ok": True}
        names = {p.name() for p in psutil.Process(parts.pid).children(recursive=True)}
        cmdlines = " ".join(
            " ".join(p.cmdline()) for p in psutil.Process(parts.pid).children(recursive=True)
        )
        assert "daphne" not in cmdlines and "worker" in cmdlines and "beat" in cmdlines, names
        assert "Log in as" not in "\n".join(part_lines.seen)  # only the web part makes the login
        for process in processes:
            descendants = psutil.Process(process.pid).children(recursive=True)
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=30) == 0
            _gone, alive = psutil.wait_procs(descendants, timeout=10)
            assert not alive, alive
    finally:
        for process in processes:
            if process.poll() is None:
                for child in psutil.Process(process.pid).children(recursive=True):
                    child.kill()
                process.kill()
                process.wait(timeout=10)


def test_the_health_probe_asks_by_a_name_a_leading_dot_allows(settings) -> None:
    """``.example.org`` (example.org and its subdomains) gave the probe no name to ask by:
    Django answered 400 for a minute of tracebacks, then "did not become healthy (HTTP 400)"
    named no setting. The probe asks by example.org; a refused probe stops at once, saying
    which setting."""
    from tasks_app.management.commands import up

    settings.ALLOWED_HOSTS = [".example.org"]
    assert up._probe_headers("127.0.0.1", 8000) == {"Host": "example.org:8000"}
    settings.ALLOWED_HOSTS = ["[::1]", ".", "dash.example.org"]
    assert up._probe_headers("127.0.0.1", 8000) == {"Host": "dash.example.org:8000"}
    assert "ALLOWED_HOSTS" in up._refused_probe(400)
    assert "SECURE_PROXY_SSL_HEADER" in up._refused_probe(301)


def test_the_webhook_part_follows_log_level(settings) -> None:
    """uvicorn logged at its own level (INFO) whatever LOG_LEVEL said."""
    from tasks_app.management.commands import up

    settings.LOG_LEVEL = "WARNING"
    argv = up.webhook_argv("python", "127.0.0.1", 8001, False)
    assert argv[argv.index("--log-level") + 1] == "warning"


@pytest.mark.django_db
def test_the_demo_agent_registered_by_an_earlier_run_is_not_a_failure(monkeypatch) -> None:
    """Every start on the same DATA_DIR said "Could not register the demo agent ...: This URL
    is already registered", which read as a failure; nothing is fetched or added now."""
    from tasks_app.models import Agent, Project
    from tasks_app.services import agents

    url = "http://127.0.0.1:9/demo"
    Agent.objects.create(project=Project.objects.get_or_create(name="default")[0],
                         name="Demo agent", base_url=url)  # fmt: skip
    monkeypatch.setattr(agents, "preview_card", lambda url: pytest.fail("fetched again"))
    up_command.register_demo_agent(url + "/")
    assert Agent.objects.count() == 1
