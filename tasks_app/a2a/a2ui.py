"""A2UI, the "agent to UI" extension of A2A: negotiation, detection, validation and the fold.

Pure functions, no Django: ``tasks_app.services.surfaces`` calls them inside ``record()``.

Versions. We speak v0.8, v0.9 and v0.9.1, each by the extension URI its specification
names (``https://a2ui.org/a2a-extension/a2ui/v0.8`` and so on). v0.9 and v0.9.1 share
one set of JSON Schemas (their messages both say ``"version": "v0.9"``); they differ in
the URI and in the media type their parts carry. The newest specification in the A2UI
repository, v0.10, is a draft under development whose URI is ``.../v0.10``, and there is
no published v1.0 specification or schema: an agent that declares only those gets
nothing extra from us, and their messages are diagnosed as an unsupported version.

The JSON Schemas we validate against are vendored in ``a2ui_schemas/`` with the A2UI
repository's license and loaded offline (``referencing``; nothing is fetched).

Folded form. Whatever version an agent speaks, a surface's components are kept in the
v0.9.1 basic-catalog form (``{"id", "component": "Text", "text": "Hi" | {"path": ...}}``,
children as a list of ids or a ``{"componentId", "path"}`` template, actions as the
v0.9.1 ``Action``), so one renderer knows one shape. Strings stay strings: nothing here
interprets markup. URL literals outside http(s) are dropped when folded.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urldefrag, urljoin

import jsonschema
import referencing
from jsonschema.exceptions import best_match
from referencing.jsonschema import DRAFT202012

from .safejson import whole_number

__all__ = [
    "BASIC_CATALOG_IDS",
    "EXTENSION_URIS",
    "MEDIA_TYPES",
    "Outcome",
    "action_message",
    "action_metadata",
    "action_part",
    "apply",
    "client_capabilities_metadata",
    "declared_version",
    "is_a2ui_part",
    "lookup",
    "message_version",
    "messages_in_part",
    "new_surface",
    "problem_of",
    "resolve",
    "safe_url",
    "surface_id_of",
    "validate",
]

EXTENSION_BASE = "https://a2ui.org/a2a-extension/a2ui/"
# The versions we support, newest first: a card that declares several gets the newest.
EXTENSION_URIS: dict[str, str] = {
    "0.9.1": EXTENSION_BASE + "v0.9.1",
    "0.9": EXTENSION_BASE + "v0.9",
    "0.8": EXTENSION_BASE + "v0.8",
}
# Both spellings are in use: the v0.8 and v0.9 specifications (and the A2UI Python SDK)
# write the first, v0.9.1 the second.
MEDIA_TYPES = ("application/json+a2ui", "application/a2ui+json")
MEDIA_TYPE_OF = {"0.8": MEDIA_TYPES[0], "0.9": MEDIA_TYPES[0], "0.9.1": MEDIA_TYPES[1]}
CAPABILITIES_KEY = "a2uiClientCapabilities"
DATA_MODEL_KEY = "a2uiClientDataModel"
V08_CATALOG = "https://a2ui.org/specification/v0_8/standard_catalog_definition.json"
V09_CATALOG = "https://a2ui.org/specification/v0_9/catalogs/basic/catalog.json"
V091_CATALOG = "https://a2ui.org/specification/v0_9_1/catalogs/basic/catalog.json"
# The basic catalog under each id an agent may use for it (v0.9.1's file still names v0_9).
BASIC_CATALOG_IDS: dict[str, tuple[str, ...]] = {
    "0.8": (V08_CATALOG,),
    "0.9": (V09_CATALOG,),
    "0.9.1": (V091_CATALOG, V09_CATALOG),
}

# Bounds. A surface is folded inside record() and rendered server-side on every page load
# and live refresh, from an agent we do not trust: each bound keeps one surface from
# making the record, the page or the renderer's recursion expensive. Real forms are far
# inside them (a booking form is ~20 components, 5 levels, a few KiB).
MAX_JSON_DEPTH = 32  # nesting of one message / of the data model (a deep form is ~12)
MAX_TREE_DEPTH = 24  # component levels from the root (templates count once)
MAX_COMPONENTS = 500  # components in one surface
MAX_SURFACE_BYTES = 512 * 1024  # components + data model + styles, as canonical JSON
MAX_DATA_MODEL_BYTES = 256 * 1024  # the data model alone
MAX_SURFACES = 50  # surfaces per task
MAX_MESSAGES_PER_EVENT = 200  # A2UI messages folded from one log row (each is validated)
MAX_DIAGNOSES_PER_EVENT = 5  # protocol-error rows after one log row (the last counts the rest)
MAX_REASON = 500  # characters of a problem / reason
MAX_ID_CHARS = 200  # a surfaceId or root id (the Surface row's columns)
# A message a surface cannot take is kept on it (``raw_json``, what the page shows beside
# "could not render") up to this many characters of its JSON; a longer one as its first
# characters and its length (the log holds it whole). Kept whole, a 3 MB message was read and
# written out again on each draw of the task page, the inbox and the surfaces' redraw.
RAW_KEPT_CHARS = 20_000
MAX_CATALOG_ID_CHARS = 500
MAX_PATH_CHARS = 1000  # a data path (a JSON pointer; a deep form's are a few dozen)

SCHEMA_DIR = Path(__file__).with_name("a2ui_schemas")
V08_KEYS = ("beginRendering", "surfaceUpdate", "dataModelUpdate", "deleteSurface")
V09_KEYS = ("createSurface", "updateComponents", "updateDataModel", "deleteSurface")
# Component properties that bind to where a person's input goes (may be absent until then).
INPUT_VALUES = {"TextField", "CheckBox", "ChoicePicker", "Slider", "DateTimeInput"}
URL_PROPS = {"Image": ("url",), "Video": ("url",), "AudioPlayer": ("url",)}


# Negotiation --------------------------------------------------------------------------------


def declared_version(card: Any) -> str | None:
    """The newest A2UI version we support among those the card's extensions declare."""
    caps = card.get("capabilities") if isinstance(card, Mapping) else None
    extensions = caps.get("extensions") if isinstance(caps, Mapping) else None
    if not isinstance(extensions, list):
        return None
    # A card's values are the agent's: only string uris count (a list would not even hash).
    uris = {
        e.get("uri") for e in extensions if isinstance(e, Mapping) and isinstance(e.get("uri"), str)
    }
    return next((version for version, uri in EXTENSION_URIS.items() if uri in uris), None)


def client_capabilities_metadata(version: str) -> dict[str, Any]:
    """What goes into ``message.metadata`` of every message to an agent speaking ``version``.

    The key is ``a2uiClientCapabilities`` in every published version; v0.9 and v0.9.1
    nest the object under ``"v0.9"`` (their client_capabilities.json). We support the
    basic (v0.8: standard) catalog only, and accept no inline catalogs.
    """
    catalogs = list(BASIC_CATALOG_IDS[version])
    if version == "0.8":
        return {CAPABILITIES_KEY: {"supportedCatalogIds": catalogs}}
    return {CAPABILITIES_KEY: {"v0.9": {"supportedCatalogIds": catalogs}}}


def with_capabilities(message: Mapping[str, Any], version: str | None) -> dict[str, Any]:
    """``message`` as sent to an agent speaking ``version`` (None: unchanged).

    Our renderer's capabilities go into its metadata and the extension's URI into its
    ``extensions``. Idempotent: the services apply it when they build a message (so the
    log records the message exactly as sent) and the client applies it again to whatever
    it sends (so no path forgets it).
    """
    out = dict(message)
    if version is None:
        return out
    metadata = out.get("metadata")
    out["metadata"] = {
        **(metadata if isinstance(metadata, Mapping) else {}),
        **client_capabilities_metadata(version),
    }
    uri = EXTENSION_URIS[version]
    declared = out.get("extensions")
    declared = list(declared) if isinstance(declared, list) else []
    out["extensions"] = declared if uri in declared else [*declared, uri]
    return out


# Detection ----------------------------------------------------------------------------------


def _media(value: Any) -> str:
    return value.split(";")[0].strip().lower() if isinstance(value, str) else ""


def is_a2ui_part(part: Any) -> bool:
    """A data part marked A2UI by its A2A 1.0 ``mediaType`` or its ``metadata.mimeType``."""
    if not isinstance(part, Mapping) or "data" not in part:
        return False
    metadata = part.get("metadata")
    mime = metadata.get("mimeType") if isinstance(metadata, Mapping) else None
    return _media(part.get("mediaType")) in MEDIA_TYPES or _media(mime) in MEDIA_TYPES


def part_media_type(part: Mapping[str, Any]) -> str:
    metadata = part.get("metadata")
    mime = metadata.get("mimeType") if isinstance(metadata, Mapping) else None
    media = _media(part.get("mediaType"))
    return media if media in MEDIA_TYPES else _media(mime)


def messages_in_part(part: Any) -> list[Any]:
    """The A2UI messages a part carries: one object, or a list of them (in order).

    Items that are not objects are returned too, so that validation names them.
    """
    if not is_a2ui_part(part):
        return []
    data = part["data"]
    return list(data) if isinstance(data, list) else [data]


def message_version(message: Any, media_type: str = "") -> str | None:
    """The version a received message speaks, as its extension URI names it.

    v0.9+ messages say ``"version": "v0.9"`` (v0.9.1 shares v0.9's schemas; the v0.9.1
    document's examples write ``"v0.9.1"``, which we accept as the same); which of the
    two it is follows the part's media type. v0.8 messages carry no version (the A2UI
    Python SDK writes ``"v0.8"``). None: a version we do not support.
    """
    if not isinstance(message, Mapping):
        return None
    version = message.get("version")
    if version in ("v0.9", "v0.9.1"):
        return "0.9.1" if (version == "v0.9.1" or media_type == MEDIA_TYPES[1]) else "0.9"
    if version in (None, "v0.8") and any(key in message for key in V08_KEYS):
        return "0.8"
    return None


def surface_id_of(message: Any) -> str | None:
    if not isinstance(message, Mapping):
        return None
    for key in (*V08_KEYS, *V09_KEYS):
        body = message.get(key)
        if isinstance(body, Mapping) and isinstance(body.get("surfaceId"), str):
            return body["surfaceId"]
    return None


# Validation ---------------------------------------------------------------------------------


def _load(name: str) -> dict[str, Any]:
    return json.loads((SCHEMA_DIR / name).read_text(encoding="utf-8"))


@cache
def _registry09(basic: bool) -> referencing.Registry:
    """The v0.9 schemas' ``$ref`` targets, from the vendored files.

    They refer to ``catalog.json``, the catalog the surface uses. For the basic catalog
    that is the basic catalog with its components left open (each is then checked on its
    own, see :func:`_component_validator`); for any other catalog, whose schema we do not
    have, an open stand-in that checks only what every component has.
    """
    common = _load("v0_9/common_types.json")
    basic_catalog = _load("v0_9/basic_catalog.json")
    if basic:
        catalog = {
            **basic_catalog,
            "$defs": {**basic_catalog["$defs"], "anyComponent": _OPEN_COMPONENT},
        }
    else:
        catalog = _open_catalog()
    base = "https://a2ui.org/specification/v0_9/"
    return referencing.Registry().with_resources(
        [
            (base + "common_types.json", DRAFT202012.create_resource(common)),
            (base + "catalog.json", DRAFT202012.create_resource(catalog)),
            (V09_CATALOG, DRAFT202012.create_resource(basic_catalog)),
        ]
    )


@cache
def _validator(family: str, basic: bool) -> jsonschema.protocols.Validator:
    """The validator of a message's envelope (v0.9: components checked for shape only)."""
    if family == "0.8":
        name = "server_to_client_with_standard_catalog.json" if basic else "server_to_client.json"
        return jsonschema.Draft202012Validator(_load(f"v0_8/{name}"))
    schema = _load("v0_9/server_to_client.json")
    return jsonschema.Draft202012Validator(schema, registry=_registry09(basic))


@cache
def _basic_components() -> frozenset[str]:
    return frozenset(_load("v0_9/basic_catalog.json")["components"])


@cache
def _component_validator(name: str) -> jsonschema.protocols.Validator:
    """One basic-catalog component's schema, its non-recursive ``$ref`` written in place.

    Checking each component against its own schema (chosen by its ``component`` name)
    instead of the catalog's ``oneOf`` over every component, with the references already
    resolved, is what makes a surface of a few hundred components cheap enough to check
    inside the record's transaction. The meaning is the schema's: a ``$ref`` applies its
    target beside the other keywords, as the ``allOf`` it becomes does.
    """
    registry = _registry09(True)
    found = registry.resolver(base_uri=V09_CATALOG).lookup(f"#/components/{name}")
    schema = _inlined(registry, found.contents, V09_CATALOG, frozenset())
    return jsonschema.Draft202012Validator(schema, registry=registry)


_ANNOTATIONS = ("description", "$schema", "$id", "title", "default", "examples")


def _inlined(
    registry: referencing.Registry, schema: Any, base: str, expanding: frozenset[str]
) -> Any:
    """``schema`` (from the resource at ``base``) with its references written in place."""
    if isinstance(schema, list):
        return [_inlined(registry, item, base, expanding) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref":
            uri = urljoin(base, value)
            if uri in expanding:  # recursive (a function call's arguments): keep the reference
                out["$ref"] = uri
                continue
            target = registry.resolver(base_uri=base).lookup(value)
            inner = _inlined(registry, target.contents, urldefrag(uri).url, expanding | {uri})
            if len(schema) == 1:
                return inner
            out.setdefault("allOf", []).append(inner)
        elif key in _ANNOTATIONS:
            continue
        elif key in ("properties", "$defs", "patternProperties", "dependentSchemas"):
            out[key] = {n: _inlined(registry, v, base, expanding) for n, v in value.items()}
        elif key in ("const", "enum", "required", "type"):
            out[key] = value
        else:
            out[key] = _inlined(registry, value, base, expanding)
    return out


_OPEN_COMPONENT = {
    "type": "object",
    "properties": {"id": {"type": "string"}, "component": {"type": "string"}},
    "required": ["id", "component"],
}


def _open_catalog() -> dict[str, Any]:
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$defs": {
            "anyComponent": _OPEN_COMPONENT,
            "anyFunction": {"type": "object"},
            "theme": {"type": "object"},
        },
    }


def _depth(value: Any, limit: int) -> bool:
    """Whether ``value`` nests deeper than ``limit`` (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def _pointer(parts: Any) -> str:
    return "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 1] + "…"


def validate(version: str, message: Any, *, catalog_id: str | None = None) -> str | None:
    """Why ``message`` fails ``version``'s schema (its place and the schema path), or None.

    ``catalog_id``: the surface's catalog; components of a catalog other than the basic
    one are checked only for an ``id`` and a ``component`` name. Never raises.
    """
    if not isinstance(message, Mapping):
        return f"schema: an A2UI message must be a JSON object, got {type(message).__name__}"
    if _depth(message, MAX_JSON_DEPTH):
        return f"too deep: the message nests more than {MAX_JSON_DEPTH} levels"
    family = "0.8" if version == "0.8" else "0.9"
    body = dict(message)
    if family == "0.8":
        body.pop("version", None)  # the A2UI Python SDK writes "v0.8"; the schema has no such key
    elif body.get("version") == "v0.9.1":
        body["version"] = "v0.9"
    size = _size(body)
    if size > MAX_SURFACE_BYTES:
        return f"too large: the message is {size} bytes (at most {MAX_SURFACE_BYTES})"
    holder = body.get("updateComponents") or body.get("surfaceUpdate")
    items = holder.get("components") if isinstance(holder, Mapping) else None
    if isinstance(items, list) and len(items) > MAX_COMPONENTS:
        return f"too large: {len(items)} components in one message (at most {MAX_COMPONENTS})"
    basic = catalog_id is None or catalog_id == "" or catalog_id in _all_basic_ids()
    try:
        error = best_match(_validator(family, basic).iter_errors(body))
        if error is None and family == "0.9" and basic and isinstance(items, list):
            return _components_reason(items)
    except (jsonschema.exceptions.SchemaError, referencing.exceptions.Unresolvable) as exc:
        return _clip(f"schema: cannot check the message ({exc.__class__.__name__})")
    except RecursionError:
        return "too deep: the message cannot be checked"
    if error is None:
        return None
    return _reason(_narrowed(error), (), ())


def _reason(error: jsonschema.ValidationError, at: tuple, schema_at: tuple) -> str:
    where = _pointer((*at, *error.absolute_path))
    schema_path = _pointer((*schema_at, *error.absolute_schema_path))
    return _clip(f"schema: at {where}: {error.message} (schema path {schema_path})")


def _components_reason(items: list[Any]) -> str | None:
    """The first basic-catalog component that fails its own schema, with its place."""
    at = ("updateComponents", "components")
    for index, item in enumerate(items):
        name = item.get("component") if isinstance(item, Mapping) else None
        if name not in _basic_components():
            return _clip(
                f"schema: at {_pointer((*at, index, 'component'))}: {name!r} is not a component "
                f"of the basic catalog (schema path /$defs/anyComponent)"
            )
        errors = list(_component_validator(name).iter_errors(item))
        # "Unevaluated properties" follows from the real failure inside an allOf: name that.
        error = best_match([e for e in errors if e.validator != "unevaluatedProperties"] or errors)
        if error is not None:
            return _reason(_narrowed(error), (*at, index), ("components", name))
    return None


def _narrowed(error: jsonschema.ValidationError) -> jsonschema.ValidationError:
    """The error inside a ``oneOf`` branch that applies, rather than "valid under none".

    The message and catalog schemas pick a branch by a constant (``"component": "Text"``,
    ``"version"``); branches whose constant does not match are not what the agent meant.
    """
    while error.validator in ("oneOf", "anyOf") and error.context:
        branches: dict[Any, list[jsonschema.ValidationError]] = {}
        for sub in error.context:
            branches.setdefault(sub.relative_schema_path[0], []).append(sub)
        meant = [
            errors
            for errors in branches.values()
            if not any(e.validator == "const" for e in errors)
            and not any(
                e.validator == "required" and len(e.path) == len(error.path) for e in errors
            )
        ]
        if len(meant) != 1:
            break
        # "Unevaluated properties" follows from the real failure inside an allOf: name that.
        real = [e for e in meant[0] if e.validator != "unevaluatedProperties"] or meant[0]
        error = best_match(real) or error
    return error


@cache
def _all_basic_ids() -> frozenset[str]:
    return frozenset(i for ids in BASIC_CATALOG_IDS.values() for i in ids)


# Data model ---------------------------------------------------------------------------------


_MISSING = object()


def _tokens(pointer: str) -> list[str]:
    if pointer in ("", "/"):
        return []
    body = pointer[1:] if pointer.startswith("/") else pointer
    return [t.replace("~1", "/").replace("~0", "~") for t in body.split("/")]


def _absolute(path: str, scope_path: str = "") -> str:
    if path.startswith("/"):
        return path
    scope = scope_path.rstrip("/")
    return f"{scope}/{path}" if path else (scope or "/")


def lookup(data: Any, pointer: str) -> tuple[bool, Any]:
    """``(found, value)`` at a JSON Pointer into the data model (lists by index)."""
    current = data
    for token in _tokens(pointer):
        if isinstance(current, dict) and token in current:
            current = current[token]
        elif (
            isinstance(current, list)
            and (index := whole_number(token)) is not None
            and (index < len(current))
        ):
            current = current[index]
        else:
            return False, None
    return True, current


class _TooDeep(Exception):
    pass


class _ModelTooDeep(Exception):
    """A value that would make the data model nest deeper than ``MAX_JSON_DEPTH``."""


class _NoFit(Exception):
    """A path that goes through a list by a name, or past its end."""


def _set(data: dict[str, Any], pointer: str, value: Any = _MISSING) -> dict[str, Any]:
    """A new data model with ``value`` at ``pointer`` (removed when missing); parents are made.

    Copy on write: only the containers along the path are copied, so an update costs the
    path's length, not the model's size, and the state before stays as it was. The bounds
    are kept the same way: the new model's depth is checked on ``value`` alone (the model
    before was within it), and its size is the size before and what the change added
    (``known_size``). Measured on the whole model after each message, an agent's 200
    one-value updates to a model of 11,000 keys took 5 s to fold, holding the write lock.
    """
    tokens = _tokens(pointer)
    if len(tokens) > MAX_JSON_DEPTH:
        raise _TooDeep
    if not tokens:
        new, grown = ({}, None) if value is _MISSING else (value, None)
        if not isinstance(new, dict):
            return data  # the root is always an object
    else:
        new, grown = _set_in(data, tokens, value)  # a path that does not fit is said first
    if value is not _MISSING and _depth(value, MAX_JSON_DEPTH - len(tokens)):
        raise _ModelTooDeep
    if grown is not None:
        _remember_size(new, known_size(data) + grown)
    return new


def _set_in(node: Any, tokens: list[str], value: Any) -> tuple[Any, int]:
    """``node`` with ``value`` at ``tokens``, and by how many bytes its JSON grew (or shrank)."""
    token, rest = tokens[0], tokens[1:]
    if isinstance(node, list):
        index = whole_number(token)
        if index is None or index > len(node) or (rest and index == len(node)):
            raise _NoFit
        items = list(node)
        if rest:
            child = items[index]
            if isinstance(child, dict | list):
                items[index], grown = _set_in(child, rest, value)
                return items, grown
            items[index], grown = _set_in({}, rest, value)
            return items, _EMPTY_OBJECT + grown - _size(child)
        if value is _MISSING:
            if index == len(items):
                return items, 0
            removed = items.pop(index)
            return items, -(_size(removed) + (1 if items else 0))
        if index < len(items):
            old, items[index] = items[index], value
            return items, _size(value) - _size(old)
        items.append(value)
        return items, _size(value) + (1 if len(items) > 1 else 0)
    out = dict(node)
    if rest:
        child = out.get(token)
        if isinstance(child, dict | list):
            out[token], grown = _set_in(child, rest, value)
            return out, grown
        out[token], grown = _set_in({}, rest, value)
        if token in node:
            return out, _EMPTY_OBJECT + grown - _size(child)
        return out, _entry_size(token, _EMPTY_OBJECT + grown, node)
    if value is _MISSING:
        if token not in out:
            return out, 0
        removed = out.pop(token)
        return out, -_entry_size(token, _size(removed), out)
    if token in out:
        old, out[token] = out[token], value
        return out, _size(value) - _size(old)
    out[token] = value
    return out, _entry_size(token, _size(value), node)


_EMPTY_OBJECT = 2  # "{}"


def _entry_size(key: str, value_size: int, others: Mapping[str, Any]) -> int:
    """What a member adds to an object's JSON that holds ``others`` besides it."""
    return _size(key) + 1 + value_size + (1 if others else 0)


# The sizes of the last few data models and component sets, by identity (each thread its
# own): an update's new model gets the size before and what it added, so the bounds are
# checked without writing the whole model out again after every message.
_sizes = threading.local()
_SIZES_KEPT = 16


def known_size(value: Any) -> int:
    """``_size(value)``, remembered for the object itself (a container is never changed in
    place here: an update makes a new one)."""
    kept: dict[int, tuple[Any, int]] = _sizes.__dict__.setdefault("kept", {})
    found = kept.get(id(value))
    if found is not None and found[0] is value:
        return found[1]
    size = _size(value)
    _remember_size(value, size)
    return size


def _remember_size(value: Any, size: int) -> None:
    kept: dict[int, tuple[Any, int]] = _sizes.__dict__.setdefault("kept", {})
    if len(kept) >= _SIZES_KEPT:
        del kept[next(iter(kept))]  # the oldest (dicts keep their order)
    kept[id(value)] = (value, size)


def resolve(value: Any, data_model: Any, scope_path: str = "") -> Any:
    """A DynamicValue's value: a literal as is, ``{"path": p}`` from the data model (else None).

    Relative paths are taken inside ``scope_path`` (a template item's place). Function
    calls (``{"call": ...}``) are not evaluated here: None.
    """
    if isinstance(value, Mapping):
        if "call" in value:
            return None
        if isinstance(value.get("path"), str):
            found, got = lookup(data_model, _absolute(value["path"], scope_path))
            return got if found else None
        return dict(value)
    return value


def safe_url(url: Any) -> str | None:
    """The URL if it is http(s) with a host, else None (a renderer loads nothing else)."""
    if not isinstance(url, str):
        return None
    text = url.strip()
    return text if re.match(r"^https?://[^/\s?#]+", text, re.IGNORECASE) else None


# v0.8 -> v0.9.1 form ------------------------------------------------------------------------


def _value08(value: Any) -> Any:
    """A v0.8 bound value (``literalString``/``path``/...) as a v0.9.1 DynamicValue."""
    if not isinstance(value, Mapping):
        return value
    if isinstance(value.get("path"), str):
        return {"path": value["path"]}
    for key in ("literalString", "literalNumber", "literalBoolean", "literalArray"):
        if key in value:
            return value[key]
    return ""


def _literal08(value: Any) -> Any:
    if isinstance(value, Mapping):
        for key in ("literalString", "literalNumber", "literalBoolean", "literalArray"):
            if key in value:
                return value[key]
    return _MISSING


def _children08(children: Any) -> Any:
    if not isinstance(children, Mapping):
        return []
    if isinstance(children.get("explicitList"), list):
        return list(children["explicitList"])
    template = children.get("template")
    if isinstance(template, Mapping):
        return {
            "componentId": template.get("componentId", ""),
            "path": template.get("dataBinding", ""),
        }
    return []


def _action08(action: Any) -> dict[str, Any]:
    action = action if isinstance(action, Mapping) else {}
    context: dict[str, Any] = {}
    for item in _list(action.get("context")):
        if isinstance(item, Mapping) and isinstance(item.get("key"), str):
            value = item.get("value") or {}
            if isinstance(value, Mapping) and isinstance(value.get("path"), str):
                context[item["key"]] = {"path": value["path"]}
            else:
                literal = _literal08(value)
                context[item["key"]] = None if literal is _MISSING else literal
    event: dict[str, Any] = {"name": str(action.get("name", ""))}
    if context:
        event["context"] = context
    return {"event": event}


# name -> (v0.9.1 name, {v0.8 property: v0.9.1 property}); values are converted by kind.
_RENAMES: dict[str, tuple[str, dict[str, str]]] = {
    "Text": ("Text", {"text": "text", "usageHint": "variant"}),
    "Image": ("Image", {"url": "url", "altText": "description", "fit": "fit", "usageHint": "variant"}),
    "Icon": ("Icon", {"name": "name"}),
    "Video": ("Video", {"url": "url"}),
    "AudioPlayer": ("AudioPlayer", {"url": "url", "description": "description"}),
    "Row": ("Row", {"distribution": "justify", "alignment": "align"}),
    "Column": ("Column", {"distribution": "justify", "alignment": "align"}),
    "List": ("List", {"direction": "direction", "alignment": "align"}),
    "Card": ("Card", {"child": "child"}),
    "Divider": ("Divider", {"axis": "axis"}),
    "Modal": ("Modal", {"entryPointChild": "trigger", "contentChild": "content"}),
    "Button": ("Button", {"child": "child"}),
    "CheckBox": ("CheckBox", {"label": "label", "value": "value"}),
    "TextField": ("TextField", {"label": "label", "text": "value", "validationRegexp": "validationRegexp"}),
    "DateTimeInput": ("DateTimeInput", {"value": "value", "enableDate": "enableDate", "enableTime": "enableTime"}),
    "MultipleChoice": ("ChoicePicker", {"selections": "value"}),
    "Slider": ("Slider", {"label": "label", "value": "value", "minValue": "min", "maxValue": "max"}),
    "Tabs": ("Tabs", {}),
}  # fmt: skip


def convert_component08(item: Mapping[str, Any], surface: dict[str, Any]) -> dict[str, Any]:
    """One v0.8 ``surfaceUpdate`` component in v0.9.1 form.

    A value given with both a path and a literal initialises the data model at that path
    (the v0.8 shorthand), so ``surface["data_model"]`` may be replaced.
    """
    wrapper = item.get("component") if isinstance(item.get("component"), Mapping) else {}
    name, props = next(iter(wrapper.items()), ("", {}))
    props = props if isinstance(props, Mapping) else {}
    out: dict[str, Any] = {"id": str(item.get("id", ""))}
    if isinstance(item.get("weight"), int | float):
        out["weight"] = item["weight"]
    new_name, renames = _RENAMES.get(name, (name, {}))
    out["component"] = new_name
    if name not in _RENAMES:
        out.update({k: copy.deepcopy(v) for k, v in props.items()})  # an unknown component, as sent
        return out
    for old, new in renames.items():
        if old not in props:
            continue
        value = props[old]
        if isinstance(value, Mapping):
            literal = _literal08(value)
            if isinstance(value.get("path"), str) and literal is not _MISSING:
                pointer = _absolute(value["path"])
                surface["data_model"] = _set(surface["data_model"], pointer, copy.deepcopy(literal))
            value = _value08(value)
        elif isinstance(value, str) and old == "fit" and value == "scale-down":
            value = "scaleDown"
        out[new] = copy.deepcopy(value)
    if "children" in props:
        out["children"] = _children08(props["children"])
    if name == "Button":
        if props.get("primary"):
            out["variant"] = "primary"
        out["action"] = _action08(props.get("action"))
    elif name == "Tabs":
        out["tabs"] = [
            {"title": _value08(t.get("title")), "child": str(t.get("child", ""))}
            for t in _list(props.get("tabItems"))
            if isinstance(t, Mapping)
        ]
    elif name == "TextField":
        kind = props.get("textFieldType")
        if kind == "date":  # v0.9.1 has no date text field: its date input instead
            out["component"] = "DateTimeInput"
            out["enableDate"] = True
            out.pop("validationRegexp", None)
            out.setdefault("value", "")
        elif kind in ("longText", "number", "shortText", "obscured"):
            out["variant"] = kind
    elif name == "MultipleChoice":
        out["options"] = [
            {"label": _value08(o.get("label")), "value": str(o.get("value", ""))}
            for o in _list(props.get("options"))
            if isinstance(o, Mapping)
        ]
        out["variant"] = (
            "mutuallyExclusive" if props.get("maxAllowedSelections") == 1 else "multipleSelection"
        )
        out.setdefault("value", [])
    elif name == "Slider":
        out.setdefault("max", 100)  # required in v0.9.1; v0.8 left it to the renderer
    return out


def _contents08(entries: Any) -> list[tuple[str, Any]]:
    pairs = []
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("key"), str):
            continue
        if "valueMap" in entry:
            value: Any = dict(_contents08(entry["valueMap"]))
        else:
            value = next(
                (entry[k] for k in ("valueString", "valueNumber", "valueBoolean") if k in entry),
                None,
            )
        pairs.append((entry["key"], value))
    return pairs


# The fold -----------------------------------------------------------------------------------


def kept_raw(message: Any) -> Any:
    """``message`` as a surface keeps it (``RAW_KEPT_CHARS``): a copy, or when longer
    ``{"cut": its first characters of JSON text, "chars": its length}``."""
    try:
        text = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        return None
    if len(text) <= RAW_KEPT_CHARS:
        return copy.deepcopy(message)
    return {"cut": text[:RAW_KEPT_CHARS], "chars": len(text)}


def new_surface(version: str) -> dict[str, Any]:
    """A surface's folded state (the fields of ``tasks_app.models.Surface`` it determines)."""
    return {
        "version": version,
        "catalog_id": "",
        "root_id": "",
        "components": {},
        "data_model": {},
        "styles": {},
        "ready": False,
        "deleted": False,
        "problem": "",
        "raw_json": None,
    }


@dataclass
class Outcome:
    """What one message did: the surface it concerned, and why it was refused (or "")."""

    surface_id: str | None
    problem: str = ""
    applied: bool = False


def _drop_unsafe_urls(component: dict[str, Any]) -> dict[str, Any]:
    for prop in URL_PROPS.get(component.get("component", ""), ()):
        value = component.get(prop)
        if isinstance(value, str) and safe_url(value) is None:
            del component[prop]
    return component


def _with_components(
    before: dict[str, Any], components: Iterable[dict[str, Any]]
) -> dict[str, Any]:
    """``before`` with ``components`` put in by id: a new dict, its size remembered from the
    size before and what each component changed (``known_size``), not written out again."""
    size = known_size(before)
    out = dict(before)
    for component in components:
        cid = str(component.get("id", ""))
        if cid in out:
            size += _size(component) - _size(out[cid])
        else:
            size += _entry_size(cid, _size(component), out)
        out[cid] = component
    _remember_size(out, size)
    return out


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def apply(
    surfaces: dict[str, dict[str, Any]], version: str, message: Any, *, others: int = 0
) -> Outcome:
    """Fold one server-to-client message into ``surfaces`` ({surface_id: state}).

    The message is validated first; a message that fails, or would break a bound, is not
    applied and its surface (when it names one) gets the reason as its ``problem`` with the
    message as ``raw_json``. Otherwise it is applied and the surface's ``problem`` is
    recomputed by :func:`problem_of` (so a later valid message can clear it).

    A changed surface is a new dict (what it shares with the old state is not changed), so
    a caller can tell what changed by identity. ``others``: how many surfaces the task has
    besides those in ``surfaces`` (for the bound on surfaces per task).
    """
    surface_id = surface_id_of(message)
    surface = surfaces.get(surface_id) if surface_id is not None else None
    catalog = surface["catalog_id"] if surface is not None else None
    reason = validate(version, message, catalog_id=catalog)
    if reason is None and surface_id is None:
        reason = "schema: no surfaceId"
    if reason is None:
        reason = _ids_problem(message)
    if reason is None and surface is not None and _family(surface["version"]) != _family(version):
        reason = f"version mismatch: surface {surface_id!r} is v{surface['version']}, message is v{version}"
    if reason is None and surface is None and len(surfaces) + others >= MAX_SURFACES:
        reason = f"too many surfaces: at most {MAX_SURFACES} per task"
        return Outcome(surface_id, reason)
    if reason is not None:
        fits = surface_id is not None and len(surface_id) <= MAX_ID_CHARS
        if fits and (surface is not None or len(surfaces) + others < MAX_SURFACES):
            target = surfaces.setdefault(surface_id, new_surface(version))
            target["problem"], target["raw_json"] = reason, kept_raw(message)
        return Outcome(surface_id, reason)
    assert surface_id is not None
    if reason is None and _family(version) != "0.8" and not _created(surface, message):
        reason = f"{_kind(message)} before createSurface for surface {surface_id!r}"
        target = surfaces.setdefault(surface_id, new_surface(version))
        target["problem"], target["raw_json"] = reason, kept_raw(message)
        return Outcome(surface_id, reason)
    work = dict(surface) if surface is not None else new_surface(version)
    try:
        if _family(version) == "0.8":
            _apply08(work, version, message)
        else:
            _apply09(work, version, message)
        bound = _bounds_problem(work)
    except _TooDeep:
        bound = f"too deep: a data path has more than {MAX_JSON_DEPTH} levels"
    except _ModelTooDeep:
        bound = f"too deep: the data model nests more than {MAX_JSON_DEPTH} levels"
    except _NoFit:
        bound = "unresolvable data path: it goes through a list by a name or past its end"
    if bound:
        target = surfaces.setdefault(surface_id, new_surface(version))
        target["problem"], target["raw_json"] = bound, kept_raw(message)
        return Outcome(surface_id, bound)
    work["problem"] = problem_of(work)
    work["raw_json"] = kept_raw(message) if work["problem"] else None
    surfaces[surface_id] = work
    return Outcome(surface_id, work["problem"], applied=True)


def _ids_problem(message: Mapping[str, Any]) -> str | None:
    """Ids longer than the columns that keep them (a valid message can still be absurd)."""
    body = next((message[k] for k in (*V08_KEYS, *V09_KEYS) if k in message), {})
    limits = (
        ("surfaceId", MAX_ID_CHARS),
        ("root", MAX_ID_CHARS),
        ("catalogId", MAX_CATALOG_ID_CHARS),
    )
    for key, limit in limits:
        value = body.get(key)
        if isinstance(value, str) and len(value) > limit:
            return f"too large: {key} is longer than {limit} characters"
    return None


def _kind(message: Mapping[str, Any]) -> str:
    return next((key for key in (*V08_KEYS, *V09_KEYS) if key in message), "message")


def _created(surface: Mapping[str, Any] | None, message: Mapping[str, Any]) -> bool:
    """v0.9+: a surface exists (not deleted) before anything but createSurface/deleteSurface."""
    if "createSurface" in message or "deleteSurface" in message:
        return True
    return surface is not None and surface["ready"] and not surface["deleted"]


def _family(version: str) -> str:
    return "0.8" if version == "0.8" else "0.9"


def _apply08(surface: dict[str, Any], version: str, message: Mapping[str, Any]) -> None:
    if "beginRendering" in message:
        body = message["beginRendering"]
        surface.update(
            version=version,
            root_id=body["root"],
            catalog_id=body.get("catalogId", "") or "",
            styles=copy.deepcopy(body.get("styles") or {}),
            ready=True,
            deleted=False,
        )
    elif "surfaceUpdate" in message:
        if surface["deleted"]:
            surface.update(new_surface(version))
        surface["components"] = _with_components(
            surface["components"],
            (
                _drop_unsafe_urls(convert_component08(item, surface))
                for item in message["surfaceUpdate"]["components"]
            ),
        )
    elif "dataModelUpdate" in message:
        body = message["dataModelUpdate"]
        base = _absolute(body.get("path") or "/").rstrip("/")
        for key, value in _contents08(body["contents"]):
            key = key.strip("/")
            pointer = f"{base}/{key}" if key not in ("", ".") else (base or "/")
            surface["data_model"] = _set(surface["data_model"], pointer, value)
    elif "deleteSurface" in message:
        surface.update(new_surface(version), deleted=True)


def _apply09(surface: dict[str, Any], version: str, message: Mapping[str, Any]) -> None:
    if "createSurface" in message:
        body = message["createSurface"]
        theme = copy.deepcopy(body.get("theme") or {})
        if isinstance(theme, dict) and "iconUrl" in theme and safe_url(theme["iconUrl"]) is None:
            del theme["iconUrl"]
        same = (
            not surface["deleted"]
            and surface["ready"]
            and surface["catalog_id"] == body["catalogId"]
            and surface["styles"] == theme
        )
        if not same:  # a new (or re-created) surface; the same one again changes nothing
            surface.update(new_surface(version))
        surface.update(
            version=version, catalog_id=body["catalogId"], styles=theme, root_id="root", ready=True
        )
    elif "updateComponents" in message:
        if surface["deleted"]:
            surface.update(new_surface(version))
        surface["components"] = _with_components(
            surface["components"],
            (
                _drop_unsafe_urls(copy.deepcopy(dict(item)))
                for item in message["updateComponents"]["components"]
            ),
        )
        surface["root_id"] = "root"
    elif "updateDataModel" in message:
        body = message["updateDataModel"]
        pointer = body.get("path") or "/"
        value = copy.deepcopy(body["value"]) if "value" in body else _MISSING
        surface["data_model"] = _set(surface["data_model"], _absolute(pointer), value)
    elif "deleteSurface" in message:
        surface.update(new_surface(version), deleted=True)


def _bounds_problem(surface: Mapping[str, Any]) -> str:
    """Whether a surface is past a bound: its depth is checked as its data model changes
    (``_set``), its sizes remembered by identity (``known_size``), so a message costs what
    it changes, not the whole surface."""
    if len(surface["components"]) > MAX_COMPONENTS:
        return f"too large: {len(surface['components'])} components (at most {MAX_COMPONENTS})"
    data_bytes = known_size(surface["data_model"])
    if data_bytes > MAX_DATA_MODEL_BYTES:
        return f"too large: the data model is {data_bytes} bytes (at most {MAX_DATA_MODEL_BYTES})"
    total = data_bytes + known_size(surface["components"]) + _size(surface["styles"])
    if total > MAX_SURFACE_BYTES:
        return f"too large: the surface is {total} bytes (at most {MAX_SURFACE_BYTES})"
    return ""


def _references(component: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
    """``(property, child id, templated)`` for each component this one refers to."""
    refs: list[tuple[str, str, bool]] = []
    children = component.get("children")
    if isinstance(children, list):
        refs.extend(("children", str(c), False) for c in children)
    elif isinstance(children, Mapping) and "componentId" in children:
        refs.append(("children", str(children["componentId"]), True))
    for prop in ("child", "trigger", "content"):
        if isinstance(component.get(prop), str):
            refs.append((prop, component[prop], False))
    for tab in _list(component.get("tabs")):
        if isinstance(tab, Mapping) and isinstance(tab.get("child"), str):
            refs.append(("tabs", tab["child"], False))
    return refs


def _list(value: Any) -> list:
    """``value`` when it is a list, else nothing: an agent's ``"tabs": 5`` is not iterated
    (it raised TypeError, and the whole row's messages were lost)."""
    return value if isinstance(value, list) else []


def _bindings(component: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(property, path)`` of the values a component shows (not where input goes)."""
    found = []
    name = component.get("component")
    for prop, value in component.items():
        if prop in ("id", "component", "children", "action", "checks", "accessibility"):
            continue
        if prop == "value" and name in INPUT_VALUES:
            continue
        if (
            isinstance(value, Mapping)
            and isinstance(value.get("path"), str)
            and "call" not in value
        ):
            found.append((prop, value["path"]))
    for key in ("tabs", "options"):
        for item in _list(component.get(key)):
            inner = item.get("title", item.get("label")) if isinstance(item, Mapping) else None
            if isinstance(inner, Mapping) and isinstance(inner.get("path"), str):
                found.append((key, inner["path"]))
    return found


def problem_of(surface: Mapping[str, Any]) -> str:
    """Why a surface cannot be rendered as it stands ("" when it can).

    Checked once it is ready and has components: the root and every component reachable
    from it exist (no cycles, at most ``MAX_TREE_DEPTH`` levels), and, once the agent has
    sent a data model, every path a shown value binds to resolves (paths where a person's
    input goes may be absent until then; relative paths under a template are taken per
    item by the renderer and are not checked here).
    """
    components = surface["components"]
    if not surface["ready"] or surface["deleted"] or not components:
        return ""
    problem, bindings = _structure(components, surface["root_id"])
    if problem:
        return problem
    data = surface["data_model"]
    if not data:
        return ""
    for cid, prop, path in bindings:
        found, value = lookup(data, _absolute(path))
        if not found or (prop == "children template" and not isinstance(value, list | dict)):
            return f"unresolvable data path {path!r} (component {cid!r}, {prop})"
    return ""


# The last tree walked, by identity: a data model update keeps the components object
# (copy on write), so a stream of updates to one surface walks its tree once.
_last_walk: tuple[Any, str, tuple[str, list[tuple[str, str, str]]]] = (None, "", ("", []))


def _structure(components: Mapping[str, Any], root: str) -> tuple[str, list[tuple[str, str, str]]]:
    """The tree's problem (or ""), and the ``(component, property, path)`` bindings to check."""
    global _last_walk
    walked = _last_walk
    if walked[0] is components and walked[1] == root:
        return walked[2]
    result = _walk(components, root)
    _last_walk = (components, root, result)
    return result


def _walk(components: Mapping[str, Any], root: str) -> tuple[str, list[tuple[str, str, str]]]:
    if root not in components:
        return f"missing component {root!r} (the root)", []
    # Depth-first from the root, iteratively: 1 = on the current path, 2 = done.
    state: dict[str, int] = {root: 1}
    height: dict[str, int] = {}
    refs_of = {root: _references(components[root])}
    stack = [(root, iter(refs_of[root]))]
    while stack:
        cid, refs = stack[-1]
        ref = next(refs, None)
        if ref is None:
            stack.pop()
            state[cid] = 2
            height[cid] = 1 + max((height[c] for _, c, _ in refs_of[cid]), default=0)
            if height[cid] > MAX_TREE_DEPTH:
                return f"too deep: more than {MAX_TREE_DEPTH} levels of components", []
            continue
        prop, child, _ = ref
        if child not in components:
            return f"missing component {child!r} ({prop} of {cid!r})", []
        if state.get(child) == 1:
            return f"cycle: component {child!r} contains itself", []
        if child not in state:
            if len(stack) >= MAX_TREE_DEPTH:
                return f"too deep: more than {MAX_TREE_DEPTH} levels of components", []
            state[child] = 1
            refs_of[child] = _references(components[child])
            stack.append((child, iter(refs_of[child])))
    templated = _under_templates(components, set(state))
    bindings: list[tuple[str, str, str]] = []
    for cid in state:
        component = components[cid]
        long_path = _long_path(component)
        if long_path:
            return (
                f"a data path longer than {MAX_PATH_CHARS} characters ({long_path[:40]!r}…, "
                f"component {cid!r})"
            ), []
        for prop, path in _bindings(component):
            if cid not in templated or path.startswith("/"):
                bindings.append((cid, prop, path))
        children = component.get("children")
        if isinstance(children, Mapping) and cid not in templated:
            bindings.append((cid, "children template", str(children.get("path", ""))))
    return "", bindings


def _long_path(component: Mapping[str, Any]) -> str:
    """A ``path`` in the component longer than ``MAX_PATH_CHARS`` ("" when none): every drawn
    copy writes its paths into the page, and one 40,000-character path drawn 1,500 times
    (repeated child ids) was a response of 60 MB."""
    todo: list[Any] = [component]
    while todo:
        node = todo.pop()
        if isinstance(node, Mapping):
            path = node.get("path")
            if isinstance(path, str) and len(path) > MAX_PATH_CHARS:
                return path
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return ""


def _under_templates(components: Mapping[str, Any], reachable: set[str]) -> set[str]:
    """The reachable components drawn once per item of a template (their paths are per item)."""
    todo = [
        str(c["children"]["componentId"])
        for cid in reachable
        if isinstance((c := components[cid]).get("children"), Mapping)
        and "componentId" in c["children"]
    ]
    found: set[str] = set()
    while todo:
        cid = todo.pop()
        if cid in found or cid not in components:
            continue
        found.add(cid)
        todo.extend(child for _, child, _ in _references(components[cid]))
    return found


# Acting -------------------------------------------------------------------------------------


def _timestamp(value: str | datetime) -> str:
    if isinstance(value, datetime):
        value = value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)
        return value.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return str(value)


def action_message(
    version: str,
    *,
    name: str,
    surface_id: str,
    source_component_id: str,
    context: Mapping[str, Any] | None,
    data_model: Any,
    timestamp: str | datetime,
    scope_path: str = "",
) -> dict[str, Any]:
    """The client-to-server message for a person's action (v0.8 ``userAction``, v0.9+ ``action``).

    ``context`` is the action's context as the component declares it; each value is
    resolved against ``data_model`` (a ``{"path": ...}`` becomes the value there). The
    whole data model travels in the message's metadata (:func:`action_metadata`).
    """
    resolved = {str(k): resolve(v, data_model, scope_path) for k, v in (context or {}).items()}
    body = {
        "name": name,
        "surfaceId": surface_id,
        "sourceComponentId": source_component_id,
        "timestamp": _timestamp(timestamp),
        "context": resolved,
    }
    if version == "0.8":
        return {"userAction": body}
    return {"version": "v0.9", "action": body}


def action_part(version: str, message: Mapping[str, Any]) -> dict[str, Any]:
    """The A2A 1.0 data part carrying an action: v0.9+ put a list in ``data``, v0.8 one object."""
    media = MEDIA_TYPE_OF[version]
    data: Any = dict(message) if version == "0.8" else [dict(message)]
    return {"data": data, "mediaType": media, "metadata": {"mimeType": media}}


def action_metadata(version: str, surface_id: str, data_model: Any) -> dict[str, Any]:
    """The message metadata beside an action: v0.9+ ``a2uiClientDataModel`` (none in v0.8)."""
    if version == "0.8":
        return {}
    return {DATA_MODEL_KEY: {"version": "v0.9", "surfaces": {surface_id: data_model}}}
