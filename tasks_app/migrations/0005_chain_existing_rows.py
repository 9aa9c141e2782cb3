"""Chain the log rows written before the hash chain existed (see tasks_app/services/chain.py)."""

from django.db import migrations


def chain_existing(apps, schema_editor):
    from tasks_app.services.chain import content_digest, event_hash

    RemoteTask = apps.get_model("tasks_app", "RemoteTask")
    TaskEvent = apps.get_model("tasks_app", "TaskEvent")
    for task_pk in (
        RemoteTask.objects.filter(last_hash="", last_seq__gt=0)
        .values_list("pk", flat=True)
        .iterator()
    ):
        previous, after = "", 0
        while True:
            rows = list(
                TaskEvent.objects.filter(task_id=task_pk, seq__gt=after).order_by("seq")[:1000]
            )
            for event in rows:
                event.digest, _ = content_digest(event.raw)
                event.hash = previous = event_hash(previous, event, event.digest)
            TaskEvent.objects.bulk_update(rows, ["digest", "hash"])
            if len(rows) < 1000:
                break
            after = rows[-1].seq
        RemoteTask.objects.filter(pk=task_pk).update(last_hash=previous)


class Migration(migrations.Migration):
    dependencies = [("tasks_app", "0004_trust")]
    operations = [migrations.RunPython(chain_existing, migrations.RunPython.noop)]
