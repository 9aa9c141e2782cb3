"""``manage.py agents add URL [--name NAME] [--token T | --api-key K]`` and ``agents list``."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from tasks_app.models import Agent
from tasks_app.services.agents import AgentError, add_agent


class Command(BaseCommand):
    help = "Register and show A2A agents."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        add = sub.add_parser("add", help="fetch an agent's card and register it")
        add.add_argument("url", help="the agent's base URL or its card URL")
        add.add_argument("--name", default="")
        add.add_argument("--token", default="", help="bearer token the agent requires")
        add.add_argument("--api-key", default="", help="API key the agent requires")
        listing = sub.add_parser("list", help="show registered agents")
        listing.add_argument("--json", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["action"] == "add":
            credentials = {"token": options["token"], "api_key": options["api_key"]}
            try:
                agent = add_agent(options["url"], name=options["name"], credentials=credentials)
            except AgentError as exc:
                raise CommandError(str(exc)) from exc
            self.stdout.write(f"{agent.pk}\t{agent.name}\t{agent.binding} {agent.interface_url}")
            for problem in agent.card_problems:
                self.stdout.write(f"  card problem: {problem}")
            return
        agents = Agent.objects.order_by("pk")
        if options["json"]:
            for agent in agents:
                self.stdout.write(json.dumps({
                    "id": agent.pk, "name": agent.name, "base_url": agent.base_url,
                    "binding": agent.binding, "interface_url": agent.interface_url,
                    "streaming": agent.streaming, "push": agent.push, "reachable": agent.reachable,
                    "last_error": agent.last_error, "credentials": bool(agent.credentials_encrypted),
                }))  # fmt: skip
            return
        for agent in agents:
            reach = {True: "reachable", False: "UNREACHABLE", None: "unknown"}[agent.reachable]
            caps = ",".join(c for c, on in (("streaming", agent.streaming), ("push", agent.push)) if on)
            self.stdout.write(f"{agent.pk}\t{agent.name}\t{agent.base_url}\t{agent.binding}\t{caps or '-'}\t{reach}")
