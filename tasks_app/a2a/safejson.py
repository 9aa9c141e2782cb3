"""JSON from agents, made safe to parse and safe to store.

An agent is untrusted input. Two things in perfectly legal JSON break the
layers above us:

* **nesting**: CPython's ``json`` module recurses once per level, so a reply
  of 10,000 nested arrays raises ``RecursionError`` (which callers report as
  a crash, not as a bad reply). :func:`loads` measures the depth first with a
  linear scan and refuses anything deeper than ``max_depth`` with a
  :class:`ProtocolError` that says where.
* **text that cannot be stored**: ``"\\ud800"`` decodes to a lone surrogate
  (``UnicodeEncodeError`` the moment it is written as UTF-8), ``"\\u0000"``
  is refused by PostgreSQL ``jsonb``, and ``NaN``/``Infinity`` are accepted by
  Python's parser but are not JSON. :func:`clean` replaces them and counts the
  replacements, so the caller can record that the agent sent them.

Both functions are iterative: no input can make them recurse.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from .errors import ProtocolError

__all__ = ["DEFAULT_MAX_DEPTH", "clean", "loads"]

DEFAULT_MAX_DEPTH = 256
REPLACEMENT = "\ufffd"

# A string token (an unterminated one runs to the end, so no match ever fails
# and the scan stays linear) or one bracket. Brackets inside strings are
# consumed with the string and never counted.
_TOKEN_TEXT = re.compile(r'"[^"\\]*(?:\\[\s\S][^"\\]*)*(?:"|\\?\Z)|[\[\]{}]')
_TOKEN_BYTES = re.compile(rb'"[^"\\]*(?:\\[\s\S][^"\\]*)*(?:"|\\?\Z)|[\[\]{}]')
_OPENERS_TEXT: frozenset[str | int] = frozenset("[{")
_OPENERS_BYTES = frozenset(b"[{")
_CLOSERS_TEXT = frozenset("]}")
_CLOSERS_BYTES = frozenset(b"]}")

# Characters clean() must replace: NUL and any surrogate code point. JSON
# decoding joins a valid \ud83d\ude00 pair into one code point, so what is
# left here is lone (pairs written as two code points are joined below).
_UNSAFE = re.compile("[\x00\ud800-\udfff]")
_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


# --------------------------------------------------------------------------- depth


def _too_deep(data: bytes | str, max_depth: int) -> int | None:
    """Offset (in ``data``'s units) of the first opener past ``max_depth``, or None."""
    if isinstance(data, bytes):
        if data.count(b"[") + data.count(b"{") <= max_depth:
            return None  # cannot be that deep: skip the scan
        pattern, openers, closers = _TOKEN_BYTES, _OPENERS_BYTES, _CLOSERS_BYTES
    else:
        if data.count("[") + data.count("{") <= max_depth:
            return None
        pattern, openers, closers = _TOKEN_TEXT, _OPENERS_TEXT, _CLOSERS_TEXT
    depth = 0
    for m in pattern.finditer(data):
        ch = m.group()[0]  # an int for bytes, a str for text
        if ch in openers:
            depth += 1
            if depth > max_depth:
                return m.start()
        elif ch in closers:
            depth -= 1  # may go negative on broken JSON; the parser says so
    return None


def _byte_offset(text: str, pos: int, encoding: str) -> int:
    return len(text[:pos].encode(encoding, "surrogatepass"))


def _snippet(data: bytes | str, limit: int) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return " ".join(text[: limit * 4].split())[:limit]


def loads(data: bytes | str, *, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Parse JSON from an agent, refusing nesting deeper than ``max_depth``.

    Raises :class:`ProtocolError` for too deep or invalid JSON; never
    ``RecursionError``. The depth scan costs one pass over the input and is
    skipped when the input holds fewer brackets than ``max_depth``.
    """
    text: bytes | str = data
    encoding = "utf-8"
    if isinstance(data, bytes | bytearray):
        data = bytes(data)
        encoding = json.detect_encoding(data)
        if encoding != "utf-8":
            try:
                text = data.decode(encoding)
            except UnicodeDecodeError as exc:
                raise ProtocolError(
                    f"expected JSON, got undecodable {encoding} text",
                    snippet=_snippet(data, 500),
                ) from exc
    pos = _too_deep(text, max_depth)
    if pos is not None:
        at = pos if isinstance(text, bytes) else _byte_offset(text, pos, encoding)
        raise ProtocolError(
            f"JSON nested deeper than {max_depth} levels (at byte {at})",
            snippet=_snippet(data, 500),
        )
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(
            f"expected JSON, got: {_snippet(data, 160) or '(empty body)'}",
            snippet=_snippet(data, 500),
        ) from exc
    except RecursionError as exc:  # pragma: no cover - the scan should prevent it
        raise ProtocolError(
            f"JSON nested too deeply to parse (limit {max_depth})", snippet=_snippet(data, 500)
        ) from exc


# --------------------------------------------------------------------------- clean


def _clean_str(s: str) -> tuple[str, int]:
    if not _UNSAFE.search(s):
        return s, 0
    had = s.count(REPLACEMENT)
    # Round-trip through UTF-16: adjacent high+low surrogates become the one
    # character they encode (one character fewer each), lone ones become U+FFFD (one each).
    fixed = s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    joined = len(s) - len(fixed)
    nul = fixed.count("\x00")
    if nul:
        fixed = fixed.replace("\x00", REPLACEMENT)
    return fixed, fixed.count(REPLACEMENT) - had + joined


def whole_number(text: str, *, max_digits: int = 18) -> int | None:
    """``text`` as a non-negative integer when it is only ASCII digits (at most ``max_digits``).

    ``str.isdigit()`` alone is no test: it is true of "²" and other digits ``int()``
    refuses, and ``int()`` refuses more than 4,300 digits. A list index in an agent's
    JSON Pointer, or a number a browser posts, is read with this.
    """
    if 0 < len(text) <= max_digits and text.isascii() and text.isdigit():
        return int(text)
    return None


def clean_text(text: str) -> str:
    """``text`` with lone surrogates and NUL replaced (U+FFFD), as :func:`clean` stores strings."""
    return _clean_str(text)[0]


def _clean_scalar(value: Any) -> tuple[Any, int]:
    if isinstance(value, str):
        return _clean_str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return ("NaN" if math.isnan(value) else _NON_FINITE[value]), 1
    return _stable_number(value), 0


EXACT_INTEGERS = 2**53


def _stable_number(value: Any) -> Any:
    """A number as every store reads it back (not counted as a replacement).

    PostgreSQL's ``jsonb`` keeps numbers as exact decimals: a float of 2**53 or
    more (always integral) comes back as an integer, and ``-0.0`` as ``0.0``.
    Storing them in that form to begin with makes a value read back equal to
    what was stored, on SQLite and PostgreSQL alike (the log's hash chain
    relies on it).
    """
    if isinstance(value, float):
        if value == 0.0 and math.copysign(1.0, value) < 0:
            return 0.0
        if math.isfinite(value) and abs(value) >= EXACT_INTEGERS:
            return int(value)
    return value


def _needs_cleaning(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for k, v in item.items():
                if isinstance(k, str) and _UNSAFE.search(k):
                    return True
                stack.append(v)
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif _clean_scalar(item)[1] or _stable_number(item) is not item:
            return True
    return False


# What, in a value's JSON text written with ASCII escapes (``ensure_ascii``), may need
# cleaning: an escaped NUL or surrogate (lone or half of a pair: the text cannot tell
# them apart), NaN or Infinity, and floats that jsonb reads back in another form (-0.0;
# 2**53 and more: sixteen digits, or an exponent). Strings that merely contain such text
# match too: the answer may be a false "maybe", never a false "no".
_ESCAPES = re.compile(rb"\\u0000|\\ud[89a-f]")
_DIGITS_AS_ZERO = bytes.maketrans(b"0123456789", b"0" * 10)
_SIXTEEN_DIGITS = b"0" * 16


def may_need_cleaning(ascii_json: bytes) -> bool:
    """Whether the value whose ``ensure_ascii`` JSON text is ``ascii_json`` may need :func:`clean`.

    A fast test for the usual case: the recorder writes that text anyway (to hash
    the entry), and a few substring searches over it cost a fraction of walking
    the value (a regular expression with the same alternatives cost four times
    as much). ``False`` means :func:`clean` would return the value itself.
    """
    return bool(
        (b"\\u" in ascii_json and _ESCAPES.search(ascii_json))
        or b"NaN" in ascii_json
        or b"Infinity" in ascii_json
        or b"-0.0" in ascii_json
        or b"e+" in ascii_json
        or _SIXTEEN_DIGITS in ascii_json.translate(_DIGITS_AS_ZERO)
    )


def _unique_key(out: dict[str, Any], key: str, taken: dict[str, int]) -> str:
    """A cleaned key may collide with a key already present: keep both values.

    The later value goes under the key and a U+FFFD, then under the key, a U+FFFD and a
    count (2, 3, ...); ``taken`` remembers, for the object being built, the next count to
    try for each key. Appending one more U+FFFD per key already kept made an object of n
    colliding keys (lone surrogates all cleaned to the same text) cost n**3 steps and n**2
    characters of keys: 3,000 of them, 57 KB from an agent, took 2.8 s to record.
    """
    if key not in out:
        return key
    count = taken.get(key, 1)
    while True:
        candidate = key + REPLACEMENT if count == 1 else f"{key}{REPLACEMENT}{count}"
        count += 1
        if candidate not in out:
            taken[key] = count
            return candidate


def clean(value: Any) -> tuple[Any, int]:
    """A copy of a decoded JSON value that any UTF-8 store (and ``jsonb``) accepts.

    Lone surrogates and NUL in strings (keys too) become U+FFFD, and a high and
    a low surrogate side by side the one character they encode (both counted); NaN and
    +/-Infinity become the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``;
    floats that ``jsonb`` would read back in another form are stored in that
    form (see :func:`_stable_number`; not counted).
    Returns ``(value, replacements)``; when nothing needed replacing the value
    itself is returned (no copy). Iterative, so any depth is fine.
    """
    if not isinstance(value, dict | list | tuple):
        return _clean_scalar(value)
    if not _needs_cleaning(value):
        return value, 0
    count = 0
    root: Any = {} if isinstance(value, dict) else []
    # Work items: (source container, destination container of the same kind).
    stack: list[tuple[Any, Any]] = [(value, root)]
    while stack:
        src, dst = stack.pop()
        if isinstance(src, dict):
            taken: dict[str, int] = {}
            for k, v in src.items():
                if isinstance(k, str):
                    k, n = _clean_str(k)
                    count += n
                    k = _unique_key(dst, k, taken)
                if isinstance(v, dict | list | tuple):
                    child: Any = {} if isinstance(v, dict) else []
                    stack.append((v, child))
                    dst[k] = child
                else:
                    dst[k], n = _clean_scalar(v)
                    count += n
        else:
            for v in src:
                if isinstance(v, dict | list | tuple):
                    child = {} if isinstance(v, dict) else []
                    stack.append((v, child))
                    dst.append(child)
                else:
                    cleaned, n = _clean_scalar(v)
                    count += n
                    dst.append(cleaned)
    return root, count
