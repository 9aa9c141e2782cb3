"""The hash chain over a task's log: the canonical form of a row and its hash.

Each ``TaskEvent`` stores ``hash = sha256(previous_hash + canonical(row))``, the
first row of a task chaining from the empty string. Changing, removing or
reordering any stored row changes every hash after it, so ``manage.py audit
verify`` names the first row that no longer matches.

The canonical form of a row is a JSON object with the keys ``actor``,
``channel``, ``kind``, ``note``, ``raw_sha256`` (the sha256 of the canonical
form of the row's raw content), ``received_at``, ``seq`` and ``state`` (the
state right after the row), serialized with sorted keys, no spaces and ASCII
escapes (``ensure_ascii``), where:

* ``received_at`` is ISO 8601 in UTC with microseconds (``2026-11-30T10:00:00.000000Z``);
* the raw content is canonical in the same way (sorted keys, no spaces, ASCII);
* numbers are written as Python's ``json`` writes them (integers in full,
  floats as their shortest ``repr``). This reads back the same from both
  databases because what is stored was made stable first: PostgreSQL's
  ``jsonb`` would turn a float of 2**53 or more into an integer and ``-0.0``
  into ``0.0``, so ``tasks_app.a2a.safejson.clean`` stores them in that form.

The content is hashed as stored: strings an agent sent that neither database
can hold (lone surrogates, NUL) were replaced before storing (see
``tasks_app.a2a.safejson``), and the row's note says so.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

# The encoder's own string writer (its C version where there is one): a row's canonical form,
# written field by field with it, is byte for byte what the encoder writes for the whole dict.
_encode_string = json.encoder.encode_basestring_ascii


def sorted_compact_encoder(*, ensure_ascii: bool) -> Callable[[Any], str]:
    """``json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=...)``, made once.

    ``JSONEncoder.encode`` builds its C encoder anew on every call, which was most of
    the cost for the small values the recorder writes several times per event
    (profiled, P3: 2.4 us of 3.3 for an artifact part). Here the C encoder is built
    once and called directly; without one (another Python), the encoder's own
    ``encode``. It keeps no circular-reference markers: a container left in them by an
    encoding that failed half-way would make a later, unrelated value "circular".
    A circular value (never JSON's) ends in ``RecursionError`` instead of ``ValueError``.
    """
    encoder = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=ensure_ascii)
    make = json.encoder.c_make_encoder
    if make is None:
        return encoder.encode
    write_string = (
        json.encoder.encode_basestring_ascii if ensure_ascii else json.encoder.encode_basestring
    )
    one_shot = make(None, encoder.default, write_string, None, ":", ",", True, False, True)

    def encode(value: Any) -> str:
        if isinstance(value, str):  # as ``encode`` does: the string writer alone
            return write_string(value)
        return "".join(one_shot(value, 0))

    return encode


_encode_canonical = sorted_compact_encoder(ensure_ascii=True)


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no spaces, ASCII escapes (numbers as Python writes them)."""
    return _encode_canonical(value).encode("ascii")


def content_digest(raw: Any) -> tuple[str, int]:
    """sha256 of one entry's raw content alone, and its canonical size in bytes.

    The digest recognizes the same chunk delivered twice, and stands for the
    content in the row's hash; the size counts against the task's byte budget.
    """
    return text_digest(canonical_json(raw))


def text_digest(text: bytes) -> tuple[str, int]:
    """:func:`content_digest` of a value whose canonical form is at hand (computed once)."""
    return hashlib.sha256(text).hexdigest(), len(text)


def timestamp_text(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def row_form(
    *,
    seq: int,
    received_at: datetime,
    channel: str,
    kind: str,
    raw_digest: str,
    note: str,
    state_after: str,
    actor_id: int | None,
) -> dict[str, Any]:
    """A row's canonical form as a value: ``canonical_json`` of it is what is hashed.

    The definition the module's docstring gives, as code; recording and verifying
    write the same bytes directly (:func:`row_text`), held to this by
    ``tests/test_chain.py``.
    """
    return {
        "actor": actor_id,
        "channel": channel,
        "kind": kind,
        "note": note,
        "raw_sha256": raw_digest,
        "received_at": timestamp_text(received_at),
        "seq": seq,
        "state": state_after,
    }


def chain_hash(previous: str, row: bytes) -> str:
    """The chained hash of a row whose canonical form is ``row``."""
    return hashlib.sha256(previous.encode("ascii") + row).hexdigest()


def row_text(
    *,
    seq: int,
    received_text: str,
    channel: str,
    kind: str,
    raw_digest: str,
    note: str,
    state_after: str,
    actor_id: int | None,
) -> bytes:
    """``canonical_json(row_form(...))``, written directly (``received_text``: :func:`timestamp_text`).

    Recording hashes every row it appends: building the dict and sorting its keys
    was a third of a row's hashing. The keys are written in their sorted order and
    each string by the encoder's own writer, so the bytes are the same
    (``tests/test_chain.py`` checks it on generated rows).
    """
    actor = "null" if actor_id is None else repr(int(actor_id))
    return (
        f'{{"actor":{actor},"channel":{_encode_string(channel)},"kind":{_encode_string(kind)},'
        f'"note":{_encode_string(note)},"raw_sha256":{_encode_string(raw_digest)},'
        f'"received_at":{_encode_string(received_text)},"seq":{int(seq)!r},'
        f'"state":{_encode_string(state_after)}}}'
    ).encode("ascii")


def event_hash(previous: str, event: Any, raw_digest: str) -> str:
    """The chained hash of a ``TaskEvent`` (stored or about to be) after ``previous``.

    ``raw_digest`` is :func:`content_digest` of the row's raw content: computed
    once when recording; recomputed from the stored content when verifying.
    """
    return chain_hash(
        previous,
        row_text(
            seq=event.seq,
            received_text=timestamp_text(event.received_at),
            channel=event.channel,
            kind=event.kind,
            raw_digest=raw_digest,
            note=event.note,
            state_after=event.state_after,
            actor_id=event.actor_id,
        ),
    )
