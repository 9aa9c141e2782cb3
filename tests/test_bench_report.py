"""``manage.py bench --merge-docs``: only the rows measured now are replaced."""

from __future__ import annotations

from bench.report import Row, merge_rows


def row(name: str, db: str, measure: str, value: str) -> Row:
    return Row(row=name, measure=measure, value=value, goal="g", ok=True, db=db, note="how")


def test_merge_replaces_each_measured_row_and_database_in_place() -> None:
    earlier = [
        row("P1", "sqlite", "latency", "old"),
        row("P10", "postgres", "alone", "old"),
        row("P10", "postgres", "beside", "old"),
        row("P10", "sqlite", "alone", "kept"),
    ]
    measured = [
        row("P10", "postgres", "alone", "new"),
        row("P10", "postgres", "beside", "new"),
        row("P2x", "postgres", "scale-out", "new"),
    ]
    merged = merge_rows(earlier, measured)
    assert [(r.row, r.db, r.measure, r.value) for r in merged] == [
        ("P1", "sqlite", "latency", "old"),
        ("P10", "postgres", "alone", "new"),
        ("P10", "postgres", "beside", "new"),
        ("P10", "sqlite", "alone", "kept"),
        ("P2x", "postgres", "scale-out", "new"),
    ]
    assert all(r.note.startswith("measured ") and r.note.endswith(": how") for r in merged[1:3])
    assert merged[0].note == merged[3].note == "how"  # rows not measured now keep their note
    assert all(r.note == "how" for r in measured)  # the caller's rows are not changed


def test_the_performance_page_is_what_its_rows_and_bench_analysis_render(tmp_path) -> None:
    """docs/performance.md is rendered from its rows and bench/analysis.md: notes written into
    the page alone (four dated entries were) are dropped by the next --write-docs or
    --rewrite-docs. Write them in bench/analysis.md, then ``manage.py bench --rewrite-docs``."""
    from bench.report import rows_from_docs, write_docs
    from tasks_app.management.commands.bench import ANALYSIS_PATH, DOCS_PATH

    page = tmp_path / "performance.md"
    page.write_text(DOCS_PATH.read_text())
    rows, command = rows_from_docs(page)
    write_docs(page, rows, command, ANALYSIS_PATH.read_text(), keep_machine=True)
    assert page.read_text() == DOCS_PATH.read_text()
