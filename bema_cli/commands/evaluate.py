"""`bema eval` and `bema rescore` (placeholder until its issue lands)."""

from bema_cli.errors import BemaError


def evaluate() -> None:
    """Not implemented yet."""
    raise BemaError("bema eval is not implemented yet")


def rescore() -> None:
    """Not implemented yet."""
    raise BemaError("bema rescore is not implemented yet")
