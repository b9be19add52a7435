"""`bema report` (placeholder until its issue lands)."""

from bema_cli.errors import BemaError


def report() -> None:
    """Not implemented yet."""
    raise BemaError("bema report is not implemented yet")
