"""Errors a user can cause and fix: printed as one line (no traceback unless --debug)."""


class UserError(Exception):
    """Bad input: the message names the file, line or key, and what to do."""
