"""Test-only: installs the loopback-only connect hook in every Python process started with
this folder on ``PYTHONPATH`` (tests/conftest.py puts it there for the children of a test
run: workers, daphne, agents). Product code has no such hook."""

import loopback_hook

loopback_hook.install()
