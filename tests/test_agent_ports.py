"""The demo agent's start (``tests.agents.start_agent``) when its picked port is taken.

A port is picked free and then bound by the agent's process: between the two, another
process (CI runs two suites at once, each with agents and servers) can take it. The agent
then exits at once; a picked port is picked again, a port asked for is not.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from unittest import mock

import pytest

from tests import agents

pytestmark = [pytest.mark.agent, pytest.mark.subprocess, pytest.mark.timeout(90)]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_picked_port_taken_meanwhile_is_picked_again(busy_port: int) -> None:
    picks = iter([busy_port, agents.free_port()])
    with mock.patch.object(agents, "free_port", lambda: next(picks)):
        handle = agents.start_agent()
    try:
        assert handle.port != busy_port
        assert handle.process.poll() is None
    finally:
        handle.stop()


def test_a_port_asked_for_and_taken_is_an_error_naming_it(busy_port: int) -> None:
    with pytest.raises(agents.PortTaken, match=f"'127.0.0.1', {busy_port}"):
        agents.start_agent(port=busy_port)
