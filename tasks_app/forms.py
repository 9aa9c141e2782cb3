"""Forms of the dashboard. They validate input; views hand the cleaned values to services."""

from __future__ import annotations

import base64
import json
from typing import Any

from django import forms
from django.db.models import QuerySet

from tasks_app import kept_uploads
from tasks_app.a2a import safejson
from tasks_app.a2a.errors import ProtocolError
from tasks_app.models import STATE_CHOICES, Agent, Channel, Project, RemoteTask, TaskEvent
from tasks_app.rendering import safe_filename
from tasks_app.services import agents as agent_services

MAX_UPLOAD_BYTES = 10 * 1024 * 1024

MODE_CHOICES = [
    (RemoteTask.Mode.AUTO, "Auto (stream when the agent can)"),
    (RemoteTask.Mode.STREAM, "Stream"),
    (RemoteTask.Mode.RETURN_IMMEDIATELY, "Return immediately, then poll"),
    (RemoteTask.Mode.BLOCKING, "Blocking (wait for the answer)"),
    (RemoteTask.Mode.PUSH, "Push (the agent calls back; nothing held open)"),
]


NUL_REMOVED = (
    "This held a NUL character (U+0000, invisible; often pasted along with text), which no "
    "field takes. It was removed and nothing was sent: check the value and send again."
)


class NulRemovingForm(forms.Form):
    """A form that takes what was posted minus its NUL characters, and marks the fields that
    held one with an error (``NUL_REMOVED``): the person's input comes back, the form is not
    valid, and no NUL reaches a query or the database (PostgreSQL text cannot hold one).

    Its view is marked ``tasks_app.middleware.form_removes_nul`` (the middleware refuses a
    NUL before any other view). A subclass's ``clean`` calls ``super().clean()`` first, so
    it sees these errors.
    """

    def __init__(self, data: Any = None, *args: Any, **kwargs: Any) -> None:
        self.nul_removed: list[str] = []
        if data is not None and hasattr(data, "getlist"):
            for key in list(data):
                values = data.getlist(key)
                if any("\x00" in value for value in values if isinstance(value, str)):
                    if not self.nul_removed:
                        data = data.copy()
                    self.nul_removed.append(key)
                    data.setlist(key, [value.replace("\x00", "") for value in values])
        super().__init__(data, *args, **kwargs)

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        named = {self.add_prefix(name): name for name in self.fields}
        for key in self.nul_removed:
            name = named.get(key)
            if name is not None and not self.fields[name].widget.is_hidden:
                self.add_error(name, NUL_REMOVED)
            else:
                self.add_error(None, f"“{key[:40]}”: {NUL_REMOVED}")
        return data


class AgentRenameForm(NulRemovingForm):
    name = forms.CharField(
        label="Name",
        max_length=200,
        help_text="How the dashboard shows the agent; its card's own name is not changed.",
    )
    # The name the page showed: a rename from a page loaded before another rename is refused.
    # Not stripped: a name stored with outer spaces (from a card, before names were tidied)
    # must come back as stored for the compare-and-set to match it.
    was = forms.CharField(max_length=200, required=False, strip=False, widget=forms.HiddenInput)

    def clean_name(self) -> str:
        return _typed_name(self.cleaned_data["name"])


def _typed_name(name: str) -> str:
    """A name a person typed, tidied, or its refusal next to the field (``typed_name``)."""
    try:
        return agent_services.typed_name(name)
    except agent_services.AgentError as exc:
        raise forms.ValidationError(str(exc)) from None


class AgentAddForm(NulRemovingForm):
    url = forms.URLField(
        label="Agent URL",
        max_length=1000,
        assume_scheme="https",
        help_text="The agent's base URL or the URL of its card (…/.well-known/agent-card.json).",
        widget=forms.URLInput(
            attrs={"autofocus": True, "placeholder": "https://agent.example.org"}
        ),
    )
    name = forms.CharField(
        label="Display name",
        max_length=200,
        required=False,
        help_text="Optional; defaults to the card's name.",
    )
    project = forms.ModelChoiceField(
        queryset=Project.objects.none(), empty_label=None, required=False
    )

    def __init__(self, *args: Any, projects: QuerySet[Project], **kwargs: Any) -> None:
        """``projects``: where the person may add agents (``access.projects_for``)."""
        super().__init__(*args, **kwargs)
        self.fields["project"].queryset = projects

    def clean_url(self) -> str:
        """The URL, unless it holds a user name or password (``agents.preview_card`` says why).

        Such a URL is not drawn back into the field either: the form would show the secret.
        """
        url = self.cleaned_data["url"]
        try:
            agent_services.check_agent_url(url)
        except agent_services.AgentError as exc:
            self.data = self.data.copy()
            self.data[self.add_prefix("url")] = ""
            raise forms.ValidationError(str(exc)) from None
        return url

    def clean(self) -> dict[str, Any]:
        """A refused URL that may hold a password is not drawn back: ``clean_url`` runs only
        when Django's own URL and length checks pass, and a password holding a space or a
        ``/`` fails those first (the page showed it under "Enter a valid URL")."""
        data = super().clean()
        posted = self.data.get(self.add_prefix("url"), "")
        if "url" in self.errors and "@" in str(posted).partition("://")[2]:
            self.data = self.data.copy()
            self.data[self.add_prefix("url")] = ""
        return data

    def clean_name(self) -> str:
        name = self.cleaned_data["name"]
        return _typed_name(name) if name.strip() else ""

    def clean_project(self) -> Project:
        """The chosen project; may be left out when the person can add agents to only one."""
        project = self.cleaned_data.get("project")
        if project is None:
            choices = list(self.fields["project"].queryset[:2])
            if len(choices) != 1:
                raise forms.ValidationError("Choose the project the agent belongs to.")
            project = choices[0]
        return project


class CredentialsForm(forms.Form):
    KIND_CHOICES = [
        ("bearer", "Bearer token"),
        ("api-key", "API key"),
        ("clear", "Remove stored credentials"),
    ]
    kind = forms.ChoiceField(label="Kind", choices=KIND_CHOICES, initial="bearer")
    token = forms.CharField(
        label="Bearer token", required=False, max_length=4000,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "off"}),
    )  # fmt: skip
    api_key = forms.CharField(
        label="API key", required=False, max_length=4000,
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "off"}),
    )  # fmt: skip
    api_key_name = forms.CharField(
        label="API key name", required=False, max_length=200,
        help_text="Only when the card declares no API-key scheme (default header X-API-Key).",
    )  # fmt: skip
    api_key_location = forms.ChoiceField(
        label="API key location", required=False,
        choices=[("", "as the card says"), ("header", "header"), ("query", "query"), ("cookie", "cookie")],
    )  # fmt: skip

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        kind = data.get("kind")
        if kind == "bearer" and not data.get("token"):
            self.add_error("token", "Enter the token.")
        if kind == "api-key" and not data.get("api_key"):
            self.add_error("api_key", "Enter the API key.")
        return data

    def credentials(self) -> dict[str, str]:
        data = self.cleaned_data
        if data["kind"] == "bearer":
            return {"token": data["token"]}
        if data["kind"] == "api-key":
            creds = {"api_key": data["api_key"]}
            if data.get("api_key_name"):
                creds["api_key_name"] = data["api_key_name"]
            if data.get("api_key_location"):
                creds["api_key_location"] = data["api_key_location"]
            return creds
        return {}


def parse_json_text(text: str) -> Any:
    """JSON from a text box, with a plain error message; standard JSON only.

    Python's parser recursed until it failed on text nested a few thousand levels deep (a
    500), and it reads ``NaN`` and ``Infinity`` (and ``1e999`` as infinity), which JSON does
    not have: the agent's parser would refuse what was sent.
    """
    try:
        value = safejson.loads(text)
    except ProtocolError as exc:
        cause = exc.__cause__
        if isinstance(cause, json.JSONDecodeError):
            raise forms.ValidationError(
                f"Not valid JSON: {cause.msg} at line {cause.lineno}, column {cause.colno}."
            ) from None
        raise forms.ValidationError(
            f"Not taken: JSON nested deeper than {safejson.DEFAULT_MAX_DEPTH} levels."
        ) from None
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        raise forms.ValidationError(
            "Not valid JSON: NaN and Infinity are not JSON numbers (nor is one as large as 1e999)."
        ) from None
    return value


class _AgentChoices(forms.models.ModelChoiceIterator):
    """The agents offered, named with their project when they span several (a URL may be
    registered once per project, so two projects' rows may share a name), and marked when
    retired (a retired agent and the one that took its URL share a name); one query."""

    def __iter__(self) -> Any:
        if self.field.empty_label is not None:
            yield ("", self.field.empty_label)
        agents = list(self.queryset.select_related("project"))
        several = len({agent.project_id for agent in agents}) > 1
        for agent in agents:
            label = f"{agent.name} ({agent.project.name})" if several else agent.name
            if agent.retired_at is not None:  # the task filter still offers it, for its history
                label += " (retired)"
            yield (
                forms.models.ModelChoiceIteratorValue(self.field.prepare_value(agent), agent),
                label,
            )


class AgentChoiceField(forms.ModelChoiceField):
    iterator = _AgentChoices


class StartTaskForm(NulRemovingForm):
    agent = AgentChoiceField(queryset=Agent.objects.none(), empty_label=None)
    skill = forms.CharField(required=False, max_length=300, label="Skill (hint)")
    text = forms.CharField(
        required=False, label="Message", max_length=100_000,
        widget=forms.Textarea(attrs={"rows": 5, "placeholder": "What should the agent do?"}),
    )  # fmt: skip
    file = forms.FileField(required=False, label="Attach a file")
    data = forms.CharField(
        required=False, label="JSON data", max_length=1_000_000,
        widget=forms.Textarea(attrs={"rows": 4, "placeholder": '{"key": "value"}', "spellcheck": "false"}),
    )  # fmt: skip
    mode = forms.ChoiceField(choices=MODE_CHOICES, initial=RemoteTask.Mode.AUTO)
    # A file already uploaded with a form that had another error: kept (``kept_uploads``) under
    # this token, so it is not lost; its name is shown.
    kept_file = forms.CharField(required=False, widget=forms.HiddenInput, max_length=100)
    kept_file_name = forms.CharField(required=False, widget=forms.HiddenInput, max_length=200)
    drop_kept_file = forms.BooleanField(required=False, label="Remove the kept file")

    def __init__(
        self, *args: Any, agents: QuerySet[Agent], person_id: int | None = None, **kwargs: Any
    ) -> None:
        """``agents``: those the person may start tasks on (``access.readable_agents``);
        ``person_id``: whose kept file this form may carry."""
        super().__init__(*args, **kwargs)
        self.fields["agent"].queryset = agents
        self.person_id = person_id
        self._offer_push()

    def _offer_push(self) -> None:
        """Push is offered only when agents can reach us (PUBLIC_URL); else the field says why."""
        from tasks_app.services.push import unavailable_reason

        reason = unavailable_reason()
        field = self.fields["mode"]
        if reason:
            field.choices = [c for c in MODE_CHOICES if c[0] != RemoteTask.Mode.PUSH]
            field.help_text = f"Push is not offered: {reason}"
        else:
            field.help_text = "Push: for long work on agents that declare push notifications."

    def clean_data(self) -> Any:
        text = (self.cleaned_data.get("data") or "").strip()
        if not text:
            return None
        return parse_json_text(text)

    def clean_file(self) -> Any:
        upload = self.cleaned_data.get("file")
        if upload and upload.size > MAX_UPLOAD_BYTES:
            raise forms.ValidationError(
                f"The file is larger than {MAX_UPLOAD_BYTES // (1024 * 1024)} MB."
            )
        return upload

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        upload = data.get("file")
        part: dict[str, str] | None = None
        if upload:
            content = upload.read()
            part = {
                "raw": base64.b64encode(content).decode(),
                "filename": safe_filename(upload.name, "upload"),
                "mediaType": (upload.content_type or "application/octet-stream")[:200],
            }
        elif data.get("kept_file") and not data.get("drop_kept_file"):
            part = self._kept(data["kept_file"])
        if data.get("drop_kept_file") and self.person_id:
            # Removed now, not an hour later (it was held until the form went through).
            kept_uploads.drop(self.person_id)
        data["file_part"] = part
        empty = not (data.get("text") or "").strip() and data.get("data") is None and part is None
        # A field with an error of its own (a message too long, a file too large) was filled
        # in: its error says what is wrong, not "write a message".
        if empty and not any(name in self.errors for name in ("text", "data", "file")):
            self.add_error("text", "Write a message, add JSON data or attach a file.")
        return data

    def _kept(self, token: str) -> dict[str, str] | None:
        try:
            part = kept_uploads.take(self.person_id, token) if self.person_id else None
        except kept_uploads.KeptUploadError:
            part = None
        if part is None:
            self.add_error(
                "file",
                "The file kept from before is no longer kept (for an hour, one per person); "
                "attach it again.",
            )
        return part

    def keep_file(self) -> None:
        """After an error elsewhere, keep the uploaded file for the next try (a token in the form)."""
        cleaned = getattr(self, "cleaned_data", {})
        part = cleaned.get("file_part")
        if not part and cleaned.get("drop_kept_file"):
            self.data = self.data.copy()  # removed: the page no longer offers it
            for name in ("kept_file", "kept_file_name", "drop_kept_file"):
                self.data.pop(name, None)
        if not part or not self.person_id:
            return
        self.data = self.data.copy()
        try:
            self.data["kept_file"] = kept_uploads.keep(self.person_id, part)
        except kept_uploads.KeptUploadError:
            self.add_error("file", "The file could not be kept for the next try; attach it again.")
            self.data.pop("kept_file", None)
            return
        self.data["kept_file_name"] = part["filename"]
        self.data.pop("drop_kept_file", None)

    @property
    def kept_file_label(self) -> str:
        name = self.data.get("kept_file_name") if self.is_bound else ""
        return name or ""


class CancelForm(forms.Form):
    reason = forms.CharField(required=False, max_length=500, label="Reason (optional)")


class AnswerForm(NulRemovingForm):
    """A free answer: text, and optionally JSON data and a file (the question has no usable schema).

    Schema-driven answers are ``tasks_app.answers.SchemaAnswerForm``; both give ``message_parts()``.
    """

    schema_driven = False
    schema_note = ""  # why the agent's schema (if any) was not used, shown above the form

    text = forms.CharField(
        label="Your answer",
        max_length=100_000,
        required=False,
        widget=forms.Textarea(attrs={"rows": 3}),
    )
    data = forms.CharField(
        required=False, label="JSON data (optional)", max_length=1_000_000,
        widget=forms.Textarea(attrs={"rows": 3, "placeholder": '{"key": "value"}', "spellcheck": "false"}),
    )  # fmt: skip
    file = forms.FileField(required=False, label="Attach a file (optional)")
    # The seq of the question the person saw: one answer per question (see answer_task).
    question = forms.IntegerField(min_value=0, widget=forms.HiddenInput)
    # The question itself, by digest: an agent may change it without asking anew.
    asked = forms.CharField(required=False, max_length=64, widget=forms.HiddenInput)

    def clean_data(self) -> Any:
        text = (self.cleaned_data.get("data") or "").strip()
        return parse_json_text(text) if text else None

    def clean_file(self) -> Any:
        upload = self.cleaned_data.get("file")
        if upload and upload.size > MAX_UPLOAD_BYTES:
            raise forms.ValidationError(
                f"The file is larger than {MAX_UPLOAD_BYTES // (1024 * 1024)} MB."
            )
        return upload

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        upload = data.get("file")
        if upload is not None and self.errors:
            # A browser cannot put a file back into the form: say so, rather than send the
            # corrected answer without it.
            self.add_error("file", "Attach the file again: it is not kept after an error.")
        data["file_part"] = (
            {
                "raw": base64.b64encode(upload.read()).decode(),
                "filename": safe_filename(upload.name, "upload"),
                "mediaType": (upload.content_type or "application/octet-stream")[:200],
            }
            if upload
            else None
        )
        empty = not (data.get("text") or "").strip() and data.get("data") is None and upload is None
        if empty and not any(name in self.errors for name in ("text", "data", "file")):
            self.add_error("text", "Write an answer, add JSON data or attach a file.")
        return data

    def message_parts(self) -> tuple[str, Any, tuple[dict, ...]]:
        """(text, data, files) of the answer message."""
        data = self.cleaned_data
        return (
            data.get("text") or "",
            data.get("data"),
            (data["file_part"],) if data.get("file_part") else (),
        )


SORT_CHOICES = [
    ("-updated", "Recently updated"),
    ("updated", "Least recently updated"),
    ("-created", "Newest"),
    ("created", "Oldest"),
]


class TaskFilterForm(forms.Form):
    agent = AgentChoiceField(
        queryset=Agent.objects.none(), required=False, empty_label="All agents"
    )
    state = forms.ChoiceField(
        required=False,
        choices=[
            ("", "All states"),
            ("active", "active (not ended)"),
            ("open", "open (running or waiting; not abandoned or gone)"),
            *[(k, v) for k, v in STATE_CHOICES if k],
        ],
    )
    phase = forms.ChoiceField(
        required=False, label="Phase (no state)",
        choices=[("", "any"), *[(p.value, p.label) for p in RemoteTask.Phase]],
    )  # fmt: skip
    context = forms.CharField(required=False, max_length=300, label="Context id")
    q = forms.CharField(
        required=False, max_length=300, label="Search", help_text="title or remote id"
    )
    sort = forms.ChoiceField(required=False, choices=SORT_CHOICES, initial="-updated")

    def __init__(self, *args: Any, agents: QuerySet[Agent], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["agent"].queryset = agents


class EventFilterForm(forms.Form):
    """The event log page: which entries, and which view of them."""

    VIEWS = [("full", "Full"), ("compact", "Compact"), ("raw", "Raw")]

    kind = forms.ChoiceField(required=False, choices=[("", "all kinds"), *TaskEvent.Kind.choices])
    channel = forms.ChoiceField(required=False, choices=[("", "all channels"), *Channel.choices])
    view = forms.ChoiceField(required=False, choices=VIEWS)
