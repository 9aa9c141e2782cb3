"""``./dash test``'s promises about a run cut short: every failure is named in the log the
moment it happens (``tests/conftest.py``), and a pass interrupted at its time limit (SIGINT,
``dash``'s ``timeout --signal=INT``) still prints pytest's summary of the failures so far."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.subprocess

PROBE = """
import time

def test_fails_at_once():
    assert 1 == 2

def test_outlives_the_limit():  # a test still running at the limit: SIGINT ends it, not this
    time.sleep(300)
"""


def test_a_failure_is_named_at_once_and_an_interrupted_pass_prints_its_summary(
    tmp_path: Path,
) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    argv = [
        sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
        "-n", "2", "--rootdir", str(REPO_ROOT), "-c", str(REPO_ROOT / "pyproject.toml"),
        str(probe),
    ]  # fmt: skip
    child = subprocess.Popen(
        argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    stdout: list[str] = []
    stderr: list[str] = []
    readers = [
        threading.Thread(target=lambda: stdout.extend(child.stdout), daemon=True),
        threading.Thread(target=lambda: stderr.extend(child.stderr), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        # The line comes while the other test still runs: before any summary could.
        deadline = time.monotonic() + 60
        named = ""
        while not named and time.monotonic() < deadline and child.poll() is None:
            named = next((line for line in list(stderr) if "dash test: FAILED" in line), "")
            time.sleep(0.1)
        assert "::test_fails_at_once (call," in named, "".join(stderr)[-2000:]
        assert child.poll() is None  # the sleeping test holds the run open
        child.send_signal(signal.SIGINT)  # what dash's limit sends
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    for reader in readers:
        reader.join(timeout=10)
    out = "".join(stdout)
    assert child.returncode == pytest.ExitCode.INTERRUPTED, out[-2000:]
    assert "KeyboardInterrupt" in out
    assert "FAILED " in out and "::test_fails_at_once" in out, out[-2000:]
