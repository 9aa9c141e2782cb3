#!/usr/bin/env python
"""Django's command-line utility for the A2A dashboard."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        settings.INSTALLED_APPS  # noqa: B018 - loads the settings module
    except ImproperlyConfigured as exc:
        # A configuration mistake is the operator's to fix: one line, no traceback.
        sys.stderr.write(f"Configuration error: {exc}\n")
        raise SystemExit(2) from None
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
