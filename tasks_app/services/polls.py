"""What a poll asks an agent for: the task with the newest part of its history.

An agent's history grows with every message it says, and a poll that stores a changed
snapshot stored the whole conversation each time: a ten-minute task of one status a second
grew its log by 185 KB a poll, went over its byte budget and was parked after six minutes.
So a poll (a watcher's, or the push drain's GetTask) asks for the newest ``POLL_HISTORY``
messages.

A window alone could skip messages: when the agent said more than the window between two
polls, the ones before it were found only by a later, wider read and mirrored after newer
ones, out of the agent's order. So the window must reach back to a message the mirror
holds; when its oldest is one the mirror does not hold, the same turn asks again for the
whole history (what the agent said in between, in its order). The GetTask that settles a
task, and the ones an operator's action makes, ask for all of it as before.
"""

from __future__ import annotations

from typing import Any

from tasks_app import eventloop
from tasks_app.a2a import A2AClient
from tasks_app.models import ConversationMessage
from tasks_app.services.record import MAX_ID_CHARS

# The messages a poll asks for; more than an agent says between two polls, as a rule.
POLL_HISTORY = 20


async def poll_task(client: A2AClient, remote_id: str, task_pk: int) -> dict[str, Any]:
    """GetTask with the newest ``POLL_HISTORY`` messages; the whole history when they leave a hole.

    1. Ask for the window. An agent may send fewer than asked, or ignore the length.
    2. No message with an id in it (an agent that keeps no history): it is what there is.
    3. Its oldest message is one the mirror holds: everything newer is in the window.
    4. Otherwise ask for the whole history, once, and return that instead.
    """
    window = await client.get_task(remote_id, history_length=POLL_HISTORY)
    oldest = next(
        (
            m["messageId"]
            for m in window.get("history") or []
            if isinstance(m, dict) and isinstance(m.get("messageId"), str)
        ),
        None,
    )
    if oldest is None or await eventloop.db(_holds, task_pk, oldest):
        return window
    return await client.get_task(remote_id)


def _holds(task_pk: int, message_id: str) -> bool:
    if len(message_id) > MAX_ID_CHARS:
        return False  # refused by the fold: never held
    return ConversationMessage.objects.filter(task_id=task_pk, message_id=message_id).exists()
