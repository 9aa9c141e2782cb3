"""Bad input from the environment and the command line: one sentence, never a traceback.

Settings are checked at start (``manage.py check`` as an operator runs it); commands are
run as an operator runs them, and stopped the ways an operator stops them (Ctrl-C, a
reader that closes the output early).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from tasks_app.models import Agent, ImportJob, OperatorAction, Project, RemoteTask
from tasks_app.runtime.net import free_port
from tests.agents import AgentHandle
from tests.infra import REPO_ROOT
from tests.test_settings_env import manage, refused

ChildEnv = Callable[..., dict[str, str]]
SECRET = "pw-s3cr3t"
KEY = "k" * 50


# ---------------------------------------------------------------- settings


def test_a_data_dir_that_is_a_file_is_one_sentence_with_a_secret_key_set(
    child_env: ChildEnv, tmp_path: Path
) -> None:
    """With SECRET_KEY set the database's folder is the first use of DATA_DIR: a traceback."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    env = child_env(DATA_DIR=str(a_file), SECRET_KEY=KEY)
    env.pop("DATABASE_URL")  # SQLite in DATA_DIR
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"Configuration error: DATA_DIR ({a_file}) cannot be used: File exists."
    ]


@pytest.mark.parametrize("folder", ["data#1", "data?x=1", "data%41b", "data%2Fb"])
def test_a_data_dir_with_url_characters_keeps_the_database_inside_it(
    child_env: ChildEnv, tmp_path: Path, folder: str
) -> None:
    """The default database's path went into a URL unquoted: DATA_DIR=/srv/data#1 put it in
    /srv/data (a world-readable file beside the folder), and %41 or %2F named a folder that
    does not exist (migrate ended in a traceback)."""
    data_dir = tmp_path / folder
    env = child_env(DATA_DIR=str(data_dir), SECRET_KEY=KEY)
    env.pop("DATABASE_URL")  # SQLite in DATA_DIR
    result = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--no-input"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    database = data_dir / "dashboard.sqlite3"
    assert database.stat().st_size > 0 and (database.stat().st_mode & 0o077) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder]  # nothing beside it


def test_a_redis_url_whose_database_is_not_a_number_stops_the_start(child_env: ChildEnv) -> None:
    """redis-py took a database that is not a number for 0 (another deployment's, maybe); a
    negative one passed the check and failed every websocket later."""
    for url in (
        f"redis://:{SECRET}@127.0.0.1:6379/abc",
        f"redis://:{SECRET}@127.0.0.1:6379/-1",
        f"redis://:{SECRET}@127.0.0.1:6379/1.5",
        f"redis://:{SECRET}@127.0.0.1:6379/0?db=x",
        "unix:///run/redis/redis.sock?db=two",
    ):
        result = manage(child_env, "check", REDIS_URL=url)
        assert result.returncode == 2, (url, result.stderr)
        assert "its database number must be a whole number (0, 1, 2, ...)" in result.stderr
        assert SECRET not in result.stdout + result.stderr
    for url in ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379/", "redis://127.0.0.1:6379/15",
                "redis://127.0.0.1:6379/1/"):  # fmt: skip
        assert manage(child_env, "check", REDIS_URL=url).returncode == 0, url


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("10.0.0.0/33", "'10.0.0.0/33' is neither a network (CIDR), an address nor a host name."),
        ("10.20.0.0/16,not a host!", "'not a host!' is neither a network (CIDR),"),
    ],
)
def test_a_malformed_outbound_allow_stops_the_start(
    child_env: ChildEnv, value: str, says: str
) -> None:
    """It was read at the first fetch: a traceback there (``manage.py a2a``, a request)."""
    line = refused(child_env, "OUTBOUND_ALLOW", value)
    assert line.startswith(f"Configuration error: OUTBOUND_ALLOW: {says}")


def test_a_well_formed_outbound_allow_still_starts(child_env: ChildEnv) -> None:
    value = "10.20.0.0/16,agents.corp.internal,127.0.0.0/8,::1,[::1],192.0.2.7"
    assert manage(child_env, "check", OUTBOUND_ALLOW=value).returncode == 0


@pytest.mark.parametrize(
    ("name", "url", "wrong"),
    [
        ("REDIS_URL", f"redis://:{SECRET}@127.0.0.1:abc/0", "it cannot be read as one"),
        ("REDIS_URL", f"redis://:{SECRET}@127.0.0.1:99999/0", "it cannot be read as one"),
        ("REDIS_URL", f"redis://:hun/{SECRET}@127.0.0.1:6379/0", "it cannot be read as one"),
        ("REDIS_URL", f"redis://u:{SECRET}@[::1/0", "it cannot be read as one"),
        ("REDIS_URL", f"http://:{SECRET}@127.0.0.1:6379/0", "it does not start with redis://"),
        ("REDIS_URL", f"redis://:{SECRET}@127.0.0.1:0/0", "its port is 0"),
        ("CELERY_BROKER_URL", f"redis://:{SECRET}@127.0.0.1:abc/0", "it cannot be read as one"),
    ],
)
def test_a_malformed_redis_url_stops_the_start_without_showing_it(
    child_env: ChildEnv, name: str, url: str, wrong: str
) -> None:
    """It was read at the first dispatch: ``tasks start`` then left its task unsent and
    exited 0 (a warning the only trace); the web and worker parts failed later still."""
    result = manage(child_env, "check", **{name: url})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"Configuration error: {name} must be a Redis URL, but {wrong}")
    assert line.endswith("the value is not shown, as it may hold a password.")
    assert SECRET not in result.stdout + result.stderr


def test_another_broker_and_a_unix_socket_are_still_taken(child_env: ChildEnv) -> None:
    result = manage(
        child_env, "check", CELERY_BROKER_URL="amqp://guest:guest@127.0.0.1:5672//",
        REDIS_URL="unix:///run/redis/redis.sock?db=2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("url", "wrong"),
    [
        ("dash.example.org", "its scheme is not http or https"),
        ("https://", "it has no host"),
        ("https://dash.example.org:99999", "its port is not a number from 1 to 65535"),
        (f"https://dash.example.org/?token={SECRET}", "it has a query or fragment"),
        ("https://dash.example.org/#top", "it has a query or fragment"),
        (f"https://ops:{SECRET}@dash.example.org/", "it holds a user name or password"),
        (f"https://ops:{SECRET}/x@dash.example.org/", "it holds a user name or password"),
    ],
)
def test_a_public_url_agents_cannot_use_stops_the_start(
    child_env: ChildEnv, url: str, wrong: str
) -> None:
    """Agents were handed ``PUBLIC_URL/push/<id>/`` whatever it was (compose's
    ``https://${DASHBOARD_HOST}`` with the host unset gave ``https:///push/...``)."""
    line = refused(child_env, "PUBLIC_URL", url)
    assert line.startswith("Configuration error: PUBLIC_URL must be the dashboard's http:// or")
    assert f"but {wrong} (the value is not shown" in line and SECRET not in line


def test_a_public_url_with_a_path_is_still_taken(child_env: ChildEnv) -> None:
    result = manage(child_env, "check", PUBLIC_URL="https://dash.example.org:8443/base/")
    assert result.returncode == 0, result.stderr


def test_tls_and_ssl_for_mail_together_stop_the_start(child_env: ChildEnv) -> None:
    """Django refuses the pair only when a mail is sent: at the first alert, not at start."""
    result = manage(child_env, "check", EMAIL_USE_TLS="1", EMAIL_USE_SSL="on")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(
        "Configuration error: EMAIL_USE_TLS and EMAIL_USE_SSL cannot both be on:"
    )


@pytest.mark.parametrize("hosts", [",", " , ", " "])
def test_allowed_hosts_of_only_commas_is_unset_in_production(
    child_env: ChildEnv, hosts: str
) -> None:
    """It passed the production check and fell back to the localhost names."""
    result = manage(
        child_env, "check", DASHBOARD_PRODUCTION="1", SECRET_KEY=KEY, ALLOWED_HOSTS=hosts
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "Configuration error: ALLOWED_HOSTS must be set when DASHBOARD_PRODUCTION is on."
    ]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SECURE_SSL_REDIRECT", "maybe"),
        ("SECURE_HSTS_INCLUDE_SUBDOMAINS", "ture"),
        ("SECURE_HSTS_SECONDS", "a year"),
    ],
)
def test_production_switches_with_a_typo_stop_any_start(
    child_env: ChildEnv, name: str, value: str
) -> None:
    """README: every on/off setting's typo stops the start; these were read in production
    only, so a typo stayed hidden until the day production was switched on."""
    line = refused(child_env, name, value)
    assert line.startswith(f"Configuration error: {name} must be ") and repr(value) in line


def test_a_long_log_format_is_shown_cut_short(child_env: ChildEnv) -> None:
    line = refused(child_env, "LOG_FORMAT", "j" * 300)
    assert (
        line
        == "Configuration error: LOG_FORMAT must be one of text, json, not "
        + repr("j" * 37 + "...")
        + "."
    )


# ---------------------------------------------------------------- a2a's URL argument


@pytest.mark.parametrize(
    ("action", "url", "said"),
    [
        ("card", f"http://user:{SECRET}@127.0.0.1:9/", "must not hold a user name or password"),
        ("get", f"http://user:{SECRET}@127.0.0.1:9/", "must not hold a user name or password"),
        ("card", f"http://user:{SECRET}@[::1/", "The URL cannot be read: its port must be"),
        ("card", f"http://user:a/{SECRET}@127.0.0.1:9/", "The URL cannot be read: its port"),
        ("card", "http://127.0.0.1:99999/", "The URL cannot be read: its port must be"),
        ("cancel", "http://127.0.0.1:0/", "URL's port must be a number from 1 to 65535, not 0."),
    ],
)
def test_a2a_never_repeats_a_password_in_its_url_argument(action: str, url: str, said: str) -> None:
    """``GET http://user:pw-s3cr3t@...: cannot connect`` and ``card URL 'http://user:pw...'``
    were printed; a port past 65535 was "Port out of range 0-65535", naming nothing."""
    args = ["a2a", action, url] + ([] if action == "card" else ["task-1"])
    with pytest.raises(CommandError) as refusal:
        call_command(*args, stdout=io.StringIO(), stderr=io.StringIO())
    assert said in str(refusal.value) and SECRET not in str(refusal.value)
    assert "\n" not in str(refusal.value)


def test_a2a_names_states_as_the_docs_spell_them() -> None:
    with pytest.raises(CommandError) as refusal:
        call_command("a2a", "list", "http://127.0.0.1:9/", "--status", "bogus")
    assert "input-required, auth-required" in str(refusal.value)


# ---------------------------------------------------------------- stopped from outside


def _start(child_env: ChildEnv, *args: str, **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "manage.py", *args],
        cwd=REPO_ROOT,
        env=child_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # SIGINT as a terminal sends it; a test runner may start children ignoring it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.django_db(transaction=True)
def test_ctrl_c_while_a_command_waits_is_one_line_and_nothing_is_written(
    child_env: ChildEnv, tmp_path: Path
) -> None:
    """A FIFO as the token file (``<(...)`` is one) waits for its writer; Ctrl-C there, or
    anywhere in a command, ended in a KeyboardInterrupt traceback."""
    fifo = tmp_path / "token"
    os.mkfifo(fifo)
    child = _start(child_env, "agents", "add", "http://127.0.0.1:9/", "--token-file", str(fifo))
    # Until the command has the FIFO open (a fixed 3 s sleep sent Ctrl-C while a loaded
    # machine was still importing Django): a writer's non-blocking open fails until a reader
    # is there. Held open, not written: the command then waits in its read.
    deadline = time.monotonic() + 60
    while True:
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            assert time.monotonic() < deadline and child.poll() is None, "never opened the FIFO"
            time.sleep(0.05)
    try:
        time.sleep(0.2)  # in its read of the token
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    finally:
        os.close(writer)
    assert child.returncode == 130, err.decode()
    assert err.decode().strip().splitlines() == [
        "Stopped by Ctrl-C; nothing was left half-written."
    ]
    assert not Agent.objects.exists()


@pytest.mark.django_db
def test_ctrl_c_during_an_import_leaves_no_running_job(monkeypatch) -> None:
    """A job left "running" refused every import of its agent until it went stale
    (IMPORT_DEADLINE_SECONDS and a minute: 11 minutes by default)."""
    from tasks_app.services import imports

    agent = Agent.objects.create(
        project=Project.objects.create(name="p"), name="a", base_url="http://127.0.0.1:9/"
    )

    def interrupted(walk: object) -> str:  # Ctrl-C in the middle of the walk of pages
        raise KeyboardInterrupt

    monkeypatch.setattr(imports._Walk, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        call_command("tasks", "import", str(agent.pk), stdout=io.StringIO())
    job = ImportJob.objects.get(agent=agent)
    assert job.status == ImportJob.Status.CANCELED
    assert job.error == "The import was stopped (KeyboardInterrupt)." and job.finished_at


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("args", [["audit", "actions"], ["audit", "actions", "--csv"]])
def test_a_reader_that_leaves_early_ends_the_command_quietly(
    child_env: ChildEnv, args: list[str]
) -> None:
    """``manage.py audit actions | head -1`` ended in a BrokenPipeError traceback."""
    OperatorAction.objects.bulk_create(
        OperatorAction(action="member-add", payload={"n": n, "pad": "x" * 100}) for n in range(3000)
    )
    child = _start(child_env, *args)
    assert child.stdout is not None and child.stdout.readline()
    child.stdout.close()  # as `head -1` does after its line
    _, err = child.communicate(timeout=60)
    assert child.returncode == 1 and err.decode() == ""


def test_a_database_that_cannot_be_used_is_one_sentence(
    child_env: ChildEnv, tmp_path: Path
) -> None:
    """Every command ended in a driver traceback: a server that is down, a file that is no
    database, a database not migrated."""
    junk = tmp_path / "junk.sqlite3"
    junk.write_bytes(b"not a database, only text " * 200)
    cases = {
        f"sqlite:///{junk}": "file is not a database.",
        f"sqlite:///{tmp_path / 'empty.sqlite3'}": (
            "no such table: tasks_app_agent (has 'manage.py migrate' run?)."
        ),
    }
    for url, says in cases.items():
        result = subprocess.run(
            [sys.executable, "manage.py", "agents", "list"],
            cwd=REPO_ROOT, env=child_env(DATABASE_URL=url), capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert result.returncode == 1, result.stderr
        assert result.stderr.strip().splitlines() == [
            "The database (DATABASE_URL, or the SQLite file in DATA_DIR) cannot be used: " + says
        ]


def test_a_database_server_that_is_down_is_one_sentence_without_the_password(
    child_env: ChildEnv,
) -> None:
    url = f"postgres://dash:{SECRET}@127.0.0.1:{free_port()}/dash"  # nothing listens there
    result = subprocess.run(
        [sys.executable, "manage.py", "tasks", "list"],
        cwd=REPO_ROOT, env=child_env(DATABASE_URL=url), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("The database (DATABASE_URL, or the SQLite file in DATA_DIR) cannot")
    assert "Connection refused" in line and SECRET not in result.stdout + result.stderr


def _a2a(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "manage.py", "a2a", *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.subprocess
def test_a2a_stream_read_by_a_reader_that_leaves_ends_quietly(agent: AgentHandle) -> None:
    """``a2a send ... --mode stream | head -1``: a BrokenPipeError traceback, then asyncio's
    "aclose(): asynchronous generator is already running" tracebacks for the open stream."""
    child = _a2a("send", agent.base_url, "slow 30 0.1", "--mode", "stream")
    assert child.stdout is not None and child.stdout.readline().startswith(b"task ")
    child.stdout.close()
    _, err = child.communicate(timeout=60)
    assert child.returncode == 1 and err.decode() == ""


@pytest.mark.subprocess
def test_a2a_subscribe_stopped_by_ctrl_c_says_one_line(agent: AgentHandle) -> None:
    """docs/a2a-cli.md: "subscribe ... # Ctrl-C to stop"; it ended in a traceback."""
    out = io.StringIO()
    call_command("a2a", "send", agent.base_url, "long 60", "--mode", "return-immediately",
                 "--json", stdout=out)  # fmt: skip
    task_id = json.loads(out.getvalue().splitlines()[-1])["task"]["id"]
    child = _a2a("subscribe", agent.base_url, task_id)
    assert child.stdout is not None and child.stdout.readline().startswith(b"task ")
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130
    assert err.decode().strip().splitlines() == [
        "Stopped by Ctrl-C; nothing was left half-written."
    ]
    call_command("a2a", "cancel", agent.base_url, task_id, stdout=io.StringIO())


@pytest.mark.django_db
def test_a_message_of_spaces_alone_is_refused() -> None:
    """``tasks start AGENT "   "`` started a task with an empty-looking message ("" was refused)."""
    agent = Agent.objects.create(
        project=Project.objects.create(name="p"), name="a", base_url="http://127.0.0.1:9/"
    )
    with pytest.raises(CommandError, match="needs text, data or a file"):
        call_command("tasks", "start", str(agent.pk), " \n\t ", stdout=io.StringIO())
    assert not RemoteTask.objects.exists()


@pytest.mark.parametrize(
    ("low", "high"),
    [
        ("WATCH_POLL_MIN_SECONDS", "WATCH_POLL_MAX_SECONDS"),
        ("WATCH_BACKOFF_BASE_SECONDS", "WATCH_BACKOFF_MAX_SECONDS"),
    ],
)
def test_bounds_the_wrong_way_round_stop_the_start(
    child_env: ChildEnv, low: str, high: str
) -> None:
    """A minimum above its maximum was clamped in silence (polls every 30 s for a 40 s minimum)."""
    result = manage(child_env, "check", **{low: "40", high: "30"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"Configuration error: {low} (40) must not be more than {high} (30)."
    )


@pytest.mark.django_db(transaction=True)
def test_a_start_the_broker_did_not_take_says_so_and_keeps_the_task(child_env: ChildEnv) -> None:
    """With Redis down, ``tasks start`` printed the task as if handed to a worker and said
    nothing; the send waits for the reconciler. It says so now (and exits 0: the task is
    saved, and a script that started it again would make a second one)."""
    agent = Agent.objects.create(
        name="far", base_url="http://127.0.0.1:9/", interface_url="http://127.0.0.1:9/rpc",
        binding="JSONRPC", protocol_version="1.0",
    )  # fmt: skip
    down = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    child = _start(child_env, "tasks", "start", str(agent.pk), "hello",
                   REDIS_URL=down, CELERY_BROKER_URL=down)  # fmt: skip
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err.decode()
    pk = int(out.decode().split("\t")[0])
    assert f"Task {pk} is saved but no worker was asked to send it" in err.decode()
    assert "Traceback" not in err.decode()
    task = RemoteTask.objects.get(pk=pk)
    assert task.phase == RemoteTask.Phase.SENDING
