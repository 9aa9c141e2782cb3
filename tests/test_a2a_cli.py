"""``manage.py a2a`` against a running demo agent (no database needed)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from tests import test_views
from tests.agents import AGENT_TOKEN, REPO_ROOT, AgentHandle
from tests.hostile_servers import HostileServer

pytestmark = pytest.mark.timeout(60)

odd_card_server = test_views.odd_card_server  # a card server whose card a test sets


def run(*args: str) -> list[str]:
    out = StringIO()
    call_command("a2a", *args, stdout=out)
    return [line for line in out.getvalue().splitlines() if line.strip()]


def run_json(*args: str) -> list[dict]:
    return [json.loads(line) for line in run(*args, "--json")]


def test_card_human_and_json(agent: AgentHandle) -> None:
    lines = run("card", agent.base_url)
    assert lines[0].startswith("Demo Agent 1.0.0")
    assert f"chosen: JSONRPC {agent.jsonrpc_url}" in lines
    assert "valid A2A 1.0 card" in lines
    (card,) = run_json("card", agent.card_url)
    assert card["name"] == "Demo Agent"


def test_an_unusable_card_is_summarised_then_exits_1(odd_card_server) -> None:
    """A script checking a card read exit 0 for one with problems and no usable interface;
    and a card without a description printed a dangling "Broken 1 — "."""
    url = odd_card_server({"name": "Broken", "version": "1", "supportedInterfaces": []})
    out = StringIO()
    with pytest.raises(CommandError, match=r"the card is not usable as it is: .*problem") as err:
        call_command("a2a", "card", url, stdout=out)
    assert err.value.returncode == 1
    lines = out.getvalue().splitlines()
    assert lines[0] == "Broken 1" and any(line.startswith("chosen: none") for line in lines)
    with pytest.raises(CommandError):
        call_command("a2a", "card", url, "--json", stdout=StringIO())


@pytest.mark.parametrize("binding", ["jsonrpc", "rest"])
def test_send_modes(agent: AgentHandle, binding: str) -> None:
    (reply,) = run_json("send", agent.base_url, "hello", "--binding", binding)
    assert set(reply) == {"message"}
    (blocking,) = run_json("send", agent.base_url, "quick", "--binding", binding)
    assert blocking["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
    (immediate,) = run_json(
        "send", agent.base_url, "quick", "--mode", "return-immediately", "--binding", binding
    )
    assert "task" in immediate
    streamed = run_json(
        "send", agent.base_url, "slow 3 0.01", "--mode", "stream", "--binding", binding
    )
    kinds = [next(iter(o)) for o in streamed]
    assert kinds[0] == "task" and kinds.count("artifactUpdate") == 3
    assert streamed[-1]["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED"


def test_answer_get_list_cancel_subscribe(agent: AgentHandle) -> None:
    (asked,) = run_json("send", agent.base_url, "ask")
    task = asked["task"]
    assert task["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
    human = run("send", agent.base_url, "Ada", "--task", task["id"], "--context", task["contextId"])
    assert human[0].startswith(f"task {task['id']} completed")
    (got,) = run_json("get", agent.base_url, task["id"])
    assert got["task"]["id"] == task["id"]
    listed = run_json(
        "list", agent.base_url, "--context", task["contextId"], "--status", "completed"
    )
    assert [t["task"]["id"] for t in listed] == [task["id"]]

    (long,) = run_json(
        "send", agent.base_url, "long 30", "--mode", "return-immediately", "--binding", "rest"
    )
    (canceled,) = run_json("cancel", agent.base_url, long["task"]["id"])
    assert canceled["task"]["status"]["state"] == "TASK_STATE_CANCELED"
    with pytest.raises(CommandError) as err:
        run("subscribe", agent.base_url, long["task"]["id"])
    assert "-32004" in str(err.value) and "UNSUPPORTED_OPERATION" in str(err.value)
    assert err.value.returncode == 1


def test_list_paging_line(agent: AgentHandle) -> None:
    for _ in range(3):
        run("send", agent.base_url, "quick")
    lines = run_json("list", agent.base_url, "--page-size", "2")
    assert [next(iter(o)) for o in lines[:2]] == ["task", "task"]
    assert lines[2]["nextPageToken"]
    more = run_json(
        "list", agent.base_url, "--page-size", "2", "--page-token", lines[2]["nextPageToken"]
    )
    assert more and "task" in more[0]


@pytest.mark.subprocess
def test_errors_exit_nonzero_with_one_line(agent: AgentHandle) -> None:
    proc = subprocess.run(
        [sys.executable, "manage.py", "a2a", "get", agent.base_url, "no-such-task"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    err_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(err_lines) == 1 and "-32001" in err_lines[0] and "TASK_NOT_FOUND" in err_lines[0]
    with pytest.raises(CommandError, match="cannot connect"):
        run("get", "http://127.0.0.1:9", "x")


def test_secrets_come_from_a_file_stdin_or_the_environment(
    agent_token: AgentHandle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("A2A_TOKEN", raising=False)
    for flag, file_flag in (("--token", "--token-file"), ("--api-key", "--api-key-file")):
        with pytest.raises(CommandError, match=f"{flag} is refused: .*{file_flag} PATH"):
            run("send", agent_token.base_url, "quick", flag, AGENT_TOKEN)
    with pytest.raises(CommandError, match="401"):
        run("send", agent_token.base_url, "quick")

    token_file = tmp_path / "token"
    token_file.write_text(AGENT_TOKEN + "\n")
    (by_file,) = run_json("send", agent_token.base_url, "quick", "--token-file", str(token_file))
    assert by_file["task"]["status"]["state"] == "TASK_STATE_COMPLETED"

    out = StringIO()
    call_command(
        "a2a", "send", agent_token.base_url, "quick", "--json", "--token-file", "-",
        stdin=StringIO(AGENT_TOKEN), stdout=out,
    )  # fmt: skip
    assert json.loads(out.getvalue())["task"]["status"]["state"] == "TASK_STATE_COMPLETED"

    monkeypatch.setenv("A2A_TOKEN", AGENT_TOKEN)
    (by_env,) = run_json("send", agent_token.base_url, "quick")
    assert by_env["task"]["status"]["state"] == "TASK_STATE_COMPLETED"

    with pytest.raises(CommandError, match="Cannot read --token-file"):
        run("send", agent_token.base_url, "quick", "--token-file", str(tmp_path / "missing"))


def test_the_outbound_guard_applies(agent: AgentHandle, settings: Any) -> None:
    """The CLI's client is the dashboard's: loopback only when OUTBOUND_ALLOW says so."""
    with pytest.raises(
        CommandError, match=r"refused by the outbound guard: 169\.254\.169\.254 is link-local"
    ):
        run("card", "http://169.254.169.254/")
    settings.OUTBOUND_ALLOW = []
    with pytest.raises(
        CommandError, match=r"refused by the outbound guard: 127\.0\.0\.1 is loopback"
    ):
        run("card", agent.base_url)


def test_credentials_do_not_follow_a_card_to_another_origin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The token given for one agent went to whatever interface URL its card named."""
    from tests.test_ssrf import CardServer, card

    elsewhere = CardServer("127.0.0.1")
    named = CardServer("127.0.0.1")
    named.card(card(f"{elsewhere.base}/rpc"))
    try:
        monkeypatch.setenv("A2A_TOKEN", "cli-S3CRET")
        with pytest.raises(CommandError, match="the credentials are not sent there") as err:
            run("get", named.base, "task-1")
        assert elsewhere.base.replace("http://", "") in str(err.value)
        assert elsewhere.connections == 0
        # Named as an origin they may go to, they go (this server speaks no A2A: an HTTP error).
        with pytest.raises(CommandError, match="HTTP 501"):
            run("get", named.base, "task-1", "--credentials-origin", elsewhere.base)
        assert elsewhere.connections == 1
    finally:
        named.close()
        elsewhere.close()


@pytest.mark.parametrize("command", [["card"], ["get", "t-1"]])
def test_timeout_bounds_the_whole_call_not_only_each_read(command: list[str]) -> None:
    """``--timeout`` set the per-read limit only: a card trickling a byte every 0.25 s kept
    ``card`` for its fixed 30 s deadline and every other command for 60 s, whatever it said."""
    server = HostileServer(interval=0.25, trickle_bytes=160).start()  # 40 s to finish
    try:
        action, *rest = command
        start = time.monotonic()
        with pytest.raises(CommandError, match=r"no complete response after 3 s") as err:
            call_command(
                "a2a", action, server.url_for("trickle"), *rest, "--timeout", "3",
                stdout=StringIO(),
            )  # fmt: skip
        elapsed = time.monotonic() - start
        assert err.value.returncode == 1
        assert 2.5 < elapsed < 15, elapsed
        (conn,) = server.conns_for("trickle")
        assert conn.path.endswith("/.well-known/agent-card.json")
        assert server.wait_peer_closed(conn), "the command kept the connection open"
    finally:
        server.close()
