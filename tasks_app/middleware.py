"""What the whole site shares: two response headers (the Content-Security-Policy and
``no-store``) and one check of requests (no NUL character in a query string or form).

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
from django.http import HttpRequest, HttpResponseBadRequest, HttpResponseBase, QueryDict
from django.template import loader
from django.urls import Resolver404, resolve
from django.utils.cache import patch_vary_headers

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


class RefuseNulCharactersMiddleware:
    """A query string or form holding a NUL character is refused (400) before any view.

    No field takes one (Django's form fields refuse it too), and PostgreSQL refuses it in a
    query, so a view that looked such a value up answered 500 on PostgreSQL only (an audit
    filter, an origin to approve). One check here instead of one in every view that reads
    ``request.GET`` or ``request.POST``. Only form bodies are parsed (as the view would parse
    them); a JSON body (the webhook) is left to its view.

    A browser (``Accept: text/html``) gets the site's 400 page naming the fields and saying
    to go back (its Back button keeps what was typed); any other client gets the plain-text
    ``MESSAGE``. A form view marked with ``form_removes_nul`` gets the POST as sent: its form
    removes the NUL characters, shows the rest again and marks the fields (a NUL in a field's
    name is still refused here: no form field has one).
    """

    MESSAGE = "A value in this request holds a NUL character, which no field takes."

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        names = _names_holding_nul(request.GET)
        if request.method == "POST":
            posted = _names_holding_nul(request.POST)
            if posted and not names and _form_removes_nul(request, posted):
                return self.get_response(request)
            names += posted
        if names:
            return self.refuse(request, names)
        return self.get_response(request)

    def refuse(self, request: HttpRequest, names: list[str]) -> HttpResponseBase:
        if "text/html" not in request.headers.get("Accept", ""):
            response = HttpResponseBadRequest(
                self.MESSAGE, content_type="text/plain; charset=utf-8"
            )
        else:
            # Rendered as Django renders its own 400 page: without the request (no user is
            # known yet here), so the layout without the navigation.
            shown = [name.replace("\x00", "") or "(no name)" for name in names[:5]]
            response = HttpResponseBadRequest(
                loader.render_to_string(
                    "400.html",
                    {
                        "nul_fields": shown,
                        "nul_in_query": request.method != "POST",
                    },
                )
            )
        patch_vary_headers(response, ("Accept",))
        return response


def form_removes_nul(view: Callable[..., HttpResponseBase]) -> Callable[..., HttpResponseBase]:
    """Mark a view whose form removes NUL characters from what was posted and says so on the
    fields (``tasks_app.forms.NulRemovingForm``): the POST reaches it as sent. Put it above the
    other decorators (it marks the view the URL conf names)."""
    view.form_removes_nul = True  # type: ignore[attr-defined]
    return view


def _form_removes_nul(request: HttpRequest, names: list[str]) -> bool:
    if any("\x00" in name for name in names):
        return False  # a field's name: no form has such a field
    try:
        match = resolve(request.path_info, getattr(request, "urlconf", None))
    except Resolver404:
        return False
    return getattr(match.func, "form_removes_nul", False) is True


def _names_holding_nul(data: QueryDict) -> list[str]:
    """The keys of ``data`` whose name or one of whose values holds a NUL, in order."""
    return [
        key for key in data if "\x00" in key or any("\x00" in value for value in data.getlist(key))
    ]
