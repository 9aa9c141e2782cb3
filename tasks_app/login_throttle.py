"""What a locked-out login sees: the login page again, with one sentence, and 429.

django-axes counts failed logins per username and client address (``AXES_*`` in
``dashboard/settings.py``) and, once the limit is reached, refuses that pair before the
password is even checked, right or wrong, until the cool-off has passed. It calls
``locked_out`` for the answer (``AXES_LOCKOUT_CALLABLE``) so the page keeps the site's look
instead of axes' bare text. The sentence is the same whether or not the username exists.
"""

from __future__ import annotations

from typing import Any

from axes.helpers import get_cool_off
from django.contrib.auth import get_user_model
from django.contrib.auth.forms import AuthenticationForm
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.cache import add_never_cache_headers

STATUS = 429


def throttled_username(request: HttpRequest, credentials: dict | None = None) -> str | None:
    """The username axes counts failures for (``AXES_USERNAME_CALLABLE``): as typed, without
    NUL characters and cut to the longest username there can be.

    Django's login form calls ``authenticate`` without checking the name's length, and axes
    stored it as it came: a name over 255 characters, or one holding a NUL, made PostgreSQL
    refuse the failure's row and the login page answer 500. No account has such a name, so
    cutting it changes nobody's count.
    """
    source = credentials if credentials else getattr(request, "POST", {})
    username = source.get("username")
    if not isinstance(username, str):
        return None
    longest = get_user_model()._meta.get_field("username").max_length or 150
    return username.replace("\x00", "")[:longest]


def lockout_message(request: HttpRequest | None = None) -> str:
    cool_off = get_cool_off(request)
    minutes = max(1, round(cool_off.total_seconds() / 60)) if cool_off else 0
    wait = (
        f"try again in {minutes} minute{'s' if minutes != 1 else ''}"
        if minutes
        else "ask an administrator"
    )
    return f"Too many failed logins for this username from your address; {wait}."


def locked_out(
    request: HttpRequest, original_response: HttpResponse | None = None, credentials: Any = None
) -> HttpResponse:
    """The login form (username kept, password not) with the lockout sentence."""
    username = (credentials or {}).get("username") or request.POST.get("username", "")
    context = {
        "form": AuthenticationForm(request, initial={"username": username}),
        "lockout_message": lockout_message(request),
        "next": request.POST.get("next", request.GET.get("next", "")),
    }
    response = render(request, "registration/login.html", context, status=STATUS)
    add_never_cache_headers(response)
    return response
