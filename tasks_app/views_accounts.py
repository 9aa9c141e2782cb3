"""The log-out address, answered for a browser that opens it.

Django's ``LogoutView`` takes only POST (a GET that logs out can be triggered by any page
that links or embeds the address), and answers a GET with an empty 405, which a browser
shows as its own error page: someone who typed or bookmarked ``/accounts/logout/`` saw
nothing of ours. A GET now shows a page with the log-out button; only its POST logs out.
"""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_http_methods

_logout = auth_views.LogoutView.as_view()


@require_http_methods(["GET", "POST"])
def logout_page(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        return _logout(request)
    return render(request, "registration/logout.html")
