"""ASGI entry point: HTTP through Django, websockets through Channels consumers.

Websockets pass the origin check of ``tasks_app.routing`` (scheme, host and port) first.
The push webhook (``/push/<config_id>/``) is answered before Django by
``tasks_app.webhooks.PushRoute``: agents deliver there at a thousand a second, and
Django's middleware and its one-thread sync views are no part of what it needs.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402

from tasks_app.routing import websocket_application  # noqa: E402
from tasks_app.webhooks import PushRoute  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": PushRoute(django_asgi_app),
        "websocket": websocket_application(),
    }
)
