"""What Django's error pages and error mails may show of the settings (with ``DEBUG`` on).

Django hides settings whose names look secret (``SECRET``, ``PASS``, ``TOKEN``…). Ours also
carry secrets in URLs: ``REDIS_URL``, ``CELERY_BROKER_URL``, the channel layer's and the
cache's addresses, ``DATABASE_URL``. Those are hidden too, whole.
"""

from __future__ import annotations

import re

from django.views.debug import SafeExceptionReporterFilter


class SettingsFilter(SafeExceptionReporterFilter):
    hidden_settings = re.compile(
        "API|AUTH|TOKEN|KEY|SECRET|PASS|SIGNATURE|HTTP_COOKIE"
        "|URL|BROKER|BACKEND|CHANNEL_LAYERS|CACHES|DATABASES",
        flags=re.IGNORECASE,
    )
