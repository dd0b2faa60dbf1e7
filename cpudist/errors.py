"""Errors a user can cause and fix: printed as one line (no traceback unless --debug)."""


class UserError(Exception):
    """Bad input: the message names the file, line or key, and what to do."""


# The exit status of a command stopped by a UserError (argparse uses it for bad flags too): a
# supervisor such as `cpudist launch --restarts` does not start such a job again.
USER_ERROR_EXIT = 2
