from django.urls import path
from django.views.generic import RedirectView

from . import inbox, views, views_a2ui, views_alerts, views_audit, views_help, webhooks

urlpatterns = [
    path("", views.overview, name="overview"),
    path("agents/", views.agent_list, name="agent-list"),
    path("agents/add/", views.agent_add, name="agent-add"),
    path("agents/<int:pk>/", views.agent_detail, name="agent-detail"),
    path("agents/<int:pk>/card.json", views.agent_card, name="agent-card"),
    path("agents/<int:pk>/credentials/", views.agent_credentials, name="agent-credentials"),
    path("agents/<int:pk>/refresh/", views.agent_refresh, name="agent-refresh"),
    path("agents/<int:pk>/rename/", views.agent_rename, name="agent-rename"),
    path("agents/<int:pk>/retire/", views.agent_retire, name="agent-retire"),
    path("agents/<int:pk>/restore/", views.agent_restore, name="agent-restore"),
    path(
        "agents/<int:pk>/approve-origin/", views.agent_approve_origin, name="agent-approve-origin"
    ),
    path("agents/<int:pk>/import/", views.agent_import, name="agent-import"),
    path("agents/<int:pk>/import/status/", views.agent_import_status, name="agent-import-status"),
    path(
        "agents/<int:pk>/import/<int:job_pk>/cancel/",
        views.agent_import_cancel,
        name="agent-import-cancel",
    ),
    path("inbox/", inbox.inbox, name="inbox"),
    path("inbox/<int:pk>/row/", inbox.inbox_row, name="inbox-row"),
    path("inbox/<int:pk>/answer/", inbox.inbox_answer, name="inbox-answer"),
    path("tasks/", views.task_list, name="task-list"),
    path("tasks/new", views.task_new, name="task-new"),
    # Every other page's address ends with a slash: the one typed by analogy finds it too.
    path(
        "tasks/new/",
        RedirectView.as_view(pattern_name="task-new", query_string=True),
        name="task-new-slash",
    ),
    path("tasks/<int:pk>/", views.task_detail, name="task-detail"),
    path("tasks/<int:pk>/row/", views.task_row, name="task-row"),
    path("tasks/<int:pk>/live/", views.task_live, name="task-live"),
    path("tasks/<int:pk>/cancel/", views.task_cancel, name="task-cancel"),
    path("tasks/<int:pk>/refresh/", views.task_refresh, name="task-refresh"),
    path("tasks/<int:pk>/retry/", views.task_retry, name="task-retry"),
    path("tasks/<int:pk>/abandon/", views.task_abandon, name="task-abandon"),
    path("tasks/<int:pk>/watch/", views.task_watch_again, name="task-watch-again"),
    path("tasks/<int:pk>/answer/", views.task_answer, name="task-answer"),
    path("tasks/<int:pk>/events/", views.task_events, name="task-events"),
    path("tasks/<int:pk>/surfaces/", views_a2ui.task_surfaces, name="task-surfaces"),
    path("tasks/<int:pk>/surfaces/act/", views_a2ui.task_surface_act, name="task-surface-act"),
    path("tasks/<int:pk>/export/", views_audit.task_export, name="task-export"),
    path("audit/", views_audit.audit_log, name="audit"),
    path("audit/actions.csv", views_audit.audit_csv, name="audit-csv"),
    path("alerts/", views_alerts.alert_list, name="alerts"),
    path("guides/<slug:name>/", views_help.guide, name="guide"),
    path("alerts/live/", views_alerts.alerts_live, name="alerts-live"),
    path("alerts/test/", views_alerts.alerts_test, name="alerts-test"),
    path("tasks/<int:pk>/push/", webhooks.push_configs, name="task-push-configs"),
    path(
        "tasks/<int:pk>/push/<str:config_id>/delete/",
        webhooks.push_config_delete,
        name="task-push-config-delete",
    ),
    path("tasks/<int:pk>/watch-mode/", webhooks.task_watch_mode, name="task-watch-mode"),
    # Public: agents deliver push notifications here (authenticated per config).
    path("push/<str:config_id>/", webhooks.receive, name="push-webhook"),
    path("tasks/<int:pk>/events/<int:seq>/", views.event_detail, name="event-detail"),
    path(
        "tasks/<int:pk>/artifacts/<int:artifact_pk>/download",
        views.artifact_download_all,
        name="artifact-download-all",
    ),
    path(
        "tasks/<int:pk>/artifacts/<int:artifact_pk>/parts/<int:index>/download",
        views.artifact_download,
        name="artifact-download",
    ),
    path(
        "tasks/<int:pk>/messages/<int:message_pk>/parts/<int:index>/download",
        views.message_download,
        name="message-download",
    ),
]
