"""Bounded views of big content: artifact previews, streamed artifact downloads, log previews.

An agent decides how big an artifact or a log entry is; the web process must not.
A task page shows at most ``ARTIFACT_PREVIEW_BYTES`` of each artifact and a few KB
of each log entry, and the database cuts the text (``SUBSTR``) so that a 30 MB
part is never read into the web process to show its first 64 KB. The whole
artifact is a streamed download read from the database in batches and slices,
so memory stays bounded whatever the size.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db.models import Count, Max, QuerySet, Sum, TextField, Value
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Coalesce, Length, Substr
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from tasks_app.models import Artifact, ArtifactPart
from tasks_app.rendering import parts_html, pretty_json, safe_filename, shown_media_type

# Parts per query while building a preview, each part's text cut to PREVIEW_HEAD_CHARS (a
# query reads at most 1 MB of heads); a longer text the budget reaches is read in one more
# query per batch (``_preview_extras``). At most PREVIEW_MAX_PARTS parts are looked at: a
# part can be an empty text, which costs the budget nothing, and an agent's artifact of
# millions of them made a preview read them all, 16 a query (minutes and a GB a view).
PREVIEW_BATCH = 512
PREVIEW_HEAD_CHARS = 2048
PREVIEW_MAX_PARTS = 4096
PLACEHOLDER_BYTES = 256  # what a part shown only as a link counts against the budget
DOWNLOAD_BATCH = 64  # parts per query while streaming a download
DOWNLOAD_HEAD_CHARS = 64 * 1024  # text of each part read with its batch
DOWNLOAD_SLICE_CHARS = 2 * 1024 * 1024  # the rest of a long text part, a slice per query
# A log entry's raw JSON up to this size is shown on a page; a bigger one only says its size
# (a hundred rows of a streamed artifact would otherwise be most of the page).
EVENT_RAW_PREVIEW_CHARS = 2048


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "replace"))


def _cut_utf8(text: str, limit: int) -> str:
    """The longest prefix of ``text`` whose UTF-8 form fits in ``limit`` bytes."""
    encoded = text.encode("utf-8", "replace")
    if len(encoded) <= limit:
        return text
    return encoded[:limit].decode("utf-8", "ignore")


def _part_rows(artifact_pk: int, after: int, limit: int, head_chars: int) -> QuerySet:
    """Part rows with only what a preview needs; the text cut by the database."""
    text = KT("part__text")
    return (
        ArtifactPart.objects.filter(artifact_id=artifact_pk, index__gt=after)
        .order_by("index")
        .annotate(
            text_len=Length(text),
            text_head=Substr(text, 1, max(1, head_chars)),
            size=Length(Cast("part", TextField())),
            filename=KT("part__filename"),
            media=KT("part__mediaType"),
            raw_len=Length(KT("part__raw")),
        )
        .values_list(
            "pk", "index", "seq", "text_len", "text_head", "size", "filename", "media", "raw_len"
        )[:limit]
    )


def _placeholder(
    index: int, kind: str, filename: Any, media: Any, size: int, url: str
) -> SafeString:
    name = safe_filename(filename, f"part-{index}")
    what = "file" if kind == "raw" else "JSON data"
    return format_html(
        '<p class="file big-part"><a class="download" href="{}" download="{}">Download {}</a>'
        ' <span class="muted">({}{}, {} bytes; too big to show here)</span></p>',
        url,
        name,
        name,
        what,
        f", {shown_media_type(media)}" if isinstance(media, str) and media else "",
        size,
    )


def artifact_preview(artifact: Artifact, download_url: Callable[[int], str]) -> dict:
    """The first ``ARTIFACT_PREVIEW_BYTES`` of an artifact, rendered, and what was left out.

    Parts are read in order, a batch at a time, until the budget is spent: text
    parts are concatenated (cut by the database to what can still be shown);
    data and file parts count their size, and one too big to show becomes a
    download link. Returns ``html``, ``seq`` (the newest part this rendering
    reflects), ``truncated``, ``shown_bytes`` and ``total_bytes``.
    """
    budget = settings.ARTIFACT_PREVIEW_BYTES
    used = 0
    # Runs of parts for parts_html (index of their first part, parts) and ready placeholders.
    pieces: list[SafeString | tuple[int, list[Any]]] = []
    run: list[Any] = []
    run_start = 0
    after = -1
    max_seq = artifact.updated_seq
    truncated = False

    def close_run() -> None:
        if run:
            pieces.append((run_start, list(run)))
            run.clear()

    looked_at = 0
    capped = False
    while not truncated:
        head_chars = min(budget - used, PREVIEW_HEAD_CHARS)
        rows = list(_part_rows(artifact.pk, after, PREVIEW_BATCH, head_chars))
        heads, data = _preview_extras(rows, budget - used)
        for pk, index, seq, text_len, head, size, filename, media, raw_len in rows:
            if looked_at == PREVIEW_MAX_PARTS:
                truncated = capped = True
                break
            looked_at += 1
            after = index
            max_seq = max(max_seq, seq)
            if not run:
                run_start = index
            if text_len is not None:
                head = heads.get(pk, head) or ""
                room = budget - used
                if text_len == len(head) and _utf8_len(head) <= room:
                    run.append({"text": head})
                    used += _utf8_len(head)
                else:
                    cut = _cut_utf8(head, room)
                    run.append({"text": cut})
                    used += _utf8_len(cut)
                    truncated = True
            elif (size or 0) <= budget - used:
                # Read with its batch (``_preview_extras`` reads every part that can fit).
                run.append(
                    data[pk]
                    if pk in data
                    else ArtifactPart.objects.values_list("part", flat=True).get(pk=pk)
                )
                used += size or 0
            else:
                close_run()
                kind = "raw" if raw_len is not None else "data"
                shown = (raw_len * 3) // 4 if raw_len is not None else size
                pieces.append(
                    _placeholder(index, kind, filename, media, shown, download_url(index))
                )
                used += PLACEHOLDER_BYTES
            if used >= budget:
                truncated = True
            if truncated:
                break
        if len(rows) < PREVIEW_BATCH:
            break
    close_run()
    html = []
    for piece in pieces:
        if isinstance(piece, tuple):
            start, parts = piece
            html.append(str(parts_html(parts, lambda i, start=start: download_url(start + i))))
        else:
            html.append(str(piece))
    total = used
    parts = looked_at
    if truncated:
        # Only now is the whole artifact measured, in the database (text counted in characters).
        totals = ArtifactPart.objects.filter(artifact_id=artifact.pk).aggregate(
            size=Sum(
                Coalesce(Length(KT("part__text")), Length(Cast("part", TextField())), Value(0))
            ),
            seq=Max("seq"),
            parts=Count("pk"),
        )
        total = max(int(totals["size"] or 0), used)
        max_seq = max(max_seq, int(totals["seq"] or 0))
        parts = int(totals["parts"] or 0)
    return {
        "html": mark_safe("".join(html)),  # every piece rendered by parts_html or format_html
        "seq": max_seq,
        "truncated": truncated and (total > used or capped),
        "shown_bytes": used,
        "total_bytes": total,
        # Set when the parts looked at ran out before the bytes did (PREVIEW_MAX_PARTS).
        "shown_parts": looked_at if capped else None,
        "total_parts": parts,
    }


def _preview_extras(rows: list[tuple], room: int) -> tuple[dict[int, str], dict[int, Any]]:
    """What a batch's rows need beyond their own columns, in one query each: the text of a
    part longer than its head, cut to ``room`` (pk -> text), and the value of a data or file
    part that may fit (pk -> part).

    Only the parts the budget can reach are read: walking the rows in order, each costs the
    budget at least its text's characters (its UTF-8 bytes are never fewer) or, another
    part, its size or the placeholder's, whichever is less; a part starting past ``room``
    is never shown. So the texts read add up to at most about twice ``room``, and the other
    parts read to at most ``room`` (one this leaves out that fits after all is read on its
    own, and counts against the budget as it is shown).
    """
    longer: list[int] = []
    fitting: list[int] = []
    reach = values = 0
    for pk, _index, _seq, text_len, head, size, *_ in rows:
        if reach >= room:
            break
        if text_len is not None:
            if text_len > len(head or ""):
                longer.append(pk)
            reach += text_len
        else:
            if (size or 0) <= room - reach and values + (size or 0) <= room:
                fitting.append(pk)
                values += size or 0
            reach += min(size or 0, PLACEHOLDER_BYTES)
    heads: dict[int, str] = {}
    if longer:
        heads = dict(
            ArtifactPart.objects.filter(pk__in=longer)
            .annotate(head=Substr(KT("part__text"), 1, max(1, room)))
            .values_list("pk", "head")
        )
    data: dict[int, Any] = {}
    if fitting:
        data = dict(ArtifactPart.objects.filter(pk__in=fitting).values_list("pk", "part"))
    return heads, data


# Streamed download ---------------------------------------------------------------------------


def artifact_is_text(artifact_pk: int) -> bool:
    """Whether every part is a text part (the download is then text/plain)."""
    return not (
        ArtifactPart.objects.filter(artifact_id=artifact_pk)
        .annotate(t=KT("part__text"))
        .filter(t__isnull=True)
        .exists()
    )


def _text_rest(pk: int, start: int, length: int) -> Iterator[bytes]:
    """The text of one long part after its head, a slice per query."""
    while start <= length:
        piece = (
            ArtifactPart.objects.filter(pk=pk)
            .annotate(piece=Substr(KT("part__text"), start, DOWNLOAD_SLICE_CHARS))
            .values_list("piece", flat=True)
            .first()
        )
        if not piece:
            return
        yield piece.encode("utf-8", "replace")
        start += DOWNLOAD_SLICE_CHARS


def _other_part_bytes(part: Any) -> bytes:
    """A non-text part in the whole-artifact download: data as JSON, files as their bytes."""
    from tasks_app.rendering import decode_raw

    if isinstance(part, dict) and "data" in part:
        return (json.dumps(part["data"], ensure_ascii=False) + "\n").encode("utf-8", "replace")
    if isinstance(part, dict) and "raw" in part:
        return decode_raw(part) or b""
    if isinstance(part, dict) and isinstance(part.get("url"), str):
        return (part["url"] + "\n").encode("utf-8", "replace")
    return (json.dumps(part, ensure_ascii=False) + "\n").encode("utf-8", "replace")


def artifact_chunks(artifact_pk: int) -> Iterator[bytes]:
    """The whole artifact, in order, as bytes: one chunk per batch of parts or slice of a part."""
    after = -1
    text = KT("part__text")
    while True:
        rows = list(
            ArtifactPart.objects.filter(artifact_id=artifact_pk, index__gt=after)
            .order_by("index")
            .annotate(text_len=Length(text), head=Substr(text, 1, DOWNLOAD_HEAD_CHARS))
            .values_list("pk", "index", "text_len", "head")[:DOWNLOAD_BATCH]
        )
        if not rows:
            return
        batch: list[bytes] = []
        for pk, index, text_len, head in rows:
            after = index
            if text_len is None:
                batch.append(
                    _other_part_bytes(
                        ArtifactPart.objects.values_list("part", flat=True).get(pk=pk)
                    )
                )
                continue
            batch.append((head or "").encode("utf-8", "replace"))
            if text_len > DOWNLOAD_HEAD_CHARS:
                yield b"".join(batch)
                batch.clear()
                yield from _text_rest(pk, DOWNLOAD_HEAD_CHARS + 1, text_len)
        if batch:
            yield b"".join(batch)
        if len(rows) < DOWNLOAD_BATCH:
            return


async def artifact_chunks_async(artifact_pk: int) -> AsyncIterator[bytes]:
    """``artifact_chunks`` for an ASGI server: Django would read a sync iterator whole first."""
    chunks = artifact_chunks(artifact_pk)
    step = sync_to_async(lambda: next(chunks, None), thread_sensitive=True)
    while (chunk := await step()) is not None:
        yield chunk


# Log entries on a page -----------------------------------------------------------------------


def with_raw_preview(events: QuerySet) -> QuerySet:
    """Log rows without their raw JSON, but with its size and its head (cut by the database)."""
    raw = Cast("raw", TextField())
    return events.defer("raw").annotate(
        raw_size=Length(raw), raw_head=Substr(raw, 1, EVENT_RAW_PREVIEW_CHARS)
    )


def raw_preview(event: Any) -> str:
    """A log entry's raw JSON for a page: indented when small, else only its size."""
    size = getattr(event, "raw_size", None)
    head = getattr(event, "raw_head", None)
    if head is None:
        return pretty_json(event.raw)
    if size is not None and size <= EVENT_RAW_PREVIEW_CHARS:
        try:
            return pretty_json(json.loads(head))
        except ValueError:
            return head
    return f"{size} characters: too long to show here; open the entry to see it."


# Log rows read in bounded batches -----------------------------------------------------------


def batch_within(rows: QuerySet, limit: int, chars: int) -> tuple[int | None, bool]:
    """The last seq of the first log rows of ``rows`` within ``limit`` rows and ``chars``
    characters of their raw JSON (one row at least; None: no row), and whether more rows
    follow. Their sizes are read, not their JSON: a row's goes up to WATCH_MAX_EVENT_BYTES,
    and reads of a fixed number of rows (exports, a socket's resume) peaked at hundreds of MB.
    """
    sizes, more = sized_batch(rows, limit, chars)
    return (max(sizes) if sizes else None), more


def sized_batch(rows: QuerySet, limit: int, chars: int) -> tuple[dict[int, int], bool]:
    """As :func:`batch_within`: the batch's rows, each seq with the size of its raw JSON."""
    sizes = list(
        rows.order_by("seq")
        .annotate(size=Length(Cast("raw", TextField())))
        .values_list("seq", "size")[:limit]
    )
    taken, total = 0, 0
    for _seq, size in sizes:
        total += size or 0
        if taken and total > chars:
            break
        taken += 1
    more = taken < len(sizes) or len(sizes) == limit
    return {seq: size or 0 for seq, size in sizes[:taken]}, bool(taken) and more


# A task page's conversation -------------------------------------------------------------------

# A message up to this many characters (its JSON) is read whole for a task page, while the
# page's reads stay within CONVERSATION_LOADED_CHARS; a bigger one (or one past that) is read
# as the heads of its first MESSAGE_HEAD_PARTS text parts, cut by the database. The page shows
# at most MESSAGE_SHOWN_CHARS (64,000) of a message anyway, and a hundred messages read whole
# were an agent's to size: six 4 MB messages made each view of the page peak at 55 MB.
MESSAGE_LOADED_CHARS = 256 * 1024
CONVERSATION_LOADED_CHARS = 2 * 1024 * 1024
MESSAGE_HEAD_PARTS = 4


def conversation_messages(
    messages: QuerySet, limit: int, head_chars: int
) -> list[tuple[Any, Any, int | None]]:
    """The first ``limit`` messages of ``messages`` (in its order), each with what a page may
    show of it.

    Returns ``(row, message, size)``: ``size`` is None when ``message`` is the whole stored
    message, else the stored message's size in characters and ``message`` a stand-in with the
    first ``head_chars`` of its first text parts and, for each of its first parts, ``size``
    (its JSON's length) and ``index``, so the page can offer it as a download.

    1. The rows and their messages' sizes, without the messages.
    2. The newest messages first, each read whole while it and the page's total fit.
    3. The others: the heads of their first parts, in one query.
    """
    sized = messages.defer("message").annotate(size=Length(Cast("message", TextField())))
    rows = list(sized[:limit])
    whole: set[int] = set()  # 2
    left = CONVERSATION_LOADED_CHARS
    for row in sorted(rows, key=lambda row: (row.seq, row.pk), reverse=True):
        size = row.size or 0
        if size <= min(MESSAGE_LOADED_CHARS, left):
            whole.add(row.pk)
            left -= size
    model = messages.model
    stored = dict(model.objects.filter(pk__in=whole).values_list("pk", "message"))
    heads: dict[int, dict] = {}
    cut = [row.pk for row in rows if row.pk not in whole]
    if cut:  # 3
        fields = {}
        for index in range(MESSAGE_HEAD_PARTS + 1):  # one more: whether there are more parts
            fields[f"size_{index}"] = Length(KT(f"message__parts__{index}"))
            fields[f"text_{index}"] = Substr(KT(f"message__parts__{index}__text"), 1, head_chars)
        for values in model.objects.filter(pk__in=cut).annotate(**fields).values("pk", *fields):
            heads[values["pk"]] = values
    shown = []
    for row in rows:
        if row.pk in whole:
            shown.append((row, stored[row.pk], None))
            continue
        values = heads[row.pk]
        parts = []
        for index in range(MESSAGE_HEAD_PARTS + 1):
            size = values[f"size_{index}"]
            if size is None:
                break
            text = values[f"text_{index}"]
            parts.append({"index": index, "size": size, **({} if text is None else {"text": text})})
        shown.append((row, {"parts": parts}, row.size))
    return shown


def cut_message_html(
    message: dict, size: int, download_url: Callable[[int], str], max_chars: int
) -> SafeString:
    """A message too big to read for a page (see ``conversation_messages``): the heads of its
    first text parts, what was left out, and each of its first parts as a download."""
    parts = message["parts"]
    first = parts[:MESSAGE_HEAD_PARTS]
    links = format_html_join(
        ", ",
        '<a class="download" href="{}">part {}</a> ({} characters)',
        ((download_url(p["index"]), p["index"] + 1, f"{p['size']:,}") for p in first),
    )
    return format_html(
        '{}<p class="muted small left-out">… this message is {} characters, more than a page '
        "reads: shown is the start of the text of its first {} parts{}. Download: {}</p>",
        parts_html([part for part in first if "text" in part], None, max_chars=max_chars),
        f"{size:,}",
        MESSAGE_HEAD_PARTS,
        " (it has more: the log and the export hold them)" if len(parts) > len(first) else "",
        links,
    )
