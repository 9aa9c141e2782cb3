"""Dropping default-valued fields, so equal objects compare equal.

ProtoJSON lets a server omit a field holding its default value, or send it.
The reference SDK omits them everywhere except in ``ListTasks`` results, which
carry ``"filename": ""``, ``"extensions": []`` and the like. A mirror that
compares snapshots (or hashes them) needs one form: this module removes the
optional fields whose value is the default. Oneof content keys (``text``,
``raw``, ``url``, ``data``) are never removed: an empty text is still a text.
"""

from __future__ import annotations

from typing import Any

_EMPTY: tuple[Any, ...] = ("", [], {}, None, False)

PART_OPTIONAL = ("filename", "mediaType", "metadata")
MESSAGE_OPTIONAL = ("contextId", "taskId", "metadata", "extensions", "referenceTaskIds")
ARTIFACT_OPTIONAL = ("name", "description", "metadata", "extensions")


def _strip(obj: dict[str, Any], optional: tuple[str, ...]) -> dict[str, Any]:
    return {
        k: v
        for k, v in obj.items()
        if not (k in optional and any(v == e and type(v) is type(e) for e in _EMPTY))
    }


def part(value: Any) -> Any:
    return _strip(value, PART_OPTIONAL) if isinstance(value, dict) else value


def parts(values: Any) -> Any:
    return [part(p) for p in values] if isinstance(values, list) else values


def _with_parts(value: Any, optional: tuple[str, ...]) -> Any:
    """A Message or an Artifact: its own optional fields, then each of its parts."""
    if not isinstance(value, dict):
        return value
    out = _strip(value, optional)
    if "parts" in out:
        out["parts"] = parts(out["parts"])
    return out


def message(value: Any) -> Any:
    return _with_parts(value, MESSAGE_OPTIONAL)


def artifact(value: Any) -> Any:
    return _with_parts(value, ARTIFACT_OPTIONAL)


def status(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    out = dict(value)
    if out.get("message") in ({}, None):
        out.pop("message", None)
    elif "message" in out:
        out["message"] = message(out["message"])
    return out


def task(value: Any) -> Any:
    """A Task with default-valued optional fields removed, recursively."""
    if not isinstance(value, dict):
        return value
    out = dict(value)
    if "status" in out:
        out["status"] = status(out["status"])
    for key, fix in (("artifacts", artifact), ("history", message)):
        if isinstance(out.get(key), list):
            out[key] = [fix(v) for v in out[key]] or None
            if out[key] is None:
                del out[key]
    if out.get("metadata") == {}:
        del out["metadata"]
    return out
