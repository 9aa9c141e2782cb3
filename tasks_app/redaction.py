"""Values a person typed into a password field: sent to the agent, hidden in what we keep.

The log, its conversation rows, the audit rows and the pages keep the message with such
values replaced by :data:`HIDDEN`, found by value wherever they appear (a context, a
formatted string, a data model, a summary line).
"""

from __future__ import annotations

from typing import Any

HIDDEN = "[hidden: typed into a password field]"
# A secret this short is hidden where it is a whole value only: inside longer text it would
# hide letters of words.
SECRET_SUBSTRING_CHARS = 4


def hide_secrets(value: Any, secrets: set[str]) -> Any:
    """``value`` (JSON) with every occurrence of a secret replaced by ``HIDDEN``."""
    if not secrets:
        return value
    if isinstance(value, str):
        if value in secrets:
            return HIDDEN
        for secret in secrets:
            if len(secret) >= SECRET_SUBSTRING_CHARS and secret in value:
                value = value.replace(secret, HIDDEN)
        return value
    if isinstance(value, dict):
        return {k: hide_secrets(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [hide_secrets(v, secrets) for v in value]
    return value
