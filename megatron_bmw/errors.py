"""User-facing errors: entry points print them as one line and exit with code 2."""

import os
import sys


class UsageError(Exception):
    """Bad input from the user (a flag, a file, a layout). The message is one line naming what is wrong."""


def exit_on_usage_error(fn):
    """Decorator for entry points: a UsageError becomes `error: <message>` on stderr and exit code 2."""

    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UsageError as exc:
            if os.environ.get("RANK", "0") == "0":  # every rank meets the same bad input; say it once
                print(f"error: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper
