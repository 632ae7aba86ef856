"""User-facing errors: the CLI turns these into one line on stderr and exit code 2.

``UserError`` is a ``trials.core.errors.ConfigError`` (what the library raises for a configuration that cannot run):
the CLI catches ``ConfigError``, so both are bad input to a user."""

from trials.core.errors import ConfigError


class UserError(ConfigError):
    """Bad input from the user (a value, a file, a combination). The message is the whole story."""
