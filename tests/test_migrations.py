"""The models and the migrations agree: the test databases are built from migrations alone
(and kept between runs by migration files, see ``tests/infra.py``), so a model changed without
its migration would be tested against a schema it does not have."""

from io import StringIO

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_every_model_change_has_its_migration() -> None:
    out = StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)
    except SystemExit as exit_:
        pytest.fail(f"models changed without a migration (exit {exit_.code}):\n{out.getvalue()}")
    assert "No changes detected" in out.getvalue()
