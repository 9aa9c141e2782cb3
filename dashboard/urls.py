from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from tasks_app import health, metrics, views_accounts

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("metrics", metrics.metrics_view, name="metrics"),
    path("admin/", admin.site.urls),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", views_accounts.logout_page, name="logout"),
    path("", include("tasks_app.urls")),
]
