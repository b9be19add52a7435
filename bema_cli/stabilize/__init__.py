"""`bema stabilize`: plan (what to read and write), engine (the tensor-major walk), meta (records)."""

from bema_cli.stabilize.engine import stabilize
from bema_cli.stabilize.grids import grid
from bema_cli.stabilize.plan import Options, Output, Plan, Run
from bema_cli.stabilize.prepare import prepare

__all__ = ["Options", "Output", "Plan", "Run", "grid", "prepare", "stabilize"]
