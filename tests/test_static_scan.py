"""The suite's one WhiteNoise scan per process (``tests.static_scan``) serves what a fresh one does.

The cache is the suite's, not the product's: a wrong key would have every test after a
change of settings served the first scan's headers, and the tests of those headers pass
against the wrong thing.
"""

from __future__ import annotations

from django.test import Client
from whitenoise.middleware import WhiteNoiseMiddleware

from tests import static_scan

CSS = "/static/dashboard/app.css"


def fresh_scan() -> WhiteNoiseMiddleware:
    """A middleware whose files are listed by WhiteNoise itself, past the cache."""
    WhiteNoiseMiddleware.add_files_from_finders = static_scan._scan  # type: ignore[method-assign]
    try:
        return WhiteNoiseMiddleware()
    finally:
        static_scan.install()


def test_a_later_middleware_gets_the_same_files_and_headers_as_a_fresh_scan() -> None:
    first, second, fresh = WhiteNoiseMiddleware(), WhiteNoiseMiddleware(), fresh_scan()
    assert CSS in fresh.files and len(fresh.files) > 50  # ours and the admin's
    assert first.files.keys() == second.files.keys() == fresh.files.keys()
    assert second.files[CSS] is first.files[CSS]  # kept, not built again
    assert dict(second.files[CSS].alternatives[0][2]) == dict(fresh.files[CSS].alternatives[0][2])
    answer = Client().get(CSS)
    assert answer.status_code == 200 and b"{" in b"".join(answer.streaming_content)


def test_a_change_of_settings_scans_again(settings) -> None:
    before = WhiteNoiseMiddleware().files[CSS]
    settings.WHITENOISE_MAX_AGE = 1234
    after = WhiteNoiseMiddleware().files[CSS]
    assert after is not before
    assert "max-age=1234" in dict(after.alternatives[0][2])["Cache-Control"]
    assert "max-age=1234" in Client().get(CSS)["Cache-Control"]
