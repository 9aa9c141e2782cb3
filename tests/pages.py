"""Every page of the site, with real objects behind it, for tests that must cover them all.

The content security policy test (``tests/test_headers.py``) and the planted-secrets test
(``tests/test_secrets.py``) visit each page. The list is not written by hand: the app's
URLs come from walking the URL conf (``app_urls``), the admin's from its model registry
(``admin_urls``), so a page added later is visited without editing a list. A URL whose
parameters this module cannot fill fails the test with a sentence saying what to add.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django.contrib import admin
from django.contrib.auth.models import Group
from django.urls import URLPattern, URLResolver, get_resolver, reverse

from tasks_app.a2a import a2ui
from tasks_app.models import (
    Agent,
    Artifact,
    ConversationMessage,
    ImportJob,
    OperatorAction,
    PushConfig,
    RemoteTask,
    Surface,
    TaskEvent,
)
from tasks_app.services.record import record
from tests.people import member

SITE_LOGIN_PASSWORD = "site-login-password-1"


@dataclass
class Site:
    """The objects the pages are about: one of each kind a URL can name."""

    agent: Agent
    task: RemoteTask
    artifact: Artifact
    message: ConversationMessage
    import_job: ImportJob
    push_config: PushConfig

    @property
    def last_seq(self) -> int:
        return (
            TaskEvent.objects.filter(task=self.task)
            .order_by("-seq")
            .values_list("seq", flat=True)[0]
        )


def build_site(user: Any, agent: Agent | None = None, *, text: str = "a *markdown* answer") -> Site:
    """A task with a conversation, an artifact of text and a file, recorded as a stream would.

    ``agent`` may be one added through the services (with credentials); by default a row
    pointing at a closed loopback port. ``text`` goes into the agent's message and artifact.
    """
    if agent is None:
        agent = Agent.objects.create(name="site agent", base_url="http://127.0.0.1:9/",
                                     interface_url="http://127.0.0.1:9/", binding="JSONRPC")  # fmt: skip
    task = RemoteTask.objects.create(agent=agent, title="site task", started_by=user,
                                     phase="task", watch="none")  # fmt: skip
    tid, ctx = "t-site", "ctx-site"
    upload = base64.b64encode(b"operator upload\n").decode()
    record(task, {"task": {
        "id": tid, "contextId": ctx,
        "status": {"state": "TASK_STATE_INPUT_REQUIRED", "message": {
            "messageId": "m-agent", "role": "ROLE_AGENT", "parts": [
                {"text": text}, {"data": _a2ui_form(text), "mediaType": "application/a2ui+json"}]}},
        "history": [{"messageId": "m-user", "role": "ROLE_USER", "parts": [
            {"text": "please"}, {"raw": upload, "filename": "in.txt", "mediaType": "text/plain"}]}],
    }}, "stream")  # fmt: skip
    blob = base64.b64encode(bytes(range(256))).decode()
    record(task, {"artifactUpdate": {"taskId": tid, "contextId": ctx, "artifact": {
        "artifactId": "a-1", "name": "report.md", "parts": [
            {"text": text}, {"data": {"rows": [1, 2]}},
            {"raw": blob, "filename": "blob.bin", "mediaType": "application/octet-stream"}]},
        "lastChunk": True}}, "stream")  # fmt: skip
    OperatorAction.objects.create(task=task, agent=agent, actor=user, action="site-probe")
    Group.objects.get_or_create(name="site group")
    member(user)  # a project and a membership
    _log_in_through_the_form()
    job = ImportJob.objects.create(agent=agent, actor=user, status=ImportJob.Status.DONE, pages=1)
    push = PushConfig.objects.create(task=task, config_id="site-push-config")
    surface = Surface.objects.get(task=task, surface_id="site-form")
    assert not surface.problem, f"the site's A2UI form did not fold: {surface.problem}"
    message = ConversationMessage.objects.filter(task=task).order_by("seq").first()
    assert message is not None, "the recorded history made no conversation message"
    return Site(agent=agent, task=task, artifact=Artifact.objects.get(task=task),
                message=message, import_job=job, push_config=push)  # fmt: skip


def _a2ui_form(text: str) -> list[dict]:
    """An agent's A2UI form (v0.9.1): a Surface row, drawn on the task page and the inbox."""
    components = [
        {"id": "root", "component": "Column", "children": ["say", "name", "send"]},
        {"id": "say", "component": "Text", "text": text},
        {"id": "name", "component": "TextField", "label": "Name", "value": {"path": "/name"}},
        {"id": "send-label", "component": "Text", "text": "Send"},
        {"id": "send", "component": "Button", "child": "send-label",
         "action": {"event": {"name": "send", "context": {"name": {"path": "/name"}}}}},
    ]  # fmt: skip
    return [
        {"version": "v0.9", "createSurface": {"surfaceId": "site-form", "catalogId": a2ui.V091_CATALOG}},
        {"version": "v0.9", "updateComponents": {"surfaceId": "site-form", "components": components}},
        {"version": "v0.9", "updateDataModel": {"surfaceId": "site-form", "value": {"name": ""}}},
    ]  # fmt: skip


def _log_in_through_the_form() -> None:
    """A failed and a good login through the real form: the login records (django-axes)."""
    from django.contrib.auth import get_user_model
    from django.test import Client

    get_user_model().objects.create_user("site-login", password=SITE_LOGIN_PASSWORD)
    failed = Client().post(
        "/accounts/login/", {"username": "site-stranger", "password": "wrong-password"}
    )
    assert failed.status_code == 200
    good = Client().post(
        "/accounts/login/", {"username": "site-login", "password": SITE_LOGIN_PASSWORD}
    )
    assert good.status_code == 302


def _patterns(
    resolvers: list[URLPattern | URLResolver], namespace: str = ""
) -> Iterator[tuple[str, list[str]]]:
    """(qualified name, parameter names) of every named URL outside the admin."""
    for entry in resolvers:
        if isinstance(entry, URLResolver):
            if entry.namespace == "admin":
                continue  # the admin's pages come from its registry (admin_urls)
            inner = f"{namespace}{entry.namespace}:" if entry.namespace else namespace
            yield from _patterns(entry.url_patterns, inner)
            continue
        assert entry.name, f"URL {entry.pattern} has no name: name it so tests can visit it"
        params = list(getattr(entry.pattern, "converters", {})) or list(
            entry.pattern.regex.groupindex
        )
        yield f"{namespace}{entry.name}", params


def _param(site: Site, url_name: str, param: str) -> object:
    if param == "pk":
        return site.agent.pk if url_name.startswith("agent-") else site.task.pk
    values = {
        "job_pk": site.import_job.pk,
        "seq": site.last_seq,
        "artifact_pk": site.artifact.pk,
        "index": 0,
        "message_pk": site.message.pk,
        "config_id": site.push_config.config_id,
        "name": "exports",  # a guide
    }
    if param not in values:
        raise LookupError(f"tests/pages.py does not know what to put in <{param}> of {url_name}")
    return values[param]


def app_urls(site: Site) -> dict[str, str]:
    """URL name -> a URL of it about the site's objects, for every named URL of the app."""
    return {
        name: reverse(name, kwargs={p: _param(site, name, p) for p in params})
        for name, params in _patterns(get_resolver().url_patterns)
    }


def admin_urls(per_model: int = 1) -> dict[str, str]:
    """The admin's index, each app's index, and for every registered model its list and the
    change (or view) and history pages of its first ``per_model`` objects (at least one)."""
    urls = {"admin:index": reverse("admin:index")}
    for model in admin.site._registry:
        meta = model._meta
        urls[f"admin:{meta.app_label}"] = reverse("admin:app_list", args=[meta.app_label])
        base = f"admin:{meta.app_label}_{meta.model_name}"
        urls[f"{base}_changelist"] = reverse(f"{base}_changelist")
        objects = list(model._default_manager.order_by("pk")[:per_model])
        assert objects, f"no {meta.label} to visit: make one in tests/pages.build_site"
        for obj in objects:
            suffix = "" if obj is objects[0] else f"[{obj.pk}]"
            urls[f"{base}_change{suffix}"] = reverse(f"{base}_change", args=[obj.pk])
            urls[f"{base}_history{suffix}"] = reverse(f"{base}_history", args=[obj.pk])
    return urls
