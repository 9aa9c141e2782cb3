"""Push tasks settled by a cancel, a refresh or an import before ``settle_if_ended`` ended
their "awaiting push": idle now, as a release would have left them (retention skipped them)."""

from django.db import migrations
from django.utils import timezone


def settled_push_tasks_idle(apps, schema_editor):
    RemoteTask = apps.get_model("tasks_app", "RemoteTask")
    RemoteTask.objects.filter(
        settled_at__isnull=False, lease_token="", watcher_status="awaiting-push"
    ).update(
        watcher_status="idle",
        watcher_note="task ended",
        watcher_since=timezone.now(),
        lease_expires_at=None,
    )


class Migration(migrations.Migration):
    dependencies = [
        ("tasks_app", "0023_agent_retired"),
    ]

    operations = [
        migrations.RunPython(settled_push_tasks_idle, migrations.RunPython.noop),
    ]
