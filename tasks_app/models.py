"""The mirror: remote A2A tasks as an append-only event log plus a folded snapshot.

Only ``tasks_app.services`` writes these models (see docs/architecture.md); views,
watchers, webhooks and commands go through services.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from tasks_app.a2a import safejson, states

# The protocol's sets, as tuples for queries (``state__in``).
TERMINAL_STATES = tuple(sorted(states.TERMINAL_STATES))
INTERRUPTED_STATES = tuple(sorted(states.INTERRUPTED_STATES))

STATE_CHOICES = [
    ("", "unknown"),
    ("TASK_STATE_SUBMITTED", "submitted"),
    ("TASK_STATE_WORKING", "working"),
    ("TASK_STATE_INPUT_REQUIRED", "input required"),
    ("TASK_STATE_AUTH_REQUIRED", "auth required"),
    ("TASK_STATE_COMPLETED", "completed"),
    ("TASK_STATE_FAILED", "failed"),
    ("TASK_STATE_CANCELED", "canceled"),
    ("TASK_STATE_REJECTED", "rejected"),
]


class BulkJSONField(models.JSONField):
    """A JSONField for rows inserted in bulk (log entries, artifact parts, messages).

    Having ``get_placeholder`` keeps Django's PostgreSQL bulk insert on plain
    ``VALUES``: its ``UNNEST`` path sends each JSON value inside a text array,
    which psycopg escapes value by value with a regex, and which profiled at
    several times the cost of the insert itself.
    """

    def get_placeholder(self, value: object, compiler: object, connection: object) -> str:
        return "%s"

    def get_db_prep_save(self, value: object, connection: Any) -> object:
        if type(value) is JSONText:  # written already (see record.insert_rows)
            return value.text
        return super().get_db_prep_save(value, connection)


class JSONText:
    """A JSON value's text, written already: a :class:`BulkJSONField` stores it as it is on
    SQLite (which keeps JSON as text), and PostgreSQL parses it. Only ``record.insert_rows``
    makes these."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


class Project(models.Model):
    """A team's agents, and so their tasks: people see and act only within their projects."""

    name = models.CharField(max_length=100, unique=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


DEFAULT_PROJECT = "default"


def default_project() -> int:
    """The project agents go to when none is named (the run command's bootstrap makes it)."""
    return Project.objects.get_or_create(name=DEFAULT_PROJECT)[0].pk


class Membership(models.Model):
    """One person in one project, with one role (what each role may do: ``access.py``)."""

    class Role(models.TextChoices):
        VIEWER = "viewer"
        OPERATOR = "operator"
        AGENT_ADMIN = "agent-admin", "agent admin"
        AUDITOR = "auditor"

    project = models.ForeignKey(Project, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    role = models.CharField(max_length=20, choices=Role.choices)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["project__name", "user__username"]
        constraints = [
            models.UniqueConstraint(fields=["project", "user"], name="one_role_per_project")
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.project}: {self.role}"


# Columns a row of a list never shows, each as big as an agent makes it: a task's metadata,
# status message, request and outbox (up to the task's byte budget), an agent's card and its
# problems (up to 1 MB). Decoded for every row, they made the task list (60 tasks) peak at
# 200 MB and the alerts page (500 alerts) at 676 MB.
TASK_LIST_DEFERRED = ("metadata", "status_message", "request", "outbox")
AGENT_LIST_DEFERRED = ("card", "card_problems")


def for_list(
    qs: models.QuerySet, *, task: str = "", agent: str | None = "agent__"
) -> models.QuerySet:
    """``qs``, a list of tasks, without the columns above: ``task`` and ``agent`` are the
    paths to a task and to its agent in its rows (``agent`` None: not joined). A list of
    agents defers ``AGENT_LIST_DEFERRED`` itself."""
    paths = [task + name for name in TASK_LIST_DEFERRED]
    if agent is not None:
        paths += [agent + name for name in AGENT_LIST_DEFERRED]
    return qs.defer(*paths)


class Agent(models.Model):
    """A remote A2A agent, with its card as last fetched.

    A URL is registered once per project, not once overall: two projects may each register
    one shared agent (each row has its own credentials, card and tasks), and adding a URL
    must not tell anyone that another project holds it.
    """

    project = models.ForeignKey(
        Project, on_delete=models.PROTECT, related_name="agents", default=default_project
    )
    name = models.CharField(max_length=200)
    base_url = models.URLField(max_length=1000)
    card_url = models.URLField(max_length=1000, blank=True)
    card = models.JSONField(default=dict, blank=True)
    card_etag = models.CharField(max_length=300, blank=True)
    card_fetched_at = models.DateTimeField(null=True, blank=True)
    card_problems = models.JSONField(default=list, blank=True)
    interface_url = models.URLField(max_length=1000, blank=True)
    binding = models.CharField(max_length=40, blank=True)  # "JSONRPC" or "HTTP+JSON"
    protocol_version = models.CharField(max_length=10, blank=True)
    tenant = models.CharField(max_length=200, blank=True)
    streaming = models.BooleanField(default=False)
    push = models.BooleanField(default=False)
    # Fernet token of a JSON object; see tasks_app/crypto.py. Never rendered.
    credentials_encrypted = models.TextField(blank=True)
    # Origins (scheme://host:port) the credentials may be sent to, fixed when they were
    # saved; a card naming another origin waits in ``pending_origin`` for an agent admin.
    credential_origins = models.JSONField(default=list, blank=True, db_default=[])
    pending_origin = models.CharField(max_length=300, blank=True, default="", db_default="")
    # False once the agent refused a contextId this dashboard chose (A2A 1.0 section 3.4.1:
    # an agent that cannot take one must refuse the request): its sends go without one.
    takes_client_context = models.BooleanField(default=True, db_default=True)
    reachable = models.BooleanField(null=True)
    last_error = models.TextField(blank=True)
    last_contact_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    # Retired by an agent admin (``services.agents.retire_agent``): nothing is sent to it,
    # its tasks and their log stay readable, and its URL may be registered again.
    retired_at = models.DateTimeField(null=True, blank=True)
    retired_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="retired_agents",
    )

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                fields=["project", "base_url"],
                condition=Q(retired_at__isnull=True),
                name="one_agent_per_url_per_project",
            )
        ]

    def __str__(self) -> str:
        return self.name


class RemoteTask(models.Model):
    """One exchange with an agent: normally a remote task, mirrored.

    ``phase`` says how far the exchange got: the send may still be under way,
    the agent may have answered with a plain Message (no task exists), or the
    send may have failed before the agent named a task.
    """

    class Phase(models.TextChoices):
        SENDING = "sending"
        TASK = "task"
        MESSAGE = "message"
        FAILED = "failed"

    class Mode(models.TextChoices):
        AUTO = "auto"
        STREAM = "stream"
        RETURN_IMMEDIATELY = "return-immediately"
        BLOCKING = "blocking"
        PUSH = "push"
        IMPORTED = "imported"

    class Watch(models.TextChoices):
        STREAM = "stream"
        POLL = "poll"
        PUSH = "push"
        NONE = "none"

    class WatcherStatus(models.TextChoices):
        STREAMING = "streaming"
        RECONNECTING = "reconnecting"
        POLLING = "polling"
        AWAITING_PUSH = "awaiting-push"
        IDLE = "idle"
        LOST = "lost"
        PARKED = "parked"  # needs attention: fruitless turns or a budget ran out
        GONE = "gone"  # the agent no longer knows the task
        ABANDONED = "abandoned"  # an operator gave the task up locally

    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="tasks")
    remote_id = models.CharField(max_length=300, blank=True)
    context_id = models.CharField(max_length=300, blank=True, db_index=True)
    title = models.CharField(max_length=300, blank=True)
    phase = models.CharField(max_length=20, choices=Phase.choices, default=Phase.SENDING)
    mode = models.CharField(max_length=30, choices=Mode.choices, default=Mode.AUTO)
    state = models.CharField(max_length=40, choices=STATE_CHOICES, blank=True, db_index=True)
    status_message = models.JSONField(null=True, blank=True)
    status_timestamp = models.DateTimeField(null=True, blank=True)
    metadata = models.JSONField(default=dict, blank=True)
    # The first message we sent; a retry reuses its messageId.
    request = models.JSONField(default=dict, blank=True)
    # The message a watcher must send next (the first one, or an answer); cleared
    # once the agent has acknowledged it.
    outbox = models.JSONField(null=True, blank=True)
    send_error = models.TextField(blank=True)
    send_attempted_at = models.DateTimeField(null=True, blank=True)
    started_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    watch = models.CharField(max_length=20, choices=Watch.choices, default=Watch.NONE)
    watcher_status = models.CharField(
        max_length=20, choices=WatcherStatus.choices, default=WatcherStatus.IDLE
    )
    watcher_note = models.CharField(max_length=500, blank=True)
    # The lease: who holds the watch, until when (compare-and-set; see watchers.py).
    lease_token = models.CharField(max_length=64, blank=True)
    lease_owner = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True, db_index=True)
    # The last seq handed out; events are appended by compare-and-set on it.
    last_seq = models.PositiveIntegerField(default=0)
    # Fields added after the first release carry database defaults, so that rows written
    # by an older process (or by bulk SQL) are valid.
    # Hash of the newest log row: the next row's hash chains from it (see audit.py).
    last_hash = models.CharField(max_length=64, blank=True, default="", db_default="")
    # Set when a terminal task was reconciled once with GetTask; nothing changes after.
    settled_at = models.DateTimeField(null=True, blank=True)
    # The seq of the row that asked the current question (input/auth-required), and the
    # question an answer was accepted for: one answer per question, by compare-and-set.
    asked_seq = models.PositiveIntegerField(default=0, db_default=0)
    # When that row was appended: the inbox lists the oldest question first (indexed below).
    asked_at = models.DateTimeField(null=True, blank=True)
    # When the task began to wait for an answer: the first question of the wait. An agent
    # asking again (a new status, still unanswered) moves asked_seq and asked_at, not this.
    question_since = models.DateTimeField(null=True, blank=True)
    answered_seq = models.PositiveIntegerField(default=0, db_default=0)
    answered_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="answered_tasks",
    )
    answered_at = models.DateTimeField(null=True, blank=True)
    # When the last answer was refused by the agent (or never got to it) and its question
    # opened again (``answer_failed``); cleared by the next answer. The page said "sent".
    answer_failed_at = models.DateTimeField(null=True, blank=True)
    # Watcher bookkeeping (see the watcher state table in docs/architecture.md).
    watcher_since = models.DateTimeField(null=True, blank=True)
    fruitless_turns = models.PositiveIntegerField(default=0, db_default=0)
    gone_at = models.DateTimeField(null=True, blank=True)
    abandoned_at = models.DateTimeField(null=True, blank=True)
    # Bytes of agent content stored for this task (the per-task budget).
    stored_bytes = models.BigIntegerField(default=0, db_default=0)
    last_event_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    updated_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-updated_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["agent", "remote_id"],
                condition=~Q(remote_id=""),
                name="unique_remote_task_per_agent",
            )
        ]
        indexes = [
            models.Index(fields=["agent", "state", "-updated_at"]),
            models.Index(fields=["state", "-updated_at"]),
            # The inbox: waiting tasks, oldest question first (a partial index: only those).
            models.Index(
                fields=["asked_at", "id"],
                name="inbox_order",
                condition=Q(
                    state__in=INTERRUPTED_STATES, abandoned_at__isnull=True, settled_at__isnull=True
                ),
            ),
            # The parked-task alert rule's scan (tasks_app/alerts.py): only parked live tasks.
            models.Index(
                fields=["id"],
                name="parked_tasks",
                condition=Q(
                    watcher_status="parked", abandoned_at__isnull=True, gone_at__isnull=True
                ),
            ),
        ]

    def __str__(self) -> str:
        return self.remote_id or f"({self.unnamed_label} #{self.pk})"

    @property
    def unnamed_label(self) -> str:
        """What an exchange the agent named no task for is: a message reply is not "unsent"."""
        return {
            self.Phase.MESSAGE: "message reply, no task",
            self.Phase.FAILED: "send failed, no task",
            self.Phase.SENDING: "not named yet",
        }.get(self.phase, "no task id")

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def is_interrupted(self) -> bool:
        return self.state in INTERRUPTED_STATES

    @property
    def state_label(self) -> str:
        return self.get_state_display() if self.state else self.phase


class Channel(models.TextChoices):
    SEND_RESPONSE = "send-response"
    STREAM = "stream"
    RESUBSCRIBE = "resubscribe"
    POLL = "poll"
    PUSH = "push"
    OPERATOR = "operator"
    SYSTEM = "system"


class TaskEvent(models.Model):
    """One entry of a task's log. ``seq`` is per task, strictly increasing, no gaps."""

    class Kind(models.TextChoices):
        TASK = "task"
        MESSAGE = "message"
        STATUS_UPDATE = "statusUpdate"
        ARTIFACT_UPDATE = "artifactUpdate"
        GAP = "gap"
        PROTOCOL_ERROR = "protocol-error"
        OPERATOR = "operator"
        SYSTEM = "system"

    task = models.ForeignKey(RemoteTask, on_delete=models.CASCADE, related_name="events")
    seq = models.PositiveIntegerField()
    received_at = models.DateTimeField(default=timezone.now)
    channel = models.CharField(max_length=20, choices=Channel.choices)
    kind = models.CharField(max_length=20, choices=Kind.choices)
    raw = BulkJSONField(null=True, blank=True)
    state_after = models.CharField(max_length=40, blank=True)
    # True where state_after differs from the entry before: the timeline reads only these.
    state_changed = models.BooleanField(default=False)
    # Why an event changed nothing, or what was wrong with it.
    note = models.TextField(blank=True)
    # PROTECT: the actor is part of the row's hash, and the log is append-only; a person who
    # acted is deactivated, not deleted (SET_NULL rewrote their rows and broke the chain).
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT
    )
    # sha256 of the canonical raw content alone (recognizes a chunk delivered twice).
    digest = models.CharField(max_length=64, blank=True)
    # sha256 over the previous row's hash and this row's canonical form (the chain).
    hash = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["task", "seq"]
        constraints = [models.UniqueConstraint(fields=["task", "seq"], name="unique_seq_per_task")]
        indexes = [
            models.Index(
                fields=["task", "seq"], condition=Q(state_changed=True), name="state_changes"
            ),
            models.Index(fields=["task", "digest"], name="event_digest"),
        ]

    def __str__(self) -> str:
        return f"{self.task_id}#{self.seq} {self.kind}"


class Artifact(models.Model):
    """An artifact of a task; its parts are rows, so an appended chunk is one INSERT."""

    task = models.ForeignKey(RemoteTask, on_delete=models.CASCADE, related_name="artifacts")
    artifact_id = models.CharField(max_length=300)
    name = models.CharField(max_length=500, blank=True)
    description = models.TextField(blank=True)
    metadata = models.JSONField(default=dict, blank=True)
    extensions = models.JSONField(default=list, blank=True)
    part_count = models.PositiveIntegerField(default=0)
    # Chained sha256 over the parts in order: equal parts give an equal digest,
    # and appending a chunk updates it without reading the earlier parts.
    digest = models.CharField(max_length=64, blank=True)
    complete = models.BooleanField(default=False)
    position = models.PositiveIntegerField(default=0)
    updated_seq = models.PositiveIntegerField(default=0)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["task", "position"]
        constraints = [
            models.UniqueConstraint(fields=["task", "artifact_id"], name="unique_artifact_per_task")
        ]


class ArtifactPart(models.Model):
    artifact = models.ForeignKey(Artifact, on_delete=models.CASCADE, related_name="parts")
    index = models.PositiveIntegerField()
    part = BulkJSONField()
    seq = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["artifact", "index"]
        constraints = [
            models.UniqueConstraint(fields=["artifact", "index"], name="unique_part_index")
        ]


class ReplacedContent(models.Model):
    """A big part content that log rows refer to (``record.by_reference``) and whose part row
    an artifact's replacement deleted: kept here, so that every reference still resolves
    (``audit replay``). Stored once per task and content; removed with the task."""

    task = models.ForeignKey(RemoteTask, on_delete=models.CASCADE, related_name="replaced_contents")
    sha256 = models.CharField(max_length=64)
    content = models.TextField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["task", "sha256"], name="unique_replaced_content")
        ]


class ConversationMessage(models.Model):
    """Messages we sent and messages the agent sent (status messages, replies, history)."""

    task = models.ForeignKey(RemoteTask, on_delete=models.CASCADE, related_name="messages")
    message_id = models.CharField(max_length=300)
    role = models.CharField(max_length=20)
    message = BulkJSONField()
    seq = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    # One of our messages stored with the values typed into password fields hidden (the agent
    # got them): an agent's copy of it (a snapshot's history) is stored as this one.
    typed_values_hidden = models.BooleanField(default=False)

    class Meta:
        ordering = ["task", "seq", "id"]
        constraints = [
            models.UniqueConstraint(fields=["task", "message_id"], name="unique_message_per_task")
        ]


class Surface(models.Model):
    """An A2UI surface of a task, folded from the log by ``record()`` (services/surfaces.py).

    ``components`` is always in the v0.9.1 basic-catalog form whatever version the agent
    spoke, so the renderer knows one shape. ``problem`` says in one line why the surface
    cannot be rendered (``raw_json`` then holds the offending message). The ``action_*``
    fields are set once per surface state by a compare-and-set on ``updated_seq``, so
    exactly one action wins when two people submit the same form.
    """

    task = models.ForeignKey(RemoteTask, on_delete=models.CASCADE, related_name="surfaces")
    surface_id = models.CharField(max_length=200)
    version = models.CharField(max_length=20)
    catalog_id = models.CharField(max_length=500, blank=True, default="")
    root_id = models.CharField(max_length=200, blank=True, default="")
    components = models.JSONField(default=dict, blank=True)
    data_model = models.JSONField(default=dict, blank=True)
    styles = models.JSONField(default=dict, blank=True)
    ready = models.BooleanField(default=False)
    deleted = models.BooleanField(default=False)
    problem = models.CharField(max_length=1000, blank=True, default="")
    raw_json = models.JSONField(null=True, blank=True)
    updated_seq = models.PositiveIntegerField(default=0)
    action_seq = models.PositiveIntegerField(null=True, blank=True)
    action_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="surface_actions",
    )
    action_at = models.DateTimeField(null=True, blank=True)
    action_name = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        ordering = ["task", "id"]
        constraints = [
            models.UniqueConstraint(fields=["task", "surface_id"], name="unique_surface_per_task")
        ]

    def __str__(self) -> str:
        return f"surface {self.surface_id} of task {self.task_id}"


class OperatorAction(models.Model):
    """What a person (or a command) asked for, with the actor; also an event in the log."""

    task = models.ForeignKey(
        RemoteTask, null=True, blank=True, on_delete=models.CASCADE, related_name="actions"
    )
    agent = models.ForeignKey(Agent, null=True, blank=True, on_delete=models.CASCADE)
    # PROTECT, as the log's: who did what is the audit trail (deactivate a person instead).
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT
    )
    action = models.CharField(max_length=40)
    payload = models.JSONField(default=dict, blank=True)
    outcome = models.CharField(max_length=500, blank=True)
    key = models.CharField(max_length=64, default="", blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at"]
        # The action log pages by (created_at, id), whole or filtered by one of these.
        indexes = [
            models.Index(fields=["created_at", "id"], name="action_log_order"),
            models.Index(fields=["actor", "created_at", "id"], name="action_log_by_actor"),
            models.Index(fields=["action", "created_at", "id"], name="action_log_by_action"),
            models.Index(fields=["agent", "created_at", "id"], name="action_log_by_agent"),
        ]

    def save(self, *args: object, **kwargs: object) -> None:
        """Payload and outcome in a form every store and page takes: a reason typed with a
        byte that is not UTF-8 reached Python as a lone surrogate, and the audit page
        answered 500 (its CSV stopped midway; PostgreSQL refused the row)."""
        self.payload, _ = safejson.clean(self.payload)
        self.outcome = safejson.clean_text(self.outcome)
        super().save(*args, **kwargs)


class ImportJob(models.Model):
    """A background import of an agent's tasks (ListTasks, page by page), with progress."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"
        CANCELED = "canceled"

    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="import_jobs")
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.QUEUED)
    pages = models.PositiveIntegerField(default=0)
    seen = models.PositiveIntegerField(default=0)
    created = models.PositiveIntegerField(default=0)
    changed = models.PositiveIntegerField(default=0)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            # One queued or running import per agent, whatever the callers' timing: two
            # clicks at once (services/imports.create_job) and concurrent claimers
            # (services/imports.claim) step back on a conflict.
            models.UniqueConstraint(
                fields=["agent"],
                condition=Q(status__in=["queued", "running"]),
                name="one_active_import",
            )
        ]


def new_token() -> str:
    return uuid.uuid4().hex


class PushConfig(models.Model):
    """A push notification config this dashboard gave an agent for one task.

    ``config_id`` is our own id: it is the config's ``id`` at the agent and the last part
    of its webhook URL (one URL per config). Its secrets (the ``token`` and the
    ``authentication`` credentials the agent presents to us) are random, single-purpose
    and stored encrypted like agent credentials (``tasks_app/crypto.py``). A config whose
    agent signs its notifications (a JWKS, from the card or set on the config) carries
    ``jwks_url`` and the issuer expected in the tokens; unsigned notifications are refused.
    """

    task = models.ForeignKey(RemoteTask, on_delete=models.CASCADE, related_name="push_configs")
    config_id = models.CharField(max_length=64, unique=True)
    # Fernet token of {"token", "scheme", "credentials"}; never rendered.
    secrets_encrypted = models.TextField(blank=True)
    jwks_url = models.URLField(max_length=1000, blank=True)
    jwt_issuer = models.CharField(max_length=1000, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    # When the agent took the config (the send that carried it, or CreateTaskPushNotificationConfig).
    registered_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)
    deleted_note = models.CharField(max_length=500, blank=True)
    last_received_at = models.DateTimeField(null=True, blank=True)
    received = models.PositiveIntegerField(default=0)
    # The queue stamp (``push.SEQ_KEY``) of the last notification counted in ``received``: a
    # drain killed after counting its batch leaves the batch queued, and the next drain
    # records it again without counting it again.
    counted_through = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["task", "created_at", "id"]

    def __str__(self) -> str:
        return f"push config {self.config_id} of task {self.task_id}"


class Alert(models.Model):
    """Something a person should look at, opened and resolved by the rules in ``tasks_app/alerts.py``.

    ``key`` names the condition and its subject (``silent-working:task:42``): at most one
    unresolved row per key (a partial unique index), so two evaluators racing open it once.
    ``since`` is when the condition began as far as the dashboard knows. A row whose
    ``opened_at`` is empty is pending: the condition is seen but its threshold has not
    passed yet (only the agent-unreachable rule needs this, the agent row keeps no time of
    its own for it); pending rows are not shown, not delivered and deleted if the condition
    ends first. ``agent`` is set on every alert about a task or an agent: who may see an
    alert is who may read that agent's project.
    """

    class Rule(models.TextChoices):
        SILENT_WORKING = "silent-working", "silent while working"
        QUESTION_WAITING = "question-waiting", "question waiting"
        AGENT_UNREACHABLE = "agent-unreachable", "agent unreachable"
        SEND_FAILED = "send-failed", "send failed"
        PARKED = "parked", "watcher parked the task"
        TEST = "test", "test"

    rule = models.CharField(max_length=30, choices=Rule.choices)
    task = models.ForeignKey(
        RemoteTask, null=True, blank=True, on_delete=models.CASCADE, related_name="alerts"
    )
    agent = models.ForeignKey(
        Agent, null=True, blank=True, on_delete=models.CASCADE, related_name="alerts"
    )
    key = models.CharField(max_length=200)
    message = models.CharField(max_length=500)
    since = models.DateTimeField(default=timezone.now)
    opened_at = models.DateTimeField(null=True, blank=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    last_seen_at = models.DateTimeField(default=timezone.now)
    # When the news of its opening, and of its end, went to the channels (None: not yet).
    # The evaluator that opened or resolved it tells at once; if it died first, the first
    # evaluation after ``tell_after`` tells (at least once; see alerts._tell_untold).
    opened_told_at = models.DateTimeField(null=True, blank=True)
    resolved_told_at = models.DateTimeField(null=True, blank=True)
    tell_after = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-opened_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["key"],
                condition=Q(resolved_at__isnull=True),
                name="one_unresolved_alert_per_key",
            )
        ]
        indexes = [
            # The open alerts (pages, the live check): few rows, read often.
            models.Index(
                fields=["-opened_at"],
                condition=Q(resolved_at__isnull=True),
                name="unresolved_alerts",
            ),
            models.Index(fields=["rule", "resolved_at"], name="alerts_by_rule"),
        ]

    def __str__(self) -> str:
        return f"{self.rule} {self.key}"


class AlertDelivery(models.Model):
    """One attempt to tell someone about an alert (or a test), with what came of it.

    ``target`` is what may be shown: the e-mail addresses, or only the webhook's origin
    (a webhook URL often carries its secret in the path or query).
    """

    class Channel(models.TextChoices):
        EMAIL = "email", "e-mail"
        WEBHOOK = "webhook"

    class Outcome(models.TextChoices):
        SENT = "sent"
        FAILED = "failed"

    alert = models.ForeignKey(Alert, on_delete=models.CASCADE, related_name="deliveries")
    channel = models.CharField(max_length=20, choices=Channel.choices)
    # "opened", "resolved" or "test": which news this delivery carried.
    event = models.CharField(max_length=20)
    target = models.CharField(max_length=500)
    outcome = models.CharField(max_length=20, choices=Outcome.choices)
    error = models.CharField(max_length=500, blank=True)
    attempted_at = models.DateTimeField(default=timezone.now)
    duration_ms = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-attempted_at", "-id"]
        indexes = [models.Index(fields=["-attempted_at"], name="alert_deliveries_newest")]

    def __str__(self) -> str:
        return f"{self.channel} {self.event} of alert {self.alert_id}: {self.outcome}"
