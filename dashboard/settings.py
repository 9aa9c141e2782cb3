"""Settings for the A2A dashboard, read from the environment (12-factor).

One module for every environment. Local runs need no configuration at all:
SQLite in the data folder, a secret key generated once and kept there, and a
Redis that ``manage.py up`` starts itself when ``REDIS_URL`` is unset.

Environment variables:
    DATA_DIR        folder for local state (default ``./var``)
    DATABASE_URL    a dj-database-url URL, sqlite:// or postgres:// (default: SQLite in DATA_DIR)
    REDIS_URL       broker, channel layer and health checks (default ``redis://127.0.0.1:6379/0``
                    for tools; ``manage.py up`` starts its own when unset)
    SECRET_KEY      required in production; generated into DATA_DIR otherwise
    FIELD_ENCRYPTION_KEY  key for stored agent credentials (derived from SECRET_KEY if unset)
    FIELD_ENCRYPTION_OLD_KEYS  comma-separated keys (or SECRET_KEYs) used before, for rotation
    ALLOWED_HOSTS   comma-separated (default: localhost names)
    OUTBOUND_ALLOW  comma-separated CIDRs and host names fetches may reach besides public addresses
    DEBUG           "1"/"true" to enable (default off)
    DASHBOARD_PRODUCTION  "1" to require real SECRET_KEY and ALLOWED_HOSTS; secure cookies and HSTS
    SECURE_HSTS_SECONDS  HSTS max-age in production (default one year)
    SECURE_PROXY_SSL_HEADER  "HEADER,value" a TLS proxy sets, e.g. "X-Forwarded-Proto,https"
    LOGIN_FAILURE_LIMIT / LOGIN_COOLOFF_MINUTES  login throttling per username and address (10 / 15)
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import logging
import math
import os
import re
import secrets
from datetime import timedelta
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.core.validators import validate_email
from redis.connection import parse_url as parse_redis_url

from tasks_app.runtime.files import create_private_once, ensure_private_file, narrow, private_dir
from tasks_app.runtime.logs import FORMATS, formatter_config

BASE_DIR = Path(__file__).resolve().parent.parent


_on_words = ("1", "true", "yes", "on")
_off_words = ("0", "false", "no", "off")


def env_flag(name: str, default: bool = False) -> bool:
    """On/off; a typo is an error, not "off" (``DASHBOARD_PRODUCTION=ture`` must not run insecure)."""
    text = os.environ.get(name, "").strip()
    value = text.lower()
    if not value:
        return default
    if value in _on_words or value in _off_words:
        return value in _on_words
    raise ImproperlyConfigured(
        f"{name} must be 1, true, yes or on (or 0, false, no or off), not {_shown(text)}."
    )


def env_text(name: str, default: str) -> str:
    """A word or address; empty (or only spaces) means the default, as for every variable."""
    return os.environ.get(name, "").strip() or default


def env_list(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name, "")
    items = [item.strip() for item in value.split(",") if item.strip()]
    return items or default


def _shown(text: str) -> str:
    """The bad value, quoted and cut short (a pasted secret should not fill the screen)."""
    return repr(text if len(text) <= 40 else f"{text[:37]}...")


# Longest duration taken, per unit: past about this, timedelta arithmetic overflows at use.
_century = {"seconds": 100 * 365 * 24 * 3600, "minutes": 100 * 365 * 24 * 60, "days": 100 * 365}
# Shortest duration taken (other than a 0 that means something): a loop period of 1e-300 s
# passed "more than 0" and made its loop spin, writing to the database and Redis each turn.
SHORTEST_DURATION = 0.01


def _duration_bounds(unit: str, *, zero_ok: bool) -> str:
    span = f"from {SHORTEST_DURATION:g} to {_century[unit]}"
    return f"0, or {span}" if zero_ok else span


def _a_duration(value: float, unit: str) -> bool:
    return SHORTEST_DURATION <= value <= _century[unit]


def env_int(name: str, default: int, *, minimum: int, maximum: int | None = None) -> int:
    """A whole number in range, or ImproperlyConfigured naming the setting; empty: the default."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value: int | None = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        bounds = f"of at least {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ImproperlyConfigured(f"{name} must be a whole number {bounds}, not {_shown(text)}.")
    return value


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None  # nan and inf pass float()


def env_number(name: str, default: float, *, minimum: float = 0) -> float:
    """A finite number of at least ``minimum`` (a rate, where 0 means off)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return float(default)
    value = _number(text)
    if value is None or value < minimum:
        raise ImproperlyConfigured(
            f"{name} must be a number of at least {minimum:g}, not {_shown(text)}."
        )
    return value


def env_duration(
    name: str, default: float, unit: str = "seconds", *, zero_ok: bool = False
) -> float:
    """A duration from SHORTEST_DURATION to a century (or 0, where 0 means something)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return float(default)
    value = _number(text)
    if value == 0 and zero_ok:
        return 0.0
    if value is None or not _a_duration(value, unit):
        raise ImproperlyConfigured(
            f"{name} must be a number of {unit} {_duration_bounds(unit, zero_ok=zero_ok)}, "
            f"not {_shown(text)}."
        )
    return value


def env_duration_or_off(name: str, default: float | None, unit: str = "seconds") -> float | None:
    """A duration, or None for 0/off/false/no (the feature it times is off)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    value = _number(text)
    if text.lower() in _off_words or value == 0:
        return None
    if value is None or not _a_duration(value, unit):
        raise ImproperlyConfigured(
            f"{name} must be a number of {unit} {_duration_bounds(unit, zero_ok=False)}, "
            f"or 0 or off to turn it off, not {_shown(text)}."
        )
    return value


PRODUCTION = env_flag("DASHBOARD_PRODUCTION")
DATA_DIR = Path(os.environ.get("DATA_DIR") or BASE_DIR / "var").resolve()
# The guides the pages link to (tasks_app/views_help.py) are read from here.
DOCS_DIR = BASE_DIR / "docs"


def _data_dir_unusable(exc: OSError | UnicodeDecodeError) -> ImproperlyConfigured:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not text"
    return ImproperlyConfigured(f"DATA_DIR ({DATA_DIR}) cannot be used: {reason}.")


def _local_secret_key() -> str:
    """Generate the key once and keep it in the data folder, so sessions survive restarts.

    Created owner-only from the first byte (``tasks_app/runtime/files.py``).
    """
    try:
        private_dir(DATA_DIR)
        path = DATA_DIR / "secret_key"
        if not path.exists():
            create_private_once(path, secrets.token_urlsafe(50))
        narrow(path)
        key = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise _data_dir_unusable(exc) from None
    if len(key) < 32:
        # An emptied file gave an empty key: every request then failed on it.
        raise ImproperlyConfigured(
            f"DATA_DIR's secret_key ({path}) is empty or too short; remove it and a new one "
            "is made (sessions then end), or set SECRET_KEY."
        )
    return key


# Stripped: a line end from a CRLF env file would be part of the key (and of the
# encryption keys derived from it).
SECRET_KEY = os.environ.get("SECRET_KEY", "").strip()
if os.environ.get("SECRET_KEY", "") and len(SECRET_KEY) < 32:
    raise ImproperlyConfigured("SECRET_KEY must be at least 32 characters.")
if not SECRET_KEY:
    if PRODUCTION:
        raise ImproperlyConfigured("SECRET_KEY must be set when DASHBOARD_PRODUCTION is on.")
    SECRET_KEY = _local_secret_key()

DEBUG = env_flag("DEBUG")
if PRODUCTION and DEBUG:
    raise ImproperlyConfigured(
        "DEBUG must be off when DASHBOARD_PRODUCTION is on: its error pages show requests "
        "and settings to whoever meets an error."
    )
# Error pages and mails hide settings that carry secrets in URLs too (REDIS_URL, say).
DEFAULT_EXCEPTION_REPORTER_FILTER = "dashboard.reporting.SettingsFilter"

# Checked on the parsed list: "," or " " is as empty as unset (and would mean the localhost names).
if PRODUCTION and not env_list("ALLOWED_HOSTS", []):
    raise ImproperlyConfigured("ALLOWED_HOSTS must be set when DASHBOARD_PRODUCTION is on.")
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "tasks_app",
    "axes",  # login throttling (see AXES_* below)
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "tasks_app.middleware.ContentSecurityPolicyMiddleware",
    # Static files straight from the app folders: daphne serves none itself.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    # A NUL in a query string or form: 400 before any view looks it up (tasks_app/middleware.py).
    "tasks_app.middleware.RefuseNulCharactersMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # After authentication: what a logged-in user gets is never cached (tasks_app/middleware.py).
    "tasks_app.middleware.NoStoreForUsersMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last: turns a locked-out login into the login page with a sentence (AXES_LOCKOUT_CALLABLE).
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "dashboard.urls"
ASGI_APPLICATION = "dashboard.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "tasks_app.access.navigation",
            ],
        },
    },
]


# Keys of a PostgreSQL URL's query that Django's backend takes itself; the rest go to libpq.
_DJANGO_POSTGRES_OPTIONS = (
    "assume_role",
    "isolation_level",
    "pool",
    "server_side_binding",
    "service",
)


def _check_postgres_options(options: dict) -> None:
    """A connection option libpq does not know (``?conn_max_age=60``: dj-database-url passes
    the query on) failed at the first query with a traceback: said at start, by its name."""
    import psycopg
    from psycopg.conninfo import make_conninfo

    given = {k: str(v) for k, v in options.items() if k not in _DJANGO_POSTGRES_OPTIONS}
    try:
        make_conninfo("", **given)
    except psycopg.ProgrammingError as exc:
        unknown = sorted(k for k in given if f'"{k}"' in str(exc))
        named = f" ({', '.join(unknown)})" if unknown else ""
        raise ImproperlyConfigured(
            f"DATABASE_URL's query holds an option PostgreSQL does not know{named}."
        ) from None


def _database() -> dict:
    url = os.environ.get("DATABASE_URL", "").strip()
    if not url:
        # Sessions, password hashes and credentials: the file (and so its WAL and
        # shared-memory files, which SQLite creates with its mode) is owner-only.
        try:  # reached first when SECRET_KEY is set: a file or read-only DATA_DIR is a sentence
            private_dir(DATA_DIR)
            ensure_private_file(DATA_DIR / "dashboard.sqlite3")
        except OSError as exc:
            raise _data_dir_unusable(exc) from None
        # Quoted: the URL's parser reads # and ? in a path as a fragment and a query, and
        # %XX as an escape (DATA_DIR=/srv/a#b put the database in /srv/a, world-readable).
        url = f"sqlite:///{quote(str(DATA_DIR / 'dashboard.sqlite3'), safe='/')}"
    try:
        config = dj_database_url.parse(url, conn_max_age=60, conn_health_checks=True)
    except Exception as exc:  # dj-database-url raises bare ValueErrors and KeyErrors
        raise ImproperlyConfigured(f"DATABASE_URL is not a valid database URL: {exc}") from exc
    # Any other engine (mysql://, oracle://) failed at the first query with a traceback: its
    # driver is not installed, and nothing here was made or tested for it.
    if config["ENGINE"] not in ("django.db.backends.sqlite3", "django.db.backends.postgresql"):
        raise ImproperlyConfigured(
            "DATABASE_URL must be a sqlite:// or postgres:// URL: the dashboard runs on SQLite "
            "and PostgreSQL."
        )
    if config["ENGINE"] == "django.db.backends.sqlite3" and config.get("NAME") == ":memory:":
        raise ImproperlyConfigured(
            "DATABASE_URL names an in-memory SQLite database (sqlite://), a different, empty one "
            "in each process: name a file (sqlite:///PATH), or leave it unset for DATA_DIR's."
        )
    if not config.get("NAME") and not (config.get("OPTIONS") or {}).get("service"):
        raise ImproperlyConfigured(
            "DATABASE_URL names no database (postgres://USER@HOST:PORT/NAME, ?service=NAME, or "
            "sqlite:///PATH)."
        )
    if config["ENGINE"] == "django.db.backends.postgresql":
        _check_postgres_options(config.get("OPTIONS") or {})
    if config["ENGINE"] == "django.db.backends.sqlite3":
        # WAL and a busy timeout let the web server, workers and beat write concurrently.
        # Connections are kept: opening one (and its PRAGMAs) cost about a third of a
        # watcher's database time when every call reconnected (profiled).
        config["CONN_MAX_AGE"] = None
        config["OPTIONS"] = {
            "timeout": 20,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
        # Tests run real workers and servers in other processes: the test
        # database must be a file they can open, not SQLite's in-memory one.
        test_name = os.environ.get("DASHBOARD_TEST_DB_FILE") or str(
            DATA_DIR / "test_dashboard.sqlite3"
        )
        config["TEST"] = {"NAME": test_name}
    return config


DATABASES = {"default": _database()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


def _redis_url_problem(url: str) -> str | None:
    """What redis-py cannot read in ``url``, in words that never quote it (its own can quote
    the password: one holding / # ? or @ ends the host part early)."""
    scheme = url.partition("://")[0].lower()
    if scheme not in ("redis", "rediss", "unix"):
        return "it does not start with redis://, rediss:// or unix://"
    try:
        parts = urlsplit(url)
        port = parts.port
        # redis-py takes a database that is not a number for 0 (another deployment's, maybe).
        databases = parse_qs(parts.query).get("db", [])
        if scheme != "unix":
            databases.append(unquote(parts.path).replace("/", "") or "0")  # as redis-py reads it
        if not all(re.fullmatch(r"[0-9]{1,9}", db) for db in databases):
            return "its database number must be a whole number (0, 1, 2, ...)"
        parse_redis_url(url)
    except ValueError:
        return (
            "it cannot be read as one (its port must be a number from 1 to 65535, and a "
            "password holding / # or ? must be percent-encoded)"
        )
    return "its port is 0" if port == 0 else None


def _redis_setting(name: str, default: str) -> str:
    """A Redis URL checked now: a typo was found only by the first dispatch, and a
    ``tasks start`` then left its task unsent while exiting 0."""
    url = env_text(name, default)
    scheme = url.partition("://")[0].lower()
    if name == "CELERY_BROKER_URL" and scheme not in ("redis", "rediss", "unix"):
        # Another broker (Celery speaks several): Celery reads it. One that names none of them
        # (``abc``, ``http://...``) passed, and every dispatch failed with the task unsent.
        from kombu.transport import TRANSPORT_ALIASES

        if "://" not in url or scheme not in TRANSPORT_ALIASES:
            raise ImproperlyConfigured(
                f"{name} must be a broker URL Celery knows (redis://HOST:PORT/DB, or another "
                "of its transports, such as amqp://); the value is not shown, as it may hold "
                "a password."
            )
        return url
    problem = _redis_url_problem(url)
    if problem:
        raise ImproperlyConfigured(
            f"{name} must be a Redis URL, but {problem}; the value is not shown, as it may "
            "hold a password."
        )
    return url


REDIS_URL = _redis_setting("REDIS_URL", "redis://127.0.0.1:6379/0")

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            # redis-py 8: its default 5 s socket_timeout kills idle consumers and its
            # pool caps at 100 connections; see docs/architecture.md.
            "hosts": [{"address": REDIS_URL, "socket_timeout": None, "max_connections": 2000}],
            "capacity": 1000,
            "expiry": 60,
        },
    }
}

CELERY_BROKER_URL = _redis_setting("CELERY_BROKER_URL", REDIS_URL)
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = env_text("CELERY_QUEUE", "dashboard")
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600}
# beat's schedule in the private data folder (not the working directory), owner-only
# (dashboard.celery.PrivateScheduler); `--schedule` overrides it.
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
# django-axes first: it refuses a locked-out username+address before the password is checked.
# It needs the request, which Django's login views (site and admin) pass to authenticate().
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
# LOGIN_FAILURE_LIMIT failed logins for one username from one address lock that pair out for
# LOGIN_COOLOFF_MINUTES; a good login before that resets the count. The address is REMOTE_ADDR:
# behind a proxy run daphne with --proxy-headers so that it is the client's.
AXES_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 10, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_duration("LOGIN_COOLOFF_MINUTES", 15, "minutes"))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "tasks_app.login_throttle.locked_out"
AXES_USERNAME_CALLABLE = "tasks_app.login_throttle.throttled_username"
AXES_VERBOSE = False  # no "AXES: BEGIN" line from every process; lockouts still log warnings
AXES_ENABLE_ACCESS_FAILURE_LOG = True  # each failed login (name, address, time) for the admin
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
# ``collectstatic`` target for deployments behind a front proxy; local runs serve from the app folders.
STATIC_ROOT = env_text("STATIC_ROOT", "") or None
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = DEBUG

SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_HTTPONLY = False
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"

# What one request may make the web process hold (tests/test_upload_bounds.py). No form takes a
# file over forms.MAX_UPLOAD_BYTES (10 MB): each file is held in memory up to that and only
# counted past it (tasks_app/kept_uploads.BoundedUploadHandler), never written to a temporary
# file, so a larger one costs nothing to refuse and a temporary folder that cannot be written
# is no 500. Every form has at most one file input: two files a request (20 MB) at most.
FILE_UPLOAD_HANDLERS = ["tasks_app.kept_uploads.BoundedUploadHandler"]
DATA_UPLOAD_MAX_NUMBER_FILES = 2
# The fields besides files: the largest form (a new task, or a free answer) takes 1,000,000
# characters of JSON and 100,000 of text, up to 4 bytes each in UTF-8; Django's 2.5 MB refused
# what the form allows (900,000 CJK characters were a bare 400).
DATA_UPLOAD_MAX_MEMORY_SIZE = 5 * 1024 * 1024
# Django's own: a schema answer form has at most 50 fields and 500 options; an A2UI surface
# at most a2ui_render.MAX_NODES (1,500) components.
DATA_UPLOAD_MAX_NUMBER_FIELDS = 1000
# What daphne takes in of one request body before anything else sees it (Twisted spools the
# whole body to disk first; tasks_app/runtime/request_bodies.py): the largest form (5 MB of
# fields and two 10 MB files) with room for the multipart framing. Over it: 413, nothing kept.
REQUEST_MAX_BODY_BYTES = env_int(
    "REQUEST_MAX_BODY_BYTES",
    DATA_UPLOAD_MAX_MEMORY_SIZE + DATA_UPLOAD_MAX_NUMBER_FILES * 10 * 1024 * 1024 + 1024 * 1024,
    minimum=64 * 1024,
)
# Under ASGI, Django keeps a request body up to this in memory and spools the rest to a
# temporary file before parsing (uploads themselves no longer use it: see above).
FILE_UPLOAD_MAX_MEMORY_SIZE = 2621440
# Django's admin change list has one inline <style> block when the list has no actions (as on
# the view-only models); it is allowed by its hash, not by 'unsafe-inline'. tests/test_headers.py
# fails if a Django upgrade changes it.
ADMIN_CHANGELIST_STYLE = "\n      #changelist table thead th:first-child {width: inherit}\n    "
ADMIN_CHANGELIST_STYLE_HASH = f"'sha256-{base64.b64encode(hashlib.sha256(ADMIN_CHANGELIST_STYLE.encode()).digest()).decode()}'"
# Static: no page of ours has inline script or style (tasks_app/middleware.py). 'self' in
# connect-src covers the site's own ws:/wss: (CSP 3; Chromium 71+, Firefox, Safari 16+).
CONTENT_SECURITY_POLICY = {
    "default-src": ["'self'"],
    "script-src": ["'self'"],
    "style-src": ["'self'", ADMIN_CHANGELIST_STYLE_HASH],
    "img-src": ["'self'", "data:"],
    "connect-src": ["'self'"],
    "frame-ancestors": ["'none'"],
    "base-uri": ["'none'"],
    "form-action": ["'self'"],
    "object-src": ["'none'"],
}


def _proxy_ssl_header() -> tuple[str, str] | None:
    """``SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto,https"`` -> ("HTTP_X_FORWARDED_PROTO", "https").

    Only when set: Django then believes that header about the request's scheme, which is safe
    only behind a proxy that always sets (or strips) it; without one any client could claim https.
    """
    value = os.environ.get("SECURE_PROXY_SSL_HEADER", "").strip()
    if not value:
        return None
    name, _, expected = (part.strip() for part in value.partition(","))
    # A header name is letters, digits and dashes: "X Y" can never match a request, and a
    # second comma left the proxy's value expected to be "b,c".
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name) or not expected or "," in expected:
        raise ImproperlyConfigured(
            'SECURE_PROXY_SSL_HEADER must be "HEADER,value", e.g. "X-Forwarded-Proto,https".'
        )
    name = name.upper().replace("-", "_")
    return (name if name.startswith("HTTP_") else f"HTTP_{name}", expected)


SECURE_PROXY_SSL_HEADER = _proxy_ssl_header()
# Read in every mode, used in production only: a typo is found before the day it matters.
_hsts_seconds = env_int("SECURE_HSTS_SECONDS", 365 * 24 * 3600, minimum=0)
_hsts_subdomains = env_flag("SECURE_HSTS_INCLUDE_SUBDOMAINS")
_ssl_redirect = env_flag("SECURE_SSL_REDIRECT")
if PRODUCTION:
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    # Browsers remember to use https only; the proxy in front terminates TLS (and usually
    # redirects http), so the redirect here is off unless asked for.
    SECURE_HSTS_SECONDS = _hsts_seconds
    SECURE_HSTS_INCLUDE_SUBDOMAINS = _hsts_subdomains
    SECURE_SSL_REDIRECT = _ssl_redirect

FIELD_ENCRYPTION_KEY = os.environ.get("FIELD_ENCRYPTION_KEY", "").strip()
if FIELD_ENCRYPTION_KEY:
    from cryptography.fernet import Fernet

    try:  # checked at start: a malformed key failed only when a credential was first stored
        Fernet(FIELD_ENCRYPTION_KEY)
    except ValueError:
        raise ImproperlyConfigured(
            "FIELD_ENCRYPTION_KEY must be a Fernet key (32 url-safe base64-encoded bytes)."
        ) from None
# Keys used before (comma-separated Fernet keys or old SECRET_KEYs): stored credentials
# still decrypt with them; `manage.py rotate_keys` re-encrypts with the current key.
FIELD_ENCRYPTION_OLD_KEYS = env_list("FIELD_ENCRYPTION_OLD_KEYS", [])

# LOG_FORMAT: "text" (default, one line per record) or "json" (one object per line, with
# task_id and agent_id where the code works for one; tasks_app/runtime/logs.py).
LOG_FORMAT = os.environ.get("LOG_FORMAT", "text").strip().lower() or "text"
if LOG_FORMAT not in FORMATS:
    raise ImproperlyConfigured(
        f"LOG_FORMAT must be one of {', '.join(FORMATS)}, not {_shown(LOG_FORMAT)}."
    )
# Checked here: logging would otherwise fail later with "Unable to configure root logger".
_log_level = os.environ.get("LOG_LEVEL", "").strip()
LOG_LEVEL = _log_level.upper() or "INFO"  # logging itself takes only upper-case names
if LOG_LEVEL not in logging.getLevelNamesMapping():
    raise ImproperlyConfigured(
        f"LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, not {_shown(_log_level)}."
    )
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": formatter_config(LOG_FORMAT)},
    # The reconcile tick (every RECONCILE_EVERY_SECONDS) logs nothing at INFO; its warnings do.
    "filters": {
        "context_ids": {"()": "tasks_app.runtime.logs.ContextIds"},
        # A refused request (4xx) of each kind logged once a minute, without a traceback.
        "refused_requests": {"()": "tasks_app.runtime.logs.RefusedRequests"},
        "routine_tasks": {
            "()": "tasks_app.runtime.logs.QuietRoutineTasks",
            # The push drain runs once per delivery burst: two INFO lines each made half of
            # a busy log (a soak run: 7,915 of 15,578 lines).
            "tasks": [
                "tasks_app.watchers.reconcile",
                "tasks_app.jobs.evaluate_alerts",
                "tasks_app.jobs.drain_push",
            ],
        },
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "filters": ["context_ids", "refused_requests"],
        }
    },
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "httpx": {"level": "WARNING"},
        "daphne": {"level": "WARNING"},
        **{
            name: {"filters": ["routine_tasks"]}
            for name in ("celery.beat", "celery.worker.strategy", "celery.app.trace")
        },
    },
}

# Watcher tuning (see tasks_app/watchers.py); tests shorten these.
# A killed worker's streams are taken over within about lease + reconcile period.
WATCH_LEASE_SECONDS = env_duration("WATCH_LEASE_SECONDS", 4)
WATCH_SLICE_SECONDS = env_duration("WATCH_SLICE_SECONDS", 300)
WATCH_POLL_MIN_SECONDS = env_duration("WATCH_POLL_MIN_SECONDS", 1)
WATCH_POLL_MAX_SECONDS = env_duration("WATCH_POLL_MAX_SECONDS", 30)
# A task waiting for an answer is asked about (one GetTask) this often: the agent may end it
# meanwhile (timed out, canceled elsewhere) without a word on any channel we hold.
WATCH_QUESTION_RECHECK_SECONDS = env_duration("WATCH_QUESTION_RECHECK_SECONDS", 300)


def _ordered(low_name: str, low: float, high_name: str, high: float) -> None:
    """A pair of bounds the wrong way round: the code clamped, so a typo went unseen."""
    if low > high:
        raise ImproperlyConfigured(
            f"{low_name} ({low:g}) must not be more than {high_name} ({high:g})."
        )


_ordered("WATCH_POLL_MIN_SECONDS", WATCH_POLL_MIN_SECONDS, "WATCH_POLL_MAX_SECONDS",
         WATCH_POLL_MAX_SECONDS)  # fmt: skip
RECONCILE_EVERY_SECONDS = env_duration("RECONCILE_EVERY_SECONDS", 2)


# Threads per worker process for the watchers' database calls on PostgreSQL (SQLite always
# uses one). Fewer threads leave more of the interpreter lock to the loop that reads the
# streams and relays (P1's end burst: p99 52-62 ms with one), more keep up with many streams
# starting at once (P2: 1,000 streams need several); docs/performance.md has the figures.
WATCH_DB_THREADS = env_int("WATCH_DB_THREADS", 8, minimum=1)
# PostgreSQL: what agents say is committed without waiting for the WAL flush (synchronous_commit
# off; a server crash may lose the last fraction of a second, never half a transaction): the
# same durability as SQLite's WAL with synchronous=NORMAL above. "false" waits for every flush.
RECORD_ASYNC_COMMIT = env_flag("RECORD_ASYNC_COMMIT", True)
# SQLite: how often beat refreshes the query planner's statistics (tasks_app/runtime/sqlite_stats.py).
SQLITE_ANALYZE_EVERY_SECONDS = env_duration("SQLITE_ANALYZE_EVERY_SECONDS", 3600)
# /metrics answers a staff login, or this bearer token (for Prometheus); unset: staff only.
METRICS_TOKEN = os.environ.get("METRICS_TOKEN", "").strip()
# Workers also tick the reconciler (claimed once per period in Redis), so beat is no single point.
RECONCILE_IN_WORKERS = env_flag("RECONCILE_IN_WORKERS", True)
WATCH_STREAM_IDLE_SECONDS = env_duration("WATCH_STREAM_IDLE_SECONDS", 60)
# A holder's own note that can come back every turn (a cut stream, a failed poll, the agent's
# error): logged at most once per this many seconds; the next one counts those in between.
WATCH_REPEATED_NOTE_SECONDS = env_duration("WATCH_REPEATED_NOTE_SECONDS", 60)
WATCH_BACKOFF_BASE_SECONDS = env_duration("WATCH_BACKOFF_BASE_SECONDS", 0.5)
WATCH_BACKOFF_MAX_SECONDS = env_duration("WATCH_BACKOFF_MAX_SECONDS", 30)
_ordered("WATCH_BACKOFF_BASE_SECONDS", WATCH_BACKOFF_BASE_SECONDS, "WATCH_BACKOFF_MAX_SECONDS",
         WATCH_BACKOFF_MAX_SECONDS)  # fmt: skip
WATCH_MAX_EVENT_BYTES = env_int("WATCH_MAX_EVENT_BYTES", 8 * 1024 * 1024, minimum=1)
# Rows one entry may make: artifact parts and history messages, and artifacts (each costs
# several statements). Bytes alone let one 8 MB event ask for millions of part rows.
WATCH_MAX_EVENT_ROWS = env_int("WATCH_MAX_EVENT_ROWS", 10_000, minimum=1)
WATCH_MAX_EVENT_ARTIFACTS = env_int("WATCH_MAX_EVENT_ARTIFACTS", 1_000, minimum=1)
# A watcher that records nothing new this many turns in a row parks the task ("needs attention").
WATCH_MAX_FRUITLESS_TURNS = env_int("WATCH_MAX_FRUITLESS_TURNS", 8, minimum=1)

# Budgets: what one agent may make us do (see docs/architecture.md, "Budgets").
# Per task: events recorded per second, bytes of agent content stored in all.
BUDGET_TASK_EVENTS_PER_SECOND = env_number("BUDGET_TASK_EVENTS_PER_SECOND", 50)
BUDGET_TASK_BYTES = env_int("BUDGET_TASK_BYTES", 64 * 1024 * 1024, minimum=1)
# Artifacts one task may hold: within its bytes, a stream of chunks with fresh ids made
# hundreds of thousands, and a snapshot's comparison reads them all.
BUDGET_TASK_ARTIFACTS = env_int("BUDGET_TASK_ARTIFACTS", 1_000, minimum=1)
# Per person: live sockets open at once, over every web process (tasks_app/socket_places.py).
BUDGET_PERSON_SOCKETS = env_int("BUDGET_PERSON_SOCKETS", 40, minimum=1)
# Per person: bytes of files attached to new tasks and answers in a clock hour
# (tasks_app/upload_budget.py); one file is at most 10 MB (forms.MAX_UPLOAD_BYTES).
BUDGET_PERSON_UPLOAD_BYTES_PER_HOUR = env_int(
    "BUDGET_PERSON_UPLOAD_BYTES_PER_HOUR", 200 * 1024 * 1024, minimum=0
)
# Per agent: protocol errors per minute before its tasks are parked.
BUDGET_AGENT_PROTOCOL_ERRORS_PER_MINUTE = env_int(
    "BUDGET_AGENT_PROTOCOL_ERRORS_PER_MINUTE", 20, minimum=0
)
# A part's content larger than this is stored once (in the part row, or a message's in its
# conversation row); the log row keeps a reference (its digest and size) instead of a second copy.
INLINE_CONTENT_BYTES = env_int("INLINE_CONTENT_BYTES", 64 * 1024, minimum=0)

# Retention (tasks_app/retention.py, manage.py prune): settled tasks older than this many
# days are removed by a beat job every RETENTION_EVERY_SECONDS; unset or empty keeps every
# task forever. With RETENTION_EXPORT_DIR each task is exported there first (JSON Lines).
RETENTION_DAYS = env_duration_or_off("RETENTION_DAYS", None, "days")


def _retention_export_dir() -> str:
    """RETENTION_EXPORT_DIR, checked now: a folder that could not be made failed the daily
    job, and retention with it, with nothing said at start. Relative, it would name another
    folder for each process's working directory. It may not exist yet (the job makes it,
    0700, on the workers' machines), so only a path that is there and not a folder fails."""
    text = os.environ.get("RETENTION_EXPORT_DIR", "").strip()
    if not text:
        return ""
    path = Path(text)
    if not path.is_absolute():
        raise ImproperlyConfigured(
            f"RETENTION_EXPORT_DIR must be an absolute path, not {_shown(text)}."
        )
    if path.exists() and not path.is_dir():
        raise ImproperlyConfigured(
            f"RETENTION_EXPORT_DIR must be a folder (or where one can be made), and "
            f"{_shown(text)} is a file."
        )
    return text


RETENTION_EXPORT_DIR = _retention_export_dir()
RETENTION_EVERY_SECONDS = env_duration("RETENTION_EVERY_SECONDS", 24 * 3600)

# Deadlines on whole outbound calls (not only per read): a trickling answer fails.
A2A_CALL_DEADLINE_SECONDS = env_duration("A2A_CALL_DEADLINE_SECONDS", 60)
A2A_SEND_DEADLINE_SECONDS = env_duration("A2A_SEND_DEADLINE_SECONDS", 600)

# The outbound (SSRF) guard: non-public addresses every server-side fetch may reach, as
# CIDRs and host names (comma-separated). Empty: public addresses only. Link-local and
# cloud-metadata addresses are refused whatever it says. See tasks_app/a2a/guard.py.


def _outbound_allow() -> list[str]:
    """Checked now with the guard's own rule: a typo was found at the first fetch, as a
    traceback in that request, worker or ``manage.py a2a``."""
    entries = env_list("OUTBOUND_ALLOW", [])
    # Imported here: the guard (pure Python, nothing from Django) is needed only when set.
    from tasks_app.a2a.guard import Policy

    try:
        Policy.from_entries(entries)
    except ValueError as exc:
        raise ImproperlyConfigured(f"OUTBOUND_ALLOW: {exc}.") from None
    return entries


OUTBOUND_ALLOW = _outbound_allow()

# Import (ListTasks) jobs: at most this many pages, and this long in all.
IMPORT_MAX_PAGES = env_int("IMPORT_MAX_PAGES", 200, minimum=1)
IMPORT_DEADLINE_SECONDS = env_duration("IMPORT_DEADLINE_SECONDS", 600)

# How much of an artifact the task page shows inline; the rest is a download.
ARTIFACT_PREVIEW_BYTES = env_int("ARTIFACT_PREVIEW_BYTES", 64 * 1024, minimum=1)

# A page's "verify now" on a log too long to check on every load (tasks_app/services/audit.py,
# verify_on_request): 100,000 entries took 3-4 s of a web process. Its outcome is remembered
# for this long while the log does not grow (the page says when it was checked); one check
# per task and one per person run at once, and a person starts at most this many an hour.
CHAIN_VERIFY_REMEMBER_SECONDS = env_duration("CHAIN_VERIFY_REMEMBER_SECONDS", 3600)
CHAIN_VERIFY_PER_PERSON_PER_HOUR = env_int("CHAIN_VERIFY_PER_PERSON_PER_HOUR", 20, minimum=1)


def _http_url_problem(url: str) -> str | None:
    """What keeps ``url`` from being an http(s) URL with a host and a valid port, in words
    that never quote it; None when nothing does."""
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an IPv6 address without its closing "]"
        return "it cannot be read as a URL"
    try:
        port = parts.port
    except ValueError:  # not a number, or past 65535
        port = 0
    if parts.scheme not in ("http", "https"):
        return "its scheme is not http or https"
    if not parts.hostname:
        return "it has no host"
    if port == 0:
        return "its port is not a number from 1 to 65535"
    return None


# Push notifications (tasks_app/services/push.py, tasks_app/webhooks.py).
# The dashboard's externally reachable base URL; without it push is not offered (agents
# need somewhere to deliver). ``manage.py up --demo`` sets it to the local address.


def _public_url() -> str:
    """PUBLIC_URL, checked now: agents were handed ``<it>/push/<id>/`` whatever it was (a
    query or fragment swallows that path), and the push failed at the agent, unexplained."""
    url = os.environ.get("PUBLIC_URL", "").strip().rstrip("/")
    if not url:
        return ""
    # Every webhook URL handed to agents, the push configs' page and alert links show it. (A
    # "/" in a password ends the host part early: any "@" after the scheme is refused.)
    if "@" in url.partition("://")[2]:
        wrong: str | None = "it holds a user name or password"
    else:
        wrong = _http_url_problem(url)
    if wrong is None and ("?" in url or "#" in url):
        wrong = "it has a query or fragment"
    if wrong is not None:
        raise ImproperlyConfigured(
            "PUBLIC_URL must be the dashboard's http:// or https:// base URL with a host, a "
            "valid port, no user name or password and no query, but "
            f"{wrong} (the value is not shown: it may hold a secret)."
        )
    return url


PUBLIC_URL = _public_url()
# A webhook body larger than this is refused (413) before it is parsed.
PUSH_MAX_BODY_BYTES = env_int("PUSH_MAX_BODY_BYTES", 1024 * 1024, minimum=1)
# Bytes of notifications waiting in Redis to be recorded; past it the webhook answers 503
# (the agent retries later). Bounds Redis's memory and what one drain takes at once.
PUSH_QUEUE_MAX_BYTES = env_int("PUSH_QUEUE_MAX_BYTES", 256 * 1024 * 1024, minimum=1)
# Accepted notifications per config, and requests per source address, per second (429 past it).
PUSH_RATE_PER_CONFIG = env_int("PUSH_RATE_PER_CONFIG", 200, minimum=1)
PUSH_RATE_PER_SOURCE = env_int("PUSH_RATE_PER_SOURCE", 5000, minimum=1)
# Refused requests (unknown config, bad credentials) per source address per minute: past it
# that address gets 429 at once, before any lookup (a forger cannot make us work).
PUSH_REFUSED_PER_SOURCE = env_int("PUSH_REFUSED_PER_SOURCE", 60, minimum=1)
# A push-watched task that hears nothing this long is polled (backing off up to the max).
PUSH_SILENCE_SECONDS = env_duration("PUSH_SILENCE_SECONDS", 120)
PUSH_POLL_MAX_SECONDS = env_duration("PUSH_POLL_MAX_SECONDS", 600)
# Signed notifications: clock skew allowed on iat/exp, and the longest token life taken.
PUSH_JWT_SKEW_SECONDS = env_duration("PUSH_JWT_SKEW_SECONDS", 30, zero_ok=True)
PUSH_JWT_MAX_LIFETIME_SECONDS = env_duration("PUSH_JWT_MAX_LIFETIME_SECONDS", 300)
PUSH_JWKS_CACHE_SECONDS = env_duration("PUSH_JWKS_CACHE_SECONDS", 300, zero_ok=True)
# A delivery seen within this long (same config, same body) is a repeat: it appends nothing.
PUSH_DEDUPE_SECONDS = env_int(
    "PUSH_DEDUPE_SECONDS", 24 * 3600, minimum=1, maximum=_century["seconds"]
)
# The GetTask after notifications waits until the task's notifications pause this long
# (a GetTask made at once is often ahead of notifications still in flight), at most the max.
PUSH_REFRESH_DELAY_SECONDS = env_duration("PUSH_REFRESH_DELAY_SECONDS", 1, zero_ok=True)
PUSH_REFRESH_MAX_WAIT_SECONDS = env_duration("PUSH_REFRESH_MAX_WAIT_SECONDS", 10, zero_ok=True)


# Alerts (tasks_app/alerts.py): a beat job every ALERT_EVERY_SECONDS opens and resolves them.
# A threshold of 0 (or "off") turns its rule off; ALERT_SEND_FAILED and ALERT_PARKED are on/off.
# ALERT_EVERY_SECONDS=0 leaves the job out of beat's schedule.
ALERT_EVERY_SECONDS = env_duration("ALERT_EVERY_SECONDS", 30, zero_ok=True)
ALERT_SILENT_WORKING_SECONDS = env_duration_or_off("ALERT_SILENT_WORKING_SECONDS", 30 * 60)
ALERT_QUESTION_WAITING_SECONDS = env_duration_or_off("ALERT_QUESTION_WAITING_SECONDS", 60 * 60)
ALERT_AGENT_UNREACHABLE_SECONDS = env_duration_or_off("ALERT_AGENT_UNREACHABLE_SECONDS", 10 * 60)
ALERT_SEND_FAILED = env_flag("ALERT_SEND_FAILED", True)
ALERT_PARKED = env_flag("ALERT_PARKED", True)
# At most this many subjects per rule per evaluation (each rule is one bounded query).
ALERT_MAX_PER_RULE = env_int("ALERT_MAX_PER_RULE", 500, minimum=1)
# Delivery, when set: one e-mail (Django's mail, EMAIL_* below) to these comma-separated
# addresses, and/or one JSON POST to this URL (through the outbound guard: a webhook on a
# private network needs OUTBOUND_ALLOW), each within the timeout. With the secret the body
# is signed: X-Dashboard-Signature: sha256=<HMAC-SHA256 of the body, hex>.


def _alert_email_to() -> list[str]:
    """ALERT_EMAIL_TO, checked now: an address that is not one failed every delivery, found
    at the first alert rather than at start."""
    addresses = env_list("ALERT_EMAIL_TO", [])
    for address in addresses:
        try:
            validate_email(address)
        except ValidationError:
            raise ImproperlyConfigured(
                f"ALERT_EMAIL_TO must be e-mail addresses separated by commas, and "
                f"{_shown(address)} is not one."
            ) from None
    return addresses


ALERT_EMAIL_TO = _alert_email_to()
ALERT_EMAIL_FROM = os.environ.get("ALERT_EMAIL_FROM", "").strip()


def _webhook_url() -> str:
    """ALERT_WEBHOOK_URL, checked now: a bad port would otherwise fail every alerts page and
    delivery. The message never shows the URL (its path, query or user part may be a secret)."""
    url = os.environ.get("ALERT_WEBHOOK_URL", "").strip()
    if not url:
        return ""
    wrong = _http_url_problem(url)
    if wrong is None:
        return url
    raise ImproperlyConfigured(
        "ALERT_WEBHOOK_URL must be an http:// or https:// URL with a host and a valid port, "
        f"but {wrong} (the value is not shown: it may hold a secret)."
    )


ALERT_WEBHOOK_URL = _webhook_url()
ALERT_WEBHOOK_SECRET = os.environ.get("ALERT_WEBHOOK_SECRET", "")
ALERT_DELIVERY_TIMEOUT_SECONDS = env_duration("ALERT_DELIVERY_TIMEOUT_SECONDS", 10)
ALERT_NOTIFY_RESOLVED = env_flag("ALERT_NOTIFY_RESOLVED", True)
# How often an open overview or inbox page asks whether its alerts changed.
ALERT_REFRESH_SECONDS = env_duration("ALERT_REFRESH_SECONDS", 5)

# Django's e-mail, from the environment (used by alert delivery).


def _email_backend() -> str:
    """EMAIL_BACKEND, checked now as far as it can be without importing it (a module of the
    deployment's own may need settings): a dotted path whose module exists. A typo failed
    every delivery, found at the first alert."""
    path = env_text("EMAIL_BACKEND", "django.core.mail.backends.smtp.EmailBackend")
    module, _, name = path.rpartition(".")
    try:
        found = bool(module) and name.isidentifier() and importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ImproperlyConfigured(
            "EMAIL_BACKEND must be the dotted path of a mail backend class (such as "
            f"django.core.mail.backends.smtp.EmailBackend) in a module that exists, not "
            f"{_shown(path)}."
        )
    return path


EMAIL_BACKEND = _email_backend()
EMAIL_HOST = env_text("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1, maximum=65535)
EMAIL_HOST_USER = os.environ.get("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = os.environ.get("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_flag("EMAIL_USE_TLS")
EMAIL_USE_SSL = env_flag("EMAIL_USE_SSL")
if EMAIL_USE_TLS and EMAIL_USE_SSL:
    # Django refuses the pair only when a mail is sent: at the first alert, not at start.
    raise ImproperlyConfigured(
        "EMAIL_USE_TLS and EMAIL_USE_SSL cannot both be on: TLS upgrades a plain connection "
        "(STARTTLS, usually port 587), SSL is encrypted from the start (usually 465); set one."
    )
DEFAULT_FROM_EMAIL = env_text("DEFAULT_FROM_EMAIL", "a2a-dashboard@localhost")
