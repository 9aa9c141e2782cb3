"""Shared fixtures: real infrastructure (``tests.infra``) and real A2A peers (``tests.agents``).

See the docstrings of those modules for the fixture list; nothing in the suite is mocked.
"""

import importlib.util

pytest_plugins = ["tests.infra"]
# The A2A peers are written separately; keep the suite importable while they are missing.
if importlib.util.find_spec("tests.agents") is not None:
    pytest_plugins.append("tests.agents")
