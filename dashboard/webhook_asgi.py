"""ASGI entry point of the webhook part: ``/push/<config_id>/`` and nothing else.

``manage.py up --only webhook`` serves this with uvicorn (its C HTTP parser and event
loop when installed), and a reverse proxy sends ``/push/`` here: agents deliver at a
thousand notifications a second, and under daphne Twisted's HTTP handling cost about
as much CPU per delivery as the webhook's own checks (docs/performance.md, P10). The
checks are the same object the web part uses (:class:`tasks_app.webhooks.PushRoute`),
so both doors answer alike; everything else is a 404 here (pages, websockets and
logins stay on the web part).
"""

import json
import os
from typing import Any

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
django.setup(set_prefix=False)

from tasks_app.webhooks import PushRoute  # noqa: E402

_NOT_HERE = json.dumps({"error": "only /push/<config_id>/ is served here"}).encode()
_HEALTHY = json.dumps({"ok": True}).encode()


async def _elsewhere(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """What is not a delivery: a 404 (``/healthz`` answers that the process serves)."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return  # a websocket: closed unanswered (the web part serves them)
    healthy = scope["path"] == "/healthz" and scope["method"] == "GET"
    body = _HEALTHY if healthy else _NOT_HERE
    await send(
        {
            "type": "http.response.start",
            "status": 200 if healthy else 404,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
                (b"x-content-type-options", b"nosniff"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


application = PushRoute(_elsewhere)
