"""``manage.py a2a``: talk A2A 1.0 to an agent from the shell.

A thin face over :mod:`tasks_app.a2a`; it touches no database, so it works
before the dashboard is set up and against any agent the outbound guard lets it
reach (its HTTP client is ``tasks_app.outbound``'s, like the dashboard's: an
agent on this machine or the private network needs ``OUTBOUND_ALLOW``).
See ``docs/a2a-cli.md`` for examples.

Secrets come from a file or standard input (``--token-file PATH``,
``--api-key-file PATH``, ``-`` for stdin) or the environment (``A2A_TOKEN``,
``A2A_API_KEY``), never from the command line, which every user of the machine
can read (``ps``); ``--token`` and ``--api-key`` are refused with a sentence
saying so.

Subcommands: ``card``, ``send``, ``get``, ``list``, ``cancel``, ``subscribe``.
``URL`` is the agent's base URL (the card is discovered at
``/.well-known/agent-card.json``) or the card's own URL. With ``--json`` every
received object is printed as one JSON line in StreamResponse form
(``{"task": …}``, ``{"message": …}``, ``{"statusUpdate": …}``,
``{"artifactUpdate": …}``). Errors exit with status 1 and one line naming the
A2A code and reason.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.core.management.base import CommandError, CommandParser

from tasks_app import outbound
from tasks_app.a2a import (
    A2AClient,
    A2AError,
    Credentials,
    StreamEvent,
    choose_interface,
    fetch_card,
    message_text,
    user_message,
    validate_card,
)
from tasks_app.a2a.card import DEFAULT_CARD_DEADLINE
from tasks_app.management.arguments import float_between, int_between
from tasks_app.management.commands._stopping import StoppableCommand
from tasks_app.management.commands.agents import read_secret
from tasks_app.services.agents import header_safe

SECRETS = (  # (option key, refused flag, file flag, environment variable)
    ("token", "--token", "--token-file", "A2A_TOKEN"),
    ("api_key", "--api-key", "--api-key-file", "A2A_API_KEY"),
)

STATES = (
    "SUBMITTED", "WORKING", "INPUT_REQUIRED", "AUTH_REQUIRED",
    "COMPLETED", "FAILED", "CANCELED", "REJECTED",
)  # fmt: skip


def _state_arg(value: str) -> str:
    v = value.strip().upper().replace("-", "_")
    v = v if v.startswith("TASK_STATE_") else f"TASK_STATE_{v}"
    if v.removeprefix("TASK_STATE_") not in STATES:
        raise argparse.ArgumentTypeError(
            f"unknown state {value!r} (one of "
            f"{', '.join(s.lower().replace('_', '-') for s in STATES)})"
        )
    return v


def _url_problem(url: str) -> str | None:
    """What is wrong with the URL argument, in words that never quote it (it may hold a
    password); None when it can be tried. The scheme and the rest are the client's to judge."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # a port that is no number or past 65535, an unclosed "[", or a
        # password holding / # or ?, which ends the host part early
        return (
            "The URL cannot be read: its port must be a number from 1 to 65535, and a "
            "bracketed address closed (the value is not shown: it may hold a password)."
        )
    if parts.username is not None or parts.password is not None:
        return (
            "URL must not hold a user name or password: the command line shows in the process "
            "list. Put the secret in a file and pass --token-file PATH or --api-key-file PATH "
            "(or set A2A_TOKEN or A2A_API_KEY)."
        )
    if port == 0:
        return "URL's port must be a number from 1 to 65535, not 0."
    return None


def _short_state(state: str | None) -> str:
    return (state or "TASK_STATE_UNSPECIFIED").removeprefix("TASK_STATE_").lower().replace("_", "-")


def _part_summary(part: dict[str, Any], limit: int = 200) -> str:
    if isinstance(part.get("text"), str):
        text = part["text"].strip().replace("\n", "\\n")
        return text if len(text) <= limit else text[: limit - 1] + "…"
    name = part.get("filename") or ""
    mt = part.get("mediaType") or ""
    if "raw" in part:
        return f"[file {name} {mt} {len(part['raw']) * 3 // 4} bytes]".replace("  ", " ")
    if "url" in part:
        return f"[file {name} {mt} {part['url']}]".replace("  ", " ")
    if "data" in part:
        data = json.dumps(part["data"], ensure_ascii=False)
        return data if len(data) <= limit else data[: limit - 1] + "…"
    return "[empty part]"


def _parts(obj: dict[str, Any] | None) -> str:
    return " | ".join(_part_summary(p) for p in (obj or {}).get("parts") or [])


class Command(StoppableCommand):
    help = "Talk A2A 1.0 to an agent: card, send, get, list, cancel, subscribe."
    requires_system_checks: list[str] = []
    requires_migrations_checks = False

    def add_arguments(self, parser: CommandParser) -> None:
        common = argparse.ArgumentParser(add_help=False)
        common.add_argument("--json", action="store_true", help="one JSON object per line")
        common.add_argument(
            "--binding",
            choices=["jsonrpc", "rest"],
            help="force a binding (default: the card's first)",
        )
        common.add_argument(
            "--token-file", default="", metavar="PATH",
            help="file holding the bearer token ('-': standard input; or env A2A_TOKEN)",
        )  # fmt: skip
        common.add_argument(
            "--api-key-file", default="", metavar="PATH",
            help="file holding the API key ('-': standard input; or env A2A_API_KEY)",
        )  # fmt: skip
        # Refused (see the module docstring); defined so they are never taken as abbreviations.
        common.add_argument("--token", default=None, help=argparse.SUPPRESS)
        common.add_argument("--api-key", default=None, help=argparse.SUPPRESS)
        common.add_argument("--api-key-name", help="API key name when the card declares none")
        common.add_argument("--api-key-location", choices=["header", "query", "cookie"])
        common.add_argument(
            "--credentials-origin",
            action="append",
            default=[],
            metavar="ORIGIN",
            help="another origin (https://host:port) the token or API key may go to, when the "
            "card names an interface there (repeatable)",
        )
        common.add_argument(
            "--extension",
            action="append",
            default=[],
            help="extension URI to activate (repeatable)",
        )
        common.add_argument(
            "--timeout",
            type=float_between(0, 3600, more_than_low=True),
            default=None,
            help="seconds; bounds every call, a blocking send and stream silence",
        )

        sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        p = sub.add_parser(
            "card", parents=[common], help="fetch, validate and summarise the agent card"
        )
        p.add_argument("url")
        p = sub.add_parser("send", parents=[common], help="send a text message")
        p.add_argument("url")
        p.add_argument("text")
        p.add_argument(
            "--mode", choices=["blocking", "return-immediately", "stream"], default="blocking"
        )
        p.add_argument(
            "--task", dest="task_id", help="continue this task (e.g. answer input-required)"
        )
        p.add_argument("--context", dest="context_id", help="context id for the message")
        p.add_argument("--message-id", help="reuse a messageId (safe retry)")
        p = sub.add_parser("get", parents=[common], help="GetTask")
        p.add_argument("url")
        p.add_argument("task_id")
        p.add_argument("--history-length", type=int_between(0, 2**31 - 1))  # int32
        p = sub.add_parser("list", parents=[common], help="ListTasks")
        p.add_argument("url")
        p.add_argument("--context", dest="context_id")
        p.add_argument("--status", type=_state_arg, help="e.g. working, input-required, completed")
        p.add_argument("--page-size", type=int_between(1, 100))  # A2A: 1-100
        p.add_argument("--page-token")
        p = sub.add_parser("cancel", parents=[common], help="CancelTask")
        p.add_argument("url")
        p.add_argument("task_id")
        p = sub.add_parser("subscribe", parents=[common], help="SubscribeToTask (stream)")
        p.add_argument("url")
        p.add_argument("task_id")

    # ------------------------------------------------------------------ output

    def _emit(self, obj: dict[str, Any], human: str, options: dict[str, Any]) -> None:
        self.stdout.write(json.dumps(obj, ensure_ascii=False) if options["json"] else human)
        self.stdout.flush()

    def _event_line(self, ev: StreamEvent) -> str:
        p = ev.payload
        if ev.kind == "message":
            role = "agent" if p.get("role") == "ROLE_AGENT" else "user"
            return f"message ({role}): {_parts(p)}"
        if ev.kind == "task":
            line = f"task {p['id']} {_short_state(ev.state)}"
            if p.get("contextId"):
                line += f" (context {p['contextId']})"
            if ev.status_message:
                line += f": {message_text(ev.status_message, ' ')}"
            for art in p.get("artifacts") or []:
                line += f"\n  artifact {art.get('name') or art.get('artifactId')}: {_parts(art)}"
            return line
        if ev.kind == "statusUpdate":
            line = f"status {_short_state(ev.state)}"
            if ev.status_message:
                line += f": {message_text(ev.status_message, ' ')}"
            return line
        art = p.get("artifact") or {}
        flags = ("+" if p.get("append") else "") + (" (last chunk)" if p.get("lastChunk") else "")
        return f"artifact {art.get('name') or art.get('artifactId')}{flags}: {_parts(art)}"

    # ------------------------------------------------------------------ actions

    stealth_options = ("stdin",)

    def handle(self, *args: Any, **options: Any) -> None:
        problem = _url_problem(options["url"])
        if problem:
            # Checked first: the client's errors quote the URL, password and all.
            raise CommandError(problem)
        options.update(self._secrets(options))
        try:
            asyncio.run(self._run(options))
        except A2AError as exc:
            raise CommandError(str(exc), returncode=1) from exc
        except ValueError as exc:
            raise CommandError(str(exc), returncode=2) from exc

    def _secrets(self, options: dict[str, Any]) -> dict[str, str | None]:
        """The token and API key: from their files (or stdin), else from the environment."""
        for key, flag, file_flag, env in SECRETS:
            if options.get(key) is not None:
                raise CommandError(
                    f"{flag} is refused: a secret on the command line shows in the process list. "
                    f"Put it in a file and pass {file_flag} PATH, pipe it in with {file_flag} -, "
                    f"or set {env}."
                )
        if options.get("token_file") == "-" and options.get("api_key_file") == "-":
            raise CommandError(
                "Only one of --token-file and --api-key-file can read standard input."
            )
        stdin = options.get("stdin") or sys.stdin
        secrets: dict[str, str | None] = {}
        for key, _flag, file_flag, env in SECRETS:
            source = options.get(key + "_file") or ""
            from_env = (os.environ.get(env) or "").strip()
            if from_env and not header_safe(from_env):
                raise CommandError(
                    f"{env} holds characters an HTTP header cannot carry (control characters "
                    "or non-ASCII)."
                )
            secrets[key] = read_secret(source, file_flag, stdin) if source else from_env or None
        return secrets

    def _credentials(self, options: dict[str, Any]) -> Credentials | None:
        if not (options.get("token") or options.get("api_key")):
            return None
        return Credentials(
            token=options.get("token") or None,
            api_key=options.get("api_key") or None,
            api_key_name=options.get("api_key_name"),
            api_key_location=options.get("api_key_location"),
        )

    async def _run(self, options: dict[str, Any]) -> None:
        action = options["action"]
        timeout = options.get("timeout")
        http = outbound.new_http_client()  # the outbound guard applies here too
        http.timeout = httpx.Timeout(timeout or 30.0)
        async with http:
            if action == "card":
                await self._card(options, http)
                return
            kwargs: dict[str, Any] = {}
            if timeout:
                # Each read and the whole call: a reply that trickles a byte a second is
                # cut at the deadline, not at the per-read timeout.
                kwargs = {
                    "timeout": timeout,
                    "send_timeout": timeout,
                    "stream_idle_timeout": timeout,
                    "call_deadline": timeout,
                    "send_deadline": timeout,
                }
            client = await A2AClient.connect(
                options["url"],
                http=http,
                binding=options.get("binding"),
                credentials=self._credentials(options),
                credential_origins=options.get("credentials_origin") or (),
                extensions=options.get("extension") or (),
                **kwargs,
            )
            await getattr(self, f"_{action}")(client, options)

    async def _card(self, options: dict[str, Any], http: httpx.AsyncClient) -> None:
        timeout = options.get("timeout")
        result = await fetch_card(
            options["url"],
            http=http,
            timeout=timeout or 15.0,
            deadline=timeout or DEFAULT_CARD_DEADLINE,
        )
        card = result.card or {}
        problems = validate_card(card)
        refusal: A2AError | None = None
        try:
            chosen = choose_interface(card, binding=options.get("binding"), card_url=result.url)
        except A2AError as exc:
            chosen, refusal = None, exc
        if options["json"]:
            self._emit(card, "", options)
            self._card_verdict(problems, chosen)
            return
        heading = " ".join(str(card.get(key) or "") for key in ("name", "version")).strip()
        description = card.get("description")
        out = [
            f"{heading or '?'} — {description}" if description else heading or "?",
            f"card: {result.url}",
        ]
        for iface in card.get("supportedInterfaces") or []:
            if isinstance(iface, dict):
                tenant = f" tenant={iface['tenant']}" if iface.get("tenant") else ""
                out.append(
                    f"interface: {iface.get('protocolBinding')} {iface.get('protocolVersion')} {iface.get('url')}{tenant}"
                )
        if chosen is not None:
            out.append(f"chosen: {chosen.binding} {chosen.url}")
        else:
            out.append(f"chosen: none ({refusal})")
        caps = card.get("capabilities") or {}
        flags = [
            k
            for k in ("streaming", "pushNotifications", "extendedAgentCard")
            if caps.get(k) is True
        ]
        out.append(f"capabilities: {', '.join(flags) or 'none'}")
        for skill in card.get("skills") or []:
            if isinstance(skill, dict):
                out.append(
                    f"skill: {skill.get('id')} — {skill.get('name')}: {skill.get('description')}"
                )
        out.extend(f"problem: {p}" for p in problems)
        if not problems:
            out.append("valid A2A 1.0 card")
        self.stdout.write("\n".join(out))
        self._card_verdict(problems, chosen)

    def _card_verdict(self, problems: list[Any], chosen: object) -> None:
        """Exit 1 after the summary when the card cannot be used as it is: a script that
        checks a card read exit 0 for one with six problems and no usable interface."""
        if problems or chosen is None:
            said = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}" if problems else ""
            none = "no interface this client can use" if chosen is None else ""
            raise CommandError(
                "the card is not usable as it is: " + "; ".join(x for x in (said, none) if x),
                returncode=1,
            )

    async def _send(self, client: A2AClient, options: dict[str, Any]) -> None:
        msg = user_message(
            options["text"],
            task_id=options.get("task_id"),
            context_id=options.get("context_id"),
            message_id=options.get("message_id"),
        )
        mode = options["mode"]
        if mode == "stream":
            await self._stream(client.send_streaming_message(msg), options)
            return
        ev = await client.send_message(msg, return_immediately=mode == "return-immediately")
        self._emit(ev.raw, self._event_line(ev), options)

    async def _stream(self, stream: Any, options: dict[str, Any]) -> None:
        # Closed here when printing fails (a reader that left): left to asyncio.run's end,
        # the open stream's generators logged "aclose(): asynchronous generator is already
        # running" tracebacks.
        async with contextlib.aclosing(stream):
            async for ev in stream:
                self._emit(ev.raw, self._event_line(ev), options)

    async def _get(self, client: A2AClient, options: dict[str, Any]) -> None:
        task = await client.get_task(
            options["task_id"], history_length=options.get("history_length")
        )
        ev = StreamEvent("task", task, {"task": task})
        self._emit(ev.raw, self._event_line(ev), options)

    async def _list(self, client: A2AClient, options: dict[str, Any]) -> None:
        page = await client.list_tasks(
            context_id=options.get("context_id"),
            status=options.get("status"),
            page_size=options.get("page_size"),
            page_token=options.get("page_token"),
        )
        for task in page["tasks"]:
            ev = StreamEvent("task", task, {"task": task})
            self._emit(ev.raw, self._event_line(ev).split("\n", 1)[0], options)
        if page.get("nextPageToken"):
            tail = {k: page[k] for k in ("nextPageToken", "pageSize", "totalSize") if k in page}
            self._emit(tail, f"next page: --page-token {page['nextPageToken']}", options)

    async def _cancel(self, client: A2AClient, options: dict[str, Any]) -> None:
        task = await client.cancel_task(options["task_id"])
        ev = StreamEvent("task", task, {"task": task})
        self._emit(ev.raw, self._event_line(ev), options)

    async def _subscribe(self, client: A2AClient, options: dict[str, Any]) -> None:
        await self._stream(client.subscribe_to_task(options["task_id"]), options)
