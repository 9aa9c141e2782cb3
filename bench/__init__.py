"""Benchmarks of the dashboard (``manage.py bench``; docs/performance.md has the results).

Why this shape: every row runs in a child process (:mod:`bench.child`)
whose settings point at a scratch database (a temporary SQLite file or a scratch
PostgreSQL database) and a private Redis, so a run never touches real data, other
engineers' test runs on the same Redis, or the Django settings of the calling process.

Modules:

* :mod:`.report` - the result rows, the table, docs/performance.md;
* :mod:`.procs` - scratch databases, a private Redis, child processes stopped on any exit;
* :mod:`.agent` - a lightweight A2A 1.0 JSON-RPC streaming agent stamping emit times;
* :mod:`.inproc` - rows measured in-process against the database (P3, P4, P5);
* :mod:`.live` - rows measured end to end with daphne, a Celery worker and the agent
  (P1, P6, P7, P2);
* :mod:`.noisy` - P9, healthy streams beside misbehaving agents (:mod:`.hostile`);
* :mod:`.webhook` - P10, push webhook ingest alone and beside forgeries, with its load
  generator :mod:`.loadgen` (a separate process);
* :mod:`.child` - the entry point of the child process.
"""
