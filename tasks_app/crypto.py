"""Encryption of stored secrets (agent credentials) with Fernet.

The key comes from ``FIELD_ENCRYPTION_KEY`` (a Fernet key) or, when unset, is
derived from ``SECRET_KEY`` with HKDF, so a local run needs no extra setting.
"""

from __future__ import annotations

import base64
import json
from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings


class SecretError(Exception):
    """A stored secret could not be decrypted (the key changed, or the data is damaged)."""


@lru_cache(maxsize=4)
def _fernet(key_setting: str, secret_key: str) -> Fernet:
    if key_setting:
        return Fernet(key_setting.encode())
    derived = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=b"a2a-dashboard", info=b"field-encryption"
    ).derive(secret_key.encode())
    return Fernet(base64.urlsafe_b64encode(derived))


def fernet() -> Fernet:
    return _fernet(settings.FIELD_ENCRYPTION_KEY, settings.SECRET_KEY)


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
        raise SecretError("stored credentials cannot be decrypted with the current key") from exc
