from django.db import migrations, models
from django.utils import timezone


def one_active_per_agent(apps, schema_editor):
    """Before the index: of an agent's queued or running imports (two clicks at once could
    queue two), one stays (the running one, else the newest) and the others fail, saying
    why."""
    ImportJob = apps.get_model("tasks_app", "ImportJob")
    kept: set[int] = set()
    running = list(ImportJob.objects.filter(status="running").order_by("agent_id", "-id"))
    queued = list(ImportJob.objects.filter(status="queued").order_by("agent_id", "-id"))
    for job in [*running, *queued]:
        if job.agent_id in kept:
            ImportJob.objects.filter(pk=job.pk).update(
                status="failed",
                finished_at=timezone.now(),
                error="Another import of this agent was queued or running (found on an upgrade).",
            )
        kept.add(job.agent_id)


class Migration(migrations.Migration):
    dependencies = [("tasks_app", "0016_one_running_import")]

    operations = [
        migrations.RunPython(one_active_per_agent, migrations.RunPython.noop),
        migrations.RemoveConstraint(model_name="importjob", name="one_running_import"),
        migrations.AddConstraint(
            model_name="importjob",
            constraint=models.UniqueConstraint(
                condition=models.Q(("status__in", ["queued", "running"])),
                fields=("agent",),
                name="one_active_import",
            ),
        ),
    ]
