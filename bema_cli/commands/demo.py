"""`bema demo` (placeholder until its issue lands)."""

from bema_cli.errors import BemaError


def demo() -> None:
    """Not implemented yet."""
    raise BemaError("bema demo is not implemented yet")
