"""A file attached to a form that failed for another reason, kept for the person's next try.

A browser cannot put a file back into a file input. Sent back as a hidden field (base64),
a 10 MB file made a 14 MB form, which Django refuses past ``DATA_UPLOAD_MAX_MEMORY_SIZE``
(2.5 MB): the person got a bare 400 and lost the file and the message. So the file waits
in Redis, which every web process shares, and the form carries only a random token.

One kept file per person (a newer one replaces it), for ``KEEP_SECONDS``: what one person
can make Redis hold is one upload (``forms.MAX_UPLOAD_BYTES``).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets

import redis
from django.conf import settings

from tasks_app.runtime import shared_redis

KEEP_SECONDS = 3600


class KeptUploadError(Exception):
    """Redis could not keep or give back the file (the form says so in a sentence)."""


def _key(person_id: int) -> str:
    return f"kept-upload:{person_id}"


def keep(person_id: int, part: dict[str, str]) -> str:
    """Keep ``part`` (``raw`` base64, ``filename``, ``mediaType``) for ``person_id``; its token."""
    token = secrets.token_urlsafe(16)
    value = json.dumps({"token": token, **part})
    try:
        shared_redis.client(settings.REDIS_URL).set(_key(person_id), value, ex=KEEP_SECONDS)
    except redis.RedisError as exc:
        raise KeptUploadError(type(exc).__name__) from exc
    return token


def take(person_id: int, token: str) -> dict[str, str] | None:
    """The part kept under ``token`` for this person (it stays kept); None when it is gone."""
    try:
        value = shared_redis.client(settings.REDIS_URL).get(_key(person_id))
    except redis.RedisError as exc:
        raise KeptUploadError(type(exc).__name__) from exc
    if value is None:
        return None
    kept = json.loads(value)
    # As bytes: compare_digest refuses text with non-ASCII characters (a forged form field).
    if not hmac.compare_digest(str(kept.pop("token", "")).encode(), token.encode()):
        return None  # replaced by a newer one, or a token from elsewhere
    return kept  # as keep() stored it (its base64 is the upload's, encoded by the form)


def drop(person_id: int) -> None:
    """Forget the person's kept file (the form went through)."""
    with contextlib.suppress(redis.RedisError):  # it expires on its own
        shared_redis.client(settings.REDIS_URL).delete(_key(person_id))
