"""Answer forms against what an agent's question may hold, found by an audit of the forms.

Each test names what happened before its fix. Agents are not called: the watcher dispatch is
stubbed (``no_dispatch``), so "sent" is read from the task's outbox.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.urls import reverse

from tasks_app import answers
from tasks_app.models import ConversationMessage, Membership, OperatorAction, RemoteTask, TaskEvent
from tasks_app.redaction import HIDDEN
from tasks_app.services.record import record
from tests.test_inbox import alpha, asking, people, question  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db


def schema_of(**properties: Any) -> dict:
    return {"type": "object", "properties": properties}


def names(task: RemoteTask) -> dict[str, str]:
    """The form field name of each top-level property, as the page draws it."""
    return {item.path[-1]: item.name for item in answers.question_of(task).inputs()}


def post_answer(client: Any, task: RemoteTask, values: dict, **extra: Any) -> Any:
    data = {"question": task.asked_seq, "asked": answers.question_key(task), **extra}
    data.update({names(task)[k]: v for k, v in values.items()})
    return client.post(reverse("task-answer", args=[task.pk]), data)


def test_a_property_order_beyond_any_float_is_no_order(alpha, people) -> None:  # noqa: F811
    """``float(10**330)`` raised OverflowError on every draw: one agent's question made the
    inbox a 500 for every person of the project."""
    schema = schema_of(a={"type": "string", "propertyOrder": 10**330}, b={"type": "string"})
    asking(alpha, "order", question(schema))
    for url in (reverse("inbox"),):
        assert people[Membership.Role.OPERATOR].get(url).status_code == 200
    assert answers.read_question(schema).root is not None


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]},
         "a property it does not describe"),
        ({"type": "object", "properties": {"a": {"type": "string"}},
          "dependentRequired": {"a": ["ghost"]}}, "a property it does not describe"),
        (schema_of(a={"type": "string", "minLength": answers.MAX_TEXT + 1}), "more characters"),
        (schema_of(a={"type": "string", "minLength": 5, "maxLength": 2}), "more characters"),
        (schema_of(a={"type": "array", "items": {"type": "string"},
                      "minItems": answers.MAX_ARRAY_ITEMS + 1}), "more items"),
        (schema_of(a={"type": "integer", "minimum": 5, "maximum": 1}), "above its maximum"),
        (schema_of(**{f"p{i}": {"type": "array", "items": {"enum": list(range(100))}}
                      for i in range(6)}), "options in all"),
    ],
)  # fmt: skip
def test_a_question_no_answer_can_meet_becomes_free_text(schema: dict, why: str) -> None:
    """Each of these was drawn as a form whose every answer failed (or, with thousands of
    options, an inbox page of 33 s and 12 MB): the task had no way forward."""
    read = answers.read_question(schema)
    assert read.root is None and why in read.note


@pytest.mark.parametrize(
    ("value", "ok"), [("0.07", True), ("19.99", True), ("1.15", True), ("0.075", False)]
)
def test_multiple_of_is_decided_in_decimal(value: str, ok: bool) -> None:
    """jsonschema's float arithmetic refused 0.07 as a multiple of 0.01: no amount in cents
    could be given."""
    spec = answers.read_question(schema_of(amount={"type": "number", "multipleOf": 0.01}))
    (item,) = spec.inputs()
    form = answers.SchemaAnswerForm(spec, {"question": "1", item.name: value})
    assert form.is_valid() is ok, form.errors


def test_a_step_beyond_any_float_is_a_form_error_not_a_500() -> None:
    """``1.5 % 10**400`` raised OverflowError: every answer was a 500."""
    spec = answers.read_question(schema_of(x={"type": "number", "multipleOf": 10**400}))
    (item,) = spec.inputs()
    refused = answers.SchemaAnswerForm(spec, {"question": "1", item.name: "1.5"})
    assert not refused.is_valid() and "multiple of" in str(refused.errors)
    assert answers.SchemaAnswerForm(spec, {"question": "1", item.name: "0"}).is_valid()


@pytest.mark.parametrize(
    ("step", "value", "ok"),
    [(0.01, "0.07", True), (0.01, "0.075", False), (0.5, "1" + "0" * 400, True),
     (0.5, "1.25", False)],
)  # fmt: skip
def test_draft_3s_divisible_by_is_decided_in_decimal_too(step: float, value: str, ok: bool) -> None:
    """Draft 3 names ``multipleOf`` ``divisibleBy``, and jsonschema checked it with floats: a
    long number was an OverflowError (a 500 at every answer) and 0.07 no multiple of 0.01."""
    schema = {"$schema": "http://json-schema.org/draft-03/schema#",
              **schema_of(n={"type": "integer" if len(value) > 10 else "number",
                             "divisibleBy": step, "required": True})}  # fmt: skip
    spec = answers.read_question(schema)
    (item,) = spec.inputs()
    form = answers.SchemaAnswerForm(spec, {"question": "1", item.name: value})
    assert form.is_valid() is ok, form.errors
    if not ok:
        assert "A multiple of" in str(form.errors)


@pytest.mark.parametrize("typed", ["a{4294967296}", "(" * 4000, "[z-a]"])
def test_text_that_is_no_regex_is_a_form_error_not_a_500(typed: str) -> None:
    """``format: regex`` compiled what the person typed with ``re``: a repeat count past
    ``re``'s limit raised OverflowError and 4,000 ``(`` RecursionError, a 500 each."""
    spec = answers.read_question(schema_of(rule={"type": "string", "format": "regex"}))
    (item,) = spec.inputs()
    refused = answers.SchemaAnswerForm(spec, {"question": "1", item.name: typed})
    assert not refused.is_valid() and "Enter a valid regex" in str(refused.errors)
    assert answers.SchemaAnswerForm(spec, {"question": "1", item.name: "^a+$"}).is_valid()


def test_an_optional_object_with_an_unticked_box_may_stay_empty() -> None:
    """An unticked box is a value: the optional object counted as filled in, and its
    required field insisted, though nothing had been typed into it."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "extra": {"type": "object", "required": ["why"], "properties": {
                "flag": {"type": "boolean"}, "why": {"type": "string"}}},
        },
        "required": ["name"],
    }  # fmt: skip
    spec = answers.read_question(schema)
    by_path = {item.path: item.name for item in spec.inputs()}
    form = answers.SchemaAnswerForm(spec, {"question": "1", by_path[("name",)]: "Ada"})
    assert form.is_valid(), form.errors
    assert form.answer() == {"name": "Ada"}
    ticked = {"question": "1", by_path[("name",)]: "Ada", by_path[("extra", "flag")]: "on"}
    form = answers.SchemaAnswerForm(spec, ticked)
    assert not form.is_valid() and by_path[("extra", "why")] in form.errors


@pytest.mark.parametrize(("required", "sent"), [(["m"], {"m": None}), ([], {})])
def test_a_nullable_enum_left_on_the_blank_choice_is_null_when_required(
    required: list[str], sent: dict
) -> None:
    """A nullable enum gets the blank choice "—" and is not marked required, but choosing it
    left the value out, so the schema's ``required`` refused every such answer ("This field
    is required.") while a nullable integer left blank sent null. An optional one is still
    left out."""
    schema = {
        "type": "object",
        "properties": {"m": {"type": ["string", "null"], "enum": ["a", "b", None]}},
        "required": required,
    }
    spec = answers.read_question(schema)
    (item,) = spec.inputs()
    assert "—" in str(answers.SchemaAnswerForm(spec)[item.name])
    form = answers.SchemaAnswerForm(spec, {"question": "1", item.name: ""})
    assert form.is_valid(), form.errors
    assert form.answer() == sent


def test_a_password_in_an_answer_goes_to_the_agent_only(alpha, people, no_dispatch) -> None:  # noqa: F811
    """A ``writeOnly`` / ``format: password`` property was a plain text input, typed back
    into the page after an error, and kept in the log for every viewer."""
    schema = {**schema_of(user={"type": "string"},
                          pin={"type": "string", "format": "password", "writeOnly": True,
                               "minLength": 8}), "required": ["user", "pin"]}  # fmt: skip
    task = asking(alpha, "pin", question(schema))
    operator, viewer = people[Membership.Role.OPERATOR], people[Membership.Role.VIEWER]
    page = operator.get(reverse("task-detail", args=[task.pk])).content.decode()
    assert f'type="password" name="{names(task)["pin"]}"' in page
    refused = post_answer(operator, task, {"user": "ada", "pin": "s3cr3t"})
    assert refused.status_code == 400 and "s3cr3t" not in refused.content.decode()
    sent = post_answer(operator, task, {"user": "ada", "pin": "s3cr3t-PIN-99"})
    assert sent.status_code == 302
    task.refresh_from_db()
    parts = task.outbox["message"]["parts"]
    assert parts[1]["data"] == {"user": "ada", "pin": "s3cr3t-PIN-99"}  # the agent gets it
    assert "s3cr3t" not in parts[0]["text"]  # the summary line does not carry it
    kept = json.dumps([
        list(TaskEvent.objects.filter(task=task).values_list("raw", flat=True)),
        list(ConversationMessage.objects.filter(task=task).values_list("message", flat=True)),
        list(OperatorAction.objects.filter(task=task).values_list("payload", flat=True)),
    ]) + viewer.get(reverse("task-detail", args=[task.pk])).content.decode()  # fmt: skip
    assert "s3cr3t" not in kept and HIDDEN in kept


def test_a_password_the_agent_carries_back_in_its_history_is_not_kept(
    alpha,  # noqa: F811
    people,  # noqa: F811
    no_dispatch,
) -> None:
    """The answer's own row hid the typed value, but the agent's snapshot carries the message
    back whole in its history (the send's reply, every GetTask, a push): that row kept it,
    for every reader of the log, the exports and the live rows."""
    schema = {**schema_of(pin={"type": "string", "format": "password"}), "required": ["pin"]}
    task = asking(alpha, "echo", question(schema))
    post_answer(people[Membership.Role.OPERATOR], task, {"pin": "s3cr3t-PIN-42"})
    task.refresh_from_db()
    sent = task.outbox["message"]  # what the agent got, and repeats
    assert "s3cr3t-PIN-42" in json.dumps(sent)
    reply = {"task": {"id": "t-echo", "contextId": "c", "history": [sent],
                      "status": {"state": "TASK_STATE_WORKING"}}}  # fmt: skip
    first = record(task, reply, "send")
    again = record(task, reply, "poll")  # the same snapshot read again: nothing new
    assert first.seqs and not again.seqs
    row = TaskEvent.objects.get(task=task, seq=first.seqs[0])
    assert "s3cr3t" not in json.dumps(row.raw) and HIDDEN in json.dumps(row.raw)
    assert "password fields hidden" in row.note
    viewer = people[Membership.Role.VIEWER]
    page = viewer.get(reverse("task-detail", args=[task.pk])).content.decode()
    event = viewer.get(reverse("event-detail", args=[task.pk, row.seq])).content.decode()
    assert "s3cr3t" not in page + event
    # An agent's message of its own that repeats nothing of ours is kept as it came.
    own = {"statusUpdate": {"taskId": "t-echo", "contextId": "c", "status": {
        "state": "TASK_STATE_WORKING", "message": {"messageId": "m-agent", "role": "ROLE_AGENT",
                                                    "parts": [{"text": "PIN taken"}]}}}}  # fmt: skip
    kept = TaskEvent.objects.get(task=task, seq=record(task, own, "poll").seqs[0])
    assert kept.raw == own and "password" not in kept.note


def test_a_question_changed_under_the_same_seq_is_not_answered_blind(
    alpha,  # noqa: F811
    people,  # noqa: F811
    no_dispatch,
) -> None:
    """A snapshot with the same state and status time but another question (another schema)
    kept the question's seq: a form filled for the tip was sent as a transfer amount. It is
    a new question now (a new seq), and the old form is refused as one for an older one."""
    first = question(schema_of(tip_percent={"type": "number"}))
    task = asking(alpha, "changed", first)
    operator = people[Membership.Role.OPERATOR]
    stamp = "2026-01-01T00:00:00Z"

    def snapshot(message: dict) -> None:
        status = {"state": "TASK_STATE_INPUT_REQUIRED", "timestamp": stamp, "message": message}
        record(task, {"task": {"id": task.remote_id, "contextId": "c", "status": status}}, "poll")
        task.refresh_from_db()

    snapshot({**first, "messageId": "q-stamped"})  # the question, now with its status time
    form = {"question": task.asked_seq, "asked": answers.question_key(task),
            names(task)["tip_percent"]: "15"}  # fmt: skip
    asked = task.asked_seq
    snapshot(question(schema_of(transfer_amount_eur={"type": "number"})))
    assert task.asked_seq > asked  # another message at the same time: asked again
    assert "transfer_amount_eur" in names(task)
    # The old form's field names may be the new form's: it must not be read against it.
    form[names(task)["transfer_amount_eur"]] = "15"
    answer = operator.post(reverse("task-answer", args=[task.pk]), form)
    assert answer.status_code == 400 and "asked something else since" in answer.content.decode()
    task.refresh_from_db()
    assert task.outbox is None


def test_a_form_for_a_question_already_answered_says_who_and_shows_the_new_one(
    alpha,  # noqa: F811
    people,  # noqa: F811
    no_dispatch,
    django_user_model,
) -> None:
    """The old question's form was read against the new question's schema ("This field is
    required" on a field the person never saw), with no word that someone had answered."""
    from tasks_app.services import tasks as task_services

    task = asking(alpha, "twice", question())
    first_form = {"question": task.asked_seq, "asked": answers.question_key(task),
                  "text": "from ann"}  # fmt: skip
    bob = django_user_model.objects.create_user("bob-person", password="pw-12345678")
    from tests.people import member

    member(bob, Membership.Role.OPERATOR, "alpha")
    task_services.answer_task(task, "from bob", actor_id=bob.pk)
    record(task, {"statusUpdate": {"taskId": task.remote_id, "contextId": "c", "status": {
        "state": "TASK_STATE_INPUT_REQUIRED",
        "message": question(schema_of(amount={"type": "number"}), text="How much?")}}}, "poll")  # fmt: skip
    answer = people[Membership.Role.OPERATOR].post(
        reverse("task-answer", args=[task.pk]), first_form
    )
    page = answer.content.decode()
    assert answer.status_code == 400
    assert "Already answered by bob-person" in page and "asked something else" in page
    assert "This field is required" not in page


def test_a_file_attached_to_an_answer_that_failed_is_asked_for_again(
    alpha,  # noqa: F811
    people,  # noqa: F811
    no_dispatch,
) -> None:
    """The file was dropped without a word: the corrected answer went without it, and the
    question, answered once, could not be answered again."""
    from django.core.files.uploadedfile import SimpleUploadedFile

    task = asking(alpha, "file", question())
    post = {"question": task.asked_seq, "asked": answers.question_key(task), "text": "here",
            "data": "{bad", "file": SimpleUploadedFile("contract.pdf", b"%PDF-1.4")}  # fmt: skip
    answer = people[Membership.Role.OPERATOR].post(reverse("task-answer", args=[task.pk]), post)
    assert answer.status_code == 400
    assert "Attach the file again" in answer.content.decode()


def test_an_auth_required_question_warns_that_the_answer_is_kept_for_the_project(
    alpha,  # noqa: F811
    people,  # noqa: F811
) -> None:
    """A token pasted as the answer to an authorization question was shown to every viewer
    of the project, and nothing on the form said it would be."""
    task = asking(alpha, "auth", question(), state="TASK_STATE_AUTH_REQUIRED")
    page = people[Membership.Role.OPERATOR].get(reverse("task-detail", args=[task.pk]))
    assert "do not paste a password or token" in page.content.decode()


def test_the_inbox_reads_its_rows_answers_at_once(
    alpha,  # noqa: F811
    people,  # noqa: F811
    no_dispatch,
    django_user_model,
) -> None:
    """Each answered row read its answer message on its own: the page's queries grew with
    its rows, and every such row had the same element id."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from tasks_app.services import tasks as task_services

    user = django_user_model.objects.get(username=f"{Membership.Role.OPERATOR}-person")
    operator = people[Membership.Role.OPERATOR]

    def answered(count: int) -> int:
        for i in range(count):
            task = asking(alpha, f"q{count}-{i}", question())
            task_services.answer_task(task, f"answer {i}", actor_id=user.pk)
        with CaptureQueriesContext(connection) as queries:
            page = operator.get(reverse("inbox")).content.decode()
        assert page.count('class="answer-record"') == len(set(
            line for line in page.split('id="answer-record-')[1:]))  # fmt: skip
        assert 'id="answer-record"' not in page
        return len(queries)

    few = answered(2)
    many = answered(8)
    assert many == few


HTML = {"HTTP_ACCEPT": "text/html,application/xhtml+xml,*/*;q=0.8"}  # as a browser asks


@pytest.mark.parametrize("page", ["task-answer", "inbox-answer"])
def test_a_nul_in_an_answer_shows_the_form_again_with_the_answer_kept(
    alpha,  # noqa: F811
    people,  # noqa: F811
    no_dispatch,
    page: str,
) -> None:
    """A NUL pasted into an answer (free text, or a field of a schema's form) was refused
    before the view: the site's 400 page, the answer not on it. Now the form comes back, with
    what was typed minus the NUL and the field marked, and nothing is sent."""
    from tasks_app.forms import NUL_REMOVED

    operator = people[Membership.Role.OPERATOR]
    free = asking(alpha, f"free-{page}", question())
    schema = asking(alpha, f"schema-{page}", question(schema_of(city={"type": "string"})))
    for task, field, typed in (
        (free, "text", "Ship it\x00 on Monday."),
        (schema, names(schema)["city"], "Par\x00is"),
    ):
        prefix = f"t{task.pk}-" if page == "inbox-answer" else ""
        data = {"question": task.asked_seq, "asked": answers.question_key(task), field: typed}
        answer = operator.post(
            reverse(page, args=[task.pk]), {f"{prefix}{k}": v for k, v in data.items()}, **HTML
        )
        assert answer.status_code == 400, (page, field)
        body = answer.content.decode()
        assert "\x00" not in body and NUL_REMOVED in body
        assert typed.replace("\x00", "") in body  # what was typed comes back, minus the NUL
        assert 'id="bad-request"' not in body  # the page with its form, not the bare 400 page
        task.refresh_from_db()
        assert not task.outbox and task.answered_by_id is None  # nothing sent
    assert not no_dispatch and not OperatorAction.objects.exists()  # nothing sent, nothing logged
