"""Encryption of stored secrets (agent credentials) with Fernet, and key rotation.

The key comes from ``FIELD_ENCRYPTION_KEY`` (a Fernet key) or, when unset, is
derived from ``SECRET_KEY`` with HKDF, so a local run needs no extra setting.

Rotating a key would otherwise make every stored credential unreadable at once. So
``FIELD_ENCRYPTION_OLD_KEYS`` lists the keys used before (comma-separated; each entry is
an old Fernet key or an old ``SECRET_KEY``): a ``MultiFernet`` decrypts with any of them
and encrypts with the current one only, and ``manage.py rotate_keys`` re-encrypts every
stored credential with the current key, after which the old keys can be dropped. A value
none of the keys opens raises :class:`SecretError` with a sentence that says what to do.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Iterable
from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

UNREADABLE = (
    "stored credentials cannot be decrypted with the current key; "
    "re-enter them or list the old key in FIELD_ENCRYPTION_OLD_KEYS"
)


class SecretError(Exception):
    """A stored secret could not be decrypted (the key changed, or the data is damaged)."""


def _derived(secret_key: str) -> Fernet:
    derived = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=b"a2a-dashboard", info=b"field-encryption"
    ).derive(secret_key.encode())
    return Fernet(base64.urlsafe_b64encode(derived))


def _old_fernets(entry: str) -> list[Fernet]:
    """An old entry may be a Fernet key or a SECRET_KEY the key was derived from: try both."""
    keys = []
    with contextlib.suppress(ValueError):  # not a Fernet key: only the derived one
        keys.append(Fernet(entry.encode()))
    keys.append(_derived(entry))
    return keys


@lru_cache(maxsize=4)
def _fernets(key_setting: str, secret_key: str, old: tuple[str, ...]) -> tuple[Fernet, MultiFernet]:
    current = Fernet(key_setting.encode()) if key_setting else _derived(secret_key)
    return current, MultiFernet([current, *(f for entry in old for f in _old_fernets(entry))])


def _old_keys() -> tuple[str, ...]:
    value: str | Iterable[str] = getattr(settings, "FIELD_ENCRYPTION_OLD_KEYS", ()) or ()
    items = value.split(",") if isinstance(value, str) else value
    return tuple(item.strip() for item in items if item and item.strip())


def _keys() -> tuple[Fernet, MultiFernet]:
    return _fernets(settings.FIELD_ENCRYPTION_KEY, settings.SECRET_KEY, _old_keys())


def fernet() -> MultiFernet:
    """Encrypts with the current key; decrypts with the current or any old one."""
    return _keys()[1]


def encrypt_json(value: dict) -> str:
    if not value:
        return ""
    return fernet().encrypt(json.dumps(value).encode()).decode()


def decrypt_json(token: str) -> dict:
    if not token:
        return {}
    try:
        return json.loads(fernet().decrypt(token.encode()))
    except (InvalidToken, ValueError) as exc:
        raise SecretError(UNREADABLE) from exc


def readable(token: str) -> bool:
    """Whether a stored value can be decrypted with the keys configured now."""
    try:
        decrypt_json(token)
    except SecretError:
        return False
    return True


def on_current_key(token: str) -> bool:
    """Whether a stored value is already encrypted with the current key (nothing to rotate)."""
    try:
        _keys()[0].decrypt(token.encode())
    except (InvalidToken, ValueError):
        return False
    return True


def rotate(token: str) -> str:
    """The same secret encrypted with the current key; SecretError if no key opens it."""
    if not token:
        return token
    try:
        return fernet().rotate(token.encode()).decode()
    except (InvalidToken, ValueError) as exc:
        raise SecretError(UNREADABLE) from exc
