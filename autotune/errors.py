"""User-facing errors: the CLI turns these into one line on stderr and exit code 2."""


class UserError(ValueError):
    """Bad input from the user (a value, a file, a combination). The message is the whole story."""
