"""An agent's URL is unique per project, not across all projects.

Two projects may each register one shared agent, and adding a URL no longer tells a person
that a project they cannot see holds it. The rows this finds were unique across all
projects, so they are unique per project: nothing to change in the data. Going back fails
while two projects hold one URL (remove one of the rows first).
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("tasks_app", "0019_alert_news_told"),
    ]

    operations = [
        migrations.AlterField(
            model_name="agent",
            name="base_url",
            field=models.URLField(max_length=1000),
        ),
        migrations.AddConstraint(
            model_name="agent",
            constraint=models.UniqueConstraint(
                fields=("project", "base_url"), name="one_agent_per_url_per_project"
            ),
        ),
    ]
