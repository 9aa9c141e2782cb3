"""Entry point of one benchmark child: ``python -m bench.child ROW --db-label sqlite [--quick]``.

The parent (``manage.py bench``) sets ``DATABASE_URL`` (a scratch database),
``REDIS_URL`` (a private Redis), ``DATA_DIR`` and ``CELERY_QUEUE`` in the
environment; settings are read from it at import, which is why a row runs in its
own process rather than by swapping settings in the caller. The child migrates
the scratch database, runs the row and prints each result as one line
``BENCHROW {json}`` on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("row")
    parser.add_argument("--db-label", default="sqlite")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    # The parent stops this process with SIGTERM (its own SIGTERM or Ctrl-C, a timeout): unwind,
    # so that the rows' finally blocks stop the agents, workers and servers they started, which
    # live in process groups of their own.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
    import django

    django.setup()
    from django.core.management import call_command

    from bench import inproc, live, noisy, webhook
    from bench.report import Row

    call_command("migrate", verbosity=0, interactive=False)
    rows_by_name = {"P1": live.p1, "P2": live.p2, "P3": inproc.p3, "P8": inproc.p8, "P4": inproc.p4, "P5": inproc.p5,
                    "P6": live.p6, "P7": live.p7, "P2x": live.p2x, "P9": noisy.p9, "P10": webhook.p10}  # fmt: skip
    func = rows_by_name[args.row]
    try:
        rows = func(args.db_label, args.quick)
    except Exception as exc:
        traceback.print_exc()
        rows = [
            Row(
                args.row,
                "error",
                "error",
                "",
                False,
                db=args.db_label,
                note=f"the benchmark failed: {type(exc).__name__}: {str(exc)[:500]}",
            )
        ]
    for row in rows:
        print("BENCHROW " + json.dumps(row.to_json(), default=str), flush=True)
    from tasks_app import eventloop

    eventloop.stop(timeout=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
