"""Services: the only code that changes mirrored tasks and agents.

Views, watchers, webhooks and management commands call these; none of them
writes task models directly.
"""
