"""A first login for a fresh install, without ever printing any other secret.

A new install has no user, and the dashboard is useless without one. ``manage.py up``
creates ``admin`` with a random password and keeps that password in
``DATA_DIR/admin_password`` (mode 0600) so it can be shown again on later runs, until the
operator changes it: a password that no longer works is never shown.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from tasks_app.runtime.files import private_dir, write_private

ADMIN_USERNAME = "admin"
PASSWORD_FILE = "admin_password"


def ensure_admin(data_dir: Path, *, show_again: bool = True) -> str:
    """Make sure someone can log in; return the line to show the operator.

    ``show_again=False`` (production, where this line goes to a log collector on every
    start): the password is shown once, when it is made; later lines name its file.

    Also makes sure the project ``default`` exists with the admin as its agent admin
    (agents added without a project go there).
    """
    line = _ensure_login(data_dir, show_again)
    _ensure_default_project()
    return line


def _ensure_default_project() -> None:
    from django.contrib.auth import get_user_model

    from tasks_app.models import DEFAULT_PROJECT, Membership, Project

    project = Project.objects.get_or_create(name=DEFAULT_PROJECT)[0]
    admin = get_user_model().objects.filter(username=ADMIN_USERNAME, is_superuser=True).first()
    if admin is not None:
        Membership.objects.get_or_create(
            project=project, user=admin, defaults={"role": Membership.Role.AGENT_ADMIN}
        )


def _ensure_login(data_dir: Path, show_again: bool = True) -> str:
    from django.contrib.auth import get_user_model

    user_model = get_user_model()
    path = data_dir / PASSWORD_FILE
    if not user_model.objects.filter(is_superuser=True).exists():
        if user_model.objects.filter(username=ADMIN_USERNAME).exists():
            return (
                f"No superuser exists and the name '{ADMIN_USERNAME}' is taken: "
                "create one with 'manage.py createsuperuser'."
            )
        password = secrets.token_urlsafe(12)
        private_dir(data_dir)
        write_private(path, password + "\n")
        user_model.objects.create_superuser(ADMIN_USERNAME, email="", password=password)
        return f"Log in as {ADMIN_USERNAME} / {password}"

    if path.exists():
        password = path.read_text().strip()
        user = user_model.objects.filter(username=ADMIN_USERNAME, is_active=True).first()
        if password and user is not None and user.check_password(password):
            if not show_again:
                return f"Log in as {ADMIN_USERNAME}: the password is in {path} until it is changed"
            return f"Log in as {ADMIN_USERNAME} / {password}"
    return (
        "Log in with your superuser account ('manage.py changepassword <name>' resets a password)."
    )
