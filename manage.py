#!/usr/bin/env python
import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "telemachus.settings")
    from django.core.management import execute_from_command_line

    from telemachus.environment import configuration_errors_reported

    # A configuration error is one line naming the setting and the fix, exit status 78.
    with configuration_errors_reported("manage.py"):
        execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
