"""The protocol layer against agents that misbehave on purpose.

The first part checks :mod:`tasks_app.a2a.safejson` on its own (examples and
Hypothesis properties). The rest runs the real client against raw HTTP servers
on 127.0.0.1 (``tests/hostile_servers.py``) that trickle, nest, stream
keep-alives forever or send text that cannot be stored, and asserts both the
precise error and the bound (time, bytes) at which the client gave up.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks_app.a2a import ProtocolError
from tasks_app.a2a._http import decode_json, error_for_status
from tasks_app.a2a.safejson import clean, loads

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- safejson: loads


def _nested(depth: int, *, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + closer * depth


def test_loads_refuses_deep_nesting_with_the_offset() -> None:
    body = _nested(10_000).encode()
    with pytest.raises(ProtocolError) as info:
        loads(body)
    assert "JSON nested deeper than 256 levels (at byte 256)" in str(info.value)


def test_loads_deep_objects_and_prefix_offset() -> None:
    body = '{"k": "ééé", "v": ' + '{"a":' * 300 + "1" + "}" * 301
    with pytest.raises(ProtocolError) as info:
        loads(body.encode())
    # 256 objects nest inside the outer one; the 257th opener is the culprit.
    prefix = '{"k": "ééé", "v": ' + '{"a":' * 255
    assert f"(at byte {len(prefix.encode())})" in str(info.value)


def test_loads_accepts_exactly_max_depth() -> None:
    assert loads(_nested(256)) == json.loads(_nested(256))
    with pytest.raises(ProtocolError, match="deeper than 256"):
        loads(_nested(257))
    assert loads(_nested(5), max_depth=5) == [[[[[]]]]]
    with pytest.raises(ProtocolError, match="deeper than 4 levels"):
        loads(_nested(5), max_depth=4)


def test_brackets_inside_strings_do_not_count() -> None:
    text = json.dumps({"a": "[" * 5000 + '\\"{' * 100, "b": ["]" * 10]})
    assert loads(text, max_depth=2) == json.loads(text)
    assert loads(text.encode(), max_depth=2) == json.loads(text)


def test_loads_invalid_json_is_a_protocol_error() -> None:
    for bad in (b"", b"<html>oops</html>", b"{", b'"unterminated \\', b"\xff\xfe\xfa", b"[1,]"):
        with pytest.raises(ProtocolError, match="expected JSON"):
            loads(bad)


def test_unterminated_escapes_scan_in_linear_time() -> None:
    # Each quote would start a failing string match in a naive scanner: O(n^2).
    body = b"[" * 300 + b'"' + b'\\"' * 200_000
    with pytest.raises(ProtocolError):
        loads(body)


def test_utf16_and_bom_bodies() -> None:
    value = {"x": ["é", 1]}
    assert loads(json.dumps(value).encode("utf-16")) == value
    assert loads(b"\xef\xbb\xbf" + json.dumps(value).encode()) == value
    with pytest.raises(ProtocolError, match=r"deeper than 2 levels \(at byte 4\)"):
        loads("[[[1]]]".encode("utf-16-le"), max_depth=2)


def test_decode_json_and_error_for_status_use_the_depth_check() -> None:
    deep = _nested(10_000).encode()
    with pytest.raises(ProtocolError) as info:
        decode_json(deep, "SendMessage")
    assert info.value.where == "SendMessage"
    assert "nested deeper than 256" in str(info.value)
    with pytest.raises(ProtocolError, match="expected JSON, got text/html"):
        decode_json(b"<html>", "GetTask", mt="text/html")


# Valid, storable JSON: no NaN/Infinity, no surrogates, no NUL.
safe_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"))
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | safe_text,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(safe_text, children, max_size=4),
    max_leaves=30,
)


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=200, deadline=None)
@given(json_values, st.integers(min_value=0, max_value=8))
def test_loads_matches_json_within_depth(value: object, max_depth: int) -> None:
    text = json.dumps(value)
    if _depth(value) <= max_depth:
        assert loads(text, max_depth=max_depth) == json.loads(text)
        assert loads(text.encode(), max_depth=max_depth) == json.loads(text)
    else:
        with pytest.raises(ProtocolError, match=f"deeper than {max_depth} levels"):
            loads(text.encode(), max_depth=max_depth)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_loads_never_raises_anything_but_protocol_error(data: bytes) -> None:
    try:
        expected: object = json.loads(data)
    except (ValueError, RecursionError):
        expected = ProtocolError
    try:
        got: object = loads(data, max_depth=3)
    except ProtocolError:
        got = ProtocolError
    if expected is ProtocolError or _depth(expected) <= 3:
        assert got == expected or (got != got and expected != expected)  # NaN
    else:
        assert got is ProtocolError


# --------------------------------------------------------------------------- safejson: clean


def _storable(value: object) -> bool:
    """What PostgreSQL jsonb and a UTF-8 column accept."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    text.encode("utf-8")
    return "\x00" not in text and "\\u0000" not in text


def test_clean_replaces_and_counts() -> None:
    value = {
        "text": "a\ud800b\x00c",
        "pair": "\ud83d\ude00",  # two code points forming a pair: joined, not replaced
        "k\udc00": [math.nan, math.inf, -math.inf, 1.5, "ok", None, True],
    }
    cleaned, count = clean(value)
    assert count == 6
    assert cleaned == {
        "text": "a\ufffdb\ufffdc",
        "pair": "\U0001f600",
        "k\ufffd": ["NaN", "Infinity", "-Infinity", 1.5, "ok", None, True],
    }
    assert _storable(cleaned)
    assert value["text"] == "a\ud800b\x00c"  # the input is not modified


def test_clean_returns_clean_values_as_they_are() -> None:
    value = {"a": [1, "é", {"b": "\ufffd"}]}
    cleaned, count = clean(value)
    assert count == 0 and cleaned is value
    assert clean("plain") == ("plain", 0)
    assert clean(3) == (3, 0)


def test_clean_keeps_both_values_when_keys_collide() -> None:
    cleaned, count = clean(dict([("\ud800", 1), ("\ufffd", 2)]))
    assert count == 1
    assert sorted(cleaned.values()) == [1, 2]


def test_clean_is_iterative() -> None:
    value: list[object] = []
    for _ in range(100_000):
        value = [value, "\x00"]
    cleaned, count = clean(value)
    assert count == 100_000
    node = cleaned
    while node:
        assert node[1] == "\ufffd"
        node = node[0]


surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
hostile_text = st.lists(
    st.one_of(st.characters(codec=None), surrogates, st.just("\x00")), max_size=12
).map("".join)
hostile_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | hostile_text,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(hostile_text, children, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(hostile_values)
def test_clean_makes_anything_storable(value: object) -> None:
    cleaned, count = clean(value)
    assert _storable(cleaned)
    if count == 0:
        assert cleaned is value or cleaned == value
    again, more = clean(cleaned)
    assert more == 0 and again == cleaned


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_clean_leaves_valid_json_unchanged(value: object) -> None:
    assert clean(value) == (value, 0)


def test_error_for_status_with_deep_body_is_not_a_crash() -> None:
    import httpx

    resp = httpx.Response(500, headers={"content-type": "application/json"})
    err = error_for_status(resp, _nested(10_000).encode(), "GetTask")
    assert "HTTP 500" in str(err)
