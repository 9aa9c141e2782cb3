"""Projects and roles: every agent moves into a project named ``default``.

Non-atomic so that, on PostgreSQL, the rows updated by the data step are committed before
the column becomes NOT NULL (otherwise: "pending trigger events"). Each step is safe to
run again. Agents that already hold credentials keep sending them to the origin of their
current interface (approved as of this migration).
"""

from urllib.parse import urlsplit

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models

import tasks_app.models

DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_of(url):
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return ""
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        return ""
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port if port is not None else DEFAULT_PORTS[scheme]}"


def into_default_project(apps, schema_editor):
    Agent = apps.get_model("tasks_app", "Agent")
    Project = apps.get_model("tasks_app", "Project")
    if not Agent.objects.filter(project__isnull=True).exists():
        return
    project, _ = Project.objects.get_or_create(name="default")
    for agent in Agent.objects.filter(project__isnull=True):
        agent.project = project
        origin = origin_of(agent.interface_url or agent.base_url)
        if agent.credentials_encrypted and origin:
            agent.credential_origins = [origin]
        agent.save(update_fields=["project", "credential_origins"])


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("tasks_app", "0006_database_defaults"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="Project",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=100, unique=True)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
            ],
            options={"ordering": ["name"]},
        ),
        migrations.CreateModel(
            name="Membership",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "role",
                    models.CharField(
                        choices=[
                            ("viewer", "Viewer"),
                            ("operator", "Operator"),
                            ("agent-admin", "agent admin"),
                            ("auditor", "Auditor"),
                        ],
                        max_length=20,
                    ),
                ),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "project",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="memberships",
                        to="tasks_app.project",
                    ),
                ),
                (
                    "user",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="memberships",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={
                "ordering": ["project__name", "user__username"],
                "constraints": [
                    models.UniqueConstraint(fields=("project", "user"), name="one_role_per_project")
                ],
            },
        ),
        migrations.AddField(
            model_name="agent",
            name="credential_origins",
            field=models.JSONField(blank=True, db_default=[], default=list),
        ),
        migrations.AddField(
            model_name="agent",
            name="pending_origin",
            field=models.CharField(blank=True, db_default="", default="", max_length=300),
        ),
        migrations.AddField(
            model_name="agent",
            name="project",
            field=models.ForeignKey(
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="agents",
                to="tasks_app.project",
            ),
        ),
        migrations.RunPython(into_default_project, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="agent",
            name="project",
            field=models.ForeignKey(
                default=tasks_app.models.default_project,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="agents",
                to="tasks_app.project",
            ),
        ),
    ]
