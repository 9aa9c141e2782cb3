"""WhiteNoise's scan of the static files, once per test process instead of once per client.

Every Django test ``Client`` builds its own handler, and so its own middleware: WhiteNoise's
``__init__`` then lists every static file (ours and the admin's) and builds its headers,
about 30 ms each time. A deployment builds its middleware once per process; the suite built
it hundreds of times per process (about a tenth of the fast tier's CPU, profiled). The
files do not change while the suite runs, so the first scan's entries are kept and given
to every later middleware built with the same settings. What a request gets is the same:
the entries are WhiteNoise's own, built by its own code.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from whitenoise.middleware import WhiteNoiseMiddleware

_scanned: dict[tuple[Any, ...], dict[str, Any]] = {}
_scan = WhiteNoiseMiddleware.add_files_from_finders


def _settings_key() -> tuple[Any, ...]:
    """What the entries depend on: where files are found, and the settings of their headers."""
    whitenoise = sorted(
        (name, repr(getattr(settings, name)))
        for name in dir(settings)
        if name.startswith("WHITENOISE_")
    )
    return (
        settings.STATIC_URL,
        settings.FORCE_SCRIPT_NAME,
        settings.DEBUG,
        tuple(str(path) for path in settings.STATICFILES_DIRS),
        tuple(settings.INSTALLED_APPS),
        tuple(whitenoise),
    )


def _scan_once(self: WhiteNoiseMiddleware) -> None:
    key = _settings_key()
    found = _scanned.get(key)
    if found is None:
        before = dict(self.files)
        _scan(self)
        found = _scanned[key] = {
            url: entry for url, entry in self.files.items() if url not in before
        }
    for url, entry in found.items():
        self.files.setdefault(url, entry)


def install() -> None:
    WhiteNoiseMiddleware.add_files_from_finders = _scan_once  # type: ignore[method-assign]
