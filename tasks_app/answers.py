"""Answers to an agent's question: a form generated from the JSON Schema the agent sent, or free text.

An agent that asks (``input-required``) may say what shape of answer it expects: a data part
of its status message carrying a JSON Schema (which spellings are accepted: ``find_schema``
and docs/answers.md). The schema comes from an untrusted agent, so it is bounded (size,
depth, number of fields, enum sizes, no ``$ref``, no quantified groups in patterns) and
checked against its metaschema; one beyond the bounds or invalid falls back to the free-text
form with a note saying why.

A usable schema becomes a Django form: one field per property (strings, numbers, integers,
booleans, enums as radios or a select, ``date``/``date-time`` formats as date inputs, arrays
of scalars as one item per line or checkboxes for enums) with nested objects as fieldsets.
The form only converts what was typed into JSON values; the answer object is then validated
against the whole schema with ``jsonschema`` (so keywords the form does not render, like
``pattern`` or ``multipleOf``, still hold), and each error is shown next to its field. Only a
valid answer is sent, as a data part (the object) plus a short text part summarising it.

Field names are positional (``a_0_2``: the third property of the first property), never the
agent's property names, which may hold anything.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

import regex
from django import forms
from django.http import HttpRequest
from django.utils import timezone
from jsonschema import Draft202012Validator, FormatChecker
from jsonschema.exceptions import SchemaError, ValidationError
from jsonschema.validators import extend, validator_for

from tasks_app import upload_budget
from tasks_app.a2a.safejson import whole_number
from tasks_app.forms import AnswerForm, NulRemovingForm
from tasks_app.models import RemoteTask
from tasks_app.redaction import hide_secrets
from tasks_app.services import tasks as task_services

# Bounds on what an agent's schema may ask for (beyond them: free text, with a note).
MAX_SCHEMA_BYTES = 32_000
MAX_DEPTH = 4  # objects nested below the answer object
MAX_FIELDS = 50
MAX_ENUM = 100
MAX_OPTIONS = 500  # enum options of all the form's inputs together (each is drawn)
MAX_ENUM_VALUE_CHARS = 200
MAX_NAME_CHARS = 200
MAX_PATTERN_CHARS = 100
MAX_JSON_NESTING = 32  # lists and objects inside the schema document, any keyword
MAX_TEXT = 10_000  # the longest string input, whatever maxLength says
MAX_ARRAY_ITEMS = 200
RADIO_UP_TO = 5  # enums with more options are a select
LABEL_CHARS = 200
HELP_CHARS = 1_000

SCHEMA_MEDIA_TYPES = ("application/schema+json",)
SCHEMA_KINDS = ("answer-schema", "schema")
SCALARS = ("string", "number", "integer", "boolean")
# A group followed by a quantifier: the shape of catastrophic backtracking.
_QUANTIFIED_GROUP = re.compile(r"\)\s*[*+?{]")
_REFERENCES = ("$ref", "$dynamicRef", "$recursiveRef")


# The longest one check of an agent's pattern may run (the ``regex`` module's timeout): a
# pattern that passes the shape checks can still backtrack for hours (``(?x)`` hides a
# group's quantifier behind a comment), and ``re`` holds the interpreter while it does.
PATTERN_SECONDS = 0.05


def pattern_search(pattern: str, text: str) -> bool | None:
    """Whether ``pattern`` is found in ``text``; None when that is not known in time (or the
    pattern is not one ``regex`` reads): not checked here, so it is not a failure."""
    try:
        return regex.search(pattern, text, timeout=PATTERN_SECONDS) is not None
    except (TimeoutError, regex.error, RecursionError, OverflowError, ValueError):
        return None


def _bounded_pattern(validator: Any, pattern: Any, instance: Any, schema: Any) -> Iterator[Any]:
    """JSON Schema's ``pattern``, checked within PATTERN_SECONDS (jsonschema runs ``re``)."""
    if not isinstance(instance, str) or not isinstance(pattern, str):
        return
    if pattern_search(pattern, instance) is False:
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _multiple_of(validator: Any, step: Any, instance: Any, schema: Any) -> Iterator[Any]:
    """JSON Schema's ``multipleOf``, in decimal: jsonschema's float arithmetic refused
    0.07 as a multiple of 0.01 (no input could pass), and raised on a step of 10**400."""
    if not validator.is_type(instance, "number") or not validator.is_type(step, "number"):
        return
    try:
        whole = Decimal(str(instance)) % Decimal(str(step)) == 0
    except (InvalidOperation, ArithmeticError, ValueError):
        return  # not decided: not held against the person
    if not whole:
        yield ValidationError(f"{instance!r} is not a multiple of {step!r}")


log = logging.getLogger(__name__)


@functools.cache
def _bounded(cls: type) -> type:
    """The schema's validator class with ``pattern`` bounded in time and ``multipleOf``
    decided in decimal (made once per draft). Draft 3 calls it ``divisibleBy``: left to
    jsonschema's floats, a long number was a 500 and 0.07 no multiple of 0.01."""
    overrides: dict[str, Any] = {"pattern": _bounded_pattern}
    for keyword in ("multipleOf", "divisibleBy"):
        if keyword in cls.VALIDATORS:  # type: ignore[attr-defined]
            overrides[keyword] = _multiple_of
    return extend(cls, overrides)


@functools.cache
def _format_checker(cls: type) -> FormatChecker:
    """The draft's ``format`` checks, each sure to answer (made once per draft).

    A check that raises anything but its own error says the text is not of the format:
    ``format: regex`` compiles what the person typed with ``re``, and ``a{4294967296}``
    raised ``OverflowError``, 4,000 ``(`` ``RecursionError``: the answer form answered 500.
    """
    checker = FormatChecker(formats=())
    for name, (func, raises) in cls.FORMAT_CHECKER.checkers.items():
        checker.checks(name, raises=raises)(_always_answers(func, raises))
    return checker


def _always_answers(func: Callable[[Any], bool], raises: Any) -> Callable[[Any], bool]:
    def check(instance: Any) -> bool:
        try:
            return func(instance)
        except raises:
            raise  # the check's own way of saying no (it becomes the error's cause)
        except (RecursionError, OverflowError, ValueError, TypeError, LookupError):
            return False

    return check


class Unusable(Exception):
    """The agent's schema cannot become a form; the message says why, in plain words."""


# Finding the schema in the question -------------------------------------------------------


def find_schema(message: Any) -> Any:
    """The schema a question carries, or None. The first data part that is one of:

    * ``mediaType`` ``application/schema+json`` (parameters allowed);
    * ``metadata.kind`` ``"answer-schema"`` (or ``"schema"``), or ``metadata.schema`` true;
    * a data object with a ``schema`` member that is an object (``{"schema": {...}}``).

    In the first two, data of the form ``{"schema": {...}}`` (and nothing that looks like a
    schema itself) is unwrapped too.
    """
    if not isinstance(message, dict) or not isinstance(message.get("parts"), list):
        return None
    for part in message["parts"]:
        if not isinstance(part, dict) or "data" not in part:
            continue
        data = part["data"]
        media = part.get("mediaType")
        media = media.split(";", 1)[0].strip().lower() if isinstance(media, str) else ""
        metadata = part.get("metadata") if isinstance(part.get("metadata"), dict) else {}
        flagged = (
            media in SCHEMA_MEDIA_TYPES
            or metadata.get("kind") in SCHEMA_KINDS
            or metadata.get("schema") is True
        )
        wrapped = isinstance(data, dict) and isinstance(data.get("schema"), dict)
        if flagged:
            if wrapped and "type" not in data and "properties" not in data:
                return data["schema"]
            return data
        if wrapped:
            return data["schema"]
    return None


# The layout: what the form holds, in order ------------------------------------------------


@dataclass(frozen=True)
class Input:
    """One form field: where its value goes in the answer and how it is read."""

    name: str
    path: tuple[str, ...]
    kind: str  # string, number, integer, boolean, enum, date, date-time, lines, choices
    label: str
    help: str
    required: bool  # within its object (marked with *)
    nullable: bool
    schema: dict = field(hash=False, compare=False)
    # Required all the way up: only then may the form insist; inside an optional object that
    # is left empty it may stay empty (the schema judges the object once anything is in it).
    needed: bool = True


@dataclass(frozen=True)
class Group:
    """A nested object: a fieldset of inputs and groups."""

    name: str
    path: tuple[str, ...]
    label: str
    help: str
    required: bool
    children: tuple[Input | Group, ...] = ()
    needed: bool = True  # required all the way up (see Input)


@dataclass(frozen=True)
class Question:
    """What a question asks for: a schema and its layout, or a note on why it is free text."""

    schema: dict | None = None
    root: Group | None = None
    note: str = ""

    def inputs(self) -> Iterator[Input]:
        stack: list[Input | Group] = [self.root] if self.root else []
        while stack:
            item = stack.pop()
            if isinstance(item, Group):
                stack.extend(reversed(item.children))
            else:
                yield item


def _walk_bounds(schema: Any) -> None:
    """Nesting, references and patterns anywhere in the document (any keyword)."""
    stack: list[tuple[Any, int]] = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_NESTING:
            raise Unusable(f"it is nested more than {MAX_JSON_NESTING} levels deep")
        if isinstance(node, dict):
            for key in _REFERENCES:
                if key in node:
                    raise Unusable(f"it uses {key} (references are not followed)")
            pattern = node.get("pattern")
            if isinstance(pattern, str) and (
                len(pattern) > MAX_PATTERN_CHARS or _QUANTIFIED_GROUP.search(pattern)
            ):
                raise Unusable(
                    "a pattern is too long or repeats a group (it could take too long to check)"
                )
            if isinstance(node.get("patternProperties"), dict):
                raise Unusable("it uses patternProperties")
            stack.extend((value, depth + 1) for value in node.values())
        elif isinstance(node, list):
            stack.extend((value, depth + 1) for value in node)


def _types(schema: dict) -> tuple[str | None, bool]:
    """The one type a property has, and whether null is allowed too."""
    declared = schema.get("type")
    if isinstance(declared, str):
        return declared, False
    if isinstance(declared, list) and all(isinstance(t, str) for t in declared):
        others = [t for t in declared if t != "null"]
        if len(others) == 1:
            return others[0], len(others) != len(declared)
        raise Unusable(f"a property allows several types ({', '.join(declared)})")
    if declared is None:
        if isinstance(schema.get("enum"), list):
            return None, None in schema["enum"]
        if isinstance(schema.get("properties"), dict):
            return "object", False
        return None, False
    raise Unusable("a property's type is not a name or a list of names")


def _text(value: Any, limit: int) -> str:
    return (
        str(value)[:limit]
        if isinstance(value, str | int | float) and not isinstance(value, bool)
        else ""
    )


def _check_enum(values: Any) -> list:
    if not isinstance(values, list) or not values:
        raise Unusable("an enum is empty or not a list")
    if len(values) > MAX_ENUM:
        raise Unusable(f"an enum has more than {MAX_ENUM} options")
    for value in values:
        if isinstance(value, dict | list):
            raise Unusable("an enum offers objects or arrays")
        if len(json.dumps(value)) > MAX_ENUM_VALUE_CHARS:
            raise Unusable(f"an enum option is longer than {MAX_ENUM_VALUE_CHARS} characters")
    return values


def _ordered(properties: dict, required: list) -> list[tuple[str, Any]]:
    """Properties in the order to ask for them, the same wherever the question was stored:

    1. by ``propertyOrder`` where given (the convention of json-editor);
    2. then the required properties, in the order ``required`` lists them;
    3. then the rest, in the order received.

    An object's key order does not survive everywhere (protobuf's ``Struct`` on the agent's
    side, PostgreSQL's ``jsonb`` on ours), while an array's order does: so what the agent
    insists on comes first, in its order.
    """
    position = {name: i for i, name in enumerate(required) if isinstance(name, str)}

    def key(entry: tuple[int, tuple[str, Any]]) -> tuple[int, float, int]:
        index, (name, sub) = entry
        order = sub.get("propertyOrder") if isinstance(sub, dict) else None
        if isinstance(order, int | float) and not isinstance(order, bool):
            try:
                place = float(order)
            except OverflowError:  # an integer beyond any float: not an order
                place = math.nan
            if math.isfinite(place):
                return (0, place, index)
        if name in position:
            return (1, float(position[name]), index)
        return (2, 0.0, index)

    return [item for _, item in sorted(enumerate(properties.items()), key=key)]


class _Builder:
    def __init__(self) -> None:
        self.count = 0
        self.options = 0

    def group(
        self,
        schema: dict,
        path: tuple[str, ...],
        name: str,
        label: str,
        required: bool,
        depth: int,
        needed: bool = True,
    ) -> Group:
        if depth > MAX_DEPTH:
            raise Unusable(f"objects are nested more than {MAX_DEPTH} levels deep")
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties:
            raise Unusable("an object has no properties to fill in")
        wanted = schema.get("required") if isinstance(schema.get("required"), list) else []
        # A name no input fills would fail every answer: the task could never be answered.
        named = [n for n in wanted if isinstance(n, str)]
        dependent = schema.get("dependentRequired")
        if isinstance(dependent, dict):
            named += [n for names in dependent.values() if isinstance(names, list) for n in names]
        missing = next((n for n in named if n not in properties), None)
        if missing is not None:
            raise Unusable(f"it requires {missing[:40]!r}, a property it does not describe")
        children: list[Input | Group] = []
        for index, (key, sub) in enumerate(_ordered(properties, wanted)):
            if len(key) > MAX_NAME_CHARS:
                raise Unusable(f"a property name is longer than {MAX_NAME_CHARS} characters")
            if not isinstance(sub, dict):
                raise Unusable(f"property {key[:40]!r} is not described by an object")
            children.append(
                self.item(sub, (*path, key), f"{name}_{index}", key in wanted, depth, needed)
            )
        return Group(
            name,
            path,
            label,
            _text(schema.get("description"), HELP_CHARS),
            required,
            tuple(children),
            needed,
        )

    def item(
        self,
        schema: dict,
        path: tuple[str, ...],
        name: str,
        required: bool,
        depth: int,
        parent_needed: bool,
    ) -> Input | Group:
        kind, nullable = _types(schema)
        label = _text(schema.get("title"), LABEL_CHARS) or path[-1][:LABEL_CHARS]
        if kind == "object":
            return self.group(
                schema, path, name, label, required, depth + 1, required and parent_needed
            )
        self.count += 1
        if self.count > MAX_FIELDS:
            raise Unusable(f"it asks for more than {MAX_FIELDS} fields")
        help_text = _text(schema.get("description"), HELP_CHARS)
        _check_possible(schema, path)
        if "enum" in schema:
            self._count_options(_check_enum(schema["enum"]))
            kind = "enum"
        elif kind == "array":
            kind = self.array(schema, path)
        elif kind == "string" and schema.get("format") in ("date", "date-time"):
            kind = schema["format"]
        elif kind not in SCALARS:
            raise Unusable(f"property {path[-1][:40]!r} has no type the form can ask for")
        return Input(
            name,
            path,
            kind,
            label,
            help_text,
            required,
            nullable,
            schema,
            required and parent_needed,
        )

    def _count_options(self, values: list) -> None:
        self.options += len(values)
        if self.options > MAX_OPTIONS:
            # Each option is drawn, in every form of the inbox's page too.
            raise Unusable(f"it offers more than {MAX_OPTIONS} options in all")

    def array(self, schema: dict, path: tuple[str, ...]) -> str:
        items = schema.get("items")
        if not isinstance(items, dict):
            raise Unusable(f"array {path[-1][:40]!r} does not describe its items")
        if "enum" in items:
            self._count_options(_check_enum(items["enum"]))
            return "choices"
        kind, _ = _types(items)
        if kind not in SCALARS:
            raise Unusable(
                f"array {path[-1][:40]!r} holds objects or arrays (only lists of values are asked for)"
            )
        return "lines"


def _check_possible(schema: dict, path: tuple[str, ...]) -> None:
    """Bounds no input can meet (the form's own caps included) make a question no one can
    answer: said here, the person gets free text instead."""
    name = repr(path[-1][:40])

    def number(key: str) -> Any:
        value = schema.get(key)
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None

    least, most = number("minLength"), number("maxLength")
    if least is not None and (least > MAX_TEXT or (most is not None and least > most)):
        raise Unusable(f"property {name} asks for more characters than can be given")
    least, most = number("minItems"), number("maxItems")
    if least is not None and (least > MAX_ARRAY_ITEMS or (most is not None and least > most)):
        raise Unusable(f"property {name} asks for more items than can be given")
    least, most = number("minimum"), number("maximum")
    if least is not None and most is not None and least > most:
        raise Unusable(f"property {name} asks for a number above its maximum")


def read_question(schema: Any) -> Question:
    """The form layout for a schema, or a Question whose note says why it is free text."""
    if schema is None:
        return Question()
    try:
        size = len(json.dumps(schema))
    except (TypeError, ValueError, RecursionError):
        return Question(note="The agent's answer schema is not valid JSON.")
    if size > MAX_SCHEMA_BYTES:
        return Question(
            note=f"The agent's answer schema is larger than {MAX_SCHEMA_BYTES // 1000} KB."
        )
    try:
        if not isinstance(schema, dict):
            raise Unusable("it is not an object")
        _walk_bounds(schema)
        cls = validator_for(schema, default=Draft202012Validator)
        try:
            cls.check_schema(schema)
        except SchemaError as exc:
            raise Unusable(f"it is not a valid JSON Schema ({exc.message[:200]})") from exc
        kind, _ = _types(schema)
        if kind != "object":
            raise Unusable("the answer it describes is not an object")
        root = _Builder().group(schema, (), "a", "", True, 0)
        for item in Question(root=root).inputs():
            make_field(item)  # what the page will draw: a value no field takes fails here
    except Unusable as exc:
        return Question(note=f"The agent's answer schema could not become a form: {exc}.")
    except Exception as exc:  # an agent's document in a shape nothing here expected
        log.warning("an answer schema could not become a form: %r", exc)
        return Question(note="The agent's answer schema could not become a form.")
    return Question(schema=schema, root=root)


_cache: OrderedDict[bytes, Question] = OrderedDict()
_cache_lock = threading.Lock()
CACHE_SIZE = 128


def question_of(task: RemoteTask) -> Question:
    """What the task's current question asks for (remembered per schema: pages redraw often)."""
    if task.state != "TASK_STATE_INPUT_REQUIRED":
        return Question()
    schema = find_schema(task.status_message)
    if schema is None:
        return Question()
    try:
        key = hashlib.sha256(json.dumps(schema, sort_keys=True).encode()).digest()
    except (TypeError, ValueError, RecursionError):
        return Question(note="The agent's answer schema is not valid JSON.")
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    question = read_question(schema)
    with _cache_lock:
        _cache[key] = question
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return question


# The generated form -------------------------------------------------------------------------


def _choices(values: list) -> list[tuple[str, str]]:
    """Enum options keyed by their JSON text, so numbers and booleans come back as they were."""
    return [(json.dumps(v), "(none)" if v is None else str(v)) for v in values]


def _num(value: Any) -> Any:
    """2.0 as 2: agents built on protobuf send every number as a double."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _attrs(schema: dict) -> dict[str, Any]:
    """Hints the browser can act on; the server checks the schema anyway."""
    attrs: dict[str, Any] = {}
    for keyword, attr in (
        ("minimum", "min"),
        ("maximum", "max"),
        ("minLength", "minlength"),
        ("maxLength", "maxlength"),
    ):
        value = schema.get(keyword)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attrs[attr] = _num(value)
    return attrs


def make_field(item: Input) -> forms.Field:
    """The Django field for one input: it converts what is typed; the schema judges it."""
    s = item.schema
    common: dict[str, Any] = {
        "label": item.label,
        "help_text": item.help,
        # Left empty, a nullable value is sent as null: the form need not insist.
        "required": item.needed
        and not item.nullable
        and item.kind not in ("boolean", "choices", "lines"),
    }
    default = s.get("default")
    if item.kind == "enum":
        choices = _choices(s["enum"])
        if not common["required"]:
            choices = [("", "—"), *choices]
        widget = forms.RadioSelect if len(choices) <= RADIO_UP_TO else forms.Select
        f: forms.Field = forms.ChoiceField(choices=choices, widget=widget, **common)
        if default is not None or (default is None and "default" in s):
            f.initial = json.dumps(default)
        return f
    if item.kind == "boolean":
        f = forms.BooleanField(**{**common, "required": False})
        f.initial = default if isinstance(default, bool) else False
        return f
    if item.kind == "integer":
        f = forms.IntegerField(widget=forms.NumberInput(attrs=_attrs(s)), **common)
    elif item.kind == "number":
        f = forms.FloatField(widget=forms.NumberInput(attrs={**_attrs(s), "step": "any"}), **common)
    elif item.kind == "date":
        f = forms.DateField(
            widget=forms.DateInput(attrs={"type": "date"}, format="%Y-%m-%d"),
            input_formats=["%Y-%m-%d"],
            **common,
        )
    elif item.kind == "date-time":
        f = forms.DateTimeField(
            widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
            input_formats=["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S"],
            **common,
        )
    elif item.kind == "choices":
        f = forms.MultipleChoiceField(
            choices=_choices(s["items"]["enum"]), widget=forms.CheckboxSelectMultiple, **common
        )
        if isinstance(default, list):
            f.initial = [json.dumps(v) for v in default]
        return f
    elif item.kind == "lines":
        item_type = _types(s["items"])[0]
        hint = {
            "string": "text",
            "number": "number",
            "integer": "whole number",
            "boolean": "true or false",
        }[item_type]
        common["help_text"] = " ".join(filter(None, [item.help, f"One {hint} per line."]))
        f = forms.CharField(
            widget=forms.Textarea(attrs={"rows": 3}), max_length=MAX_TEXT, strip=False, **common
        )
        if isinstance(default, list):
            f.initial = "\n".join(json.dumps(v) if not isinstance(v, str) else v for v in default)
        return f
    else:  # string
        if is_secret(s):
            widget: forms.Widget = forms.PasswordInput(render_value=False, attrs=_attrs(s))
        elif s.get("format") == "email":
            widget = forms.EmailInput()
        else:
            widget = forms.TextInput(attrs=_attrs(s))
        limit = _num(s.get("maxLength"))
        limit = (
            min(limit, MAX_TEXT)
            if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
            else MAX_TEXT
        )
        widget.attrs["maxlength"] = limit
        f = forms.CharField(widget=widget, max_length=limit, strip=False, **common)
    if default is not None and not isinstance(default, dict | list):
        f.initial = _num(default)
    return f


def is_secret(schema: dict) -> bool:
    """A string the schema marks as a secret: drawn as a password input, hidden in the log."""
    return schema.get("writeOnly") is True or schema.get("format") == "password"


def _filled(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_filled(v) for v in value.values())
    return value is not False


def _line_value(line: str, item_type: str) -> Any:
    if item_type == "integer":
        return int(line)
    if item_type == "number":
        value = float(line)
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(line)
        return value
    if item_type == "boolean":
        if line.lower() in ("true", "yes", "1"):
            return True
        if line.lower() in ("false", "no", "0"):
            return False
        raise ValueError(line)
    return line


class SchemaAnswerForm(NulRemovingForm):
    """A form made from an agent's answer schema; ``answer()`` is the validated object."""

    question = forms.IntegerField(min_value=0, widget=forms.HiddenInput)
    asked = forms.CharField(required=False, max_length=64, widget=forms.HiddenInput)
    schema_driven = True

    def __init__(self, spec: Question, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spec = spec
        self.inputs = {item.name: item for item in spec.inputs()}
        for name, item in self.inputs.items():
            self.fields[name] = make_field(item)
        self._answer: dict | None = None

    # Reading what was typed -----------------------------------------------------------

    def _value(self, item: Input) -> tuple[bool, Any]:
        """(present, JSON value) of one input; absent values are left out of the answer."""
        value = self.cleaned_data.get(item.name)
        if item.kind == "boolean":
            return True, bool(value)
        if item.kind == "enum":
            if value in ("", None):
                # The blank choice "—": a nullable enum is never marked required (make_field),
                # so, as for every nullable type, a required one left blank is sent as null.
                return (True, None) if item.nullable and item.needed else (False, None)
            return True, json.loads(value)
        if item.kind == "choices":
            values = [json.loads(v) for v in value or []]
            return bool(values) or item.needed, values
        if item.kind == "lines":
            item_type = _types(item.schema["items"])[0]
            lines = [
                line.strip() for line in (value or "").replace("\r", "").split("\n") if line.strip()
            ]
            if len(lines) > MAX_ARRAY_ITEMS:
                raise forms.ValidationError(f"At most {MAX_ARRAY_ITEMS} lines.")
            values = []
            for line in lines:
                try:
                    values.append(_line_value(line, item_type))
                except ValueError as exc:
                    hint = {
                        "integer": "a whole number",
                        "number": "a number",
                        "boolean": "true or false",
                    }[item_type]
                    raise forms.ValidationError(
                        f"Each line must be {hint}; {line[:60]!r} is not."
                    ) from exc
            return bool(values) or item.needed, values
        if value in (None, ""):
            return (True, None) if item.nullable and item.needed else (False, None)
        if item.kind == "date":
            return True, value.isoformat() if isinstance(value, date) else value
        if item.kind == "date-time":
            if isinstance(value, datetime):
                if timezone.is_naive(value):
                    value = timezone.make_aware(value)
                return True, value.isoformat()
            return True, value
        return True, value

    def _build(self, group: Group) -> dict:
        out: dict[str, Any] = {}
        for child in group.children:
            key = child.path[-1]
            if isinstance(child, Group):
                nested = self._build(child)
                # An optional object counts as filled in by what a person typed or ticked:
                # an unticked box alone would make its required fields insist.
                if child.needed or _filled(nested):
                    out[key] = nested
                continue
            if child.name in self.errors:
                continue
            try:
                present, value = self._value(child)
            except forms.ValidationError as exc:
                self.add_error(child.name, exc)
                continue
            if present:
                out[key] = value
        return out

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        assert self.spec.root is not None and self.spec.schema is not None
        answer = self._build(self.spec.root)
        # The schema is checked even when some fields failed their own checks: its errors go
        # next to the other fields (a field in error keeps its own), so a person learns every
        # problem at once; checked only after the fields passed, "at most 10" came on a
        # second submit. The answer is taken only when nothing failed.
        cls = validator_for(self.spec.schema, default=Draft202012Validator)
        validator = _bounded(cls)(self.spec.schema, format_checker=_format_checker(cls))
        errors = sorted(
            validator.iter_errors(answer), key=lambda e: list(map(str, e.absolute_path))
        )
        for error in errors[:50]:
            self._place(error, answer)
        if not errors and not self.errors:
            self._answer = answer
        return data

    def _place(self, error: Any, answer: dict) -> None:
        """Put a schema error next to the field it is about (else above the form)."""
        path = tuple(str(p) for p in error.absolute_path)
        if error.validator == "required" and isinstance(error.validator_value, list):
            target = answer
            for key in path:
                target = target.get(key, {}) if isinstance(target, dict) else {}
            missing = [
                k for k in error.validator_value if isinstance(target, dict) and k not in target
            ]
            if missing:
                path = (*path, str(missing[0]))
        best: Input | None = None
        for item in self.inputs.values():
            if path[: len(item.path)] == item.path and (
                best is None or len(item.path) > len(best.path)
            ):
                best = item
        message = friendly(error)
        if best is not None and best.name not in self.errors:
            self.add_error(best.name, message)
        elif best is None:
            where = " / ".join(path)
            self.add_error(None, f"{where}: {message}" if where else message)

    # What is sent -------------------------------------------------------------------------

    def answer(self) -> dict:
        assert self._answer is not None, "answer() before a valid clean()"
        return self._answer

    def message_parts(self) -> tuple[str, Any, tuple[dict, ...]]:
        return summary(self.answer(), self.spec.root), self.answer(), ()

    def secret_values(self) -> set[str]:
        """What was typed into password fields (``writeOnly`` or ``format: password``)."""
        found = set()
        for item in self.inputs.values():
            if is_secret(item.schema):
                value: Any = self.answer()
                for key in item.path:
                    value = value.get(key) if isinstance(value, dict) else None
                if isinstance(value, str) and value:
                    found.add(value)
        return found

    def layout(self) -> list[dict]:
        """Bound fields and fieldsets in the schema's order, for the template."""

        def items(group: Group) -> list[dict]:
            out: list[dict] = []
            for child in group.children:
                if isinstance(child, Group):
                    out.append({"group": child, "items": items(child)})
                else:
                    out.append({"field": self[child.name]})
            return out

        return items(self.spec.root) if self.spec.root else []


_MESSAGES = {
    "maximum": "At most {}.",
    "minimum": "At least {}.",
    "exclusiveMaximum": "Less than {}.",
    "exclusiveMinimum": "More than {}.",
    "maxLength": "At most {} characters.",
    "minLength": "At least {} characters.",
    "maxItems": "At most {} items.",
    "minItems": "At least {} items.",
    "multipleOf": "A multiple of {}.",
    "divisibleBy": "A multiple of {}.",
    "format": "Enter a valid {}.",
    "enum": "Choose one of the options.",
    "const": "This value is fixed by the agent.",
    "required": "This field is required.",
    "pattern": "This does not have the expected form.",
    "uniqueItems": "Each item only once.",
}


def friendly(error: Any) -> str:
    """A schema error in plain words (the library's own message otherwise, shortened)."""
    v, value = error.validator, error.validator_value
    if v == "type":
        names = (
            [value]
            if isinstance(value, str)
            else [str(t) for t in value]
            if isinstance(value, list)
            else []
        )
        return f"Enter a {' or '.join(names) or 'value of the right type'}."
    if v == "minLength" and value == 1:
        return "This field is required."
    template = _MESSAGES.get(v)
    if template is None:
        return str(error.message)[:300]
    return template.format(str(_num(value))[:100]) if "{}" in template else template


def summary(answer: dict, root: Group | None, limit: int = 500) -> str:
    """The short text part sent with the data: "label: value; ..." (labels from the schema)."""
    labels: dict[tuple[str, ...], str] = {}
    secret: set[tuple[str, ...]] = set()
    stack: list[Input | Group] = [root] if root else []
    while stack:
        item = stack.pop()
        labels[item.path] = item.label
        if isinstance(item, Group):
            stack.extend(item.children)
        elif is_secret(item.schema):
            secret.add(item.path)

    def flat(value: Any, path: tuple[str, ...]) -> list[str]:
        if isinstance(value, dict):
            return [text for key, sub in value.items() for text in flat(sub, (*path, key))]
        shown = ", ".join(map(_scalar, value)) if isinstance(value, list) else _scalar(value)
        if path in secret:
            shown = "(given)"  # a password field's value goes in the data part only
        return [f"{labels.get(path, path[-1] if path else '')}: {shown}"]

    text = "Answer: " + "; ".join(flat(answer, ()))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _scalar(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return str(value)


# The free-text form, and the one way both are sent ------------------------------------------


def answer_form(
    task: RemoteTask, data: Any = None, files: Any = None, *, prefix: str | None = None
) -> forms.Form:
    """The form for the task's current question: generated from its schema, or free text.

    ``prefix`` keeps field names and ids apart when several forms share a page (the inbox).
    """
    question = question_of(task)
    initial = {"question": task.asked_seq, "asked": question_key(task)}
    if question.root is not None:
        return SchemaAnswerForm(question, data, initial=initial, prefix=prefix)
    form = AnswerForm(data, files, initial=initial, prefix=prefix)
    form.schema_note = question.note
    return form


def question_key(task: RemoteTask) -> str:
    """The question a form was drawn for: its seq alone does not name it (an agent's
    snapshot may change the question without a new status time). By the message's id, so
    that the same message read again (a GetTask after the stream) is the same question;
    by digest when it has none."""
    message = task.status_message
    if isinstance(message, dict) and isinstance(message.get("messageId"), str):
        text = "id:" + message["messageId"]
    else:
        text = json.dumps(message, sort_keys=True, ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def submit(request: HttpRequest, task: RemoteTask, form: forms.Form) -> tuple[bool, forms.Form]:
    """Validate and send the answer: (sent, the form to show again when nothing was sent).

    A form for another question than the current one (the agent asked again, maybe with
    another schema, or changed its question) is not read at all: a fresh form for the
    current question comes back, with a notice (who answered, when that is why).
    """
    raw = form.data.get(form.add_prefix("question")) if form.is_bound else None
    posted = whole_number(str(raw)) if raw is not None else None
    digest = form.data.get(form.add_prefix("asked")) if form.is_bound else None
    stale = posted is not None and posted != task.asked_seq
    changed = bool(digest) and digest != question_key(task)
    if stale or changed:
        fresh = answer_form(task, prefix=form.prefix)
        why = "The agent has asked something else since; read its new question."
        if stale and posted is not None and task.answered_seq >= posted:
            why = f"{task_services.answer_refusal(task.pk, posted)} {why}"
        elif changed and not stale:
            why = "The agent changed its question since; read it again."
        fresh.notice = why
        return False, fresh
    if not form.is_valid():
        return False, form
    text, data, files = form.message_parts()
    secrets = form.secret_values() if isinstance(form, SchemaAnswerForm) else set()
    charged, refused = upload_budget.charge(request.user.id, files)
    if refused:
        form.add_error("file" if "file" in form.fields else None, refused)
        return False, form
    try:
        task_services.answer_task(
            task,
            text,
            data=data,
            files=files,
            actor_id=request.user.id,
            question_seq=form.cleaned_data["question"],
            logged=(lambda sent: hide_secrets(sent, secrets)) if secrets else None,
        )
    except task_services.TaskActionError as exc:
        upload_budget.refund(request.user.id, charged)
        # What was typed stays; sending it again answers the question now shown.
        form.data = form.data.copy()
        current = RemoteTask.objects.filter(pk=task.pk).first()
        form.data[form.add_prefix("question")] = str(current.asked_seq if current else 0)
        form.data[form.add_prefix("asked")] = question_key(current) if current else ""
        form.add_error("text" if "text" in form.fields else None, str(exc))
        return False, form
    return True, form
