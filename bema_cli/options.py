"""Option types shared by several commands, declared once (huggingface_hub `hf` CLI style)."""

from __future__ import annotations

import math
from typing import Annotated

import typer

from bema_cli.errors import UsageError


def option(kind, *names: str, help: str | None = None, **settings):
    """A typer option as one annotation: `out: option(str, "--out", help="...") = "demo"`."""
    return Annotated[kind, typer.Option(*names, help=help, **settings)]


def argument(kind, help: str | None = None, **settings):
    """A typer argument as one annotation, as `option`."""
    return Annotated[kind, typer.Argument(help=help, **settings)]


# --help's panels shared by several commands (commands/flags.py: each settings class names its own)
GRID_PANEL = "Stabilizer (the grid: comma lists)"
RESOURCES_PANEL = "Resources and scale-out"

JsonOpt = option(bool, "--json", help="Print one JSON document on stdout (logs stay on stderr).")
OutDirOpt = option(str, "--out", "-o", help="Output directory.")
OverwriteOpt = option(bool, "--overwrite", help="Replace existing outputs.")
SeedOpt = option(int, "--seed", help="Random seed.")

# Where the work runs (bema_cli/cluster.py, docs/scale-out.md).
ExecutorOpt = option(
    str, "--executor", help="local (this process) or ray (a Ray cluster; pip install 'bema-cli\\[ray]')."
)
WorkersOpt = option(int, "--workers", help="Parallel workers (with --executor ray).")
RayAddressOpt = option(
    str | None,
    "--ray-address",
    help="Ray cluster to join (default: $RAY_ADDRESS, else a local Ray started in this process).",
)


# Stabilizer hyperparameters (names follow the paper's symbols; see docs/math.md). The grid's
# dimensions are comma lists; None means "not given", so a list no method of the grid uses is an error.
def _grid(flag: str, help: str, default: str):
    return option(str | None, flag, help=f"{help} Comma list for a grid (default: {default}).")


KappaOpt = _grid("--kappa", "EMA decay power: beta_s = w(s)**-kappa.", "0.5")
EtaOpt = _grid(
    "--eta", "Bias-correction power: alpha_s = w(s)**-eta ('inf' = no correction, 0 = alpha 1).", "0.2"
)
# the window and schedule-weighted averages (docs/math.md)
WindowOpt = _grid(
    "--window",
    "lawa, wsm: merge the last K checkpoints, or the checkpoints in a span of training: 2000steps, 5Btok, 5%.",
    "8",
)
ScheduleOpt = _grid(
    "--schedule",
    "wsm: the decay g giving the weights: linear, minus-sqrt, cosine, each also NAME:reverse.",
    "minus-sqrt",
)
SwaStartOpt = _grid(
    "--swa-start",
    "swa: average every checkpoint from this step on (or from 2000steps, 5Btok, 80% of the run).",
    "the first",
)
HalfLifeOpt = _grid(
    "--half-life",
    "power: the EMA's half-life as a span of training (5%, 2000steps, 5Btok), torchtitan's half_life_fraction: "
    "gamma = ln 2 / h - 1.",
    "from --sigma-rel",
)
MinIntervalOpt = option(
    int | None,
    "--min-interval",
    help="Thin the inputs as Megatron-LM's merge tool does: from the last step back, keep checkpoints at "
    "least this many steps apart (one-shot: no state).",
)
MinCheckpointsOpt = option(
    int | None,
    "--min-checkpoints",
    help="Refuse a run with fewer checkpoints than this (after --min-interval).",
)
TokensPerStepOpt = option(
    float | None,
    "--tokens-per-step",
    help="Tokens one optimizer step consumes, for durations in tokens (default: the trainer's own record: "
    "num_input_tokens_seen, or Megatron-Bridge's run_config.yaml).",
)
SigmaRelOpt = _grid("--sigma-rel", "power: EDM2's relative width of the power EMA.", "0.05")
PowerGammaOpt = _grid(
    "--power-gamma", "power: the exponent gamma directly (instead of --sigma-rel).", "from --sigma-rel"
)
GammaOpt = option(float, "--gamma", help="Step multiplier in w(s) = rho + gamma*s.")
RhoOpt = option(float, "--rho", help="Lag offset in w(s) = rho + gamma*s.")
TauOpt = option(int, "--tau", help="Burn-in: steps <= tau restart the average (theta0 = theta_s).")
PhiOpt = option(
    int | None,
    "--phi",
    help="Update every phi steps (paper preset default: every checkpoint; reference preset: 400).",
)
BetaMinOpt = option(
    float | None, "--beta-min", help="Floor on beta_s (default 0 for paper, 1e-4 for reference)."
)
PresetOpt = option(
    str,
    "--preset",
    help="'paper' (Algorithm 1, TRL BEMACallback) or 'reference' (the authors' offline code).",
)


def _items(text: str, flag: str) -> list[str]:
    """The comma list's items; an empty one ('0.2,,0.5', a trailing comma) is a typo, never skipped."""
    parts = [p.strip() for p in text.split(",")]
    if text.strip() and not all(parts):
        raise UsageError(f"{flag}: an empty item in {text!r}")
    return [p for p in parts if p]


def parse_float_list(text: str, flag: str) -> list[float]:
    """'0.2,0.5,inf' -> [0.2, 0.5, inf]; a clear UsageError naming the flag otherwise."""
    values = []
    for part in _items(text, flag):
        try:
            values.append(float(part))
        except ValueError:
            raise UsageError(f"{flag}: {part!r} is not a number") from None
    if not values:
        raise UsageError(f"{flag}: no value given")
    return values


def parse_int_list(text: str, flag: str) -> list[int]:
    parts = _items(text, flag)
    try:
        if not all(p.isascii() for p in parts):  # int() takes '²' and '١' too
            raise ValueError
        values = [int(p) for p in parts]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values:
        raise UsageError(f"{flag}: no value given")
    return values


def check_seconds(value: float | None, flag: str, zero_ok: bool = False) -> None:
    """A duration flag must be a finite number of seconds, > 0 (or >= 0 with zero_ok); None is unset.

    typer's float parser takes 'nan' and 'inf': NaN compares false with everything, so a plain
    `value <= 0` check lets it through (and time.sleep(nan) raises later, a traceback).
    """
    if value is None:
        return
    ok = math.isfinite(value) and (value >= 0 if zero_ok else value > 0)
    if not ok:
        bound = ">= 0" if zero_ok else "> 0"
        raise UsageError(f"{flag}: must be a finite number of seconds {bound}, got {value}")


def parse_str_list(text: str, flag: str = "a list") -> list[str]:
    return _items(text, flag)


# Decimal (GB) and binary (GiB) units, as HF's --max-shard-size and memory limits are written.
_SIZE_UNITS = {
    **{"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12},
    **{"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40},
}


def parse_size(text: str, flag: str) -> int:
    """'2GiB' -> 2147483648, '5GB' -> 5000000000, '500MB', '1024' (bytes); UsageError naming the flag."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _SIZE_UNITS:
        raise UsageError(f"{flag}: {text!r} is not a size (e.g. 2GiB, 5GB, 500MB, 1TB)")
    size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise UsageError(f"{flag}: must be positive, got {text!r}")
    return size


MethodOpt = option(
    str | None,
    "--method",
    help="bema, ema, dema, ouema, lawa, wsm, swa, power, vanilla; comma list for a grid (default: bema).",
    rich_help_panel=GRID_PANEL,
)
GridConfigOpt = option(
    str | None,
    "--config",
    help="A YAML grid: `methods:` mapping each method to its own parameter lists (docs/math.md); replaces --method and the grid flags.",
)

# stabilize and sweep: reading the run
AccumDtypeOpt = option(str, "--accum-dtype", help="float32 or float64 accumulators.")
AllowNonfiniteOpt = option(bool, "--allow-nonfinite", help="Do not stop on NaN/Inf in inputs.")
AllowGapsOpt = option(
    bool,
    "--allow-gaps",
    help="Go on when checkpoints the run's cadence (trainer_state.json save_steps, or the state's history) says were saved are gone.",
)
FollowOpt = option(
    bool,
    "--follow",
    help="Keep watching CHECKPOINT_DIR and take each new checkpoint once it is complete (stabilize writes "
    "its outputs, sweep evaluates it).",
)
UntilStepOpt = option(int | None, "--until-step", help="--follow: stop once this step is processed.")
IdleTimeoutOpt = option(
    float | None, "--idle-timeout", help="--follow: stop after this many seconds without a new checkpoint."
)
PollOpt = option(float, "--poll", help="--follow: seconds between looks at CHECKPOINT_DIR.")
SettleOpt = option(
    float | None,
    "--settle",
    help="--follow, runs without trainer_state.json: seconds a checkpoint's content must hold still (default max(5, 2 x --poll)).",
)
# sweep and ship: the walk that holds every config's average in memory
WalkBaseOpt = option(
    str | None, "--base", help="theta0: a model folder or Hub repo id (default: as bema stabilize infers it)."
)
WalkMemoryOpt = option(
    str | None,
    "--max-memory",
    help="Memory the sweep may hold, states and engine (default: what is available).",
)
WalkDeviceOpt = option(
    str, "--device", help="Where the sweep's states live: auto (the GPU when present), cpu or cuda."
)
WalkDtypeOpt = option(
    str | None, "--out-dtype", help="The dtype the configs are cast to (default: the inputs')."
)
CastBaseOpt = option(
    bool,
    "--cast-base",
    help="Accept a base of another float dtype than the checkpoints (e.g. bf16 Hub base, fp32 fine-tune).",
)
