"""Who may see and do what: projects, roles, and the one per-user lookup.

Every agent belongs to a project, and so does every task (through its agent). A person
is a member of projects with one role each; superusers see and do everything. What each
role allows is one table, ``ROLE_PERMISSIONS``:

===========  ====  =======  =============  =====
role         read  operate  manage agents  audit
===========  ====  =======  =============  =====
viewer       yes
operator     yes   yes
agent admin  yes   yes      yes
auditor      yes                           yes
===========  ====  =======  =============  =====

*operate* is starting, answering, canceling, retrying, refreshing, abandoning, watching
again, importing and managing push configs; *manage agents* is adding, changing and
removing agents and their credentials; *audit* is the operator-action log and exports.

Views fetch every object through ``get_agent_for_user`` / ``get_task_for_user`` (in the
manner of healthchecks' ``_get_check_for_user``): an object outside the person's projects
is a 404 (its existence is not revealed), one they may read but not change is a 403 with
an operator-action row saying what was refused. Services check again with ``require``,
so a path that forgets the lookup still cannot act. Lists, counts and live updates go
through ``readable_agents`` / ``readable_tasks``.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import Http404, HttpRequest

from tasks_app.models import Agent, Membership, OperatorAction, Project, RemoteTask

log = logging.getLogger("tasks_app.security")


class Perm(StrEnum):
    READ = "read"
    OPERATE = "operate"
    MANAGE_AGENTS = "manage agents"
    AUDIT = "audit"


Role = Membership.Role

ROLE_PERMISSIONS: dict[str, frozenset[Perm]] = {
    Role.VIEWER: frozenset({Perm.READ}),
    Role.OPERATOR: frozenset({Perm.READ, Perm.OPERATE}),
    Role.AGENT_ADMIN: frozenset({Perm.READ, Perm.OPERATE, Perm.MANAGE_AGENTS}),
    Role.AUDITOR: frozenset({Perm.READ, Perm.AUDIT}),
}
ALL_PERMISSIONS = frozenset(Perm)


class Forbidden(PermissionDenied):
    """The person's role in the object's project does not allow the action (answered 403)."""


def _roles(user: Any) -> dict[int, str]:
    """project id -> role, read once per request (cached on the user object)."""
    cached = getattr(user, "_dashboard_roles", None)
    if cached is None:
        cached = dict(Membership.objects.filter(user_id=user.pk).values_list("project_id", "role"))
        user._dashboard_roles = cached
    return cached


def permissions(user: Any, project_id: int) -> frozenset[Perm]:
    if user is None or not user.is_authenticated or not user.is_active:
        return frozenset()
    if user.is_superuser:
        return ALL_PERMISSIONS
    role = _roles(user).get(project_id)
    return ROLE_PERMISSIONS.get(role, frozenset()) if role else frozenset()


def has_perm(user: Any, project_id: int, perm: Perm) -> bool:
    return perm in permissions(user, project_id)


def projects_with(user: Any, perm: Perm) -> list[int] | None:
    """Ids of the projects where ``user`` has ``perm``; None means every project (superuser)."""
    if user is None or not user.is_authenticated or not user.is_active:
        return []
    if user.is_superuser:
        return None
    return sorted(
        pid for pid, role in _roles(user).items() if perm in ROLE_PERMISSIONS.get(role, ())
    )


def projects_for(user: Any, perm: Perm) -> QuerySet[Project]:
    ids = projects_with(user, perm)
    qs = Project.objects.all()
    return qs if ids is None else qs.filter(pk__in=ids)


def readable_agents(user: Any, perm: Perm = Perm.READ) -> QuerySet[Agent]:
    ids = projects_with(user, perm)
    qs = Agent.objects.all()
    return qs if ids is None else qs.filter(project_id__in=ids)


def readable_tasks(user: Any, perm: Perm = Perm.READ) -> QuerySet[RemoteTask]:
    """Tasks on the agents of the person's projects (filtered by agent id: agents are few)."""
    ids = projects_with(user, perm)
    qs = RemoteTask.objects.all()
    if ids is None:
        return qs
    return qs.filter(
        agent_id__in=list(Agent.objects.filter(project_id__in=ids).values_list("pk", flat=True))
    )


def refuse(
    user: Any,
    perm: Perm,
    *,
    agent: Agent | None = None,
    task: RemoteTask | None = None,
    what: str = "",
) -> Forbidden:
    """Record a refused action (an operator-action row and a security log line); the error to raise."""
    project_id = (
        agent.project_id
        if agent is not None
        else task.agent.project_id
        if task is not None
        else None
    )
    if user is None or not user.is_authenticated:
        outcome = f"refused: anonymous may not {perm.value}"
    elif project_id is None:  # a page of no one project (adding an agent, starting a task)
        outcome = f"refused: no project of theirs lets them {perm.value}"
    elif project_id in _roles(user):
        outcome = f"refused: role {_roles(user)[project_id]} may not {perm.value}"
    else:
        outcome = f"refused: not a member of the project, may not {perm.value}"
    OperatorAction.objects.create(
        task=task,
        agent=agent if agent is not None else task.agent if task is not None else None,
        actor_id=user.pk if user is not None and user.is_authenticated else None,
        action="forbidden",
        payload={"wanted": what or perm.value},
        outcome=outcome,
    )
    log.warning(
        "forbidden: user=%s project=%s wanted=%s (%s)",
        getattr(user, "pk", None),
        project_id,
        what or perm.value,
        outcome,
    )
    if project_id is None:  # a page of no one project: none of theirs allows it
        return Forbidden(f"None of your projects allows this ({perm.value}).")
    return Forbidden(f"Your role in this project does not allow this ({perm.value}).")


def describe(request: HttpRequest) -> str:
    """What was asked for, for the refusal row: the method and the route's name."""
    match = getattr(request, "resolver_match", None)
    return f"{request.method} {match.url_name}" if match else request.method or ""


def get_agent_for_user(request: HttpRequest, pk: int, perm: Perm = Perm.READ) -> Agent:
    """The agent, if the person may read it (else 404) and has ``perm`` on it (else 403)."""
    agent = readable_agents(request.user).filter(pk=pk).select_related("project").first()
    if agent is None:
        raise Http404("No such agent.")
    if not has_perm(request.user, agent.project_id, perm):
        raise refuse(request.user, perm, agent=agent, what=describe(request))
    return agent


def get_task_for_user(
    request: HttpRequest,
    pk: int,
    perm: Perm = Perm.READ,
    *,
    related: tuple[str, ...] = ("agent",),
    unread: tuple[str, ...] = (),
) -> RemoteTask:
    """The task, if the person may read it (else 404) and has ``perm`` on it (else 403).

    ``unread``: more columns the route reads its own way (a column an agent sizes)."""
    # A task's merged metadata, which no page shows, grows with its agent to the byte budget,
    # and each poll of the page's live view read it: left unread (read on use).
    task = (
        RemoteTask.objects.select_related(*{"agent", *related})
        .defer("metadata", *unread)
        .filter(pk=pk)
        .first()
    )
    if task is None or not has_perm(request.user, task.agent.project_id, Perm.READ):
        raise Http404("No such task.")
    if not has_perm(request.user, task.agent.project_id, perm):
        raise refuse(request.user, perm, task=task, what=describe(request))
    return task


def require(actor_id: int | None, project_id: int, perm: Perm) -> None:
    """The services' second check: ``actor_id`` None is the system or a command-line admin."""
    if actor_id is None:
        return
    user = get_user_model().objects.filter(pk=actor_id).first()
    if user is None or not has_perm(user, project_id, perm):
        raise Forbidden(f"This person may not {perm.value} in this project.")


def can(user: Any, project_id: int) -> dict[str, bool]:
    """What the templates ask: which buttons to show (the server refuses the others anyway)."""
    perms = permissions(user, project_id)
    return {
        "operate": Perm.OPERATE in perms,
        "manage_agents": Perm.MANAGE_AGENTS in perms,
        "audit": Perm.AUDIT in perms,
    }


def navigation(request: HttpRequest) -> dict[str, Any]:
    """Template context processor: which navigation buttons the person may use anywhere."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    return {
        "nav_can": {
            "start": projects_with(user, Perm.OPERATE) != [],
            "add_agent": projects_with(user, Perm.MANAGE_AGENTS) != [],
            "audit": projects_with(user, Perm.AUDIT) != [],
        }
    }
