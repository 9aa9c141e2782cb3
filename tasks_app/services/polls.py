"""What a poll asks an agent for: the task with the newest part of its history.

An agent's history grows with every message it says, and a poll that stores a changed
snapshot stored the whole conversation each time: a ten-minute task of one status a second
grew its log by 185 KB a poll, went over its byte budget and was parked after six minutes.
So a poll (a watcher's, or the push drain's GetTask) asks for the newest messages only.

A window alone could skip messages: when the agent said more than the window between two
polls, the ones before it were found only by a later, wider read and mirrored after newer
ones, out of the agent's order. So the window must reach back to a message the mirror
holds; when its oldest is one the mirror does not hold, the same turn asks again with a
window ``WIDEN`` times as wide, up to ``POLL_HISTORY_MAX``, then for the whole history: at
most four GetTasks for a poll, whatever the agent sends. Asking for the whole history at
once made a chatty agent (more than the window between two polls) cost the whole
conversation every poll, in bytes fetched and stored, until its budget parked it. The next
poll's window is twice what the agent said between the last two (a watcher keeps it, and
the push drain per task), so a
steady talker costs one GetTask a poll. The GetTask that settles a task, and the ones an
operator's action makes, ask for all of it as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tasks_app import eventloop
from tasks_app.a2a import A2AClient
from tasks_app.models import ConversationMessage
from tasks_app.services.record import MAX_ID_CHARS

# The messages a first poll asks for; more than an agent says between two polls, as a rule.
POLL_HISTORY = 20
WIDEN = 8
# The widest window; past it, the whole history (an agent that says this much between two
# polls is read whole, as before windows).
POLL_HISTORY_MAX = POLL_HISTORY * WIDEN**2


@dataclass(frozen=True)
class Polled:
    task: dict[str, Any]
    # The window the next poll of this task should ask for (see ``window_for``).
    next_length: int


def window_for(new_messages: int) -> int:
    """The next poll's window: twice what the agent said since the last, within the bounds."""
    return min(POLL_HISTORY_MAX, max(POLL_HISTORY, 2 * new_messages))


async def poll_task(
    client: A2AClient, remote_id: str, task_pk: int, length: int = POLL_HISTORY
) -> Polled:
    """GetTask with the newest ``length`` messages, widened until it leaves no hole.

    1. Ask for the window. An agent may send fewer than asked, or ignore the length.
    2. No message with an id in it (an agent that keeps no history): it is what there is.
    3. Its oldest message is one the mirror holds, or the agent sent more than asked (it
       ignores the length: all it has): nothing is skipped.
    4. Fewer than asked, the oldest new: all the agent has, or a lower limit of its own
       (the spec lets it apply one), which left a hole. The whole history, once, says which.
    5. Otherwise ask again with a window ``WIDEN`` times as wide; past
       ``POLL_HISTORY_MAX``, for the whole history, once.
    """
    length = min(max(length, POLL_HISTORY), POLL_HISTORY_MAX)
    while True:
        window = await client.get_task(remote_id, history_length=length)
        ids = [
            m["messageId"]
            for m in window.get("history") or []
            if isinstance(m, dict) and isinstance(m.get("messageId"), str)
        ]
        if not ids:
            return Polled(window, length)
        held = await eventloop.db(_held, task_pk, ids)
        count = len(window.get("history") or [])
        if ids[0] in held or count > length:
            return Polled(window, window_for(len(set(ids) - held)))
        if count < length:
            return Polled(await client.get_task(remote_id), length)
        if length >= POLL_HISTORY_MAX:
            return Polled(await client.get_task(remote_id), POLL_HISTORY_MAX)
        length = min(length * WIDEN, POLL_HISTORY_MAX)


def _held(task_pk: int, message_ids: list[str]) -> set[str]:
    """Which of ``message_ids`` the mirror holds (an id over the column's width never is)."""
    wanted = {m for m in message_ids if len(m) <= MAX_ID_CHARS}
    return set(
        ConversationMessage.objects.filter(task_id=task_pk, message_id__in=wanted).values_list(
            "message_id", flat=True
        )
    )
