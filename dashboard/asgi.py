"""ASGI entry point: HTTP through Django, websockets through Channels consumers.

Websockets pass the origin check of ``tasks_app.routing`` (scheme, host and port) first.
The push webhook (``/push/<config_id>/``) is answered before Django by
``tasks_app.webhooks.PushRoute``: agents deliver there at a thousand a second, and
Django's middleware and its one-thread sync views are no part of what it needs.
"""

import functools
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402
from django.conf import settings  # noqa: E402

from tasks_app.routing import websocket_application  # noqa: E402
from tasks_app.runtime import request_bodies  # noqa: E402
from tasks_app.webhooks import PushRoute  # noqa: E402


def _remember_content_types() -> None:
    """Daphne's HTTP (Twisted) parses every POST's Content-Type with the ``email`` package to
    look for form data: about a fifth of its time per webhook delivery (profiled). Agents
    send the same few values, so the answers are remembered (a pure function of the header).
    """
    try:
        from twisted.web import http
    except ImportError:  # another ASGI server
        return
    parse = getattr(http, "_parseContentType", None)
    if parse is not None and not hasattr(parse, "cache_info"):
        http._parseContentType = functools.lru_cache(maxsize=64)(parse)


_remember_content_types()
request_bodies.install(settings.REQUEST_MAX_BODY_BYTES)

application = ProtocolTypeRouter(
    {
        "http": PushRoute(django_asgi_app),
        "websocket": websocket_application(),
    }
)
