"""Query-planner statistics for SQLite, kept fresh as the tables grow.

SQLite plans by the statistics ``ANALYZE`` writes and never gathers them by itself (the
version here predates ``PRAGMA optimize``'s own checks on open). Without them a query such
as "this person's agents' tasks, newest first" walks the agent index and sorts every row
instead of walking the ``updated_at`` index: 230 ms instead of 2 ms at 100,000 tasks. So
``up`` refreshes them after migrating, and beat every ``SQLITE_ANALYZE_EVERY_SECONDS``.
Only the tables whose queries have a choice of index are analyzed, fully (a sampled
``analysis_limit`` was measured to mislead the planner here); the log, read by its
(task, seq) key, can be millions of rows and is left out. PostgreSQL keeps its own
statistics (autovacuum): this does nothing there.
"""

from __future__ import annotations

from django.db import connection

TABLES = (
    "tasks_app_remotetask",
    "tasks_app_agent",
    "tasks_app_operatoraction",
    "tasks_app_membership",
    "tasks_app_alert",
)


def refresh() -> bool:
    """``ANALYZE`` the tables above on SQLite; False on any other database."""
    if connection.vendor != "sqlite":
        return False
    existing = set(connection.introspection.table_names())
    with connection.cursor() as cursor:
        for table in TABLES:
            if table in existing:
                cursor.execute(f'ANALYZE "{table}"')
    return True
