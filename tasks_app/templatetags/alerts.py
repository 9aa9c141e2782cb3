"""``{% open_alerts as alerts %}``: the person's open alerts, for ``tasks_app/_alerts.html``.

A tag rather than view context, so that any page (the overview, the inbox, the fragments
they redraw from) shows the alerts by including the template, with no change to its view.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django import template
from django.conf import settings
from django.utils import timezone

from tasks_app import alerts
from tasks_app.models import for_list

register = template.Library()


@register.simple_tag(takes_context=True)
def open_alerts(context: template.Context) -> dict[str, Any]:
    request = context.get("request")
    user = getattr(request, "user", None) or context.get("user")
    qs = alerts.open_alerts(user)
    pks = list(qs.values_list("pk", flat=True)[: alerts.COUNTED])
    items = (
        list(for_list(qs.select_related("task", "agent"), task="task__")[: alerts.SHOWN])
        if pks
        else []
    )
    return {
        "items": items,
        "count": len(pks),
        "capped": len(pks) >= alerts.COUNTED,
        "more": max(0, len(pks) - len(items)),
        "version": alerts.version(pks),
        "refresh_ms": int(settings.ALERT_REFRESH_SECONDS * 1000),
        "now": timezone.now(),
    }


@register.filter
def alert_age(since: datetime | None, now: datetime | None = None) -> str:
    """``{{ alert.since|alert_age:now }}``: "12 seconds", "3 minutes", "2 hours, 5 minutes"."""
    return alerts.age(since, now)
