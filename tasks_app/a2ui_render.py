"""A2UI surfaces rendered on the server: the basic catalog as Django templates.

The agent describes a surface (components in the v0.9.1 basic-catalog form, whatever version
it spoke: ``services/surfaces.py`` folds and converts) and we draw it with our own templates;
nothing the agent sends is markup. Strings go through Django's autoescape; only a ``Text``'s
markdown is marked safe, and only after ``rendering.markdown_html`` sanitized it. Images and
other media are links (the browser never loads them from the agent's host by itself).

The same walk serves the page and the submit: it numbers the input instances and buttons it
draws (``v<n>``, ``b<n>``), so a posted form is read back against exactly the components the
person saw (the form carries the surface state it was drawn from, ``updated_seq``). The walk
is bounded in depth, in components drawn and in template items: an agent cannot make a page
or a submit cost more than that.

Functions (the catalog's ``checks`` and ``formatString`` & co.) are evaluated here for the
server's side; ``static/dashboard/a2ui.js`` evaluates the validation subset in the browser.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.template.loader import get_template
from django.utils.safestring import SafeString, mark_safe

from tasks_app import answers
from tasks_app.a2a.safejson import whole_number
from tasks_app.rendering import markdown_html, safe_http_url

log = logging.getLogger(__name__)

MAX_DEPTH = 24
MAX_NODES = 1500
# What one surface's drawing may write (each node's own markup, its children not counted
# twice): with the strings and JSON each node may show, 1,500 nodes could be tens of MB.
MAX_HTML_BYTES = 2_000_000
MAX_TEMPLATE_ITEMS = 200
MAX_STRING = 10_000
MAX_JSON_SHOWN = 20_000
MAX_INPUT_CHARS = 5_000
MAX_OPTIONS = 200
MAX_TABS = 50
# Dynamic values and function calls evaluated per drawing, per check of a posted form and per
# action context: one component of nested ``and`` calls (400 KB) evaluated at each of 1,400
# repeated child ids made a task page (and a submit) take 22 s. A real form needs a few hundred.
MAX_EVALUATIONS = 20_000

INPUT_KINDS = ("TextField", "CheckBox", "ChoicePicker", "DateTimeInput", "Slider")
CONTAINERS = ("Row", "Column", "List")
KNOWN = {
    "Text",
    "Image",
    "Icon",
    "Video",
    "AudioPlayer",
    "Divider",
    "Row",
    "Column",
    "List",
    "Card",
    "Tabs",
    "Modal",
    "Button",
    *INPUT_KINDS,
}

# The catalog's icon names, drawn as a glyph (no icon font: the page loads nothing foreign).
ICON_GLYPHS = {
    "accountCircle": "👤",
    "add": "+",
    "arrowBack": "←",
    "arrowForward": "→",
    "attachFile": "📎",
    "calendarToday": "📅",
    "call": "📞",
    "camera": "📷",
    "check": "✓",
    "close": "✕",
    "delete": "🗑",
    "download": "⤓",
    "edit": "✎",
    "event": "📅",
    "error": "⚠",
    "fastForward": "⏩",
    "favorite": "♥",
    "favoriteOff": "♡",
    "folder": "📁",
    "help": "?",
    "home": "⌂",
    "info": "\u2139",
    "locationOn": "📍",
    "lock": "🔒",
    "lockOpen": "🔓",
    "mail": "✉",
    "menu": "☰",
    "moreVert": "⋮",
    "moreHoriz": "⋯",
    "notificationsOff": "🔕",
    "notifications": "🔔",
    "pause": "⏸",
    "payment": "💳",
    "person": "👤",
    "phone": "📱",
    "photo": "🖼",
    "play": "▶",
    "print": "🖶",
    "refresh": "↻",
    "rewind": "⏪",
    "search": "🔍",
    "send": "➤",
    "settings": "⚙",
    "share": "⇪",
    "shoppingCart": "🛒",
    "skipNext": "⏭",
    "skipPrevious": "⏮",
    "star": "★",
    "starHalf": "⯪",
    "starOff": "☆",
    "stop": "⏹",
    "upload": "⤒",
    "visibility": "👁",
    "visibilityOff": "⊘",
    "volumeDown": "🔉",
    "volumeMute": "🔈",
    "volumeOff": "🔇",
    "volumeUp": "🔊",
    "warning": "⚠",
}
_SVG_PATH = re.compile(r"^[MmLlHhVvCcSsQqTtAaZz0-9eE.,+\-\s]{1,4000}$")
_EMAIL = re.compile(r"^[^@\s]{1,200}@[^@\s.]{1,200}(\.[^@\s.]{1,200})+$")
# Patterns the server runs: the answers' rule (no quantified group, a short pattern) plus no
# back-references or look-arounds, and few repetitions for the length of the value, since
# Python's re has no timeout and adjacent repetitions backtrack polynomially. Otherwise the
# check is left to the agent (which checks what it receives anyway): the page's script
# (static/dashboard/a2ui.js, usablePattern) runs the same patterns only, or a viewer's tab
# hung on an agent's pattern and the value it filled in.
_BACKREF = re.compile(r"\\[1-9]|\(\?P=|\(\?<?[=!]")
_CLASS_OR_ESCAPE = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]")
_QUANTIFIER = re.compile(r"[*+?{]")


# JSON Pointer ---------------------------------------------------------------------------------


def absolute(path: Any, scope: str = "") -> str | None:
    """A binding path made absolute: relative paths (no leading "/") join the template scope."""
    if not isinstance(path, str):
        return None
    if path.startswith("/") or path == "":
        return path
    return (scope.rstrip("/") + "/" + path) if scope else "/" + path


def _tokens(pointer: str) -> list[str]:
    if pointer in ("", "/"):
        return []
    return [t.replace("~1", "/").replace("~0", "~") for t in pointer.lstrip("/").split("/")]


_MISSING = object()


def lookup(model: Any, pointer: str | None) -> Any:
    """The value at a JSON Pointer, or None when any step is missing."""
    value = _lookup(model, pointer)
    return None if value is _MISSING else value


def _lookup(model: Any, pointer: str | None) -> Any:
    if pointer is None:
        return _MISSING
    node = model
    for token in _tokens(pointer):
        if isinstance(node, dict):
            if token not in node:
                return _MISSING
            node = node[token]
        elif isinstance(node, list):
            index = whole_number(token)
            if index is None or index >= len(node):
                return _MISSING
            node = node[index]
        else:
            return _MISSING
    return node


def assign(model: dict, pointer: str, value: Any) -> dict:
    """Set a value at a JSON Pointer (upsert: missing objects on the way are created)."""
    tokens = _tokens(pointer)
    if not tokens:
        return value if isinstance(value, dict) else model
    node: Any = model
    for token in tokens[:-1]:
        index = whole_number(token)
        if isinstance(node, list) and index is not None and index < len(node):
            node = node[index]
            continue
        if not isinstance(node, dict):
            return model
        if not isinstance(node.get(token), dict | list):
            node[token] = {}
        node = node[token]
    last = tokens[-1]
    index = whole_number(last)
    if isinstance(node, dict):
        node[last] = value
    elif isinstance(node, list) and index is not None and index < len(node):
        node[index] = value
    elif isinstance(node, list) and last in ("-", str(len(node))):
        node.append(value)
    return model


# Dynamic values and the catalog's functions ----------------------------------------------------


_evaluations: ContextVar[list[int] | None] = ContextVar("a2ui_evaluations", default=None)


@contextmanager
def evaluation_budget(count: int = MAX_EVALUATIONS) -> Iterator[list[int]]:
    """Within this block at most ``count`` values are evaluated; past it each one is None.
    Yields the count left (below zero once the budget ran out)."""
    left = [count]
    token = _evaluations.set(left)
    try:
        yield left
    finally:
        _evaluations.reset(token)


def _over_budget() -> bool:
    left = _evaluations.get()
    return left is not None and left[0] < 0


def evaluate(value: Any, model: Any, scope: str = "", depth: int = 0) -> Any:
    """A DynamicValue: a literal, a ``{"path"}`` binding, or a ``{"call"}`` to a catalog function."""
    if depth > 16:
        return None
    left = _evaluations.get()
    if left is not None:
        left[0] -= 1
        if left[0] < 0:  # out of budget: not evaluated (the walk says it is cut)
            return None
    if isinstance(value, dict):
        if "path" in value and "call" not in value:
            return lookup(model, absolute(value.get("path"), scope))
        if isinstance(value.get("call"), str):
            return call(value, model, scope, depth + 1)
        return value
    return value


def call(fn: dict, model: Any, scope: str = "", depth: int = 0) -> Any:
    """One function of the basic catalog; an unknown one gives None."""
    name = fn.get("call")
    args = fn.get("args") if isinstance(fn.get("args"), dict) else {}

    def arg(key: str) -> Any:
        return evaluate(args.get(key), model, scope, depth)

    if name == "required":
        v = arg("value")
        return v is not None and v != "" and v != [] and v != {}
    if name == "regex":
        return regex_matches(arg("value"), args.get("pattern"))
    if name == "length":
        v = arg("value")
        n = len(v) if isinstance(v, str | list) else len(str(v or ""))
        lo, hi = _number(arg("min")), _number(arg("max"))
        return (lo is None or n >= lo) and (hi is None or n <= hi)
    if name == "numeric":
        v, lo, hi = _number(arg("value")), _number(arg("min")), _number(arg("max"))
        return v is not None and (lo is None or v >= lo) and (hi is None or v <= hi)
    if name == "email":
        v = arg("value")
        return isinstance(v, str) and bool(_EMAIL.match(v))
    if name in ("and", "or"):
        values = args.get("values") if isinstance(args.get("values"), list) else []
        results = [bool(evaluate(v, model, scope, depth)) for v in values[:50]]
        return all(results) if name == "and" else any(results)
    if name == "not":
        return not bool(arg("value"))
    if name == "formatString":
        return format_string(arg("value"), model, scope)
    if name == "formatNumber":
        return _format_number(arg("value"), arg("decimals"), arg("grouping"))
    if name == "formatCurrency":
        amount = _format_number(arg("value"), arg("decimals") if "decimals" in args else 2, True)
        return f"{str(arg('currency') or '')[:8]} {amount}".strip()
    if name == "formatDate":
        return format_date(arg("value"), arg("format"))
    if name == "pluralize":
        n = _number(arg("value"))
        for key, hit in (("zero", n == 0), ("one", n == 1), ("two", n == 2)):
            if hit and key in args:
                return arg(key)
        return arg("other")
    return None


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        n = float(v)
    except (TypeError, ValueError):
        return None
    return n if math.isfinite(n) else None


def _format_number(value: Any, decimals: Any, grouping: Any) -> str:
    n = _number(value)
    if n is None:
        return ""
    d = _number(decimals)
    places = int(min(max(d, 0), 10)) if d is not None else (0 if n == int(n) else 2)
    return f"{n:,.{places}f}" if grouping is not False else f"{n:.{places}f}"


def regex_matches(value: Any, pattern: Any) -> bool:
    """Whether the value matches the agent's pattern (search, as in JavaScript's ``test``).

    A pattern we do not run on this value (see ``usable_pattern``) passes here; the page's
    script still shows it where the browser can run it.
    """
    text = "" if value is None else str(value)
    if not isinstance(pattern, str) or not usable_pattern(pattern, len(text)):
        return True
    return answers.pattern_search(pattern, text) is not False


def usable_pattern(pattern: str, chars: int = 0) -> bool:
    """Whether the server may run the pattern on a value of ``chars`` characters in bounded time."""
    if (
        len(pattern) > answers.MAX_PATTERN_CHARS
        or answers._QUANTIFIED_GROUP.search(pattern)
        or _BACKREF.search(pattern)
    ):
        return False
    # Every quantifier counts, ``?`` too: ``a?a?…aaa…`` (``?`` only) backtracks
    # exponentially; ``(?`` opens a group and is not one.
    repeats = len(_QUANTIFIER.findall(_CLASS_OR_ESCAPE.sub("x", pattern).replace("(?", "(")))
    if repeats > 2 or (repeats == 2 and chars > 300) or chars > 2000:
        return False
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError):
        return False
    return True


_INTERPOLATION = re.compile(r"(?<!\\)\$\{([^{}]{1,300})\}")


def format_string(template: Any, model: Any, scope: str = "") -> str:
    """``${/path}`` and ``${relative}`` replaced by data-model values; ``\\${`` stays literal.

    Function calls inside ``${...}`` are left as written (they are a rare client nicety).
    """
    if not isinstance(template, str):
        return "" if template is None else str(template)

    def sub(m: re.Match) -> str:
        expr = m.group(1).strip()
        if "(" in expr:
            return m.group(0)
        v = lookup(model, absolute(expr, scope))
        return display(v)

    return _INTERPOLATION.sub(sub, template[:MAX_STRING]).replace("\\${", "${")


_DATE_TOKENS = re.compile(r"yyyy|yy|MMMM|MMM|MM|M|dd|d|EEEE|E+|HH|H|hh|h|mm|ss|a|'[^']*'")


def format_date(value: Any, pattern: Any) -> str:
    """A small TR35 subset (years, months, days, weekdays, hours, minutes, seconds, am/pm)."""
    if not isinstance(value, str):
        return display(value)
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return value
    if not isinstance(pattern, str) or not pattern:
        return when.isoformat()
    table = {
        "yyyy": f"{when.year:04d}",
        "yy": f"{when.year % 100:02d}",
        "MMMM": when.strftime("%B"),
        "MMM": when.strftime("%b"),
        "MM": f"{when.month:02d}",
        "M": str(when.month),
        "dd": f"{when.day:02d}",
        "d": str(when.day),
        "EEEE": when.strftime("%A"),
        "HH": f"{when.hour:02d}",
        "H": str(when.hour),
        "hh": f"{(when.hour % 12) or 12:02d}",
        "h": str((when.hour % 12) or 12),
        "mm": f"{when.minute:02d}",
        "ss": f"{when.second:02d}",
        "a": "AM" if when.hour < 12 else "PM",
    }

    def sub(m: re.Match) -> str:
        tok = m.group(0)
        if tok.startswith("'"):
            return tok[1:-1]
        if tok.startswith("E") and tok != "EEEE":
            return when.strftime("%a")
        return table.get(tok, tok)

    return _DATE_TOKENS.sub(sub, pattern[:200])


def display(value: Any) -> str:
    """A data-model value as text."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, str):
        return value[:MAX_STRING]
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)[:MAX_STRING]
    return str(value)[:MAX_STRING]


def text_of(value: Any, model: Any, scope: str) -> str:
    return display(evaluate(value, model, scope))


def check_failures(checks: Any, model: Any, scope: str = "") -> list[str]:
    """The messages of the checks that fail (v0.9.1 ``{condition, message}``; the protocol
    document's ``{call, args, message}`` is read too)."""
    if not isinstance(checks, list):
        return []
    failed = []
    for rule in checks[:20]:
        if not isinstance(rule, dict):
            continue
        condition = rule.get("condition", rule if "call" in rule else True)
        if isinstance(condition, dict) and isinstance(condition.get("call"), str):
            known = condition["call"] in _CHECK_FUNCTIONS
            ok = bool(evaluate(condition, model, scope)) if known else True
        else:
            ok = bool(evaluate(condition, model, scope))
        if _over_budget():  # not decided within the budget: met, as an unknown function is
            ok = True
        if not ok:
            failed.append(str(rule.get("message") or "This value is not valid.")[:500])
    return failed


_CHECK_FUNCTIONS = {"required", "regex", "length", "numeric", "email", "and", "or", "not"}


def client_checks(checks: Any, scope: str) -> str:
    """The checks as JSON for the page's script, with relative paths made absolute."""
    if not isinstance(checks, list) or not checks:
        return ""

    def fix(v: Any, depth: int = 0) -> Any:
        if depth > 12:
            return None
        if isinstance(v, dict):
            if "path" in v and "call" not in v:
                return {"path": absolute(v.get("path"), scope)}
            return {k: fix(x, depth + 1) for k, x in list(v.items())[:30]}
        if isinstance(v, list):
            return [fix(x, depth + 1) for x in v[:30]]
        return v

    return json.dumps(fix(checks[:20]), ensure_ascii=False)[:MAX_JSON_SHOWN]


# The walk -------------------------------------------------------------------------------------


@dataclass
class InputRef:
    """One input the page drew: ``v<index>`` in the form; its binding and checks."""

    index: int
    component_id: str
    kind: str
    path: str | None
    scope: str
    component: dict


@dataclass
class ButtonRef:
    index: int
    component_id: str
    scope: str
    component: dict


@dataclass
class Walk:
    """Draws one surface (or, with ``html=False``, only numbers its inputs and buttons)."""

    components: dict
    model: Any
    prefix: str = "a2ui"
    interactive: bool = True
    draw: bool = True
    errors: dict[str, list[str]] = field(default_factory=dict)
    inputs: list[InputRef] = field(default_factory=list)
    buttons: list[ButtonRef] = field(default_factory=list)
    nodes: int = 0
    cut: str = ""
    html_bytes: int = 0
    # Inputs the person's page drew (a posted form's ``inputs``): those after them keep the
    # agent's values and are not checked (``errors_of``). None: every input.
    drawn: int | None = None
    _child_bytes: list[int] = field(default_factory=list)  # per node being drawn

    def run(self, root_id: str) -> SafeString:
        with evaluation_budget() as left:
            out = self.node(root_id, "", 0, ())
        if left[0] < 0:
            self.cut = self.cut or f"more than {MAX_EVALUATIONS:,} values and functions evaluated"
        return out

    def node(self, cid: Any, scope: str, depth: int, stack: tuple[str, ...]) -> SafeString:
        if not isinstance(cid, str):
            return self._note("missing", "A child reference is not a component id.", cid)
        if depth > MAX_DEPTH:
            self.cut = self.cut or f"nested deeper than {MAX_DEPTH} levels"
            return self._note("cut", f"Not drawn: nested deeper than {MAX_DEPTH} levels.", None)
        if self.nodes >= MAX_NODES:
            self.cut = self.cut or f"more than {MAX_NODES} components"
            return mark_safe("")
        if self.html_bytes >= MAX_HTML_BYTES:
            self.cut = self.cut or f"more than {MAX_HTML_BYTES:,} bytes of drawing"
            return mark_safe("")
        if cid in stack:
            return self._note("cycle", f"Component {cid} contains itself; not drawn again.", None)
        comp = self.components.get(cid)
        if not isinstance(comp, dict):
            return self._note("missing", f"Missing component: {cid}", None)
        self.nodes += 1
        kind = comp.get("component")
        if kind not in KNOWN:
            return self._counted(
                self._note("unknown", f"Unknown component: {str(kind)[:100]}", comp)
            )
        self._child_bytes.append(0)
        try:
            out = getattr(self, "_" + kind.lower())(comp, scope, depth + 1, (*stack, cid))
        finally:
            children = self._child_bytes.pop()
        return self._counted(out, children)

    def _counted(self, out: SafeString, children: int = 0) -> SafeString:
        """Count a node's own markup (its children's counted as they were drawn)."""
        self.html_bytes += max(len(out) - children, 0)
        if self._child_bytes:
            self._child_bytes[-1] += len(out)
        return out

    # -- helpers

    def _render(self, name: str, context: dict) -> SafeString:
        if not self.draw:
            return mark_safe("")
        return get_template(f"tasks_app/a2ui/{name}.html").render(context)

    def _cut_short(self, reason: str) -> None:
        """Say the drawing stopped short (the first reason wins): the page notes it is partial."""
        self.cut = self.cut or reason

    def _note(self, kind: str, message: str, raw: Any) -> SafeString:
        return self._render(
            "placeholder",
            {"kind": kind, "message": message, "raw": _json_text(raw) if raw is not None else ""},
        )

    def _children(self, comp: dict, scope: str, depth: int, stack: tuple) -> list[SafeString]:
        children = comp.get("children")
        out: list[SafeString] = []
        if isinstance(children, list):
            if len(children) > MAX_TEMPLATE_ITEMS:
                self._cut_short(f"more than {MAX_TEMPLATE_ITEMS} children in one component")
            for child in children[:MAX_TEMPLATE_ITEMS]:
                out.append(self.node(child, scope, depth, stack))
        elif isinstance(children, dict):
            base = absolute(children.get("path"), scope)
            items = lookup(self.model, base)
            if isinstance(items, list):
                keys = [str(i) for i in range(min(len(items), MAX_TEMPLATE_ITEMS))]
            elif isinstance(items, dict):
                keys = [k.replace("~", "~0").replace("/", "~1") for k in items][:MAX_TEMPLATE_ITEMS]
            else:
                keys = []
            if isinstance(items, list | dict) and len(items) > MAX_TEMPLATE_ITEMS:
                self._cut_short(f"more than {MAX_TEMPLATE_ITEMS} items in one template")
            for key in keys:
                out.append(
                    self.node(
                        children.get("componentId"), f"{base.rstrip('/')}/{key}", depth, stack
                    )
                )
        return out

    def _label(self, comp: dict, scope: str, key: str = "label") -> str:
        return text_of(comp.get(key), self.model, scope) if key in comp else ""

    def _common(self, comp: dict, scope: str) -> dict:
        weight = _number(comp.get("weight"))
        acc = comp.get("accessibility") if isinstance(comp.get("accessibility"), dict) else {}
        return {
            "cid": str(comp.get("id", ""))[:200],
            "weight": int(min(max(weight, 1), 12)) if weight else 0,
            "aria_label": text_of(acc.get("label"), self.model, scope) if acc else "",
            "aria_description": text_of(acc.get("description"), self.model, scope) if acc else "",
        }

    def _bind(self, value: Any, scope: str) -> str:
        """The absolute path of a plain binding (for the page's script to keep in step)."""
        if isinstance(value, dict) and "path" in value and "call" not in value:
            return absolute(value.get("path"), scope) or ""
        return ""

    # -- display

    def _text(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        text = text_of(comp.get("text"), self.model, scope)
        variant = comp.get("variant") if comp.get("variant") in _TEXT_VARIANTS else "body"
        return self._render(
            "text",
            {
                **self._common(comp, scope),
                "html": markdown_html(text),  # sanitized (tasks_app/rendering.py)
                "variant": variant,
                "bind": self._bind(comp.get("text"), scope),
            },
        )

    def _media(self, comp: dict, scope: str, kind: str) -> SafeString:
        raw_url = text_of(comp.get("url"), self.model, scope)
        return self._render(
            "media",
            {
                **self._common(comp, scope),
                "kind": kind,
                "url": safe_http_url(raw_url),
                "raw_url": raw_url[:300],
                "description": self._label(comp, scope, "description"),
            },
        )

    def _image(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        return self._media(comp, scope, "Image")

    def _video(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        return self._media(comp, scope, "Video")

    def _audioplayer(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        return self._media(comp, scope, "Audio")

    def _icon(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        name = comp.get("name")
        svg_path = ""
        if isinstance(name, dict) and "svgPath" in name:
            svg_path = name["svgPath"] if _SVG_PATH.match(str(name["svgPath"])) else ""
            label = "icon"
        else:
            label = text_of(name, self.model, scope)[:100]
        common = self._common(comp, scope)
        # The icon's own label (the agent's accessibility label, else its name), said once.
        common["aria_label"], label_for = "", common["aria_label"] or label
        return self._render(
            "icon",
            {
                **common,
                "label_for": label_for,
                "name": label,
                "glyph": ICON_GLYPHS.get(label, ""),
                "svg_path": svg_path,
            },
        )

    def _divider(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        axis = "vertical" if comp.get("axis") == "vertical" else "horizontal"
        return self._render("divider", {**self._common(comp, scope), "axis": axis})

    # -- layout

    def _container(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        kind = comp["component"]
        justify = comp.get("justify") if comp.get("justify") in _JUSTIFY else "start"
        align = comp.get("align") if comp.get("align") in _ALIGN else "stretch"
        direction = "horizontal" if comp.get("direction") == "horizontal" else "vertical"
        return self._render(
            "container",
            {
                **self._common(comp, scope),
                "kind": kind.lower(),
                "justify": justify,
                "align": align,
                "direction": direction,
                "children": self._children(comp, scope, depth, stack),
            },
        )

    _row = _column = _list = _container

    def _card(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        return self._render(
            "card",
            {
                **self._common(comp, scope),
                "child": self.node(comp.get("child"), scope, depth, stack),
            },
        )

    def _tabs(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        tabs = comp.get("tabs") if isinstance(comp.get("tabs"), list) else []
        common = self._common(comp, scope)
        drawn = []
        if len(tabs) > MAX_TABS:
            self._cut_short(f"more than {MAX_TABS} tabs in one Tabs component")
        for i, tab in enumerate(tabs[:MAX_TABS]):
            if not isinstance(tab, dict):
                continue
            drawn.append(
                {
                    "n": i,
                    "title": text_of(tab.get("title"), self.model, scope) or f"Tab {i + 1}",
                    "child": self.node(tab.get("child"), scope, depth, stack),
                }
            )
        return self._render("tabs", {**common, "tabs": drawn, "uid": self._uid(common["cid"])})

    def _modal(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        # An id is a string: a list here raised TypeError (unhashable) on every draw.
        trigger_id = comp.get("trigger")
        trigger = self.components.get(trigger_id) if isinstance(trigger_id, str) else None
        # A Button as the trigger opens the modal: its label is drawn, its action is not sent.
        if isinstance(trigger, dict) and trigger.get("component") == "Button":
            opener = self.node(trigger.get("child"), scope, depth, (*stack, comp.get("trigger")))
        else:
            opener = self.node(comp.get("trigger"), scope, depth, stack)
        return self._render(
            "modal",
            {
                **self._common(comp, scope),
                "opener": opener,
                "content": self.node(comp.get("content"), scope, depth, stack),
            },
        )

    # -- acting

    def _uid(self, cid: str) -> str:
        return f"{self.prefix}-{self.nodes}"

    def _button(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        action = comp.get("action") if isinstance(comp.get("action"), dict) else {}
        index = len(self.buttons)
        link = ""
        sends = isinstance(action.get("event"), dict)
        if sends:
            self.buttons.append(ButtonRef(index, str(comp.get("id")), scope, comp))
        elif isinstance(action.get("functionCall"), dict):
            fn = action["functionCall"]
            if fn.get("call") == "openUrl" and isinstance(fn.get("args"), dict):
                link = safe_http_url(evaluate(fn["args"].get("url"), self.model, scope)) or ""
        variant = comp.get("variant") if comp.get("variant") in ("primary", "borderless") else ""
        return self._render(
            "button",
            {
                **self._common(comp, scope),
                "label": self.node(comp.get("child"), scope, depth, stack),
                "name": f"b{index}",
                "sends": sends and self.interactive,
                "link": link,
                "variant": variant,
                "checks": client_checks(comp.get("checks"), scope),
                "errors": self.errors.get(f"b{index}", []),
            },
        )

    def _input(self, comp: dict, scope: str, kind: str) -> dict:
        index = len(self.inputs)
        path = self._bind(comp.get("value"), scope) or None
        self.inputs.append(InputRef(index, str(comp.get("id")), kind, path, scope, comp))
        name = f"v{index}"
        return {
            **self._common(comp, scope),
            "name": name,
            "input_id": f"{self.prefix}-{name}",
            "label": self._label(comp, scope),
            "path": path or "",
            "value": evaluate(comp.get("value"), self.model, scope),
            "checks": client_checks(comp.get("checks"), scope),
            "errors": self.errors.get(name, []),
            "disabled": not self.interactive,
        }

    def _textfield(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        ctx = self._input(comp, scope, "TextField")
        variant = comp.get("variant") if comp.get("variant") in _TEXT_FIELD else "shortText"
        pattern = comp.get("validationRegexp")
        return self._render(
            "textfield",
            {
                **ctx,
                "value": display(ctx["value"]),
                "variant": variant,
                # Only a pattern the server would run: the page's script runs it on each
                # keystroke (and on the value the agent filled in, for every viewer).
                "pattern": pattern if isinstance(pattern, str) and usable_pattern(pattern) else "",
                "max_chars": MAX_INPUT_CHARS,
            },
        )

    def _checkbox(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        ctx = self._input(comp, scope, "CheckBox")
        return self._render("checkbox", {**ctx, "checked": ctx["value"] is True})

    def _choicepicker(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        ctx = self._input(comp, scope, "ChoicePicker")
        selected = ctx["value"] if isinstance(ctx["value"], list) else []
        selected = {str(v) for v in selected[:MAX_OPTIONS]}
        options = comp.get("options") if isinstance(comp.get("options"), list) else []
        if len(options) > MAX_OPTIONS:  # posted_value reads back only these too
            self._cut_short(f"more than {MAX_OPTIONS} options in one ChoicePicker")
        drawn = [
            {
                "value": str(o.get("value", ""))[:500],
                "label": text_of(o.get("label"), self.model, scope),
                "checked": str(o.get("value", "")) in selected,
                "n": i,
            }
            for i, o in enumerate(options[:MAX_OPTIONS])
            if isinstance(o, dict)
        ]
        multiple = comp.get("variant") == "multipleSelection"
        return self._render(
            "choicepicker",
            {
                **ctx,
                "options": drawn,
                "multiple": multiple,
                "chips": comp.get("displayStyle") == "chips",
            },
        )

    def _datetimeinput(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        ctx = self._input(comp, scope, "DateTimeInput")
        kind = datetime_kind(comp)
        return self._render(
            "datetime",
            {
                **ctx,
                "type": kind,
                "value": datetime_value(ctx["value"], kind),
                "min": datetime_value(evaluate(comp.get("min"), self.model, scope), kind),
                "max": datetime_value(evaluate(comp.get("max"), self.model, scope), kind),
            },
        )

    def _slider(self, comp: dict, scope: str, depth: int, stack: tuple) -> SafeString:
        ctx = self._input(comp, scope, "Slider")
        lo = _number(comp.get("min"))
        hi = _number(comp.get("max"))
        lo = 0 if lo is None else lo
        hi = lo + 100 if hi is None or hi < lo else hi
        value = _number(ctx["value"])
        return self._render(
            "slider",
            {
                **ctx,
                "min": display(lo),
                "max": display(hi),
                "value": display(lo if value is None else min(max(value, lo), hi)),
            },
        )


_TEXT_VARIANTS = {"h1", "h2", "h3", "h4", "h5", "caption", "body"}
_JUSTIFY = {"center", "end", "spaceAround", "spaceBetween", "spaceEvenly", "start", "stretch"}
_ALIGN = {"start", "center", "end", "stretch"}
_TEXT_FIELD = {"longText", "number", "shortText", "obscured"}


def datetime_kind(comp: dict) -> str:
    date, time = comp.get("enableDate") is True, comp.get("enableTime") is True
    if date and time:
        return "datetime-local"
    return "time" if time else "date"


def datetime_value(value: Any, kind: str) -> str:
    """An ISO 8601 value in the form the browser's input of that type reads."""
    if not isinstance(value, str) or not value:
        return ""
    v = value.strip()[:64]
    if kind == "date":
        return v[:10] if re.match(r"^\d{4}-\d{2}-\d{2}", v) else ""
    if kind == "time":
        m = re.search(r"(\d{2}:\d{2}(:\d{2})?)", v)
        return m.group(1) if m else ""
    m = re.match(r"^(\d{4}-\d{2}-\d{2})[T ](\d{2}:\d{2}(:\d{2})?)", v)
    return f"{m.group(1)}T{m.group(2)}" if m else ""


def _json_text(value: Any) -> str:
    """Indented JSON as text (the template escapes it), cut to a bound; a message kept cut
    (``a2ui.kept_raw``) as the text kept."""
    if (
        isinstance(value, dict)
        and set(value) == {"cut", "chars"}
        and isinstance(value["cut"], str)
        and type(value["chars"]) is int
    ):
        return f"{value['cut'][:MAX_JSON_SHOWN]}\n… (cut: {value['chars']:,} characters in all)"
    try:
        text = json.dumps(value, indent=2, ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    if len(text) > MAX_JSON_SHOWN:
        text = text[:MAX_JSON_SHOWN] + "\n… (cut)"
    return text


# Reading a surface ----------------------------------------------------------------------------


def root_of(surface: Any) -> str:
    return getattr(surface, "root_id", "") or "root"


def walk(surface: Any, *, model: Any = None, draw: bool = False, **kwargs: Any) -> Walk:
    """The surface's inputs and buttons as the page draws them (``draw=False``: no HTML)."""
    w = Walk(
        components=surface.components if isinstance(surface.components, dict) else {},
        model=surface.data_model if model is None else model,
        draw=draw,
        **kwargs,
    )
    w.html = w.run(root_of(surface))  # type: ignore[attr-defined]
    return w


def render_surface(
    surface: Any,
    *,
    task: Any,
    request: Any = None,
    place: str = "task",
    interactive: bool = True,
    can_act: bool = True,
    next_url: str = "",
    errors: dict[str, list[str]] | None = None,
    last_action: Any = None,
) -> SafeString:
    """One surface as HTML: the drawn components in a form whose buttons send actions,
    or the "could not render" notice with the reason and the raw JSON.

    ``place`` keeps ids apart where a surface is drawn twice on a page (the task page's
    progress section and its conversation); ``interactive=False`` draws it read-only.
    ``last_action`` (an ``OperatorAction``) is the latest action on an earlier state of the
    surface: the fold clears the surface's own ``action_*`` fields when the agent redraws it.
    """
    prefix = f"a2ui-{place}-{getattr(task, 'pk', 0)}-{getattr(surface, 'pk', None) or 0}"
    action_seq = getattr(surface, "action_seq", None)
    submitted = action_seq is not None and action_seq == getattr(surface, "updated_seq", 0)
    acting = interactive and can_act and not submitted and not getattr(surface, "deleted", False)
    w = None
    body: SafeString = mark_safe("")
    problem = getattr(surface, "problem", "") or ""
    if not problem and getattr(surface, "ready", True):
        w = Walk(
            components=surface.components if isinstance(surface.components, dict) else {},
            model=surface.data_model,
            prefix=prefix,
            interactive=acting,
            errors=errors or {},
        )
        try:
            body = w.run(root_of(surface))
        except RecursionError:
            problem = "nested too deep to draw"
        except Exception as exc:  # the agent's surface must not take the page down with it
            log.exception("could not draw surface %s", getattr(surface, "pk", None))
            problem = f"could not be drawn ({type(exc).__name__})"
    context = {
        "surface": surface,
        "task": task,
        "prefix": prefix,
        "place": place,
        "body": body,
        "problem": problem,
        "raw": _json_text(getattr(surface, "raw_json", None)) if problem else "",
        "cut": w.cut if w else "",
        "acting": acting and bool(w and w.buttons),
        "drawn_inputs": len(w.inputs) if w else 0,
        "interactive": acting,
        "submitted": submitted,
        "earlier": None if submitted else _earlier(last_action),
        "model_json": _model_json(surface.data_model),
        "next_url": next_url,
        "can_act": can_act,
        "key": surface_key(surface, acting),
        "agent_name": _agent_name(surface),
    }
    return get_template("tasks_app/a2ui/surface.html").render(context, request)


def _earlier(action: Any) -> dict | None:
    if action is None:
        return None
    payload = action.payload if isinstance(action.payload, dict) else {}
    return {
        "by": action.actor.get_username() if action.actor else "a command-line user",
        "at": action.created_at,
        "name": str(payload.get("name") or "")[:200],
    }


def surface_key(surface: Any, acting: bool) -> str:
    """What changes when the drawing must change (the page's script swaps on it).

    ``acting`` (whether the form can be sent) is part of it: a surface drawn while the task
    was still working is read-only, and the same surface once the task asks for input must
    replace it, though the surface itself did not change.
    """
    return (
        f"{getattr(surface, 'updated_seq', 0)}-{getattr(surface, 'action_seq', None) or 0}"
        f"-{int(bool(getattr(surface, 'deleted', False)))}-{int(acting)}"
    )


def _agent_name(surface: Any) -> str:
    styles = getattr(surface, "styles", None)
    if isinstance(styles, dict) and isinstance(styles.get("agentDisplayName"), str):
        return styles["agentDisplayName"][:100]
    return ""


def _model_json(model: Any) -> str:
    try:
        text = json.dumps(model, ensure_ascii=False, default=str)
    except (TypeError, ValueError, RecursionError):
        return "{}"
    return text if len(text) <= 200_000 else "{}"


# Reading a posted form back -------------------------------------------------------------------


def posted_value(ref: InputRef, post: Any) -> Any:
    """The value the person entered in one input, typed as its component's binding wants."""
    name = f"v{ref.index}"
    if ref.kind == "CheckBox":
        return post.get(name) == "on"
    if ref.kind == "ChoicePicker":
        options = (
            ref.component.get("options") if isinstance(ref.component.get("options"), list) else []
        )
        # As drawn (each value cut to 500 characters), back to the agent's own value.
        allowed = {
            str(o.get("value", ""))[:500]: str(o.get("value", ""))
            for o in options[:MAX_OPTIONS]
            if isinstance(o, dict)
        }
        values: list[str] = []
        for v in post.getlist(name)[:MAX_OPTIONS]:
            if v in allowed and allowed[v] not in values:  # each option once
                values.append(allowed[v])
        if ref.component.get("variant") != "multipleSelection":
            values = values[:1]
        return values
    raw = str(post.get(name, ""))[:MAX_INPUT_CHARS]
    if ref.kind == "Slider":
        n = _number(raw)
        if n is None:
            return None
        return int(n) if n == int(n) else n
    if ref.kind == "DateTimeInput":
        return raw.strip()
    return raw


def apply_post(surface: Any, post: Any) -> tuple[dict, Walk]:
    """The data model with the person's values written at their bindings, and the walk.

    Only the inputs the page drew (``inputs``, posted with the form) are read: a drawing cut
    at its byte budget leaves out inputs this walk (which draws nothing) still finds, and
    reading those as empty sent the agent a blank or unchecked value the person never saw.
    """
    model = copy.deepcopy(surface.data_model if isinstance(surface.data_model, dict) else {})
    first = walk(surface, model=model)
    drawn = whole_number(str(post.get("inputs", "")))
    for ref in first.inputs:
        if drawn is not None and ref.index >= drawn:
            break  # not on the person's page: the agent's value stays
        if ref.path is not None:
            model = assign(model, ref.path, posted_value(ref, post))
    second = walk(surface, model=model)
    second.drawn = drawn
    return model, second


_DATETIME_FORMS = {
    "date": re.compile(r"\d{4}-\d{2}-\d{2}"),
    "time": re.compile(r"\d{2}:\d{2}(:\d{2})?"),
    "datetime-local": re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(:\d{2})?"),
}


def _value_problem(ref: InputRef, value: Any, model: Any) -> str:
    """What the input's own kind refuses in the person's value ("" when fine): a form's
    fields can be posted with anything, and the agent got a slider's -99999999 and
    ``<script>`` as a date. An empty value is left to the ``required`` check."""
    comp = ref.component
    if ref.kind == "Slider":
        lo = _number(comp.get("min"))
        hi = _number(comp.get("max"))
        lo = 0 if lo is None else lo
        hi = lo + 100 if hi is None or hi < lo else hi
        if value is None or not lo <= value <= hi:
            return f"Choose a value from {display(lo)} to {display(hi)}."
    elif ref.kind == "DateTimeInput" and value not in (None, ""):
        kind = datetime_kind(comp)
        if not isinstance(value, str) or not _DATETIME_FORMS[kind].fullmatch(value):
            return "This is not a date or time in the form asked."
        for bound, word in (("min", "before"), ("max", "after")):
            limit = datetime_value(evaluate(comp.get(bound), model, ref.scope), kind)
            if limit and (value < limit if bound == "min" else value > limit):
                return f"This is {word} the {'earliest' if bound == 'min' else 'latest'} allowed."
    elif (
        ref.kind == "TextField"
        and comp.get("variant") == "number"
        and value not in (None, "")
        and _number(value) is None
    ):
        return "Enter a number."
    return ""


def errors_of(w: Walk, model: Any) -> dict[str, list[str]]:
    """Failing checks per input (``v<n>``) and button (``b<n>``), with the person's values."""
    with evaluation_budget():
        return _errors_of(w, model)


def _errors_of(w: Walk, model: Any) -> dict[str, list[str]]:
    errors: dict[str, list[str]] = {}
    for ref in w.inputs:
        if w.drawn is not None and ref.index >= w.drawn:
            break  # not on the person's page: nothing they could see or fix
        failed = check_failures(ref.component.get("checks"), model, ref.scope)
        value_problem = _value_problem(ref, lookup(model, ref.path), model) if ref.path else ""
        if value_problem:
            failed.append(value_problem)
        pattern = ref.component.get("validationRegexp")
        if ref.kind == "TextField" and isinstance(pattern, str):
            value = lookup(model, ref.path) if ref.path else None
            if value not in (None, "") and not regex_matches(value, pattern):
                failed.append("This value does not have the expected form.")
        if failed:
            errors[f"v{ref.index}"] = failed
    for ref in w.buttons:
        failed = check_failures(ref.component.get("checks"), model, ref.scope)
        if failed:
            errors[f"b{ref.index}"] = failed
    return errors


# Password fields ------------------------------------------------------------------------------


def secret_inputs(w: Walk) -> list[InputRef]:
    """The inputs drawn as password fields (TextField, variant ``obscured``)."""
    return [
        ref
        for ref in w.inputs
        if ref.kind == "TextField" and ref.component.get("variant") == "obscured" and ref.path
    ]


def secret_values(w: Walk, model: Any) -> set[str]:
    """What the person typed into the password fields (non-empty strings)."""
    values = {lookup(model, ref.path) for ref in secret_inputs(w)}
    return {v for v in values if isinstance(v, str) and v}


def without_secret_inputs(w: Walk, model: Any) -> Any:
    """The data model with each password field's value blanked: the form drawn again after a
    failed check must not carry the password back in the page."""
    blanked = copy.deepcopy(model)
    for ref in secret_inputs(w):
        if lookup(blanked, ref.path) is not None:
            blanked = assign(blanked, ref.path, "")  # type: ignore[arg-type]
    return blanked


def resolve_context(ref: ButtonRef, model: Any) -> dict:
    """The button's action context with every value resolved against the data model."""
    event = ref.component.get("action", {}).get("event", {})
    context = event.get("context") if isinstance(event.get("context"), dict) else {}
    with evaluation_budget():
        return {str(k)[:200]: evaluate(v, model, ref.scope) for k, v in list(context.items())[:100]}


def action_name(ref: ButtonRef) -> str:
    return str(ref.component.get("action", {}).get("event", {}).get("name") or "")[:200]
