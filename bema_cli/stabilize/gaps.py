"""Gaps in a run: a checkpoint the run's own cadence says was saved (trainer_state.json `save_steps`,
or the state's step history) but that is gone. A moving average over it is not the run's, so it
is refused naming the steps (`--allow-gaps` goes on); a trainer's save_total_limit deleting a
checkpoint while no bema call was running is how it happens.
"""

from __future__ import annotations

from bema_cli.errors import InputError
from bema_cli.io.checkpoints import Checkpoint, read_json


def cadence(checkpoints: list[Checkpoint], consumed: list[int]) -> tuple[int | None, str]:
    """The run's own saving cadence, where its trainer wrote it: `save_steps` of the newest
    checkpoint's trainer_state.json (the HF Trainer), `save_interval` of its run_config.yaml
    (Megatron: in iter_<N>/, beside an hf/ export, or in the run folder); else the state's step
    history when it is regular (three or more consumed steps, equal spacing)."""
    for c in sorted(checkpoints, key=lambda c: c.step, reverse=True)[:1]:
        path = c.path / "trainer_state.json"
        try:
            save = read_json(path).get("save_steps") if path.is_file() else None
        except (InputError, AttributeError):
            save = None
        if _positive(save):
            return save, f"save_steps {save} in {path}"
        native = c.path.parent if c.path.name == "hf" else c.path  # Megatron-Bridge's iter_<N>/hf export
        for path in (native / "run_config.yaml", native.parent / "run_config.yaml"):
            save = _save_interval(path)
            if _positive(save):
                return save, f"save_interval {save} in {path}"
    gaps = {b - a for a, b in zip(consumed, consumed[1:], strict=False)}
    if len(consumed) >= 3 and len(gaps) == 1:
        step = gaps.pop()
        return step, f"the state's step history (every {step} steps)"
    return None, ""


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _save_interval(path):
    """Megatron's save_interval in a run_config.yaml: top level (Megatron-LM's arguments) or under
    `checkpoint` (Megatron-Bridge's ConfigContainer); None where there is none or it cannot be read."""
    if not path.is_file():
        return None
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(doc, dict):
        return None
    nested = doc.get("checkpoint")
    return doc.get("save_interval", nested.get("save_interval") if isinstance(nested, dict) else None)


def check_gaps(checkpoints: list[Checkpoint], consumed: list[int], allow: bool) -> None:
    """Refuse a hole in the trajectory: a step the run's cadence says was saved that is neither on
    disk nor already consumed: between its first and newest step, or before its first one when no
    call has consumed any yet (a trainer's save_total_limit deletes the *oldest* checkpoints, so a
    bema call that comes late finds a run whose start is gone). --allow-gaps goes on without them."""
    present = sorted({c.step for c in checkpoints} | set(consumed))
    every, source = cadence(checkpoints, sorted(consumed))
    if every is None and not consumed:
        every, source = _spacing(present)
    if allow or every is None or not present:
        return
    # the HF Trainer saves at multiples of save_steps (and at the last step); a history keeps its phase
    phase = 0 if source.startswith(("save_steps", "save_interval")) else (consumed or present)[0] % every
    first = present[0] + (phase - present[0]) % every
    missing = [s for s in range(first, present[-1] + 1, every) if s not in set(present)]
    if not consumed:  # the run's leading steps: every saved step before the first one found
        lead = present[0] % every or every
        missing = [s for s in range(lead, present[0], every) if s > 0] + missing
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise InputError(
            f"{checkpoints[0].path.parent}: checkpoint step(s) {shown} missing from the run (cadence: "
            f"{source}); a moving average over a gap is not the run's; pass --allow-gaps to go on without them"
        )


def _spacing(present: list[int]) -> tuple[int | None, str]:
    """The spacing the checkpoints found show, as the cadence: the most common gap, when at least two
    gaps and half of them are it and every gap before the last is a multiple of it (a hole is a
    multiple; the HF Trainer's final save may come sooner). 10, 30, 40, 50: every 10, 20 missing."""
    gaps = [b - a for a, b in zip(present, present[1:], strict=False)]
    if len(present) < 3:
        return None, ""
    step = max(set(gaps), key=lambda g: (gaps.count(g), -g))
    regular = gaps.count(step) >= max(2, len(gaps) / 2) and step > 0
    if regular and all(g % step == 0 for g in gaps[:-1]) and (gaps[-1] % step == 0 or gaps[-1] < step):
        return step, f"the checkpoints' spacing (every {step} steps)"
    return None, ""
