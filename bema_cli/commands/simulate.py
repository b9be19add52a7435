"""`bema simulate` (placeholder until its issue lands)."""

from bema_cli.errors import BemaError


def simulate() -> None:
    """Not implemented yet."""
    raise BemaError("bema simulate is not implemented yet")
