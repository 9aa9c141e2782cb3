"""``manage.py rotate_keys``: re-encrypt every stored credential with the current key.

After a new ``FIELD_ENCRYPTION_KEY`` (or ``SECRET_KEY``) is set and the old one listed in
``FIELD_ENCRYPTION_OLD_KEYS``, this moves every agent's credentials onto the new key, so
the old one can then be dropped from the settings. Each row is written by compare-and-set
on the value it read: credentials an operator saves meanwhile (already on the new key)
are never overwritten. Secrets are never printed; agents whose credentials no key opens
are named, and the command fails.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from tasks_app.crypto import UNREADABLE, SecretError, on_current_key, rotate
from tasks_app.models import Agent, OperatorAction

ATTEMPTS = 3


class Command(BaseCommand):
    help = "Re-encrypt every stored agent credential with the current key."

    def handle(self, *args: Any, **options: Any) -> None:
        rotated = current = 0
        unreadable: list[str] = []
        for pk in Agent.objects.exclude(credentials_encrypted="").order_by("pk").values_list("pk", flat=True):
            outcome = self._rotate(pk)
            if outcome == "rotated":
                rotated += 1
            elif outcome == "current":
                current += 1
            elif outcome is not None:
                unreadable.append(outcome)
        self.stdout.write(
            f"{rotated} re-encrypted with the current key, {current} already on it, "
            f"{len(unreadable)} unreadable."
        )
        if unreadable:
            raise CommandError(
                f"{UNREADABLE[0].upper()}{UNREADABLE[1:]} (agents: {', '.join(unreadable)})."
            )

    def _rotate(self, pk: int) -> str | None:
        """'rotated', 'current', None (gone or cleared meanwhile), or the agent's label if unreadable."""
        for _ in range(ATTEMPTS):
            row = Agent.objects.filter(pk=pk).values("name", "credentials_encrypted").first()
            if row is None or not row["credentials_encrypted"]:
                return None
            stored = row["credentials_encrypted"]
            if on_current_key(stored):
                return "current"
            try:
                fresh = rotate(stored)
            except SecretError:
                return f"{pk} {row['name']!r}"
            # Compare-and-set: a value saved since we read it is left alone (and read again).
            if Agent.objects.filter(pk=pk, credentials_encrypted=stored).update(credentials_encrypted=fresh):
                OperatorAction.objects.create(agent_id=pk, action="rotate-key")
                return "rotated"
        return None
