"""Callers released at once: the order where a compare-and-set would break."""

from __future__ import annotations

import threading
from collections.abc import Callable

from django.db import connection


def release_together(*calls: Callable[[], object]) -> list[object]:
    """Run each call on a thread of its own, all released by one barrier.

    Returns, in the calls' order, what each returned or the exception it raised (the
    caller asserts which are expected). Each thread closes its own database connection.
    """
    barrier = threading.Barrier(len(calls))
    outcomes: list[object] = [None] * len(calls)

    def run(index: int, call: Callable[[], object]) -> None:
        try:
            barrier.wait(timeout=10)
            outcomes[index] = call()
        except BaseException as exc:  # returned to the caller, who asserts on it
            outcomes[index] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=item) for item in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return outcomes
