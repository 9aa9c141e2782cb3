"""``manage.py members add USER PROJECT ROLE``, ``members remove USER PROJECT``, ``members list``.

Who may see and do what in each project (roles: ``tasks_app/access.py``). ``add`` creates
the project if it does not exist yet and replaces the person's role if they had one.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError, CommandParser
from django.db import transaction

from tasks_app.actionlog import log_member_change
from tasks_app.management.commands._stopping import StoppableCommand
from tasks_app.models import Membership, OperatorAction, Project

ROLES = [value for value, _ in Membership.Role.choices]


class Command(StoppableCommand):
    help = "Manage project members and their roles."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        add = sub.add_parser(
            "add", help="give USER the ROLE in PROJECT (creating the project if needed)"
        )
        add.add_argument("user")
        add.add_argument("project")
        add.add_argument("role", choices=ROLES)
        remove = sub.add_parser("remove", help="take USER out of PROJECT")
        remove.add_argument("user")
        remove.add_argument("project")
        listing = sub.add_parser("list", help="every membership (of one project, if named)")
        listing.add_argument("project", nargs="?")

    def handle(self, *args: Any, **options: Any) -> None:
        action = options["action"]
        if action == "list":
            return self._list(options.get("project"))
        user = get_user_model().objects.filter(username=options["user"]).first()
        if user is None:
            raise CommandError(
                f"No user named {options['user']!r} (create one with 'manage.py createsuperuser' or the admin)."
            )
        if action == "add":
            return self._add(user, options["project"], options["role"])
        return self._remove(user, options["project"])

    def _add(self, user: Any, project_name: str, role: str) -> None:
        longest = Project._meta.get_field("name").max_length or 100
        if not project_name.strip() or len(project_name) > longest:
            # Checked here: adding a member creates the project when it does not exist.
            raise CommandError(
                f"A project name is 1 to {longest} characters, not only spaces"
                f" (this one has {len(project_name)})."
            )
        with transaction.atomic():
            project, created = Project.objects.get_or_create(name=project_name)
            Membership.objects.update_or_create(project=project, user=user, defaults={"role": role})
            log_member_change("member-add", user, project, role)
        if created:
            self.stdout.write(f"Created project {project.name}.")
        self.stdout.write(f"{user.get_username()} is now {role} in {project.name}.")

    def _remove(self, user: Any, project_name: str) -> None:
        deleted, _ = Membership.objects.filter(project__name=project_name, user=user).delete()
        if not deleted:
            raise CommandError(f"{user.get_username()} is not a member of {project_name!r}.")
        OperatorAction.objects.create(
            action="member-remove", payload={"user": user.get_username(), "project": project_name}
        )
        self.stdout.write(f"{user.get_username()} removed from {project_name}.")

    def _list(self, project_name: str | None) -> None:
        rows = Membership.objects.select_related("project", "user")
        if project_name:
            if not Project.objects.filter(name=project_name).exists():
                raise CommandError(f"No project named {project_name!r}.")
            rows = rows.filter(project__name=project_name)
        for m in rows:
            self.stdout.write(f"{m.project.name}\t{m.user.get_username()}\t{m.role}")
