"""How many examples a property test tries: all in the full suite, fewer in the fast tier.

The fast tier (``--fast``) is the loop a developer runs between edits; the full suite, which
CI runs, tries every property test's whole count. ``tests/conftest.py`` sets ``share`` before
any test module is imported, so a decorator's ``examples(n)`` reads the tier it runs in.
"""

from __future__ import annotations

FAST_TIER_SHARE = 0.25
# Never fewer than this in either tier (and never more than the test asks for).
FEWEST = 20

share = 1.0


def examples(count: int, *, fewest: int = FEWEST) -> int:
    """The ``max_examples`` for a property test that asks for ``count`` in the full suite
    (``fewest``: a lower floor for a test whose every example writes to the database)."""
    return min(count, max(fewest, round(count * share)))
