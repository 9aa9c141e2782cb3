"""``manage.py rotate_keys``: re-encrypt every stored credential with the current key.

After a new ``FIELD_ENCRYPTION_KEY`` (or ``SECRET_KEY``) is set and the old one listed in
``FIELD_ENCRYPTION_OLD_KEYS``, this moves every agent's credentials and every push
config's secrets (its token and the credentials agents send to the webhook) onto the new
key, so the old one can then be dropped from the settings. Each row is written by compare-and-set
on the value it read: credentials an operator saves meanwhile (already on the new key)
are never overwritten. Secrets are never printed; agents and push configs whose secrets
no key opens are named, and the command fails.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError

from tasks_app.crypto import UNREADABLE, SecretError, on_current_key, rotate
from tasks_app.management.commands._stopping import StoppableCommand
from tasks_app.models import Agent, OperatorAction, PushConfig

ATTEMPTS = 3


class Command(StoppableCommand):
    help = "Re-encrypt every stored agent credential and push config secret with the current key."

    def handle(self, *args: Any, **options: Any) -> None:
        rotated = current = 0
        unreadable: list[str] = []
        for pk in (
            Agent.objects.exclude(credentials_encrypted="")
            .order_by("pk")
            .values_list("pk", flat=True)
        ):
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
        configs = self._rotate_push_configs()
        self.stdout.write(
            f"Push configs: {configs['rotated']} re-encrypted, {configs['current']} already on the current key, "
            f"{len(configs['unreadable'])} unreadable."
        )
        problems = []
        if unreadable:
            problems.append(f"agents: {', '.join(unreadable)}")
        if configs["unreadable"]:
            problems.append(f"push configs: {', '.join(configs['unreadable'])}")
        if problems:
            raise CommandError(f"{UNREADABLE[0].upper()}{UNREADABLE[1:]} ({'; '.join(problems)}).")

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
            if Agent.objects.filter(pk=pk, credentials_encrypted=stored).update(
                credentials_encrypted=fresh
            ):
                OperatorAction.objects.create(agent_id=pk, action="rotate-key")
                return "rotated"
        return None

    def _rotate_push_configs(self) -> dict[str, Any]:
        """The secrets of push configs still in use (deleted ones are refused whatever they hold).

        A push config's secrets are written once, when it is made; the compare-and-set is
        kept anyway, so a config deleted meanwhile is not touched.
        """
        counts: dict[str, Any] = {"rotated": 0, "current": 0, "unreadable": []}
        live = PushConfig.objects.filter(deleted_at__isnull=True).exclude(secrets_encrypted="")
        for pk, config_id, task_id, stored in live.order_by("pk").values_list(
            "pk", "config_id", "task_id", "secrets_encrypted"
        ):
            if on_current_key(stored):
                counts["current"] += 1
                continue
            try:
                fresh = rotate(stored)
            except SecretError:
                counts["unreadable"].append(f"{config_id} of task {task_id}")
                continue
            if PushConfig.objects.filter(
                pk=pk, secrets_encrypted=stored, deleted_at__isnull=True
            ).update(secrets_encrypted=fresh):
                counts["rotated"] += 1
        if counts["rotated"]:
            OperatorAction.objects.create(
                action="rotate-key", payload={"push_configs": counts["rotated"]}
            )
        return counts
