"""The alerts pages: the list, the live section the overview and the inbox refresh, the test button.

Who sees an alert: whoever may read its agent's project (``tasks_app.alerts.open_alerts``).
Who may send a test alert: staff and the agent admins of some project; anyone else gets a
403 with a refusal row, like every refused action (``access.refuse``).
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from tasks_app import access, alerts
from tasks_app.access import Perm
from tasks_app.models import Alert, AlertDelivery, for_list

RESOLVED_SHOWN = 50
DELIVERIES_SHOWN = 30


@login_required
@require_GET
def alert_list(request: HttpRequest) -> HttpResponse:
    """Open alerts, the recently resolved ones, and (for testers) channels and deliveries."""
    user = request.user
    open_qs = for_list(
        alerts.open_alerts(user).select_related("task", "agent__project"), task="task__"
    )
    resolved_qs = Alert.objects.filter(resolved_at__isnull=False, opened_at__isnull=False).exclude(
        rule=Alert.Rule.TEST
    )
    ids = access.projects_with(user, Perm.READ)
    if ids is not None:
        resolved_qs = resolved_qs.filter(agent__project_id__in=ids)
    may_test = alerts.may_test(user)
    deliveries = []
    if may_test:
        shown = AlertDelivery.objects.select_related("alert")
        if ids is not None:
            # An alert's message names its task or agent: only those of projects this person
            # reads (and the test alerts, which name none).
            shown = shown.filter(
                Q(alert__agent__project_id__in=ids) | Q(alert__rule=Alert.Rule.TEST)
            )
        deliveries = list(shown.order_by("-attempted_at", "-id")[:DELIVERIES_SHOWN])
    context = {
        "open_alerts": list(open_qs[:500]),
        "resolved": list(
            for_list(resolved_qs.select_related("task", "agent"), task="task__").order_by(
                "-resolved_at", "-id"
            )[:RESOLVED_SHOWN]
        ),
        "may_test": may_test,
        "channels": alerts.channels() if may_test else [],
        "deliveries": deliveries,
        "rules": alerts.rules(),
        "now": timezone.now(),
    }
    return render(request, "tasks_app/alerts.html", context)


@login_required
@require_GET
def alerts_live(request: HttpRequest) -> HttpResponse:
    """The alerts section again, or 204 when the version the page shows is still current."""
    shown = request.GET.get("v")
    if shown and shown == alerts.current_version(request.user):
        return HttpResponse(status=204)
    return render(request, "tasks_app/_alerts.html")


@login_required
@require_POST
def alerts_test(request: HttpRequest) -> HttpResponse:
    """Send a test alert through each configured channel; the outcome is shown on the alerts page."""
    if not alerts.may_test(request.user):
        raise access.refuse(request.user, Perm.MANAGE_AGENTS, what=access.describe(request))
    _, deliveries = alerts.send_test(request.user)
    if not deliveries:
        messages.error(
            request, "No channel is configured: set ALERT_EMAIL_TO and/or ALERT_WEBHOOK_URL."
        )
    for delivery in deliveries:
        if delivery.outcome == AlertDelivery.Outcome.SENT:
            messages.success(
                request,
                f"Test alert sent by {delivery.get_channel_display()} to {delivery.target}.",
            )
        else:
            messages.error(
                request,
                f"Test alert by {delivery.get_channel_display()} to {delivery.target} failed: {delivery.error}",
            )
    return redirect("alerts")
