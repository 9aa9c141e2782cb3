pytest_plugins = ["tests.agents"]
