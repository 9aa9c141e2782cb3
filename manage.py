#!/usr/bin/env python
"""Django's command-line utility for the A2A dashboard."""

import os
import sys


def main() -> None:
    from django.core.management import CommandParser, execute_from_command_line
    from django.core.management.base import handle_default_options

    # --settings and --pythonpath as Django's own utility reads them, before the settings are
    # loaded below (loaded first, they made `check --settings other` check the default).
    parser = CommandParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--settings")
    parser.add_argument("--pythonpath")
    handle_default_options(parser.parse_known_args(sys.argv[2:])[0])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
    from django.conf import settings
    from django.core.exceptions import ImproperlyConfigured

    try:
        settings.INSTALLED_APPS  # noqa: B018 - loads the settings module
    except ImproperlyConfigured as exc:
        # A configuration mistake is the operator's to fix: one line, no traceback.
        sys.stderr.write(f"Configuration error: {exc}\n")
        raise SystemExit(2) from None
    except ModuleNotFoundError as exc:
        name = os.environ["DJANGO_SETTINGS_MODULE"]
        if not exc.name or not (name == exc.name or name.startswith(f"{exc.name}.")):
            raise  # a module the settings import is missing: the traceback says which
        sys.stderr.write(f"Configuration error: no settings module {name!r} ({exc})\n")
        raise SystemExit(2) from None
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
