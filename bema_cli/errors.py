"""One exception family for every failure a user can cause.

Core modules raise these and never print or exit; `cli.main` turns them into a
one-line message on stderr and the exit code below (a traceback only with --debug).
"""

from __future__ import annotations


class BemaError(Exception):
    """A user-facing failure. The message is one line naming the file/tensor/flag at fault."""

    exit_code = 1


class UsageError(BemaError):
    """Invalid flags or hyperparameters."""

    exit_code = 2


class InputError(BemaError):
    """A missing, malformed or inconsistent input file or directory."""

    exit_code = 3


class OutputError(BemaError):
    """The output exists (without --overwrite) or cannot be written."""

    exit_code = 4


class BackendError(BemaError):
    """An evaluation backend failed to load or run a model."""

    exit_code = 5


class HubAuthError(BemaError):
    """No Hugging Face token, or the Hub refused it."""

    exit_code = 6


class HubRepoError(BemaError):
    """The repo id names something else on the Hub (a dataset or Space), or the Hub refused the repo."""

    exit_code = 7


class HubNetworkError(BemaError):
    """The Hub could not be reached."""

    exit_code = 8
