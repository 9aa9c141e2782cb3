"""The operator-action log as an auditor reads it: who may see which rows, filters, paging.

Shared by the audit page, its CSV export and ``manage.py audit actions``, so the three
always agree on what a filter means. Rows are never shown as stored: payloads go
through :func:`sanitize` (no secret-looking key, ever), and what a person may see is
decided once, in :func:`visible_actions`:

* people with *audit* in a project see the actions on that project's agents and tasks;
* actions on no agent and no task (member changes, prune runs) only superusers see.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from django import forms
from django.contrib.auth import get_user_model
from django.db.models import Q, QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from tasks_app import access, cursors
from tasks_app.a2a import safejson
from tasks_app.access import Perm
from tasks_app.models import Agent, OperatorAction, Project

PAGE_SIZE = 50

# Every action the code writes today (the filter's choices); an action found in the log
# is accepted too, so a new kind of row is filterable before it is listed here.
KNOWN_ACTIONS: dict[str, str] = {
    "start": "started a task",
    "answer": "answered",
    "a2ui-action": "submitted an agent's form",
    "cancel": "canceled",
    "retry": "retried",
    "refresh": "refreshed",
    "abandon": "abandoned",
    "watch": "watched again",
    "switch-watch": "switched watch mode",
    "add-agent": "added an agent",
    "rename-agent": "renamed an agent",
    "retire-agent": "retired an agent",
    "restore-agent": "restored an agent",
    "refresh-card": "refreshed a card",
    "set-credentials": "replaced credentials",
    "clear-credentials": "cleared credentials",
    "approve-origin": "approved an origin",
    "import": "imported tasks",
    "import-cancel": "canceled an import",
    "create-push-config": "created a push config",
    "delete-push-config": "deleted a push config",
    "rotate-key": "rotated the encryption key",
    "member-add": "added a member",
    "member-remove": "removed a member",
    "superuser-add": "made a superuser",
    "superuser-remove": "took superuser status away",
    "forbidden": "was refused",
    "prune": "pruned old tasks",
}

# A payload key whose name contains one of these is never shown or exported.
SECRET_WORDS = (
    "token", "secret", "password", "passwd", "passphrase", "api_key", "apikey", "api-key",
    "authorization", "auth_header", "credential", "cookie", "private", "jwt", "bearer",
    "signature", "session", "key",
)  # fmt: skip
# Values that look like a secret whatever their key is called.
SECRET_VALUE = re.compile(r"^\s*(bearer|basic|token)\s+\S", re.IGNORECASE)
MAX_TEXT = 300
MAX_ITEMS = 20
MAX_DEPTH = 3


def log_member_change(
    action: str, user: Any, project: Project, role: str = "", actor_id: int | None = None
) -> OperatorAction:
    """A role given or changed (``member-add``, with ``role``) or taken away
    (``member-remove``), as every way of changing members writes it (the command line, the
    admin): the audit page's filters read these payloads."""
    payload = {"user": user.get_username(), "project": project.name}
    if role:
        payload["role"] = role
    return OperatorAction.objects.create(actor_id=actor_id, action=action, payload=payload)


def log_superuser_change(
    user: Any, *, granted: bool, actor_id: int | None = None
) -> OperatorAction:
    """Superuser status given or taken away (in the admin): it opens every project, and no
    membership row says so. Only superusers audit these rows (they name no agent)."""
    action = "superuser-add" if granted else "superuser-remove"
    return OperatorAction.objects.create(
        actor_id=actor_id, action=action, payload={"user": user.get_username()}
    )


def sanitize(value: Any, depth: int = 0) -> Any:
    """What of a payload may be shown: secret-named keys dropped, the rest cut short.

    Why a filter on names and not only a list of known keys: payloads are written by
    many services, and a new one must not leak a secret because nobody updated a list.
    """
    if isinstance(value, dict):
        if depth >= MAX_DEPTH:
            return "{...}"
        shown: dict[str, Any] = {}
        withheld = 0
        for key, item in list(value.items())[:MAX_ITEMS]:
            name = str(key)
            if any(word in name.lower() for word in SECRET_WORDS):
                withheld += 1
                continue
            shown[name[:80]] = sanitize(item, depth + 1)
        if withheld:
            shown["withheld"] = f"{withheld} field(s) not shown"
        return shown
    if isinstance(value, list | tuple):
        items = [sanitize(item, depth + 1) for item in value[:MAX_ITEMS]]
        if len(value) > MAX_ITEMS:
            items.append(f"... {len(value) - MAX_ITEMS} more")
        return items
    if isinstance(value, str):
        if SECRET_VALUE.match(value):
            return "(withheld)"
        value = safejson.clean_text(value)  # rows stored before payloads were cleaned
        return value if len(value) <= MAX_TEXT else value[:MAX_TEXT] + "..."
    if value is None or isinstance(value, bool | int | float):
        return value
    return str(value)[:MAX_TEXT]


def describe_payload(payload: Any) -> str:
    """One line for the page: ``key: value`` pairs of the sanitized payload."""
    clean = sanitize(payload if isinstance(payload, dict) else {"value": payload})
    parts = []
    for key, value in clean.items():
        if isinstance(value, list):
            value = ", ".join(str(v) for v in value)
        parts.append(f"{key}: {value}")
    return "; ".join(parts)


# Who may see what ------------------------------------------------------------------------------


def visible_actions(user: Any) -> QuerySet[OperatorAction] | None:
    """The rows ``user`` may audit, or None when they audit nowhere (answered 403)."""
    projects = access.projects_with(user, Perm.AUDIT)
    if projects is None:
        return OperatorAction.objects.all()
    if not projects:
        return None
    agents = list(access.readable_agents(user, Perm.AUDIT).values_list("pk", flat=True))
    # Rows name their agent; a row naming only its task is found through the task.
    return OperatorAction.objects.filter(
        Q(agent_id__in=agents) | Q(agent_id__isnull=True, task__agent_id__in=agents)
    )


# Filters ---------------------------------------------------------------------------------------

DATE_HELP = "a date (YYYY-MM-DD) or a date and time (YYYY-MM-DDTHH:MM)"


def _parse_moment(text: str, *, end: bool) -> datetime:
    """A date or a date-time from the URL; a bare date ``until`` means to the end of that day."""
    text = text.strip()
    try:
        # A bare date first: parse_datetime would read it as that day's midnight.
        day = parse_date(text) if len(text) <= 10 else None
        if day is not None and end and day == date.max:
            # Its whole day: the next midnight does not exist, the day's last moment does.
            moment = datetime.max
        elif day is not None:
            moment = datetime.combine(day + timedelta(days=1) if end else day, time.min)
        else:
            moment = parse_datetime(text)
            if moment is None:
                raise ValueError
        if timezone.is_naive(moment):
            moment = timezone.make_aware(moment, timezone.get_current_timezone())
        # Compared in UTC by the database: a moment with none (year 1 at +05:00) is no date.
        moment.astimezone(UTC)
    except (ValueError, OverflowError):
        raise forms.ValidationError(f"“{text[:40]}” is not {DATE_HELP}.") from None
    return moment


class ActionFilterForm(forms.Form):
    """The filters of the audit page (GET). Bad values become messages next to the field."""

    person = forms.CharField(required=False, max_length=150, label="Person", help_text="username")
    action = forms.ChoiceField(required=False, label="Action")
    project = forms.ChoiceField(required=False, label="Project")
    agent = forms.ChoiceField(required=False, label="Agent")
    since = forms.CharField(required=False, max_length=40, label="From",
                            widget=forms.TextInput(attrs={"placeholder": "YYYY-MM-DD"}))  # fmt: skip
    until = forms.CharField(required=False, max_length=40, label="To (inclusive)",
                            widget=forms.TextInput(attrs={"placeholder": "YYYY-MM-DD"}))  # fmt: skip

    def __init__(self, *args: Any, user: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.user = user
        # The projects whose log this person audits (None: all, for a superuser or a command).
        self.audited = access.projects_with(user, Perm.AUDIT) if user is not None else None
        projects = (
            access.projects_for(user, Perm.AUDIT) if user is not None else Project.objects.all()
        )
        agents = (
            access.readable_agents(user, Perm.AUDIT) if user is not None else Agent.objects.all()
        )
        self.fields["project"].choices = [("", "any")] + [(str(p.pk), p.name) for p in projects]
        self.fields["agent"].choices = [("", "any")] + [
            (str(a.pk), f"{a.name} (retired)" if a.retired_at is not None else a.name)
            for a in agents.only("pk", "name", "retired_at").order_by("name")
        ]
        self.fields["action"].choices = [("", "any")] + [
            (k, f"{k} ({v})") for k, v in KNOWN_ACTIONS.items()
        ]
        self.fields["project"].error_messages["invalid_choice"] = (
            "No such project (or you do not audit it)."
        )
        self.fields["agent"].error_messages["invalid_choice"] = (
            "No such agent (or you do not audit it)."
        )

    def full_clean(self) -> None:
        # An action not in KNOWN_ACTIONS but present in the log is a valid choice.
        if self.is_bound:
            wanted = (self.data.get("action") or "").strip()
            known = wanted in KNOWN_ACTIONS or len(wanted) > 40
            if wanted and not known and self._audited_actions().filter(action=wanted).exists():
                self.fields["action"].choices = [*self.fields["action"].choices, (wanted, wanted)]
            # A template Django fills with the value (a "%" typed in the filter stays text).
            self.fields["action"].error_messages["invalid_choice"] = (
                "Unknown action “%(value).40s”: choose one from the list."
            )
        super().full_clean()

    def _audited_actions(self) -> QuerySet[OperatorAction]:
        if self.audited is None:
            return OperatorAction.objects.all()
        return OperatorAction.objects.filter(
            Q(agent__project_id__in=self.audited)
            | Q(agent__isnull=True, task__agent__project_id__in=self.audited)
        )

    def clean_person(self) -> Any:
        """The person named, among those this auditor can meet in the log.

        Members of the audited projects, and whoever acted in them (a superuser, a former
        member). Anyone else is "no person" too, in the same words: whether a name exists
        elsewhere is not this auditor's to learn.
        """
        name = (self.cleaned_data.get("person") or "").strip()
        if not name:
            return None
        person = get_user_model().objects.filter(username=name).first()
        if person is not None and self.audited is not None:
            # Asked of this one person, each through its own index: "is anyone among all
            # the log's actors" read the whole audited log (125 ms for 100,000 actions).
            member = person.memberships.filter(project_id__in=self.audited).exists()
            if not member and not self._audited_actions().filter(actor=person).exists():
                person = None
        if person is None:
            where = "" if self.audited is None else " in the projects you audit"
            raise forms.ValidationError(f"No person named “{name[:40]}”{where}.")
        return person

    def clean_since(self) -> datetime | None:
        text = self.cleaned_data.get("since") or ""
        return _parse_moment(text, end=False) if text.strip() else None

    def clean_until(self) -> datetime | None:
        text = self.cleaned_data.get("until") or ""
        return _parse_moment(text, end=True) if text.strip() else None

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        since, until = data.get("since"), data.get("until")
        if since and until and since >= until:
            self.add_error("until", "“To” must be after “From”.")
        return data


def apply_filters(qs: QuerySet[OperatorAction], data: dict[str, Any]) -> QuerySet[OperatorAction]:
    """The rows matching cleaned filter data (only the filters that were valid)."""
    if data.get("person") is not None:
        qs = qs.filter(actor=data["person"])
    if data.get("action"):
        qs = qs.filter(action=data["action"])
    if data.get("agent"):
        qs = qs.filter(
            Q(agent_id=int(data["agent"]))
            | Q(agent_id__isnull=True, task__agent_id=int(data["agent"]))
        )
    if data.get("project"):
        agents = Agent.objects.filter(project_id=int(data["project"])).values_list("pk", flat=True)
        qs = qs.filter(
            Q(agent_id__in=list(agents)) | Q(agent_id__isnull=True, task__agent_id__in=list(agents))
        )
    if data.get("since"):
        qs = qs.filter(created_at__gte=data["since"])
    if data.get("until"):
        qs = qs.filter(created_at__lt=data["until"])
    return qs


# Keyset paging, newest first: the cursor is the last row's (created_at, id) -----------------


def after_cursor(
    qs: QuerySet[OperatorAction], cursor: tuple[datetime, int] | None
) -> QuerySet[OperatorAction]:
    """Rows strictly after the cursor in the order (-created_at, -id): no skip, no repeat on ties."""
    ordered = qs.order_by("-created_at", "-id")
    if cursor is None:
        return ordered
    moment, pk = cursor
    return ordered.filter(cursors.after("created_at", moment, pk, descending=True))


@dataclass
class Page:
    rows: list[OperatorAction]
    next_cursor: str


def page(
    qs: QuerySet[OperatorAction], cursor: tuple[datetime, int] | None, size: int = PAGE_SIZE
) -> Page:
    rows = list(
        after_cursor(qs, cursor).select_related("actor", "agent__project", "task").only(
            "id", "created_at", "action", "payload", "outcome", "task_id", "agent_id", "actor_id",
            "actor__username", "agent__name", "agent__project__name", "task__title", "task__remote_id",
        )[: size + 1]
    )  # fmt: skip
    has_next = len(rows) > size
    rows = rows[:size]
    return Page(rows, cursors.encode(rows[-1].created_at, rows[-1].pk) if has_next and rows else "")
