"""The recorder's fast paths give exactly what the slow definitions give.

``record()`` hashes every row it appends and checks every entry for content a
database cannot store. Both have a plain definition (``chain.row_form`` +
``canonical_json``; ``safejson.clean``) and a fast path written for the
recorder. These properties hold the fast paths to the definitions, on
generated input that includes what agents get wrong (lone surrogates, NUL,
NaN, -0.0, floats past 2**53).
"""

from __future__ import annotations

import datetime as dt
import math

import pytest
from django.utils import timezone
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks_app.a2a import safejson
from tasks_app.models import ArtifactPart, TaskEvent
from tasks_app.services import record as record_module
from tasks_app.services.chain import (
    canonical_json,
    content_digest,
    row_form,
    row_text,
    sorted_compact_encoder,
    text_digest,
    timestamp_text,
)
from tests.examples import examples

awkward_text = st.text(max_size=12) | st.sampled_from(
    ["\ud800", "a\x00b", "\udfff\ud800", "\u202e", "😀", '"\\', "NaN", "-0.0", "\\u0000"]
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats()
    | st.sampled_from([-0.0, 2.0**53, -(2.0**53), 1e16, 9007199254740993.0, math.inf, math.nan])
    | awkward_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(awkward_text, inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=examples(400), deadline=None)
@given(
    seq=st.integers(min_value=0, max_value=2**40),
    moment=st.datetimes(timezones=st.just(dt.UTC)),
    channel=awkward_text,
    kind=awkward_text,
    note=awkward_text,
    state=awkward_text,
    actor=st.none() | st.integers(min_value=0, max_value=2**40),
)
def test_a_row_written_directly_is_its_canonical_form(
    seq, moment, channel, kind, note, state, actor
):
    form = row_form(
        seq=seq, received_at=moment, channel=channel, kind=kind, raw_digest="ab" * 32,
        note=note, state_after=state, actor_id=actor,
    )  # fmt: skip
    direct = row_text(
        seq=seq, received_text=timestamp_text(moment), channel=channel, kind=kind,
        raw_digest="ab" * 32, note=note, state_after=state, actor_id=actor,
    )  # fmt: skip
    assert direct == canonical_json(form)


@settings(max_examples=examples(600), deadline=None)
@given(value=json_values)
def test_text_that_shows_nothing_to_clean_is_never_wrong(value):
    """``may_need_cleaning`` may say "maybe" for clean values, never "no" for unclean ones."""
    text = canonical_json(value)
    cleaned, replaced = safejson.clean(value)
    if not safejson.may_need_cleaning(text):
        assert replaced == 0
        assert cleaned is value
        assert canonical_json(cleaned) == text


@settings(max_examples=examples(300), deadline=None)
@given(value=json_values)
def test_an_entry_is_stored_and_hashed_as_the_slow_path_would(value):
    """parse_entry's fast path (one canonical text for the check and the digest) agrees with
    cleaning first and hashing the cleaned value."""
    obj = {
        "statusUpdate": {
            "taskId": "t",
            "status": {"state": "TASK_STATE_WORKING"},
            "metadata": {"v": value},
        }
    }
    entry = record_module.parse_entry(obj)
    cleaned, replaced = safejson.clean(obj)
    assert canonical_json(entry.raw) == canonical_json(cleaned)
    assert (entry.digest, entry.size) == content_digest(cleaned)
    assert ("replaced by U+FFFD" in entry.note) == (replaced > 0)


@settings(max_examples=examples(300), deadline=None)
@given(value=json_values)
def test_a_parts_canonical_form_is_what_dumps_writes(value):
    """Artifact digests chain each part's ``json.dumps`` form; the encoder made once writes it."""
    import json

    slow = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if any(0xD800 <= ord(c) <= 0xDFFF for c in slow):  # never stored: cleaned first
        with pytest.raises(UnicodeEncodeError):
            record_module._canonical(value)
        return
    assert record_module._canonical(value) == slow.encode()


@settings(max_examples=examples(400), deadline=None)
@given(value=json_values, ensure_ascii=st.booleans())
def test_the_encoder_made_once_writes_what_dumps_writes(value, ensure_ascii):
    """``sorted_compact_encoder`` calls the C encoder directly; the text is ``json.dumps``'s."""
    import json

    slow = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=ensure_ascii)
    assert sorted_compact_encoder(ensure_ascii=ensure_ascii)(value) == slow


def test_a_failed_encoding_leaves_nothing_behind_for_the_next_value():
    """An encoding that fails half-way (a value that is not JSON) does not make the next
    value that holds the same containers look circular, and a circular value still fails."""
    held: list = [object()]
    with pytest.raises(TypeError):
        canonical_json({"a": held})
    held[0] = 1  # the list the failure left half-written is JSON now
    assert canonical_json({"a": held}) == b'{"a":[1]}'
    loop: list = []
    loop.append(loop)
    with pytest.raises((ValueError, RecursionError)):
        canonical_json(loop)


def test_text_digest_is_the_content_digest_of_the_value():
    value = {"b": [1, 2.5, "é"], "a": None}
    assert text_digest(canonical_json(value)) == content_digest(value)


def test_rows_built_positionally_follow_the_models_fields():
    """build_events and _add_parts build rows by position (faster than keywords)."""
    assert tuple(f.attname for f in TaskEvent._meta.concrete_fields) == record_module.EVENT_FIELDS
    assert tuple(f.attname for f in ArtifactPart._meta.concrete_fields) == record_module.PART_FIELDS


def test_rows_made_without_init_are_the_rows_init_makes():
    """``_row_maker`` skips ``Model.__init__``: the same attributes and state, and nothing
    listens to these models' construction (which skipping it would silence)."""
    from django.db.models.signals import post_init, pre_init

    now = timezone.now()
    values = (None, 7, 3, now, "stream", "statusUpdate", {"a": 1}, "TASK_STATE_WORKING",
              True, "a note", None, "d" * 64, "h" * 64)  # fmt: skip
    made, built = record_module._new_event(*values), TaskEvent(*values)
    assert made.__dict__.keys() - {"_state"} == built.__dict__.keys() - {"_state"}
    assert all(getattr(made, name) == getattr(built, name) for name in record_module.EVENT_FIELDS)
    assert (made._state.adding, made._state.db) == (built._state.adding, built._state.db)
    assert made._state is not record_module._new_event(*values)._state  # each its own
    part = record_module._new_part(None, 4, 0, {"text": "x"}, 3)
    assert (part.artifact_id, part.index, part.part, part.seq, part.pk) == (
        4,
        0,
        {"text": "x"},
        3,
        None,
    )
    for model in (TaskEvent, ArtifactPart):
        assert not pre_init.has_listeners(model) and not post_init.has_listeners(model)
    with pytest.raises(ValueError):
        record_module._new_part(None, 4, 0)  # a value missing is an error, not a row
