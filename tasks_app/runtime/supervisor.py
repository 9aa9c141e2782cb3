"""Child processes that are started together and always stopped together.

Each child runs in its own session (so its own process group): a Ctrl-C in the terminal
reaches only the supervisor, which then stops the children in a known order, and signalling
the group also reaches grandchildren a child may have forked. On Linux each child also asks
the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), so a supervisor killed
with SIGKILL leaves no orphans behind as long as its children end on SIGTERM (ours do; the
signal reaches direct children only, not a child's own children).

A child started with a ``Backoff`` is restarted when it dies on its own (``Supervisor.tend``):
after 1 s, then 2, 4 ... up to a maximum, and back to the first delay once it has stayed up a
while. Children without one (the test fixtures' workers, which tests kill on purpose) are only
reported by ``first_exited``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

PR_SET_PDEATHSIG = 1


def _load_libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


# Loaded in the parent: after fork only the already-loaded function may be called.
_LIBC = _load_libc()


def _die_with_parent(parent_pid: int, umask: int | None = None) -> Callable[[], None]:
    def preexec() -> None:
        if umask is not None:
            os.umask(umask)
        if _LIBC is not None:
            _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def spawn(
    argv: Sequence[str],
    *,
    env: dict[str, str],
    cwd: str | Path,
    stdout: int | IO[bytes] | None,
    umask: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start a process in its own session, tied to this process's lifetime (with ``umask``
    when given: for a child whose files must be private whatever it creates them with)."""
    return subprocess.Popen(
        list(argv),
        env=env,
        cwd=str(cwd),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent(os.getpid(), umask),
    )


@dataclass(frozen=True)
class Backoff:
    """When to restart a child that died: ``first`` s, doubling up to ``maximum`` s.

    A child that stayed up ``stable_after`` s counts as healthy again, so its next death is
    restarted after ``first`` s; one that keeps dying right away is restarted less and less
    often instead of spinning.
    """

    first: float = 1.0
    maximum: float = 30.0
    stable_after: float = 60.0

    def delay(self, failures: int) -> float:
        """The wait before restart number ``failures`` in a row (1 for the first)."""
        return min(self.maximum, self.first * 2 ** max(0, failures - 1))


def describe_exit(returncode: int | None) -> str:
    """'exited with code 1' or 'was killed by SIGKILL', for the operator."""
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


class Child:
    """One started process (and its process group)."""

    def __init__(
        self,
        name: str,
        popen: subprocess.Popen[bytes],
        *,
        infrastructure: bool = False,
        log_path: Path | None = None,
        restart: Backoff | None = None,
        spawner: Callable[[], subprocess.Popen[bytes]] | None = None,
    ) -> None:
        self.name = name
        self.popen = popen
        self.infrastructure = infrastructure
        self.log_path = log_path
        self.reader: threading.Thread | None = None
        # Restarting: how, when it was last started, deaths in a row, when to start it again.
        self.restart = restart
        self.spawner = spawner
        self.started_at = time.monotonic()
        self.failures = 0
        self.restarts = 0
        self.restart_at: float | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def _signal_group(self, sig: int) -> bool:
        """Signal every process in the child's group; False when none is left."""
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def _group_exists(self) -> bool:
        return self._signal_group(0)

    def terminate(self) -> None:
        """Ask politely (SIGTERM to the whole group) without waiting."""
        self._signal_group(signal.SIGTERM)

    def finish(self, deadline: float) -> int | None:
        """Wait for the group until ``deadline`` (monotonic), then SIGKILL whatever is left."""
        remaining = max(0.0, deadline - time.monotonic())
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=remaining)
        # The leader may be gone while grandchildren still run in its group.
        while self._group_exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._group_exists():
            self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # SIGKILL cannot be ignored
            self.popen.wait(timeout=5)
        if self.reader is not None:
            self.reader.join(timeout=2)
        return self.popen.returncode

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the group, wait up to ``timeout`` seconds, then SIGKILL it."""
        self.terminate()
        return self.finish(time.monotonic() + timeout)

    def kill(self) -> int | None:
        """SIGKILL the group at once (simulates a crash)."""
        self._signal_group(signal.SIGKILL)
        return self.finish(time.monotonic())

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


class Supervisor:
    """Starts named children and stops all of them: the app first, infrastructure last.

    Output either goes to a log file per child (tests) or is copied line by line to
    ``output`` with the child's name in front (``manage.py up``), so the operator can tell
    which process said what.
    """

    def __init__(self, output: IO[str] | None = None) -> None:
        self.output = output
        self.children: list[Child] = []
        self._write_lock = threading.Lock()

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: str | Path,
        log_path: Path | None = None,
        infrastructure: bool = False,
        restart: Backoff | None = None,
        umask: int | None = None,
    ) -> Child:
        """Start ``argv``; with ``restart``, ``tend()`` starts it again whenever it dies."""

        def spawner() -> subprocess.Popen[bytes]:
            if log_path is not None:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                with open(log_path, "ab") as log_file:
                    return spawn(argv, env=env, cwd=cwd, stdout=log_file, umask=umask)
            if self.output is not None:
                return spawn(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, umask=umask)
            return spawn(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, umask=umask)

        child = Child(
            name,
            spawner(),
            infrastructure=infrastructure,
            log_path=log_path,
            restart=restart,
            spawner=spawner,
        )
        self._start_reader(child)
        self.children.append(child)
        return child

    def _start_reader(self, child: Child) -> None:
        if child.popen.stdout is not None:
            child.reader = threading.Thread(
                target=self._copy_output,
                args=(child, child.popen),
                name=f"output-{child.name}",
                daemon=True,
            )
            child.reader.start()

    def _copy_output(self, child: Child, popen: subprocess.Popen[bytes]) -> None:
        # ``popen``, not ``child.popen``: a restart replaces the latter while this still reads.
        assert popen.stdout is not None
        width = max(8, len(child.name))
        for raw in iter(popen.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.write(f"{child.name:<{width}} | {line}")
        popen.stdout.close()

    def write(self, line: str) -> None:
        """Print a line without interleaving it with a child's line."""
        if self.output is None:
            return
        with self._write_lock:
            self.output.write(line + "\n")
            self.output.flush()

    def first_exited(self) -> Child | None:
        """The first child that is no longer running, if any."""
        for child in self.children:
            if not child.alive():
                return child
        return None

    def tend(self) -> None:
        """Restart the children that died and are due; say what happened, one line each.

        Called periodically by the owner (``manage.py up``'s main loop), never from a signal
        handler, so a restart can never race with ``stop_all``.
        """
        for child in self.children:
            if child.restart is None:
                continue
            now = time.monotonic()
            if child.alive():
                if child.failures and now - child.started_at >= child.restart.stable_after:
                    child.failures = 0
                continue
            if child.restart_at is None:
                died = f"{child.name} (pid {child.pid}) {describe_exit(child.returncode)}"
                self._schedule_restart(child, now, died)
            elif now >= child.restart_at:
                self._restart(child)

    def _schedule_restart(self, child: Child, now: float, what: str) -> None:
        """Say ``what`` happened and when the child comes back; free its old group."""
        assert child.restart is not None
        if now - child.started_at >= child.restart.stable_after:
            child.failures = 0
        child.failures += 1
        delay = child.restart.delay(child.failures)
        child.restart_at = now + delay
        # Whatever the dead leader left in its group goes now, before a new one starts.
        child.terminate()
        self.write(f"{what}; restarting it in {delay:g} s.")

    def _restart(self, child: Child) -> None:
        assert child.spawner is not None
        child.finish(time.monotonic())  # SIGKILL leftovers of the old group, reap the leader
        try:
            popen = child.spawner()
        except OSError as exc:  # e.g. the executable vanished; try again later
            child.started_at = time.monotonic()
            self._schedule_restart(
                child, child.started_at, f"{child.name} could not be started ({exc})"
            )
            return
        child.popen = popen
        child.started_at = time.monotonic()
        child.restart_at = None
        child.restarts += 1
        self._start_reader(child)
        self.write(f"{child.name} restarted (pid {popen.pid}).")

    def discard(self, child: Child, timeout: float = 10.0) -> None:
        """Stop ``child`` and forget it: it is not tended or restarted again."""
        self.children.remove(child)
        child.stop(timeout)

    def stop_all(self, timeout: float = 10.0) -> None:
        """Stop the application processes, then the infrastructure they were using.

        Redis goes last so that the worker and beat can shut down cleanly against it.
        """
        for infrastructure in (False, True):
            batch = [c for c in reversed(self.children) if c.infrastructure is infrastructure]
            for child in batch:
                child.terminate()
            deadline = time.monotonic() + timeout
            for child in batch:
                child.finish(deadline)
        self.children.clear()

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        with contextlib.suppress(Exception):
            self.stop_all()
