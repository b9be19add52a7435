"""`bema stabilize` (placeholder until its issue lands)."""

from bema_cli.errors import BemaError


def stabilize() -> None:
    """Not implemented yet."""
    raise BemaError("bema stabilize is not implemented yet")
