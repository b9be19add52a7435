"""Durations: a window, a start or a half-life given as training steps, tokens or a fraction of the run.

Pretraining teams speak in spans of training (WSM's merge duration, torchtitan's EMA half-life as a
fraction of the run), not in counts of saved checkpoints. `2000steps`, `5Btok` (k, M, B, T), `5%`;
a bare number keeps its meaning (a count of checkpoints for --window, a step for --swa-start).

Each is resolved against the run as saved: its checkpoints' steps, the last one T (the run's
length so far), and its tokens per step (--tokens-per-step, else the HF Trainer's
`num_input_tokens_seen`, else Megatron-Bridge's `run_config.yaml`: global batch x sequence length).

- `--window D`: the checkpoints whose step lies in (T - D, T], counted: K. A duration that does not
  fall on saved steps covers the checkpoints inside it.
- `--swa-start P`: a position: the first checkpoint at or after step P (80% = 0.8 T).
- `--half-life H`: the power EMA whose half-life is the fraction h = H / T of the training time at
  every step (torchtitan's `half_life_fraction`): gamma = ln 2 / h - 1 (docs/math.md).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from bema_cli.errors import InputError, UsageError

SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}
PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(steps?|([kmbt]?)tok(?:ens)?|%)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Duration:
    """A span of training as the user wrote it: `amount` in `unit` (steps, tokens or fraction)."""

    text: str
    amount: float
    unit: str

    def steps(self, clock: RunClock) -> float:
        if self.unit == "steps":
            return self.amount
        if self.unit == "fraction":
            return self.amount * clock.last_step
        return self.amount / clock.need_tokens_per_step(self.text)


def parse(text: str | int | float) -> Duration | None:
    """A duration, or None for a bare number (the flag's old meaning); a malformed one is refused."""
    if isinstance(text, int | float) or re.fullmatch(r"\s*\d+(\.\d+)?\s*", str(text)):
        return None
    m = PATTERN.match(str(text))
    if not m:
        raise UsageError(
            f"{text!r}: a duration is steps (2000steps), tokens (5Btok, 500Mtok) or a fraction (5%)"
        )
    amount = float(m.group(1))
    if m.group(2) == "%":
        if not 0 < amount <= 100:
            raise UsageError(f"{text!r}: a fraction of the run is in (0%, 100%]")
        return Duration(str(text).strip(), amount / 100, "fraction")
    if m.group(2).lower().startswith("step"):
        return Duration(str(text).strip(), amount, "steps")
    return Duration(str(text).strip(), amount * SUFFIXES[(m.group(3) or "").lower()], "tokens")


@dataclass(frozen=True)
class RunClock:
    """What a duration is measured against: the saved steps and the tokens one step consumes."""

    steps: tuple[int, ...]
    tokens_per_step: float | None = None
    tokens_source: str = ""

    @property
    def last_step(self) -> int:
        return self.steps[-1]

    def need_tokens_per_step(self, text: str) -> float:
        if not self.tokens_per_step:
            raise UsageError(
                f"{text}: tokens per step unknown (no num_input_tokens_seen in trainer_state.json, no "
                "Megatron-Bridge run_config.yaml): pass --tokens-per-step N"
            )
        return self.tokens_per_step


def clock(checkpoints: list, tokens_per_step: float | None = None) -> RunClock:
    """The run's clock from its checkpoints (objects with .step and .path): --tokens-per-step first,
    then what the trainer recorded beside the newest checkpoint."""
    steps = tuple(sorted(c.step for c in checkpoints))
    if tokens_per_step:
        return RunClock(steps, float(tokens_per_step), "--tokens-per-step")
    newest = max(checkpoints, key=lambda c: c.step)  # the trainer's record there covers the whole run
    found = recorded_tokens_per_step(Path(newest.path), newest.step)
    return RunClock(steps, *found) if found else RunClock(steps)


def recorded_tokens_per_step(folder: Path, step: int) -> tuple[float, str] | None:
    """Tokens per step as a trainer wrote them beside a checkpoint, with where it was read."""
    from bema_cli.io.checkpoints import read_json

    state = folder / "trainer_state.json"
    if state.is_file() and step > 0:
        try:
            seen = read_json(state).get("num_input_tokens_seen")
        except (InputError, AttributeError):
            seen = None
        if isinstance(seen, int | float) and not isinstance(seen, bool) and seen > 0:
            return seen / step, f"num_input_tokens_seen in {state}"
    for config in (folder / "run_config.yaml", folder.parent / "run_config.yaml"):  # iter_N/hf: beside hf/
        if config.is_file():
            per_step = _megatron_tokens_per_step(config)
            if per_step:
                return per_step, f"global_batch_size x seq_length in {config}"
    return None


def _megatron_tokens_per_step(path: Path) -> float | None:
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(doc, dict):
        return None
    train, dataset, model = (
        doc.get(k) if isinstance(doc.get(k), dict) else {} for k in ("train", "dataset", "model")
    )
    batch = train.get("global_batch_size")
    length = dataset.get("sequence_length") or dataset.get("seq_length") or model.get("seq_length")
    ok = all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (batch, length))
    return float(batch * length) if ok else None


def window_members(d: Duration, clock: RunClock) -> tuple[int, dict]:
    """K: the checkpoints whose step is in (T - D, T]; and the record of how it was resolved."""
    span = d.steps(clock)
    T = clock.last_step
    inside = [s for s in clock.steps if T - span < s <= T]
    if not inside:
        raise UsageError(f"--window {d.text}: no checkpoint in the last {span:g} steps of the run")
    return len(inside), {
        "duration": d.text,
        "steps": span,
        "checkpoints": len(inside),
        "first_step": inside[0],
        "last_step": T,
        **_tokens(d, clock),
    }


def swa_start_step(d: Duration, clock: RunClock) -> tuple[int, dict]:
    """The first saved step at or after position P of the run."""
    at = d.steps(clock)
    later = [s for s in clock.steps if s >= at - 1e-9 * max(1.0, at)]
    if not later:
        raise UsageError(
            f"--swa-start {d.text}: step {at:g} is after the run's last checkpoint ({clock.last_step})"
        )
    return later[0], {"duration": d.text, "position_steps": at, "start_step": later[0], **_tokens(d, clock)}


def half_life_gamma(d: Duration, clock: RunClock) -> tuple[float, dict]:
    """The power EMA's gamma for a half-life of h = H / T of the training time (torchtitan's rule)."""
    h = d.amount if d.unit == "fraction" else d.steps(clock) / clock.last_step
    if not 0 < h <= 1:
        raise UsageError(f"--half-life {d.text}: a half-life of {h:.3g} of the run is outside (0, 1]")
    gamma = math.log(2) / h - 1
    return gamma, {"duration": d.text, "half_life_fraction": h, "power_gamma": gamma, **_tokens(d, clock)}


def _tokens(d: Duration, clock: RunClock) -> dict:
    if d.unit != "tokens":
        return {}
    return {"tokens_per_step": clock.tokens_per_step, "tokens_source": clock.tokens_source}


# -- the flags: --window, --swa-start, --half-life of stabilize, sweep and ship -------------------
DURATION_FLAGS = {"window": "--window", "swa_start": "--swa-start", "half_life": "--half-life"}


def resolve_flags(grid, methods: list[str], checkpoint_dir, checkpoints=None, follow: bool = False):
    """(the grid values of the flags given as spans of training, resolved on the run's checkpoints;
    how each resolved, for the outputs' records). ({}, {}) when none is. `grid`: the grid's flags
    (commands/flags.GridFlags)."""
    from bema_cli.io.checkpoints import find_checkpoints
    from bema_cli.options import parse_int_list, parse_str_list

    values = {k: getattr(grid, k) for k in DURATION_FLAGS}
    given = {k: parse_str_list(v, DURATION_FLAGS[k]) for k, v in values.items() if v is not None}
    if not any(re.search(r"[A-Za-z%]", v) for vs in given.values() for v in vs) and "half_life" not in given:
        return {}, {}  # counts and steps only: the flags' own parsing (and its errors) as before
    spans = {k: [(v, _duration(v, DURATION_FLAGS[k])) for v in vs] for k, vs in given.items()}
    if "half_life" in spans and ("power" not in methods or grid.power_gamma or grid.sigma_rel):
        raise UsageError(
            "--half-life: sets the power EMA's exponent: with --method power, without --power-gamma or --sigma-rel"
        )
    if follow:
        raise UsageError("durations (steps, tokens, %) are resolved on the run as it is: not with --follow")
    checkpoints = checkpoints or find_checkpoints(checkpoint_dir)
    run_clock = clock(checkpoints, grid.tokens_per_step)
    resolve = {"window": window_members, "swa_start": swa_start_step, "half_life": half_life_gamma}
    out, records = {}, {}
    for key, texts in spans.items():
        for text, d in texts:
            if d is None and key == "half_life":
                raise UsageError(f"--half-life {text}: give a span of training: 5%, 2000steps or 5Btok")
            value, record = (
                resolve[key](d, run_clock)
                if d is not None
                else (parse_int_list(text, DURATION_FLAGS[key])[0], None)
            )
            out.setdefault(key, []).append(value)
            if record:
                records.setdefault(key, []).append(record)
    return out, records


def _duration(text: str, flag: str):
    try:
        return parse(text)
    except UsageError as exc:
        raise UsageError(f"{flag}: {exc}") from None
