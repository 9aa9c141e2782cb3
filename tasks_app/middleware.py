"""Response headers the whole site shares: the Content-Security-Policy and ``no-store``.

The policy is static (no nonces: no page has inline script or style, see
``static/dashboard/``), so a few lines here do what a library would: the header is
built once from ``settings.CONTENT_SECURITY_POLICY`` and put on every response that does
not bring its own. Django 5.2 has no CSP support of its own (6.0 adds it).

Pages, fragments, JSON and downloads answered to a logged-in user show task data, agent
details and the operator's name: a shared cache or the browser's back-forward cache must
not keep them. Every such response that does not set its own ``Cache-Control`` gets
``no-store``; static files (served by WhiteNoise, before the session is even read) keep
their long cache lifetimes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from django.conf import settings
from django.http import HttpRequest, HttpResponseBase

CSP_HEADER = "Content-Security-Policy"


def serialize_policy(policy: Mapping[str, Sequence[str]]) -> str:
    """``{"default-src": ["'self'"], ...}`` -> ``default-src 'self'; ...`` (directives in order)."""
    return "; ".join(" ".join([directive, *sources]) for directive, sources in policy.items())


class ContentSecurityPolicyMiddleware:
    """Adds ``settings.CONTENT_SECURITY_POLICY`` to every response that has none."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response
        self.header = serialize_policy(settings.CONTENT_SECURITY_POLICY)

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        response = self.get_response(request)
        if self.header and CSP_HEADER not in response:
            response[CSP_HEADER] = self.header
        return response


class NoStoreForUsersMiddleware:
    """``Cache-Control: no-store`` on what a logged-in user gets, unless the view set one.

    Placed after ``AuthenticationMiddleware``, which gives ``request.user``.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        response = self.get_response(request)
        if response.has_header("Cache-Control"):
            return response  # the view chose (asked first: the user may cost a session read)
        user = getattr(request, "user", None)
        if user is not None and user.is_authenticated:
            response["Cache-Control"] = "no-store"
        return response
