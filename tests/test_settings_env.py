"""Bad environment values stop ``manage.py`` with one sentence naming the setting.

Each case starts ``manage.py check`` as an operator would (on this session's test database
and Redis, through ``child_env``, which also marks the test ``subprocess``) and reads what it
prints: one line, no traceback, and for ``ALERT_WEBHOOK_URL`` never the URL's secret parts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest
from django.urls import reverse

from tasks_app.alerts import channels, webhook_origin
from tests.infra import REPO_ROOT

ChildEnv = Callable[..., dict[str, str]]

# Settings read from the variable of the same name, with the default each had before the
# values were checked (types too: what was parsed with float() is still a float).
DEFAULTS = {
    "WATCH_LEASE_SECONDS": 4.0, "WATCH_SLICE_SECONDS": 300.0, "WATCH_POLL_MIN_SECONDS": 1.0,
    "WATCH_POLL_MAX_SECONDS": 30.0, "RECONCILE_EVERY_SECONDS": 2.0, "WATCH_DB_THREADS": 8,
    "RECORD_ASYNC_COMMIT": True, "SQLITE_ANALYZE_EVERY_SECONDS": 3600.0,
    "RECONCILE_IN_WORKERS": True, "WATCH_STREAM_IDLE_SECONDS": 60.0,
    "WATCH_REPEATED_NOTE_SECONDS": 60.0,
    "WATCH_BACKOFF_BASE_SECONDS": 0.5, "WATCH_BACKOFF_MAX_SECONDS": 30.0,
    "WATCH_MAX_EVENT_BYTES": 8 * 1024 * 1024, "WATCH_MAX_FRUITLESS_TURNS": 8,
    "WATCH_MAX_EVENT_ROWS": 10_000, "WATCH_MAX_EVENT_ARTIFACTS": 1_000,
    "PUSH_QUEUE_MAX_BYTES": 256 * 1024 * 1024,
    "BUDGET_TASK_EVENTS_PER_SECOND": 50.0, "BUDGET_TASK_BYTES": 64 * 1024 * 1024,
    "BUDGET_AGENT_PROTOCOL_ERRORS_PER_MINUTE": 20, "BUDGET_PERSON_SOCKETS": 40,
    "BUDGET_PERSON_UPLOAD_BYTES_PER_HOUR": 200 * 1024 * 1024, "INLINE_CONTENT_BYTES": 64 * 1024,
    "RETENTION_DAYS": None, "RETENTION_EVERY_SECONDS": 86400.0, "A2A_CALL_DEADLINE_SECONDS": 60.0,
    "A2A_SEND_DEADLINE_SECONDS": 600.0, "IMPORT_MAX_PAGES": 200, "IMPORT_DEADLINE_SECONDS": 600.0,
    "ARTIFACT_PREVIEW_BYTES": 64 * 1024, "PUSH_MAX_BODY_BYTES": 1024 * 1024,
    "PUSH_RATE_PER_CONFIG": 200, "PUSH_RATE_PER_SOURCE": 5000, "PUSH_REFUSED_PER_SOURCE": 60,
    "PUSH_SILENCE_SECONDS": 120.0, "PUSH_POLL_MAX_SECONDS": 600.0, "PUSH_JWT_SKEW_SECONDS": 30.0,
    "PUSH_JWT_MAX_LIFETIME_SECONDS": 300.0, "PUSH_JWKS_CACHE_SECONDS": 300.0,
    "PUSH_DEDUPE_SECONDS": 86400, "PUSH_REFRESH_DELAY_SECONDS": 1.0,
    "PUSH_REFRESH_MAX_WAIT_SECONDS": 10.0, "ALERT_EVERY_SECONDS": 30.0,
    "ALERT_SILENT_WORKING_SECONDS": 1800, "ALERT_QUESTION_WAITING_SECONDS": 3600,
    "ALERT_AGENT_UNREACHABLE_SECONDS": 600, "ALERT_SEND_FAILED": True, "ALERT_PARKED": True,
    "ALERT_MAX_PER_RULE": 500, "ALERT_WEBHOOK_URL": "", "ALERT_DELIVERY_TIMEOUT_SECONDS": 10.0,
    "ALERT_NOTIFY_RESOLVED": True, "ALERT_REFRESH_SECONDS": 5.0, "EMAIL_PORT": 25,
    "EMAIL_USE_TLS": False, "EMAIL_USE_SSL": False, "DEBUG": False,
}  # fmt: skip
# Read under another name (or into another shape): checked separately.
OTHER_VARIABLES = (
    "LOGIN_FAILURE_LIMIT",
    "LOGIN_COOLOFF_MINUTES",
    "LOG_LEVEL",
    "DASHBOARD_PRODUCTION",
)
UNSET = (*DEFAULTS, *OTHER_VARIABLES)


def manage(
    child_env: ChildEnv, *args: str, unset: tuple[str, ...] = (), **env: str
) -> subprocess.CompletedProcess[str]:
    full = child_env(**env)
    for name in unset:
        full.pop(name, None)
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO_ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def refused(child_env: ChildEnv, name: str, value: str) -> str:
    """The one line ``manage.py check`` prints for ``name=value`` (asserting it failed cleanly)."""
    result = manage(child_env, "check", **{name: value})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


SECONDS = "a number of seconds from 0.01 to 3153600000"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("LOGIN_FAILURE_LIMIT", "ten", "a whole number of at least 1, not 'ten'."),
        ("LOGIN_FAILURE_LIMIT", "0", "a whole number of at least 1, not '0'."),
        ("LOGIN_COOLOFF_MINUTES", "0", "a number of minutes from 0.01 to 52560000, not '0'."),
        ("WATCH_LEASE_SECONDS", "4s", f"{SECONDS}, not '4s'."),
        ("WATCH_POLL_MIN_SECONDS", "inf", f"{SECONDS}, not 'inf'."),
        # More than 0, and the reconciler's loop spun: periods are at least 10 ms.
        ("RECONCILE_EVERY_SECONDS", "1e-300", f"{SECONDS}, not '1e-300'."),
        ("ALERT_EVERY_SECONDS", "0.001",
         "a number of seconds 0, or from 0.01 to 3153600000, not '0.001'."),
        ("ALERT_QUESTION_WAITING_SECONDS", "1e-9",
         f"{SECONDS}, or 0 or off to turn it off, not '1e-9'."),
        ("EMAIL_PORT", "smtp", "a whole number from 1 to 65535, not 'smtp'."),
        ("EMAIL_PORT", "70000", "a whole number from 1 to 65535, not '70000'."),
        ("BUDGET_TASK_EVENTS_PER_SECOND", "-5", "a number of at least 0, not '-5'."),
        ("PUSH_DEDUPE_SECONDS", "0", "a whole number from 1 to 3153600000, not '0'."),
        ("ALERT_EVERY_SECONDS", "-1", "a number of seconds 0, or from 0.01 to 3153600000, not '-1'."),
        ("ALERT_SILENT_WORKING_SECONDS", "soon",
         f"{SECONDS}, or 0 or off to turn it off, not 'soon'."),
        ("RETENTION_DAYS", "nan",
         "a number of days from 0.01 to 36500, or 0 or off to turn it off, not 'nan'."),
        ("RETENTION_DAYS", "inf",
         "a number of days from 0.01 to 36500, or 0 or off to turn it off, not 'inf'."),
        ("RETENTION_DAYS", "-1",
         "a number of days from 0.01 to 36500, or 0 or off to turn it off, not '-1'."),
        ("LOG_LEVEL", "verbose", "one of DEBUG, INFO, WARNING, ERROR, CRITICAL, not 'verbose'."),
        ("DASHBOARD_PRODUCTION", "ture", "1, true, yes or on (or 0, false, no or off), not 'ture'."),
        ("EMAIL_USE_TLS", "yes please",
         "1, true, yes or on (or 0, false, no or off), not 'yes please'."),
        # Checked at start now (each failed every alert's e-mail, or the daily retention job).
        ("EMAIL_BACKEND", "smtp",
         "the dotted path of a mail backend class (such as django.core.mail.backends.smtp."
         "EmailBackend) in a module that exists, not 'smtp'."),
        ("EMAIL_BACKEND", "django.core.mail.backends.smpt.EmailBackend",
         "the dotted path of a mail backend class (such as django.core.mail.backends.smtp."
         "EmailBackend) in a module that exists, not 'django.core.mail.backends.smpt.EmailB...'."),
        ("ALERT_EMAIL_TO", "ops@example.org, on-call at example.org",
         "e-mail addresses separated by commas, and 'on-call at example.org' is not one."),
        ("RETENTION_EXPORT_DIR", "exports", "an absolute path, not 'exports'."),
        # Checked at start now (a malformed key failed when a credential was first stored;
        # a short one weakened the keys derived from it), and never shown.
        ("FIELD_ENCRYPTION_KEY", "notakey", "a Fernet key (32 url-safe base64-encoded bytes)."),
        ("SECRET_KEY", "short\r", "at least 32 characters."),
    ],
)  # fmt: skip
def test_a_bad_value_is_one_sentence_naming_the_setting(
    child_env: ChildEnv, name: str, value: str, message: str
) -> None:
    assert refused(child_env, name, value) == f"Configuration error: {name} must be {message}"


WEBHOOK = "ALERT_WEBHOOK_URL must be an http:// or https:// URL with a host and a valid port, but"
NOT_SHOWN = "(the value is not shown: it may hold a secret)."


@pytest.mark.parametrize(
    ("url", "wrong"),
    [
        ("https://hook-user:pw-s3cr3t@hooks.example.org:abc/T0/path-s3cr3t?token=query-s3cr3t",
         "its port is not a number from 1 to 65535"),
        ("https://hooks.example.org:99999/path-s3cr3t", "its port is not a number from 1 to 65535"),
        ("https://hooks.example.org:0/path-s3cr3t", "its port is not a number from 1 to 65535"),
        ("https://[::1/path-s3cr3t", "it cannot be read as a URL"),
        ("ftp://hooks.example.org/path-s3cr3t", "its scheme is not http or https"),
        ("https:///path-s3cr3t", "it has no host"),
    ],
)  # fmt: skip
def test_a_bad_alert_webhook_url_is_refused_without_showing_it(
    child_env: ChildEnv, url: str, wrong: str
) -> None:
    """Before this check a bad port failed every /alerts/ page and every delivery instead."""
    result = manage(child_env, "check", ALERT_WEBHOOK_URL=url)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"Configuration error: {WEBHOOK} {wrong} {NOT_SHOWN}"
    ]
    output = result.stdout + result.stderr
    assert "s3cr3t" not in output and "hooks.example.org" not in output


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql://someone:pw-s3cr3t@127.0.0.1:1/db",
         "DATABASE_URL must be a sqlite:// or postgres:// URL: the dashboard runs on SQLite and "
         "PostgreSQL."),
        ("oracle://someone:pw-s3cr3t@127.0.0.1:1/db",
         "DATABASE_URL must be a sqlite:// or postgres:// URL: the dashboard runs on SQLite and "
         "PostgreSQL."),
        ("postgres://", "DATABASE_URL names no database (postgres://USER@HOST:PORT/NAME, "
         "?service=NAME, or sqlite:///PATH)."),
        ("postgres://someone:pw-s3cr3t@127.0.0.1:1/db?conn_max_age=abc&sslmode=require",
         "DATABASE_URL's query holds an option PostgreSQL does not know (conn_max_age)."),
        ("sqlite://", "DATABASE_URL names an in-memory SQLite database (sqlite://), a different, "
         "empty one in each process: name a file (sqlite:///PATH), or leave it unset for "
         "DATA_DIR's."),
    ],
)  # fmt: skip
def test_a_database_url_the_dashboard_cannot_run_on_is_one_sentence(
    child_env: ChildEnv, url: str, message: str
) -> None:
    """A MySQL or Oracle URL (no driver installed), a PostgreSQL URL without a database or with
    an option libpq does not know passed the settings and failed at the first query, with a
    traceback."""
    assert refused(child_env, "DATABASE_URL", url) == f"Configuration error: {message}"
    assert "s3cr3t" not in manage(child_env, "check", DATABASE_URL=url).stderr


@pytest.mark.parametrize("url", ["abc", "http://broker-s3cr3t.example/", "bogus://u:s3cr3t@x/"])
def test_a_broker_url_celery_does_not_know_is_one_sentence(child_env: ChildEnv, url: str) -> None:
    """Not a transport Celery has: it passed the settings, and every dispatch failed (``abc``
    even sent the broker's name to the resolver)."""
    assert refused(child_env, "CELERY_BROKER_URL", url) == (
        "Configuration error: CELERY_BROKER_URL must be a broker URL Celery knows "
        "(redis://HOST:PORT/DB, or another of its transports, such as amqp://); the value is "
        "not shown, as it may hold a password."
    )
    assert "s3cr3t" not in manage(child_env, "check", CELERY_BROKER_URL=url).stderr


def test_a_postgres_url_naming_a_service_instead_of_a_database_is_taken(
    child_env: ChildEnv,
) -> None:
    """A connection service (pg_service.conf) names the database itself: no NAME is needed."""
    result = manage(child_env, "check", DATABASE_URL="postgres://?service=dashboard")
    assert result.returncode == 0, result.stderr


def test_defaults_load_unchanged(child_env: ChildEnv) -> None:
    """With none of them set, every setting has the default it had before it was checked."""
    assert manage(child_env, "check", unset=UNSET).returncode == 0
    every = (*UNSET, *TEXT_DEFAULTS, "CELERY_BROKER_URL", "STATIC_ROOT")
    assert_defaults(loaded_settings(child_env, unset=every))


# What a child process loads (the setting's values, and a few read under other names).
LOADED = (
    "import json; from django.conf import settings as s; "
    f"print(json.dumps({{n: getattr(s, n) for n in {list(DEFAULTS)!r}}} | "
    "{'AXES_FAILURE_LIMIT': s.AXES_FAILURE_LIMIT, 'PRODUCTION': s.PRODUCTION, "
    "'cooloff': s.AXES_COOLOFF_TIME.total_seconds(), 'level': s.LOGGING['root']['level'], "
    "'CELERY_QUEUE': s.CELERY_TASK_DEFAULT_QUEUE, 'EMAIL_BACKEND': s.EMAIL_BACKEND, "
    "'EMAIL_HOST': s.EMAIL_HOST, 'DEFAULT_FROM_EMAIL': s.DEFAULT_FROM_EMAIL, "
    "'broker_is_redis': s.CELERY_BROKER_URL == s.REDIS_URL, 'STATIC_ROOT': s.STATIC_ROOT}))"
)
OTHER_DEFAULTS = {
    "AXES_FAILURE_LIMIT": 10, "PRODUCTION": False, "cooloff": 900.0, "level": "INFO",
    "broker_is_redis": True, "STATIC_ROOT": None,
}  # fmt: skip


def loaded_settings(child_env: ChildEnv, **kwargs: object) -> dict:
    result = manage(child_env, "shell", "-c", LOADED, **kwargs)  # type: ignore[arg-type]
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_defaults(loaded: dict) -> None:
    assert loaded == DEFAULTS | TEXT_DEFAULTS | OTHER_DEFAULTS
    # == takes 4 for 4.0: the types are compared too (json keeps 4.0 a float).
    assert all(type(loaded[name]) is type(value) for name, value in DEFAULTS.items())


# Words and addresses with a default (an empty value must give it too).
TEXT_DEFAULTS = {
    "CELERY_QUEUE": "dashboard", "EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend",
    "EMAIL_HOST": "localhost", "DEFAULT_FROM_EMAIL": "a2a-dashboard@localhost",
}  # fmt: skip


def test_an_empty_value_means_the_default(child_env: ChildEnv) -> None:
    """As the README says: an env file that writes ``NAME=`` gets the default, not an empty
    setting (an empty broker URL made Celery look for RabbitMQ; an empty queue name started
    the worker on no queue)."""
    empty = dict.fromkeys((*UNSET, *TEXT_DEFAULTS, "CELERY_BROKER_URL", "STATIC_ROOT"), " ")
    assert_defaults(loaded_settings(child_env, **empty))


def test_documented_spellings_are_accepted(child_env: ChildEnv, tmp_path) -> None:
    """0/off turn a rule (or retention) off; flags take 1/true/yes/on and 0/false/no/off in any case."""
    accepted = {
        "RETENTION_DAYS": "off", "ALERT_SILENT_WORKING_SECONDS": "0", "ALERT_PARKED": "Off",
        "ALERT_EVERY_SECONDS": "0", "DEBUG": "TRUE", "RECORD_ASYNC_COMMIT": "0",
        "RECONCILE_IN_WORKERS": "no", "LOG_LEVEL": "warning", "EMAIL_PORT": "587",
        "WATCH_LEASE_SECONDS": "2.5", "ALERT_WEBHOOK_URL": "https://hooks.example.org:8443/x?t=1",
        "EMAIL_BACKEND": "django.core.mail.backends.locmem.EmailBackend",
        "ALERT_EMAIL_TO": "ops@example.org, on-call+a2a@example.org",
        "RETENTION_EXPORT_DIR": str(tmp_path / "not-made-yet"), "RECONCILE_EVERY_SECONDS": "0.01",
    }  # fmt: skip
    code = (
        "from django.conf import settings as s; "
        "print(s.RETENTION_DAYS, s.ALERT_SILENT_WORKING_SECONDS, s.ALERT_PARKED, "
        "s.ALERT_EVERY_SECONDS, s.DEBUG, s.RECORD_ASYNC_COMMIT, s.RECONCILE_IN_WORKERS, "
        "s.LOGGING['root']['level'], s.EMAIL_PORT, s.WATCH_LEASE_SECONDS, "
        "s.RECONCILE_EVERY_SECONDS, s.ALERT_EMAIL_TO, s.EMAIL_BACKEND.rpartition('.')[0], "
        "s.RETENTION_EXPORT_DIR.endswith('not-made-yet'))"
    )
    result = manage(child_env, "shell", "-c", code, **accepted)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == (
        "None None False 0.0 True False False WARNING 587 2.5 0.01 "
        "['ops@example.org', 'on-call+a2a@example.org'] django.core.mail.backends.locmem True"
    )


def test_a_retention_export_dir_that_is_a_file_is_one_sentence(
    child_env: ChildEnv, tmp_path
) -> None:
    """The daily job failed to make the folder, and retention with it, each day."""
    a_file = tmp_path / "exports"
    a_file.write_text("x")
    line = refused(child_env, "RETENTION_EXPORT_DIR", str(a_file))
    assert line.startswith("Configuration error: RETENTION_EXPORT_DIR must be a folder")
    assert line.endswith("is a file.")


# -- the alerts page with a URL the settings would refuse (set in-process) ------------------


@pytest.mark.parametrize(
    "url",
    [
        "https://h:abc/s3cr3t",
        "https://h:99999/s3cr3t",
        "https://[::1/s3cr3t",
        "not a url",
    ],
)
def test_webhook_origin_of_a_malformed_url_does_not_raise(url: str) -> None:
    assert webhook_origin(url) == "(not a URL)"


def test_webhook_origin_keeps_only_the_origin() -> None:
    assert webhook_origin("https://u:p@[::1]:8443/s3cr3t?q=1") == "https://[::1]:8443"
    assert webhook_origin("http://hooks.example.org/s3cr3t") == "http://hooks.example.org"


def test_the_alerts_page_survives_a_malformed_webhook_url(admin_client, settings) -> None:
    settings.ALERT_WEBHOOK_URL = "https://hooks.example.org:abc/s3cr3t"
    assert channels() == [("webhook", "(not a URL)")]
    response = admin_client.get(reverse("alerts"))
    assert response.status_code == 200
    assert "s3cr3t" not in response.content.decode()


def test_a_data_dir_that_cannot_be_used_is_one_sentence(child_env: ChildEnv, tmp_path) -> None:
    """A DATA_DIR that is a file, or whose secret_key is a folder or empty, ended in a
    traceback (or, for the empty key, in a site that failed every request)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    emptied = tmp_path / "emptied"
    emptied.mkdir()
    (emptied / "secret_key").write_text("")
    for data_dir, says in ((a_file, "cannot be used"), (emptied, "is empty or too short")):
        result = manage(child_env, "check", unset=("SECRET_KEY",), DATA_DIR=str(data_dir))
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert "DATA_DIR" in line and says in line


def test_debug_is_refused_in_production(child_env: ChildEnv) -> None:
    """DEBUG's error pages show the request and settings to whoever meets an error: it ran
    in production when both were set."""
    result = manage(
        child_env, "check", DASHBOARD_PRODUCTION="1", DEBUG="1", SECRET_KEY="k" * 50,
        ALLOWED_HOSTS="dash.example.org",
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "Configuration error: DEBUG must be off when DASHBOARD_PRODUCTION is on: its error "
        "pages show requests and settings to whoever meets an error."
    ]


def test_manage_py_reads_the_settings_and_python_path_it_is_given(child_env, tmp_path) -> None:
    """``--settings`` and ``--pythonpath`` choose the settings, as Django's utility reads them:
    the settings were loaded before the command line was read, so ``check --settings other``
    checked the default ones. A settings module that is not there is one line, exit 2."""
    (tmp_path / "other_settings.py").write_text(
        "from django.core.exceptions import ImproperlyConfigured\n"
        "raise ImproperlyConfigured('the other settings were read')\n"
    )
    result = manage(
        child_env, "check", "--settings", "other_settings", "--pythonpath", str(tmp_path)
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == "Configuration error: the other settings were read"
    result = manage(child_env, "check", f"--pythonpath={tmp_path}", "--settings=other_settings")
    assert result.stderr.strip() == "Configuration error: the other settings were read"
    result = manage(child_env, "check", "--settings", "no_such_settings")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == (
        "Configuration error: no settings module 'no_such_settings' "
        "(No module named 'no_such_settings')"
    )
    assert manage(child_env, "check").returncode == 0  # the default ones, unchanged
