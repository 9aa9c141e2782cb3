"""People in tests: a user given one role in a project (the default one unless named)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.hashers import PBKDF2PasswordHasher

from tasks_app.models import DEFAULT_PROJECT, Membership, Project


def member(
    user: Any, role: str = Membership.Role.AGENT_ADMIN, project: str = DEFAULT_PROJECT
) -> Any:
    """Make ``user`` a member of ``project`` with ``role``; returns the user."""
    target = Project.objects.get_or_create(name=project)[0]
    Membership.objects.update_or_create(project=target, user=user, defaults={"role": role})
    return user


def signed_in(scope: dict, user: Any) -> None:
    """Put ``user`` and a session of theirs in a socket's ``scope``, as the auth middleware
    does for a logged-in browser (a socket checks that its session still holds)."""
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
    from django.contrib.sessions.backends.db import SessionStore

    scope["user"] = user
    if not getattr(user, "is_authenticated", False):
        return
    session = SessionStore()
    session[SESSION_KEY] = str(user.pk)
    session[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
    session[HASH_SESSION_KEY] = user.get_session_auth_hash()
    session.save()
    scope["session"] = session


# For a user made by a child process (``manage.py shell -c``): the same, as source text.
MEMBER_SOURCE = (
    "from tasks_app.models import Membership, Project; "
    "Membership.objects.update_or_create(project=Project.objects.get_or_create(name='default')[0], "
    "user=User.objects.get(username={username!r}), defaults={{'role': 'agent-admin'}})"
)


class QuickPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    """The product's PBKDF2 at 1,000 iterations, first in the test process's PASSWORD_HASHERS
    (tests/conftest.py): the default million costs over a second per user made or login, which
    was most of the time of the tests that start nothing. The hash names its iteration count,
    so a child process (daphne, a worker) with the default hashers still verifies it."""

    iterations = 1_000
