"""Registering agents and keeping their cards fresh."""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from tasks_app import outbound
from tasks_app.a2a import (
    A2AError,
    CardProblem,
    IncompatibleAgentError,
    choose_interface,
    fetch_card,
    safejson,
    validate_card,
)
from tasks_app.a2a.card import registration_url
from tasks_app.a2a.client import api_key_placement
from tasks_app.a2a.origins import origin_of
from tasks_app.access import Perm, require
from tasks_app.crypto import encrypt_json
from tasks_app.models import Agent, ImportJob, OperatorAction, Project, RemoteTask
from tasks_app.runtime.net import redact_url


class AgentError(Exception):
    """The agent cannot be added or refreshed; the message says why, in one sentence."""


@dataclass
class CardPreview:
    """What a card fetch found: shown before saving, stored on save."""

    url: str
    card: dict[str, Any]
    etag: str = ""
    problems: list[str] = field(default_factory=list)
    interface: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.card.get("name") or "")


def _problem_text(problem: CardProblem | Any) -> str:
    path = getattr(problem, "path", "")
    message = getattr(problem, "message", str(problem))
    return f"{path}: {message}" if path else str(message)


def check_agent_url(url: str) -> None:
    """Refuse an agent URL that holds a user name or password (said without the URL).

    The URL is shown to everyone who reads the project and kept in the audit log, and
    httpx would send what it holds as Basic credentials, past the encrypted store and
    the approved origins.
    """
    longest = _longest("base_url")
    if len(url.strip()) > longest:
        raise AgentError(f"An agent URL is at most {longest} characters.")
    try:
        netloc = urlsplit(url.strip()).netloc
    except ValueError:
        return  # not a URL at all: the outbound guard says so
    if "@" in netloc:
        raise AgentError(
            "An agent URL must not hold a user name or password: the URL is shown to everyone "
            "who reads the project and kept in the audit log. Add the agent by its URL "
            "alone, then set the password under Credentials (stored encrypted)."
        )


def preview_card(url: str) -> CardPreview:
    """Fetch and check a card without saving anything.

    The outbound guard speaks first: a card URL it refuses is not fetched, and an
    interface at an address it refuses is not chosen (the problems say why), so
    nothing refused is ever saved.
    """
    check_agent_url(url)
    problem = outbound.url_problem(url)
    if problem:
        raise AgentError(f"Could not read an agent card at {redact_url(url)}: {problem}")
    try:
        result = outbound.run(
            lambda http: fetch_card(url, http=http, deadline=settings.A2A_CALL_DEADLINE_SECONDS)
        )
    except A2AError as exc:
        raise AgentError(f"Could not read an agent card at {redact_url(url)}: {exc}") from exc
    if len(result.url) > _longest("card_url"):
        raise AgentError(
            f"The agent card at {redact_url(url)} was found at a URL too long to keep."
        )
    # The card is the agent's text: stored (and shown) only in a form every database takes.
    card, _ = safejson.clean(result.card or {})
    # An ETag too long to keep is not kept: the next refresh fetches the whole card.
    etag = result.etag or ""
    preview = CardPreview(
        url=result.url, card=card, etag=etag if len(etag) <= _longest("card_etag") else ""
    )
    found = validate_card(card)
    # Kept with the agent and read with it on every watcher turn: a 1 MB card of bad skills
    # made 524,090 problems (21 MB). The first ones say what is wrong; the rest are counted.
    preview.problems = [safejson.clean_text(_problem_text(p)) for p in found[:PROBLEMS_KEPT]]
    if len(found) > PROBLEMS_KEPT:
        preview.problems.append(f"… and {len(found) - PROBLEMS_KEPT:,} more problems")
    refused: list[str] = []

    def check_url(interface_url: str) -> str | None:
        why = outbound.url_problem(interface_url)
        if not why and len(interface_url) > _longest("interface_url"):
            why = f"longer than {_longest('interface_url')} characters"
            interface_url = interface_url[:80] + "…"
        if why:
            refused.append(f"interface {interface_url}: {why}")
        return why

    try:
        iface = choose_interface(card, card_url=result.url, check_url=check_url)
    except IncompatibleAgentError as exc:
        preview.problems.append(str(exc))
    else:
        if len(iface.tenant) > _longest("tenant"):
            preview.problems.append(
                f"The interface's tenant is longer than {_longest('tenant')} characters."
            )
        else:
            preview.interface = {
                "url": iface.url,
                "binding": iface.binding,
                "protocol_version": iface.protocol_version,
                "tenant": iface.tenant,
            }
    preview.problems.extend(refused)  # in full (the sentence above may be cut short)
    return preview


PROBLEMS_KEPT = 100


def _longest(field: str) -> int:
    """The longest text an agent's ``field`` can keep: a card is the agent's text, of any length."""
    return Agent._meta.get_field(field).max_length or 0


def _apply_preview(agent: Agent, preview: CardPreview) -> None:
    capabilities = preview.card.get("capabilities") or {}
    agent.card = preview.card
    agent.card_url = preview.url
    agent.card_etag = preview.etag
    agent.card_fetched_at = timezone.now()
    agent.card_problems = preview.problems
    agent.interface_url = preview.interface.get("url", "")
    agent.binding = preview.interface.get("binding", "")
    agent.protocol_version = preview.interface.get("protocol_version", "")
    agent.tenant = preview.interface.get("tenant", "")
    # Credentials go only where they were approved: a card that moves the interface to
    # another origin waits for an agent admin (outbound.credentials_for refuses meanwhile).
    origin = origin_of(agent.interface_url)
    if agent.credentials_encrypted and origin not in agent.credential_origins:
        agent.pending_origin = origin
    else:
        agent.pending_origin = ""
    agent.streaming = capabilities.get("streaming") is True
    agent.push = capabilities.get("pushNotifications") is True
    agent.reachable = True
    agent.last_error = ""
    agent.last_contact_at = timezone.now()


# What a card refresh writes: the card and what follows from it, never the credentials.
CARD_FIELDS = ("card", "card_url", "card_etag", "card_fetched_at", "card_problems",
               "interface_url", "binding", "protocol_version", "tenant", "pending_origin",
               "streaming", "push", "reachable", "last_error", "last_contact_at")  # fmt: skip


def _store_preview(agent_pk: int, preview: CardPreview) -> None:
    """Write a fetched card onto the agent's row, by compare-and-set on its credentials.

    The row read before the fetches (seconds, on the network) is not saved whole: an
    admin's new or cleared credentials, an approved origin or a key rotation made
    meanwhile would be undone (cleared credentials, leaked ones, came back). The card's
    fields are written only while the credential columns are as read; else read again.
    """
    for _ in range(5):
        current = Agent.objects.get(pk=agent_pk)
        read = (current.credentials_encrypted, current.pending_origin)
        _apply_preview(current, preview)  # pending_origin follows the credentials as read
        if Agent.objects.filter(
            pk=agent_pk, credentials_encrypted=read[0], pending_origin=read[1]
        ).update(**{name: getattr(current, name) for name in CARD_FIELDS}):
            return
    raise AgentError("The agent's credentials kept changing during the refresh; try again.")


def add_agent(
    url: str,
    *,
    name: str = "",
    project: Project | None = None,
    credentials: dict[str, str] | None = None,
    actor_id: int | None = None,
) -> Agent:
    """Fetch the card at ``url``, check it, and store a new agent in ``project`` (default: default).

    A URL is registered once per project (``one_agent_per_url_per_project``): one already
    in ``project`` is refused with that agent's name (the person manages the project, so
    may read it), since re-adding must not silently rename or change an agent. Another
    project's agent at the same URL is neither looked at nor mentioned: each project
    registers a shared agent as its own row, and nothing here may tell whether another
    project holds it. The URL is stored in its registration form (``registration_url``),
    so ``http://a.example/`` finds the agent added as ``HTTP://A.example:80``.
    """
    typed, url = url.strip(), registration_url(url)  # messages name the URL as typed
    project = project or Project.objects.get_or_create(name="default")[0]
    require(actor_id, project.pk, Perm.MANAGE_AGENTS)
    chosen = typed_name(name) if name.strip() else ""  # said before any fetch
    check_not_registered(url, project)
    preview = preview_card(typed)
    if not preview.interface:
        raise AgentError(
            f"The agent at {redact_url(typed)} offers no interface this dashboard speaks: {'; '.join(preview.problems)}"
        )
    agent = Agent(base_url=url, project=project)
    _apply_preview(agent, preview)
    agent.name = (chosen or shown_name(preview.name) or url)[:200]
    if credentials:
        _put_credentials(agent, credentials)
    try:
        with transaction.atomic():
            # The unique (project, URL) decides between two adds at once (a look first
            # would let both by).
            agent.save()
            OperatorAction.objects.create(
                agent=agent,
                actor_id=actor_id,
                action="add-agent",
                payload={"url": url, "project": project.name},
            )
    except IntegrityError:
        # Added to this project meanwhile by someone else (the only unique columns an
        # agent has are its project and URL together).
        if Agent.objects.filter(project=project, base_url=url, retired_at__isnull=True).exists():
            raise AgentError(
                f"This URL was registered in project {project.name} a moment ago by someone else."
            ) from None
        raise
    return agent


def check_not_registered(url: str, project: Project | None) -> None:
    """Refuse a URL ``project`` (default: default) already holds, in the words of the add."""
    project = project or Project.objects.filter(name="default").first()
    if project is None:
        return
    existing = registered_at(project, registration_url(url))
    if existing is not None:
        raise AgentError(_already_registered(existing, project))


def registered_at(project: Project, url: str) -> Agent | None:
    """The agent of ``project`` registered at ``url`` (in its registration form), if any.

    Rows added before URLs were stored in that form are compared in it too: a project holds
    tens of agents, not millions, so its URLs are read rather than matched by the index.
    """
    in_service = Agent.objects.filter(project=project, retired_at__isnull=True)
    found = in_service.filter(base_url=url).first()
    if found is not None:
        return found
    for pk, base_url in in_service.values_list("pk", "base_url"):
        if registration_url(base_url) == url:
            return Agent.objects.get(pk=pk)
    return None


def _already_registered(existing: Agent, project: Project) -> str:
    """The refusal of a URL ``project`` already holds (said only to people who manage it)."""
    return (
        f"This URL is already registered in project {project.name}, as '{existing.name}': "
        "open that agent instead (a URL is added once per project)."
    )


def header_safe(secret: str) -> bool:
    """Printable ASCII (spaces allowed inside): what an HTTP header value can carry as is."""
    return secret.isascii() and secret.isprintable()


def _put_credentials(agent: Agent, credentials: dict[str, str]) -> None:
    """Encrypt ``credentials`` onto ``agent``, bound to its current interface's origin.

    An API key's placement (header, query or cookie, and its name) is pinned now, from
    the form or the current card, so that a later card cannot move it.
    """
    values = {k: v for k, v in credentials.items() if v}
    for key in ("token", "api_key"):
        if values.get(key) and not header_safe(values[key]):
            # Sent in a header: httpx refused it at every call, and its error (with the value)
            # went into the task's log. Said now, without the value.
            raise AgentError(
                f"The {key.replace('_', ' ')} holds characters an HTTP header cannot carry "
                "(control characters or non-ASCII); check that only the secret was copied."
            )
    if values.get("api_key"):
        location, name = api_key_placement(
            agent.card, values.get("api_key_name"), values.get("api_key_location")
        )
        values["api_key_location"], values["api_key_name"] = location, name
    agent.credentials_encrypted = encrypt_json(values) if values else ""
    origin = origin_of(agent.interface_url or agent.base_url)
    agent.credential_origins = [origin] if values and origin else []
    agent.pending_origin = ""


def refresh_card(agent: Agent, *, actor_id: int | None = None) -> Agent:
    """Fetch the card again (revalidating with the ETag) and store what changed."""
    require(actor_id, agent.project_id, Perm.MANAGE_AGENTS)
    refuse_if_retired(agent)
    try:
        result = outbound.run(
            lambda http: fetch_card(
                agent.card_url or agent.base_url,
                http=http,
                etag=agent.card_etag or None,
                deadline=settings.A2A_CALL_DEADLINE_SECONDS,
            )
        )
    except A2AError as exc:
        mark_unreachable(agent.pk, str(exc))
        raise AgentError(f"Could not refresh the card of {agent.name}: {exc}") from exc
    if result.not_modified:
        Agent.objects.filter(pk=agent.pk).update(
            card_fetched_at=timezone.now(),
            reachable=True,
            last_error="",
            last_contact_at=timezone.now(),
        )
    else:
        _store_preview(agent.pk, preview_card(agent.card_url or agent.base_url))
    OperatorAction.objects.create(agent=agent, actor_id=actor_id, action="refresh-card")
    agent.refresh_from_db()
    return agent


def set_credentials(
    agent: Agent, credentials: dict[str, str], *, actor_id: int | None = None
) -> None:
    """Store new credentials (encrypted), approved for the agent's current origin only.

    They are never shown back. Empty ``credentials`` clear them.
    """
    require(actor_id, agent.project_id, Perm.MANAGE_AGENTS)
    refuse_if_retired(agent)
    # Bound to the origin (and the API key placed by the card) of the row as read now, and
    # written only while its card is that one: a refresh that moved the interface to another
    # origin in between left the credentials bound to the old one with nothing pending,
    # withheld from the new origin and nothing on the page to approve.
    for _ in range(5):
        current = Agent.objects.get(pk=agent.pk)
        refuse_if_retired(current)
        _put_credentials(current, credentials)
        if Agent.objects.filter(
            pk=agent.pk,
            interface_url=current.interface_url,
            card_fetched_at=current.card_fetched_at,
            retired_at__isnull=True,  # a retire meanwhile wiped them: not put back
        ).update(
            credentials_encrypted=current.credentials_encrypted,
            credential_origins=current.credential_origins,
            pending_origin="",
        ):
            break
    else:
        raise AgentError(
            "The agent's card kept changing while the credentials were saved; try again."
        )
    for name in ("credentials_encrypted", "credential_origins", "pending_origin"):
        setattr(agent, name, getattr(current, name))
    OperatorAction.objects.create(
        agent=agent,
        actor_id=actor_id,
        action="set-credentials" if agent.credentials_encrypted else "clear-credentials",
        payload={"fields": sorted(credentials), "origins": agent.credential_origins},
    )


def approve_origin(agent: Agent, origin: str, *, actor_id: int | None = None) -> bool:
    """Let the credentials go to ``origin``, the one the card moved to; False if that is stale.

    Compare-and-set on ``pending_origin``: two admins approving at once, or an approval
    for an origin the card has since moved away from, change nothing. Tasks parked while
    waiting are watched again.
    """
    require(actor_id, agent.project_id, Perm.MANAGE_AGENTS)
    if not origin:
        return False
    approved = Agent.objects.filter(
        pk=agent.pk, pending_origin=origin, retired_at__isnull=True
    ).update(credential_origins=[origin], pending_origin="")
    if not approved:
        return False
    OperatorAction.objects.create(
        agent=agent, actor_id=actor_id, action="approve-origin",
        payload={"origin": origin, "before": agent.credential_origins},
    )  # fmt: skip
    from tasks_app.services import tasks as task_services

    parked = RemoteTask.objects.filter(
        agent=agent,
        watcher_status=RemoteTask.WatcherStatus.PARKED,
        watcher_note__contains=outbound.APPROVAL_NOTE,
    )
    for task in parked:
        task_services.watch_again(task, actor_id=actor_id)
    return True


def mark_unreachable(agent_pk: int, error: str) -> None:
    Agent.objects.filter(pk=agent_pk).update(reachable=False, last_error=error[:2000])


# How stale "last contact" may be on the agent's page: at most one write a minute per agent,
# however many streams and polls answer.
CONTACT_EVERY_SECONDS = 60


def mark_reachable(agent_pk: int) -> None:
    """The agent answered. Cheap when nothing changes: one UPDATE that writes only if the agent
    was not reachable, or its last contact is older than ``CONTACT_EVERY_SECONDS`` (the card
    fetch alone set it, so the page said "last contact 16 minutes ago" of an agent
    streaming that moment)."""
    now = timezone.now()
    stale = Q(last_contact_at__isnull=True) | Q(
        last_contact_at__lt=now - timedelta(seconds=CONTACT_EVERY_SECONDS)
    )
    Agent.objects.filter(~Q(reachable=True) | stale, pk=agent_pk).update(
        reachable=True, last_error="", last_contact_at=now
    )


# Renaming, retiring and restoring -----------------------------------------------------------


def rename_agent(agent: Agent, name: str, *, was: str = "", actor_id: int | None = None) -> Agent:
    """Give the agent another name, by compare-and-set on the name the person saw (``was``,
    the form's; else the name as read): of two renames at once, or one from a page loaded
    before another, the second is told what the first chose instead of silently undoing it."""
    require(actor_id, agent.project_id, Perm.MANAGE_AGENTS)
    seen = was or agent.name
    new = typed_name(name)
    if new == seen == agent.name:
        return agent
    with transaction.atomic():
        if not Agent.objects.filter(pk=agent.pk, name=seen).update(name=new):
            now = Agent.objects.filter(pk=agent.pk).values_list("name", flat=True).first()
            if now == new:  # the same rename sent twice, or two pages that chose alike
                agent.name = new
                return agent
            raise AgentError(
                f"The agent was renamed to '{now}' meanwhile; nothing changed. Rename it again "
                "if that is not the name it should have."
            )
        OperatorAction.objects.create(
            agent=agent,
            actor_id=actor_id,
            action="rename-agent",
            payload={"from": seen, "to": new},
        )
    agent.name = new
    return agent


# Characters that make a name look like another on a page, in the audit log and in a
# terminal: controls (ESC starts a terminal sequence), bidi overrides and isolates (they
# reversed the rest of an audit line), zero-width and other format characters (a name of a
# zero-width space alone was an unclickable link), and lone surrogates.
_HIDDEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs"})
# Letters that draw as nothing (Hangul fillers, the blank Braille pattern): a name of one
# was a blank, unclickable link.
_BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")


def _hidden(char: str) -> bool:
    return char in _BLANK_LETTERS or unicodedata.category(char) in _HIDDEN_CATEGORIES


def shown_name(text: str) -> str:
    """A name from elsewhere (an agent's card) as it may be shown: whitespace runs (tabs and
    line ends too) made one space, and the characters above dropped."""
    spaced = " ".join(text.split())
    return " ".join("".join(c for c in spaced if not _hidden(c)).split())


def typed_name(text: str) -> str:
    """A name a person typed: spaces tidied as in :func:`shown_name`; one holding a control or
    invisible formatting character, blank, or too long, is refused with a sentence."""
    spaced = " ".join(text.split())  # tabs and line ends are spaces here, not refused
    name = shown_name(spaced)
    if name != spaced:
        raise AgentError(
            "A name cannot hold control characters or invisible formatting characters "
            "(such as text-direction overrides or zero-width spaces): they make it show as "
            "another name."
        )
    if not name:
        raise AgentError("A name needs at least one character other than a space.")
    if len(name) > _longest("name"):
        raise AgentError(f"A name is at most {_longest('name')} characters.")
    return name


def refuse_if_retired(agent: Agent) -> None:
    if agent.retired_at is not None:
        raise AgentError(outbound.retired_note(agent))


def hold_in_service(agent_pk: int) -> bool:
    """Inside the caller's transaction: False if the agent is retired, else hold its row.

    Starting a task or an import, and retiring the agent, are put in one order by the
    agent's row: this no-op update holds the row until the caller commits, so a retire at
    the same moment either waits and then finds the new task or import, or has committed
    first and this finds the agent retired (``retire_agent`` writes before it looks).
    """
    return bool(Agent.objects.filter(pk=agent_pk, retired_at__isnull=True).update(retired_at=None))


def open_tasks(agent_pk: int) -> QuerySet[RemoteTask]:
    """The agent's tasks someone may still act on or a watcher still follows: unfinished and
    neither abandoned nor gone (what the task page offers to abandon), or watchable (one
    ended a moment ago still gets its settling turn)."""
    from tasks_app.services.tasks import still_open, watchable

    return RemoteTask.objects.filter(still_open() | watchable(), agent_id=agent_pk)


def abandoned_but_running(agent_pk: int) -> int:
    """The agent's abandoned tasks it named and did not end: they may go on at the agent,
    and once the agent is retired nothing can cancel them from here (the page says so)."""
    from tasks_app.services.tasks import unfinished

    return (
        RemoteTask.objects.filter(unfinished(), agent_id=agent_pk, abandoned_at__isnull=False)
        .exclude(remote_id="")
        .count()
    )


def retire_agent(agent: Agent, *, actor_id: int | None = None) -> Agent:
    """Take the agent out of service, keeping everything it left behind.

    Deleting an agent would delete its tasks, their event logs and the audit trail of what
    people did with it; retiring keeps them all readable and makes the agent inert:

    1. Mark the row retired by compare-and-set, wiping its credentials (nothing is sent to
       it again, so they are only a liability) and any origin waiting for approval.
    2. Look for tasks still open and an import queued or running: any found undo the
       whole change (the transaction), with a sentence saying what to end first. Step 1
       came first so that a start at the same moment is ordered by the row
       (``hold_in_service``).
    3. Write the action log's ``retire-agent`` entry, in the same transaction.

    Its URL is free after this: the project may register the agent again, as a new one.
    """
    require(actor_id, agent.project_id, Perm.MANAGE_AGENTS)
    with transaction.atomic():
        retired = Agent.objects.filter(pk=agent.pk, retired_at__isnull=True).update(
            retired_at=timezone.now(),
            retired_by_id=actor_id,
            credentials_encrypted="",
            credential_origins=[],
            pending_origin="",
        )
        if not retired:
            raise AgentError(f"{agent.name} was retired already.")
        still_open = open_tasks(agent.pk).count()
        if still_open:
            raise AgentError(
                f"{agent.name} has {still_open} open task{'s' if still_open != 1 else ''} "
                "(running, waiting for an answer, or a send not settled): end "
                f"{'them' if still_open != 1 else 'it'} first. "
                "Cancel asks the agent to stop one; abandon only stops following it here, and "
                "once the agent is retired it can no longer be canceled from here."
            )
        if ImportJob.objects.filter(
            agent_id=agent.pk, status__in=[ImportJob.Status.QUEUED, ImportJob.Status.RUNNING]
        ).exists():
            raise AgentError(
                f"An import of {agent.name}'s tasks is under way: stop it or let it finish first."
            )
        OperatorAction.objects.create(
            agent=agent,
            actor_id=actor_id,
            action="retire-agent",
            payload={"name": agent.name, "url": agent.base_url, "project": agent.project.name},
        )
    agent.refresh_from_db()
    return agent


def restore_agent(agent: Agent, *, actor_id: int | None = None) -> Agent:
    """Put a retired agent back in service (without credentials: retiring wiped them).

    Refused when the project registered its URL again meanwhile: two agents of one project
    at one URL would mirror its tasks twice (``one_agent_per_url_per_project`` says so).
    """
    require(actor_id, agent.project_id, Perm.MANAGE_AGENTS)
    try:
        with transaction.atomic():
            restored = Agent.objects.filter(pk=agent.pk, retired_at__isnull=False).update(
                retired_at=None, retired_by=None
            )
            if not restored:
                raise AgentError(f"{agent.name} is not retired.")
            OperatorAction.objects.create(
                agent=agent,
                actor_id=actor_id,
                action="restore-agent",
                payload={"name": agent.name, "url": agent.base_url},
            )
    except IntegrityError:
        again = registered_at(agent.project, registration_url(agent.base_url))
        raise AgentError(
            f"Its URL was registered again in project {agent.project.name}"
            + (f", as '{again.name}'" if again is not None else "")
            + ": use that agent, or retire it first."
        ) from None
    agent.refresh_from_db()
    return agent
