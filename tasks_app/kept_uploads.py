"""A file attached to a form that failed for another reason, kept for the person's next try.

A browser cannot put a file back into a file input. Sent back as a hidden field (base64),
a 10 MB file made a 14 MB form, which Django refuses past ``DATA_UPLOAD_MAX_MEMORY_SIZE``
(2.5 MB): the person got a bare 400 and lost the file and the message. So the file waits
in Redis, which every web process shares, and the form carries only a random token.

One kept file per person (a newer one replaces it), for ``KEEP_SECONDS``: what one person
can make Redis hold is one upload (``forms.MAX_UPLOAD_BYTES``).

How every uploaded file is received (``BoundedUploadHandler``, the one entry of
``FILE_UPLOAD_HANDLERS``) is here too: no form takes a file over ``forms.MAX_UPLOAD_BYTES``,
so no more of one is held, and none is written to ``FILE_UPLOAD_TEMP_DIR``.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import json
import secrets
from typing import Any

import redis
from django.conf import settings
from django.core.files.uploadedfile import InMemoryUploadedFile
from django.core.files.uploadhandler import FileUploadHandler

from tasks_app.runtime import shared_redis

KEEP_SECONDS = 3600


class BoundedUploadHandler(FileUploadHandler):
    """Each uploaded file held in memory up to ``forms.MAX_UPLOAD_BYTES``; past it only counted.

    Django's own handlers wrote every file over 2.5 MB whole to the temporary folder before
    the form could refuse it (a 10 GB upload was 10 GB on disk), and a temporary folder that
    could not be written (full, missing) made any upload over 2.5 MB a 500. Here a file over
    the limit keeps none of its content and its true size, so the form's size check refuses
    it with its sentence; what one request may hold is ``DATA_UPLOAD_MAX_NUMBER_FILES``
    times the limit.
    """

    def __init__(self, request: Any = None) -> None:
        from tasks_app.forms import MAX_UPLOAD_BYTES  # forms imports this module

        super().__init__(request)
        self.limit = MAX_UPLOAD_BYTES
        self.content: io.BytesIO | None = None
        self.received = 0

    def new_file(self, *args: Any, **kwargs: Any) -> None:
        super().new_file(*args, **kwargs)
        self.content, self.received = io.BytesIO(), 0

    def receive_data_chunk(self, raw_data: bytes, start: int) -> None:
        self.received += len(raw_data)
        if self.content is not None:
            if self.received > self.limit:
                self.content = None  # too large: what came is let go, the rest only counted
            else:
                self.content.write(raw_data)

    def file_complete(self, file_size: int) -> InMemoryUploadedFile:
        content, self.content = self.content, None
        size = file_size
        if content is None:  # let go: its size says so, and the form refuses it
            content, size = io.BytesIO(), max(file_size, self.received, self.limit + 1)
        content.seek(0)
        return InMemoryUploadedFile(
            file=content,
            field_name=self.field_name,
            name=self.file_name,
            content_type=self.content_type,
            size=size,
            charset=self.charset,
            content_type_extra=self.content_type_extra,
        )


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
