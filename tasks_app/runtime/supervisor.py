"""Child processes that are started together and always stopped together.

Each child runs in its own session (so its own process group): a Ctrl-C in the terminal
reaches only the supervisor, which then stops the children in a known order, and signalling
the group also reaches grandchildren a child may have forked. On Linux each child also asks
the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), so even a supervisor
killed with SIGKILL leaves no orphans behind.
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


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    def preexec() -> None:
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
) -> subprocess.Popen[bytes]:
    """Start a process in its own session, tied to this process's lifetime."""
    return subprocess.Popen(
        list(argv),
        env=env,
        cwd=str(cwd),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent(os.getpid()),
    )


class Child:
    """One started process (and its process group)."""

    def __init__(
        self,
        name: str,
        popen: subprocess.Popen[bytes],
        *,
        infrastructure: bool = False,
        log_path: Path | None = None,
    ) -> None:
        self.name = name
        self.popen = popen
        self.infrastructure = infrastructure
        self.log_path = log_path
        self.reader: threading.Thread | None = None

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
    ) -> Child:
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as log_file:
                popen = spawn(argv, env=env, cwd=cwd, stdout=log_file)
        elif self.output is not None:
            popen = spawn(argv, env=env, cwd=cwd, stdout=subprocess.PIPE)
        else:
            popen = spawn(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL)
        child = Child(name, popen, infrastructure=infrastructure, log_path=log_path)
        if popen.stdout is not None:
            child.reader = threading.Thread(
                target=self._copy_output, args=(child,), name=f"output-{name}", daemon=True
            )
            child.reader.start()
        self.children.append(child)
        return child

    def _copy_output(self, child: Child) -> None:
        assert child.popen.stdout is not None
        width = max(8, len(child.name))
        for raw in iter(child.popen.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            self.write(f"{child.name:<{width}} | {line}")
        child.popen.stdout.close()

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
