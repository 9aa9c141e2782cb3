"""``manage.py agents add URL [--name NAME] [--token-file PATH | --api-key-file PATH]``,
``agents list``, ``agents rename AGENT NAME``, ``agents retire AGENT`` and ``agents restore AGENT``.

Secrets are read from a file (or standard input, ``-``), never taken from the command line:
every argument of a running process is visible to every user of the machine (``ps``).
``--token`` and ``--api-key`` still exist, so that argparse does not read them as
abbreviations of the file options, only to refuse with a sentence naming those.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from django.core.management.base import CommandError, CommandParser

from tasks_app.management.commands._stopping import StoppableCommand
from tasks_app.management.commands.tasks import find_agent
from tasks_app.models import Agent, Project
from tasks_app.runtime.logs import one_line
from tasks_app.services.agents import (
    AgentError,
    add_agent,
    header_safe,
    rename_agent,
    restore_agent,
    retire_agent,
)

MAX_SECRET_BYTES = 64 * 1024
LIFECYCLE = ("rename", "retire", "restore")

REFUSED = {
    "token": ("--token", "--token-file"),
    "api_key": ("--api-key", "--api-key-file"),
}


def read_secret(source: str, option: str, stdin: TextIO) -> str:
    """The secret in file ``source`` (``-``: standard input), without its line end."""
    if source == "-":
        text = stdin.read(MAX_SECRET_BYTES + 1)
    else:
        try:
            with Path(source).open(encoding="utf-8") as handle:
                text = handle.read(MAX_SECRET_BYTES + 1)
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
            raise CommandError(f"Cannot read {option} {source}: {reason}.") from None
    where = "standard input" if source == "-" else source
    if len(text) > MAX_SECRET_BYTES:
        raise CommandError(
            f"{option}: {where} holds more than {MAX_SECRET_BYTES} bytes; is it the right file?"
        )
    secret = text.strip()
    if not secret:
        raise CommandError(f"{option}: {where} is empty.")
    if "\n" in secret:
        raise CommandError(
            f"{option}: {where} holds more than one line; put only the secret in it."
        )
    if not header_safe(secret):
        raise CommandError(
            f"{option}: {where} holds characters an HTTP header cannot carry (control "
            "characters or non-ASCII); put only the secret in it."
        )
    return secret


class Command(StoppableCommand):
    help = "Register, show, rename, retire and restore A2A agents."
    stealth_options = ("stdin",)

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        add = sub.add_parser("add", help="fetch an agent's card and register it")
        add.add_argument("url", help="the agent's base URL or its card URL")
        add.add_argument("--name", default="")
        add.add_argument(
            "--project", default="", help="the project it belongs to (default: default)"
        )
        add.add_argument(
            "--token-file", default="", metavar="PATH",
            help="file holding the bearer token the agent requires ('-': standard input)",
        )  # fmt: skip
        add.add_argument(
            "--api-key-file", default="", metavar="PATH",
            help="file holding the API key the agent requires ('-': standard input)",
        )  # fmt: skip
        # Refused (see the module docstring); defined so they are never taken as abbreviations.
        add.add_argument("--token", default=None, help=argparse.SUPPRESS)
        add.add_argument("--api-key", default=None, help=argparse.SUPPRESS)
        listing = sub.add_parser("list", help="show registered agents")
        listing.add_argument("--json", action="store_true")
        rename = sub.add_parser("rename", help="give an agent another name")
        rename.add_argument("agent", help="agent id, name or base URL")
        rename.add_argument("name")
        retire = sub.add_parser(
            "retire",
            help="take an agent out of service: nothing is sent to it, its tasks and history stay",
        )
        retire.add_argument("agent", help="agent id, name or base URL")
        restore = sub.add_parser("restore", help="put a retired agent back in service")
        restore.add_argument("agent", help="agent id, name or base URL")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["action"] == "add":
            credentials = self._credentials(options)
            try:
                project = None
                if options["project"]:
                    project = Project.objects.filter(name=options["project"]).first()
                    if project is None:
                        raise CommandError(
                            f"No project named {options['project']!r} ('manage.py members add' creates one)."
                        )
                agent = add_agent(
                    options["url"], name=options["name"], project=project, credentials=credentials
                )
            except AgentError as exc:
                raise CommandError(str(exc)) from exc
            self.stdout.write(
                f"{agent.pk}\t{one_line(agent.name)}\t{agent.binding} {one_line(agent.interface_url)}"
            )
            for problem in agent.card_problems:
                self.stdout.write(f"  card problem: {one_line(problem)}")
            return
        if options["action"] in LIFECYCLE:
            self._lifecycle(options)
            return
        self._list(options)

    def _lifecycle(self, options: dict[str, Any]) -> None:
        agent = find_agent(options["agent"], retired_first=options["action"] == "restore")
        try:
            if options["action"] == "rename":
                old = agent.name
                rename_agent(agent, options["name"])
                said = (
                    f"renamed '{one_line(old)}' to '{one_line(agent.name)}'"
                    if agent.name != old
                    else f"already named '{one_line(old)}'"
                )
            elif options["action"] == "retire":
                retire_agent(agent)
                said = "retired: nothing is sent to it, its credentials are deleted"
            else:
                restore_agent(agent)
                said = "back in service, without credentials (set them again if it needs them)"
        except AgentError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"{agent.pk}\t{one_line(agent.name)}\t{said}")

    def _credentials(self, options: dict[str, Any]) -> dict[str, str]:
        for key, (flag, file_flag) in REFUSED.items():
            if options.get(key) is not None:
                raise CommandError(
                    f"{flag} is refused: a secret on the command line shows in the process list. "
                    f"Put it in a file and pass {file_flag} PATH, or pipe it in with {file_flag} -."
                )
        if options["token_file"] == "-" and options["api_key_file"] == "-":
            raise CommandError(
                "Only one of --token-file and --api-key-file can read standard input."
            )
        stdin = options.get("stdin") or sys.stdin
        credentials: dict[str, str] = {}
        for key, option in (("token", "--token-file"), ("api_key", "--api-key-file")):
            source = options[key + "_file"]
            if source:
                credentials[key] = read_secret(source, option, stdin)
        return credentials

    def _list(self, options: dict[str, Any]) -> None:
        # One URL may be registered in several projects (one row each): the project tells
        # the rows apart.
        agents = Agent.objects.select_related("project").order_by("pk")
        if options["json"]:
            for agent in agents:
                self.stdout.write(json.dumps({
                    "id": agent.pk, "name": agent.name, "project": agent.project.name,
                    "base_url": agent.base_url,
                    "binding": agent.binding, "interface_url": agent.interface_url,
                    "streaming": agent.streaming, "push": agent.push, "reachable": agent.reachable,
                    "last_error": agent.last_error, "credentials": bool(agent.credentials_encrypted),
                    "takes_client_context": agent.takes_client_context,
                    "retired_at": agent.retired_at.isoformat() if agent.retired_at else None,
                }))  # fmt: skip
            return
        for agent in agents:
            reach = {True: "reachable", False: "UNREACHABLE", None: "unknown"}[agent.reachable]
            if agent.retired_at is not None:
                reach = "retired"
            caps = ",".join(
                c for c, on in (("streaming", agent.streaming), ("push", agent.push)) if on
            )
            self.stdout.write(
                f"{agent.pk}\t{one_line(agent.name)}\t{agent.project.name}\t{agent.base_url}\t"
                f"{agent.binding}\t{caps or '-'}\t{reach}"
            )
