"""The suite's flush (``tests.flush_rows``) leaves the rows post_migrate would have made.

The shortcut is the suite's, not the product's: if it put back fewer or other rows, every
transactional test after the first would run on a database the product never has (a
content type missing, a permission renamed).
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.core.management.sql import emit_post_migrate_signal

from tasks_app.models import RemoteTask
from tests import flush_rows


def rows() -> tuple[set[tuple[str, str]], set[tuple[str, str, str, str]]]:
    """The content types and permissions, by what they are rather than by id."""
    content_types = set(ContentType.objects.values_list("app_label", "model"))
    permissions = set(
        Permission.objects.values_list(
            "content_type__app_label", "content_type__model", "codename", "name"
        )
    )
    return content_types, permissions


@pytest.mark.django_db(transaction=True)
def test_a_flush_leaves_the_rows_the_signal_makes() -> None:
    call_command("flush", verbosity=0, interactive=False)  # the first: kept, if not yet
    call_command("flush", verbosity=0, interactive=False)  # put back from what was kept
    assert "default" in flush_rows._made
    restored = rows()
    ids = dict(ContentType.objects.values_list("model", "id"))
    assert ContentType.objects.get_for_model(RemoteTask).pk == ids["remotetask"]
    Permission.objects.all().delete()
    ContentType.objects.all().delete()
    ContentType.objects.clear_cache()
    emit_post_migrate_signal(0, False, "default")  # Django's own way
    assert restored == rows()
    assert len(restored[0]) > 10 and len(restored[1]) > 40


@pytest.mark.django_db(transaction=True)
def test_a_new_receiver_of_the_signal_takes_the_usual_way() -> None:
    from django.db.models.signals import post_migrate

    heard: list[str] = []

    def receiver(**kwargs: object) -> None:
        heard.append(str(kwargs.get("using")))

    call_command("flush", verbosity=0, interactive=False)
    post_migrate.connect(receiver)
    try:
        call_command("flush", verbosity=0, interactive=False)
    finally:
        post_migrate.disconnect(receiver)
    assert heard and set(heard) == {"default"}
    assert len(rows()[1]) > 40
