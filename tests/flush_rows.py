"""After a transactional test's flush, the rows post_migrate made put back as they were.

A test that needs real transactions (``transaction=True``: threads, the shared loop, races)
ends with Django's ``flush``: every table emptied, then the ``post_migrate`` signal sent again
so that ``contenttypes`` and ``auth`` make their rows anew, model by model, with a few queries
each. The signal was about nine tenths of each flush and 5 % of the fast tier's CPU
(profiled). Those rows depend only on the installed models, which do not change while the
suite runs: the first flush of a process sends the signal and keeps what it made; every later
flush inserts those rows again in two statements (same ids, so cached content types stay
right). Any other receiver of the signal, or a database not yet seen, takes the usual way.
"""

from __future__ import annotations

import weakref
from typing import Any

from django.core.management.commands import flush

_emit = flush.emit_post_migrate_signal
# Per database alias: the content types' and permissions' values after the first flush.
_made: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}


def _only_known_receivers() -> bool:
    """Whether the signal's receivers are just the two whose rows are kept here."""
    from django.contrib.auth.management import create_permissions
    from django.contrib.contenttypes.management import create_contenttypes
    from django.db.models.signals import post_migrate

    receivers = [entry[1] for entry in post_migrate.receivers]
    live = {r() if isinstance(r, weakref.ref) else r for r in receivers}
    return live == {create_contenttypes, create_permissions}


def _emit_or_restore(verbosity: int, interactive: bool, db: str, **kwargs: Any) -> None:
    from django.contrib.auth.models import Permission
    from django.contrib.contenttypes.models import ContentType
    from django.core.management.color import no_style
    from django.db import connections, transaction

    made = _made.get(db)
    if made is None or not _only_known_receivers():
        _emit(verbosity, interactive, db, **kwargs)
        _made[db] = (
            list(ContentType.objects.using(db).values()),
            list(Permission.objects.using(db).values()),
        )
        return
    content_types, permissions = made
    connection = connections[db]
    with transaction.atomic(using=db):
        ContentType.objects.using(db).bulk_create([ContentType(**row) for row in content_types])
        Permission.objects.using(db).bulk_create([Permission(**row) for row in permissions])
        # Sequences past the ids put back (a flush that reset them would hand them out again).
        with connection.cursor() as cursor:
            for statement in connection.ops.sequence_reset_sql(
                no_style(), [ContentType, Permission]
            ):
                cursor.execute(statement)
    ContentType.objects.clear_cache()


def install() -> None:
    flush.emit_post_migrate_signal = _emit_or_restore  # type: ignore[assignment]
