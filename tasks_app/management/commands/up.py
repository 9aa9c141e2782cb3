"""``manage.py up``: run the whole dashboard with one command.

Migrates the database, makes sure there is a login, starts Redis when ``REDIS_URL`` is unset,
then the Celery worker, celery beat and daphne as child processes, waits until ``/healthz``
says every part works (``{"ok": true}``; when it does not, the same checks run in this
process name the failing parts) and prints the URL. From then on it supervises: a child that dies on its
own (the worker, beat, daphne, the private Redis, the demo agent) is restarted after a backoff
(1 s doubling to 30 s, reset once it has stayed up a minute), with one line saying which child
died, how, and when it comes back. Only Ctrl-C (or SIGTERM) stops every child it started.
A child that dies while starting still stops everything and fails the command: that is a
configuration problem to report, not a crash to retry.

Configuration mistakes end with one sentence naming the setting, never a traceback.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib
import importlib.util
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandParser
from django.db import connection

from tasks_app.a2a.card import registration_url
from tasks_app.health import run_checks
from tasks_app.management.arguments import int_between
from tasks_app.runtime import sqlite_stats
from tasks_app.runtime.admin import ensure_admin
from tasks_app.runtime.net import (
    bind_problem,
    free_port,
    port_available,
    redact_url,
    wait_until,
)
from tasks_app.runtime.redis_server import (
    apply_redis_url,
    find_redis_server,
    ping_error,
    start_private_redis,
)
from tasks_app.runtime.supervisor import Backoff, Child, Supervisor, describe_exit

HEALTH_TIMEOUT_SECONDS = 60.0
STARTED_AFTER_SECONDS = 5.0  # a part without web that stays up this long has started
STOP_TIMEOUT_SECONDS = 10.0
SUPERVISE_EVERY_SECONDS = 0.5
# A dead child comes back after 1 s, 2 s, 4 s ... at most 30 s; a minute up resets the delay.
RESTART_BACKOFF = Backoff(first=1.0, maximum=30.0, stable_after=60.0)
DEMO_AGENT_MODULE = "tasks_app.demo_agent"
# Ports a private server (Redis, the demo agent) tries: a free port can be taken before it binds.
PORT_TRIES = 3
ROLES = ("web", "worker", "beat", "webhook")
# Without --only: everything on this machine. The web part answers /push/ too; the webhook
# part (uvicorn, /push/ alone) is for deployments that route /push/ to processes of its own.
ALL_IN_ONE = ("web", "worker", "beat")
# The webhook part's server: uvicorn with its C parser and loop when installed (httptools,
# uvloop), kept-alive connections held longer than an agent's pool keeps them idle.
WEBHOOK_KEEP_ALIVE_SECONDS = 75


def parse_roles(values: list[str] | None) -> tuple[str, ...]:
    """``--only web --only worker`` or ``--only web,worker`` -> the roles, in a fixed order."""
    if not values:
        return ALL_IN_ONE
    wanted = {part.strip() for value in values for part in value.split(",") if part.strip()}
    if not wanted:
        raise StartupError(f"--only needs a role; the roles are {', '.join(ROLES)}.")
    unknown = sorted(wanted - set(ROLES))
    if unknown:
        raise StartupError(
            f"Unknown role {', '.join(unknown)} for --only; the roles are {', '.join(ROLES)}."
        )
    if {"web", "webhook"} <= wanted:
        raise StartupError(
            "The web and webhook parts each need a port: run the webhook part in its own "
            "`up --only webhook --port N`."
        )
    return tuple(role for role in ROLES if role in wanted)


def webhook_argv(python: str, host: str, port: int, proxy_headers: bool) -> list[str]:
    """The webhook part's command line (``up --only webhook``; benchmark P10 runs the same).

    ``dashboard.webhook_asgi`` under uvicorn: per delivery, its HTTP handling costs a
    fraction of daphne's (docs/performance.md, P10). Client addresses come from
    ``X-Forwarded-For`` only with ``proxy_headers``, and then only from the proxies
    uvicorn trusts (``FORWARDED_ALLOW_IPS``, default ``127.0.0.1,::1``).
    """
    # uvicorn's own lines (its start, a malformed request) follow LOG_LEVEL; they are its
    # plain text whatever LOG_FORMAT says (docs/operations.md lists them).
    level = {"CRITICAL": "critical", "ERROR": "error", "WARNING": "warning",
             "DEBUG": "debug"}.get(settings.LOG_LEVEL, "info")  # fmt: skip
    return [python, "-m", "uvicorn", "dashboard.webhook_asgi:application",
            "--host", host, "--port", str(port), "--no-access-log", "--backlog", "2048",
            "--timeout-keep-alive", str(WEBHOOK_KEEP_ALIVE_SECONDS), "--log-level", level,
            "--proxy-headers" if proxy_headers else "--no-proxy-headers"]  # fmt: skip


class StartupError(Exception):
    """A problem the operator must fix; its message is printed as is, as one line."""


def register_demo_agent(url: str) -> None:
    """Add the demo agent to the dashboard, through the same service the UI uses."""
    try:
        agents = importlib.import_module("tasks_app.services.agents")
    except ImportError:
        agents = None
    add_agent = getattr(agents, "add_agent", None)
    if add_agent is None:
        raise StartupError(
            "--demo needs tasks_app.services.agents.add_agent(), which is not in this checkout yet."
        )
    # Started again on the same DATA_DIR: the agent is there already (its port is fixed by
    # the run), and "Could not register the demo agent" read as a failure.
    project = agents.Project.objects.filter(name="default").first()
    if project is not None and agents.registered_at(project, registration_url(url)) is not None:
        return
    add_agent(url, name="Demo agent")


def _refused_probe(status: int) -> str:
    if status == 400:
        return (
            "The web part refuses its own health probe (HTTP 400): ALLOWED_HOSTS names no host "
            "it can be asked by; list the public name (or .example.org); stopping."
        )
    return (
        f"The web part redirects its own health probe (HTTP {status}): with "
        "SECURE_SSL_REDIRECT, set SECURE_PROXY_SSL_HEADER to the header the TLS proxy sends; "
        "stopping."
    )


def broker_error(url: str, timeout: float = 2.0) -> str | None:
    """None when the Celery broker at ``url`` takes a connection, else a short reason."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        return ping_error(url, timeout)
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=timeout) as connection:
            connection.ensure_connection(max_retries=1, timeout=timeout)
    except Exception as exc:  # whatever the transport raises: its class, not its text
        return type(exc).__name__
    return None


def _demo_preflight() -> None:
    """Fail before starting anything when --demo cannot work in this checkout."""
    if importlib.util.find_spec(DEMO_AGENT_MODULE) is None:
        raise StartupError(
            f"--demo needs the demo agent ({DEMO_AGENT_MODULE}), which is not in this checkout yet."
        )
    spec = importlib.util.find_spec("tasks_app.services.agents")
    if spec is None:
        raise StartupError(
            "--demo needs tasks_app.services.agents.add_agent(), which is not in this checkout yet."
        )


def _describe_database() -> str:
    url = os.environ.get("DATABASE_URL", "").strip()
    if url:
        return f"DATABASE_URL ({redact_url(url)})"
    return f"the default SQLite database ({settings.DATABASES['default']['NAME']}; set DATABASE_URL to change it)"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(".") if text else type(exc).__name__


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _probe_host(host: str) -> str:
    """Where to reach a server bound to ``host`` from this machine."""
    if host in {"0.0.0.0", ""}:
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


# The advisory lock's key: any constant every web part agrees on (scoped to the database).
MIGRATE_LOCK_KEY = 0x0A2A_DA5B


@contextlib.contextmanager
def _one_web_part_at_a_time(
    stopping: threading.Event, say: Callable[[str], None]
) -> Iterator[bool]:
    """Web parts started together on one PostgreSQL (two replicas, a fresh install) take turns
    to migrate and make the first login: at once, both would create the same tables or the same
    admin and one would fail. A session advisory lock, so a part that dies releases it. SQLite
    serves one machine, where one web part runs.

    The lock is tried, not waited for, so that a stop asked meanwhile is heard (a blocking wait
    ignored SIGTERM and SIGINT until the other part finished); yields False when stopped.
    """
    if connection.vendor != "postgresql":
        yield True
        return
    said = False
    while True:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", [MIGRATE_LOCK_KEY])
            if cursor.fetchone()[0]:
                break
        if not said:
            say("Waiting for another web part to finish migrating ...")
            said = True
        if stopping.wait(0.5):
            yield False
            return
    try:
        yield True
    finally:
        with contextlib.suppress(Exception), connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [MIGRATE_LOCK_KEY])


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer to report, never a request to follow (it may point anywhere)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_NO_REDIRECTS = urllib.request.build_opener(_NoRedirect)


def _probe_headers(host: str, port: int) -> dict[str, str]:
    """How our own /healthz probe must ask to be answered like a browser would be.

    A production ``ALLOWED_HOSTS`` often names only the public host, and Django refuses any
    other ``Host`` (400), so the probe names the first listed one. With
    ``SECURE_SSL_REDIRECT`` behind a TLS proxy, it also sends the proxy's header
    (``SECURE_PROXY_SSL_HEADER``) so it is not redirected to https.
    """
    from django.http.request import validate_host

    headers: dict[str, str] = {}
    allowed = settings.ALLOWED_HOSTS
    # ".example.org" allows example.org and its subdomains: the probe asks by example.org.
    names = [
        h.removeprefix(".") for h in allowed if h not in ("", "*", ".") and not h.startswith("[")
    ]
    if not validate_host(host, allowed) and names:
        headers["Host"] = f"{names[0]}:{port}"
    proxy = settings.SECURE_PROXY_SSL_HEADER
    if getattr(settings, "SECURE_SSL_REDIRECT", False) and proxy:
        name, value = proxy
        headers[name.removeprefix("HTTP_").replace("_", "-").title()] = value
    return headers


class Command(BaseCommand):
    help = "Run the dashboard: migrate, then start Redis (if needed), the worker, beat and daphne."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--port", type=int_between(1, 65535), default=8000, help="HTTP port (default 8000)"
        )
        parser.add_argument(
            "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)"
        )
        parser.add_argument(
            "--demo", action="store_true", help="also start and register the demo A2A agent"
        )
        parser.add_argument(
            "--proxy-headers",
            action="store_true",
            help="behind a reverse proxy: take the client's address from X-Forwarded-For "
            "(login throttling and webhook limits count per address)",
        )
        parser.add_argument(
            "--only",
            action="append",
            metavar="ROLE",
            help="run only these parts (web, worker, beat, webhook; repeat or comma-separate) "
            "against the configured DATABASE_URL and REDIS_URL, for a deployment spread over "
            "machines (webhook: /push/ alone, for a reverse proxy to route deliveries to)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # Children's lines and ours must reach a pipe (or a test) as soon as they are written.
        if hasattr(sys.stdout, "reconfigure"):
            sys.stdout.reconfigure(line_buffering=True)
        try:
            roles = parse_roles(options.get("only"))
        except StartupError as exc:
            sys.stderr.write(f"Error: {exc}\n")
            raise SystemExit(1) from None
        runner = Runner(
            host=options["host"],
            port=options["port"],
            demo=options["demo"],
            roles=roles,
            proxy_headers=options["proxy_headers"],
            partial=bool(options.get("only")),
        )
        try:
            code = runner.run()
        except StartupError as exc:
            runner.supervisor.stop_all(STOP_TIMEOUT_SECONDS)
            sys.stderr.write(f"Error: {exc}\n")
            sys.stderr.flush()
            raise SystemExit(1) from None
        except BaseException:
            runner.supervisor.stop_all(STOP_TIMEOUT_SECONDS)
            raise
        if code:
            raise SystemExit(code)


class Runner:
    """One run of ``up``: the children it started and how to stop them."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        demo: bool,
        roles: tuple[str, ...] = ALL_IN_ONE,
        proxy_headers: bool = False,
        partial: bool | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.demo = demo
        self.roles = roles
        # Any --only is a part of a deployment, even naming every role: it shares the
        # configured Redis and never starts a private one (each machine would have its own).
        self.partial = roles != ALL_IN_ONE if partial is None else partial
        self.proxy_headers = proxy_headers
        self.supervisor = Supervisor(output=sys.stdout)
        self.stopping = threading.Event()
        self.stop_signal: str | None = None

    def say(self, line: str) -> None:
        self.supervisor.write(line)

    # -- signals ---------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signal = signal.Signals(signum).name
        self.stopping.set()

    def _install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    # -- the run -----------------------------------------------------------------------

    def run(self) -> int:
        """1. Check what the roles need (port, database, Redis); 2. migrate and make the first
        login (when serving web); 3. start the roles' processes; 4. wait until healthy (web) or
        started; 5. supervise until a signal."""
        self._install_signal_handlers()
        if self.partial and self.demo:
            raise StartupError("--demo starts every part on this machine; leave out --only.")
        if self.partial and not os.environ.get("REDIS_URL", "").strip():
            raise StartupError(
                "--only needs REDIS_URL: parts on different machines must share one Redis "
                "(and one database, DATABASE_URL)."
            )
        problem = (
            bind_problem(self.host, self.port) if {"web", "webhook"} & set(self.roles) else None
        )
        if problem == "in use":
            raise StartupError(
                f"Port {self.port} on {self.host} is already in use; pass --port to use another one."
            )
        if problem:
            raise StartupError(f"--host {self.host!r} cannot be served here: {problem}.")
        if self.demo:
            _demo_preflight()
            # The demo agent listens on 127.0.0.1, which the outbound guard refuses unless told:
            # said here, for this run and its children only.
            from tasks_app.outbound import allow_loopback

            allow_loopback()
        self._check_database()
        redis_url = os.environ.get("REDIS_URL", "").strip()
        if redis_url:
            reason = ping_error(redis_url)
            if reason is not None:
                raise StartupError(
                    f"Cannot reach Redis at REDIS_URL ({redact_url(redis_url)}): {reason.rstrip('.')}."
                )
        broker = settings.CELERY_BROKER_URL
        if redis_url and broker != settings.REDIS_URL:
            # A broker of its own: a worker started against an unreachable one said it was
            # running while Celery retried the connection in its log.
            reason = broker_error(broker)
            if reason is not None:
                raise StartupError(
                    f"Cannot reach the Celery broker at CELERY_BROKER_URL ({redact_url(broker)}): "
                    f"{reason.rstrip('.')}."
                )
        if self.stopping.is_set():
            return 0

        login_line = ""
        if "web" in self.roles:
            # The web part migrates and makes the first login; workers and beat expect both.
            with _one_web_part_at_a_time(self.stopping, self.say) as turn:
                if not turn:
                    return self._shutdown(0)
                call_command("migrate", interactive=False, verbosity=0)
                sqlite_stats.refresh()  # the planner's statistics (beat refreshes them hourly)
                # In production this line reaches the logs on every start: the password is
                # shown once, when it is made.
                login_line = ensure_admin(
                    Path(settings.DATA_DIR), show_again=not settings.PRODUCTION
                )
        # Child processes open their own connections; ours is not needed while we wait.
        connection.close()

        if not redis_url:
            self._start_redis()
            if self.stopping.is_set():
                return self._shutdown(0)
        env = self._child_env()
        self._start_app(env)
        demo_url = self._start_demo(env) if self.demo else None

        if "web" not in self.roles:
            if not self._wait_started():
                return self._shutdown(1) if not self.stopping.is_set() else self._shutdown(0)
            where = (
                f"; webhook at http://{_url_host(self.host)}:{self.port}/push/"
                if "webhook" in self.roles
                else ""
            )
            self.say(f"Running {' and '.join(self.roles)}{where} (Ctrl-C to stop)")
            return self._supervise()
        if not self._wait_healthy():
            return self._shutdown(1) if not self.stopping.is_set() else self._shutdown(0)

        if demo_url is not None:
            self._register_demo(demo_url)

        url = f"http://{_url_host(self.host)}:{self.port}/"
        self.say(login_line)
        extra = (
            f" with {' and '.join(r for r in self.roles if r != 'web')}"
            if self.partial and len(self.roles) > 1
            else ""
        )
        self.say(f"Dashboard running at {url}{extra} (Ctrl-C to stop)")
        return self._supervise()

    def _wait_started(self) -> bool:
        """Without web there is no /healthz here: the parts must stay up for a few seconds."""
        deadline = time.monotonic() + STARTED_AFTER_SECONDS
        while time.monotonic() < deadline:
            if self.stopping.is_set():
                return False
            dead = self.supervisor.first_exited()
            if dead is not None:
                self.say(f"{dead.name} {describe_exit(dead.returncode)} while starting; stopping.")
                return False
            self.stopping.wait(0.5)
        return True

    def _check_database(self) -> None:
        if connection.vendor == "postgresql":
            # Without it an unroutable host hangs for minutes instead of failing with a sentence.
            connection.settings_dict.setdefault("OPTIONS", {}).setdefault("connect_timeout", 10)
        try:
            connection.ensure_connection()
        except Exception as exc:  # every driver has its own errors; all mean the same here
            raise StartupError(
                f"Cannot connect to the database at {_describe_database()}: {_first_line(exc)}."
            ) from None

    def _start_redis(self) -> None:
        try:
            executable = find_redis_server()
        except RuntimeError as exc:
            raise StartupError(str(exc)) from None
        workdir = Path(settings.DATA_DIR) / "redis"
        port, ready = self._start_listening(
            "The private Redis",
            lambda port: start_private_redis(
                self.supervisor, executable, port, workdir, restart=RESTART_BACKOFF
            ),
            lambda port: ping_error(f"redis://127.0.0.1:{port}/0", timeout=0.5) is None,
            free_port(),
            timeout=15,
        )
        url = f"redis://127.0.0.1:{port}/0"
        if self.stopping.is_set():
            return
        if not ready:
            raise StartupError(f"The private Redis ({executable}) did not start on port {port}.")
        self.say(f"Started a private Redis at {url} (no persistence)")
        apply_redis_url(url)

    def _child_env(self) -> dict[str, str]:
        env = os.environ.copy()
        env.update(
            DJANGO_SETTINGS_MODULE=os.environ.get("DJANGO_SETTINGS_MODULE", "dashboard.settings"),
            REDIS_URL=settings.REDIS_URL,
            DATA_DIR=str(settings.DATA_DIR),
            CELERY_QUEUE=settings.CELERY_TASK_DEFAULT_QUEUE,
            PYTHONUNBUFFERED="1",
        )
        if self.demo and not env.get("PUBLIC_URL", "").strip():
            # The demo agent delivers push notifications to the local address.
            env["PUBLIC_URL"] = f"http://{_url_host(_probe_host(self.host))}:{self.port}"
        return env

    def _start_app(self, env: dict[str, str]) -> None:
        python = sys.executable
        data_dir = Path(settings.DATA_DIR)
        cwd = settings.BASE_DIR
        queue = settings.CELERY_TASK_DEFAULT_QUEUE
        if "worker" in self.roles:
            self.supervisor.start(
                "worker",
                [python, "-m", "celery", "-A", "dashboard", "worker",
                 "--pool", "threads", "--concurrency", "8", "-Q", queue,
                 "--loglevel", "INFO", "-n", f"dashboard-{os.getpid()}@%h"],
                env=env,
                cwd=cwd,
                restart=RESTART_BACKOFF,
            )  # fmt: skip
        if "beat" in self.roles:
            self.supervisor.start(
                "beat",
                [python, "-m", "celery", "-A", "dashboard", "beat",
                 "--schedule", str(data_dir / "celerybeat-schedule"), "--loglevel", "INFO"],
                env=env,
                cwd=cwd,
                restart=RESTART_BACKOFF,
            )  # fmt: skip
        if "web" in self.roles:
            self.supervisor.start(
                "web",
                [python, "-m", "daphne", "-b", self.host, "-p", str(self.port),
                 *(["--proxy-headers"] if self.proxy_headers else []), "dashboard.asgi:application"],
                env=env,
                cwd=cwd,
                restart=RESTART_BACKOFF,
            )  # fmt: skip

        if "webhook" in self.roles:
            self.supervisor.start(
                "webhook",
                webhook_argv(python, self.host, self.port, self.proxy_headers),
                env=env,
                cwd=cwd,
                restart=RESTART_BACKOFF,
            )

    def _start_demo(self, env: dict[str, str]) -> str:
        """Start the demo agent; return its URL.

        The port after the web port is preferred, so the registered URL stays the same
        across runs. The agent is ready when its card answers: a bare connect could reach
        another program listening there.
        """

        def answering(port: int) -> bool:
            card = f"http://127.0.0.1:{port}/.well-known/agent-card.json"
            try:
                with _NO_REDIRECTS.open(card, timeout=1) as response:
                    return response.status == 200
            except (OSError, ValueError, http.client.HTTPException):
                return False

        argv = [sys.executable, "-m", DEMO_AGENT_MODULE, "--host", "127.0.0.1"]
        port, started = self._start_listening(
            "The demo agent",
            lambda port: self.supervisor.start(
                "demo",
                [*argv, "--port", str(port)],
                env=env,
                cwd=settings.BASE_DIR,
                restart=RESTART_BACKOFF,
            ),
            answering,
            self.port + 1 if port_available("127.0.0.1", self.port + 1) else free_port(),
            timeout=30,
        )
        if not started and not self.stopping.is_set():
            raise StartupError(f"The demo agent did not start listening on port {port}.")
        return f"http://127.0.0.1:{port}/"

    def _start_listening(
        self,
        what: str,
        start: Callable[[int], Child],
        ready: Callable[[int], bool],
        port: int,
        *,
        timeout: float,
    ) -> tuple[int, bool]:
        """Start a server child on ``port``; return the port it serves on and whether it does.

        A port found free can be taken before the child binds it (another program's
        outgoing connection, say), and the child then exits.

        1. Start the child with ``start(port)``; wait until ``ready(port)``, until it
           exits, or until ``up`` is stopping.
        2. Ready, stopping, or still running when the time ran out: done (the caller
           says what a child that never got ready means).
        3. It exited before it was ready: unless that was the last of ``PORT_TRIES``
           tries, discard it (no restarts on that port), say so, and go back to 1 with a
           port the kernel hands out.
        """
        attempt = 1
        while True:
            child = start(port)
            started = wait_until(
                lambda port=port: ready(port),
                timeout,
                abort=lambda child=child: not child.alive() or self.stopping.is_set(),
            )
            if started or self.stopping.is_set() or child.alive() or attempt == PORT_TRIES:
                return port, started
            self.supervisor.discard(child)
            self.say(f"{what} could not listen on port {port}; trying another port.")
            port = free_port()
            attempt += 1

    def _register_demo(self, url: str) -> None:
        try:
            register_demo_agent(url)
        except StartupError:
            raise
        except Exception as exc:  # the dashboard still works; say why the demo is missing
            self.say(f"Could not register the demo agent at {url}: {_first_line(exc)}.")
        else:
            self.say(f"Demo agent running at {url} and registered as 'Demo agent'")

    def _health(self) -> tuple[int, dict[str, Any]]:
        host = _url_host(_probe_host(self.host))
        url = f"http://{host}:{self.port}/healthz"
        request = urllib.request.Request(url, headers=_probe_headers(host, self.port))
        try:
            with _NO_REDIRECTS.open(request, timeout=10) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                body = json.loads(exc.read() or b"{}")
            except ValueError:
                body = {}
            return exc.code, body
        except (OSError, ValueError) as exc:
            return 0, {"error": _first_line(exc)}

    def _wait_healthy(self) -> bool:
        """Poll /healthz until it answers ``{"ok": true}``; on timeout or a dead child, say
        what is wrong."""
        deadline = time.monotonic() + HEALTH_TIMEOUT_SECONDS
        status, body = 0, {}
        while time.monotonic() < deadline:
            if self.stopping.is_set():
                return False
            dead = self.supervisor.first_exited()
            if dead is not None:
                self.say(f"{dead.name} {describe_exit(dead.returncode)} while starting; stopping.")
                return False
            status, body = self._health()
            if status == 200 and isinstance(body, dict) and body.get("ok") is True:
                return True
            if status in (301, 302, 308, 400):
                # The settings refuse our own probe; waiting does not change that.
                self.say(_refused_probe(status))
                return False
            self.stopping.wait(0.5)
        detail = body.get("error", f"HTTP {status}") if isinstance(body, dict) else f"HTTP {status}"
        if status == 503:
            # The public answer is only ok / not ok; the same checks run here, with the
            # children's configuration, name what is failing.
            failing = [
                f"{name}: {result.message}"
                for name, result in run_checks().items()
                if not result.ok
            ]
            detail = "; ".join(failing) or detail
        self.say(
            f"The dashboard did not become healthy within {HEALTH_TIMEOUT_SECONDS:.0f} s "
            f"({detail}); stopping."
        )
        return False

    def _supervise(self) -> int:
        """Restart whatever dies until a signal asks to stop; then stop everything."""
        while not self.stopping.wait(SUPERVISE_EVERY_SECONDS):
            self.supervisor.tend()
        return self._shutdown(0)

    def _shutdown(self, code: int) -> int:
        if self.stop_signal:
            self.say(f"Got {self.stop_signal}; stopping.")
        self.supervisor.stop_all(STOP_TIMEOUT_SECONDS)
        self.say("Stopped.")
        return code
