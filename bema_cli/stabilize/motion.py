"""Can averaging help here? How far each checkpoint moved from the previous one, measured in the read
pass (every byte is read anyway): ||theta_s - theta_prev|| / ||theta_s||, overall and per tensor group.

Averaging removes the noise between consecutive checkpoints. When they barely move (a learning rate
decayed to nearly zero, the end of a long decay), there is little noise left to remove, and the
averages of the last window are the last checkpoint, give or take: nothing is likely to beat vanilla.
The first step of a fresh run is measured from theta0; the first step a continued call reads has no
previous checkpoint in memory (it was read by an earlier call), so it is not measured.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

GROUPS = ("embeddings", "attention", "mlp", "norms", "other")
_PATTERNS = (
    ("norms", re.compile(r"norm|\bln_|\.ln\d*\.|layernorm", re.IGNORECASE)),
    ("embeddings", re.compile(r"embed|wte|wpe|lm_head|output_layer", re.IGNORECASE)),
    ("attention", re.compile(r"attn|attention|q_proj|k_proj|v_proj|o_proj|query|key|value", re.IGNORECASE)),
    ("mlp", re.compile(r"mlp|ffn|feed_forward|gate_proj|up_proj|down_proj|fc\d|w[123]\b", re.IGNORECASE)),
)
FILE = "motion.json"  # a sweep's beside its results.jsonl, a ship's with its records (`record`)
WINDOW = 8  # the last window judged when the grid has none (the menu's largest)
BARELY = 0.1  # the last window "barely moves" below this share of the run's moving phase (p90)


@lru_cache(maxsize=4096)  # called per block of the fused pass: the name's regexes once
def group_of(name: str) -> str:
    return next((g for g, pattern in _PATTERNS if pattern.search(name)), "other")


class UnitMotion:
    """Per step and group, sum((theta_s - theta_prev)^2) and sum(theta_s^2), kept on the compute
    device until read (a GPU is read back once, not per block). stabilize's fused pass keeps the
    previous checkpoint in `prev` (`block`); the sweep's walker and `measure` give it (`add`)."""

    def __init__(self, prev=None, first_known: bool = True):
        self.prev, self.known, self.sums = prev, first_known, {}

    def block(self, step: int, lo: int, hi: int, parts, th, diff) -> None:
        if self.known:
            self.add(step, lo, [(p.info.name, a, b) for p, a, b in parts], th, self.prev[lo:hi], diff)
        self.prev[lo:hi].copy_(th)

    def add(self, step: int, lo: int, parts, th, prev, diff) -> None:
        """Positions [lo, lo + len(th)) of theta_s and of the previous checkpoint; `parts` the
        (tensor name, a, b) ranges they cover."""
        import torch

        torch.sub(th, prev, out=diff)
        for name, a, b in parts:
            d, t = diff[a - lo : b - lo], th[a - lo : b - lo]
            sums = self.sums.setdefault(step, {}).setdefault(group_of(name), [[], []])
            sums[0].append(torch.dot(d, d).double())
            sums[1].append(torch.dot(t, t).double())

    def end_step(self) -> None:
        self.known = True  # from the second step a call reads, the previous checkpoint is in `prev`

    def result(self) -> dict[int, dict[str, list[float]]]:
        import torch

        return {
            step: {g: [float(torch.stack(v[0]).sum()), float(torch.stack(v[1]).sum())] for g, v in by.items()}
            for step, by in self.sums.items()
        }


MEASURE_BLOCK = 1 << 22  # elements read at a time by `measure` (16 MB of float32 per buffer)


def measure(plan, upto: int) -> dict:
    """The motion alone, every checkpoint up to step `upto` read once, a block of rows at a time
    beside the previous checkpoint's same rows (read again: from the page cache, as a rule). `bema
    ship --dry-run` says it before any engine starts; it holds three blocks, not a model."""
    import torch

    from bema_cli.io.reader import open_checkpoint, read_into
    from bema_cli.io.safetensors import FLOATING
    from bema_cli.stabilize.prepare import drop_tied_head

    acc = UnitMotion()
    buffers = [torch.empty(MEASURE_BLOCK) for _ in range(3)]  # theta_s, the previous one, their difference
    prev = plan.base_index
    for c in [c for c in plan.checkpoints if c.step <= upto]:
        index = plan.indexes.get(c.step)
        if index is None:  # a step no config reads (--phi): its checkpoint all the same
            index = open_checkpoint(c.path, like=set(plan.base_index.tensors))
            drop_tied_head(index, plan.base_index)
        with prev.open() as before, index.open() as now:
            for info in index.tensors.values():
                if info.dtype not in FLOATING or info.name not in prev.tensors:
                    continue
                rows = info.shape[0] if info.shape else 1
                row = max(1, info.numel // rows)
                step = max(1, MEASURE_BLOCK // row)
                if step * row > len(buffers[0]):  # one row is longer than a block: a block of one row
                    buffers = [torch.empty(step * row) for _ in range(3)]
                for lo in range(0, rows, step):
                    hi = min(rows, lo + step)
                    th, old, diff = (b[: (hi - lo) * row] for b in buffers)
                    read_into(now, info.name, lo, hi, th)
                    read_into(before, info.name, lo, hi, old)
                    acc.add(c.step, 0, [(info.name, 0, len(th))], th, old, diff)
        prev = index
    return acc.result()


def merge(total: dict, part: dict) -> dict:
    for step, by in part.items():
        for group, (d2, n2) in by.items():
            t = total.setdefault(step, {}).setdefault(group, [0.0, 0.0])
            t[0] += d2
            t[1] += n2
    return total


def rows(sums: dict) -> list[dict]:
    """Per step: the relative distance overall and per group (stabilize --json `motion`)."""
    out = []
    for step in sorted(sums):
        by = sums[step]
        d2, n2 = sum(v[0] for v in by.values()), sum(v[1] for v in by.values())
        out.append(
            {
                "step": step,
                "relative": _ratio(d2, n2),
                "groups": {g: _ratio(*by[g]) for g in GROUPS if g in by},
            }
        )
    return out


def _ratio(d2: float, n2: float) -> float | None:
    return math.sqrt(d2 / n2) if n2 > 0 else None


def verdict(measured: list[dict], window: int) -> dict | None:
    """The last `window` steps' median distance against the run's moving phase (the 90th percentile
    of its step distances): "barely moves" below BARELY of it. A run shorter than two windows is
    judged on its last half (a window of 8 on 10 checkpoints would be most of the run); None with
    fewer than 4 steps measured."""
    values = [r["relative"] for r in measured if r["relative"] is not None]
    window = min(window, len(values) // 2)
    if window < 2:
        return None
    last, run = _median(values[-window:]), sorted(values)[int(0.9 * (len(values) - 1))]
    share = last / run if run > 0 else math.inf
    return {
        "window": window,
        "last_window": last,
        "run_p90": run,
        "share": share,
        "barely_moves": share < BARELY,
    }


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def judge(sums: dict, runs) -> dict:
    """`motion` and `motion_verdict` of a --json document, judged on the grid's largest window (the
    menu's when it has none); the warning said on stderr when the last window barely moves."""
    measured = rows(sums)
    return {"motion": measured, "motion_verdict": judge_rows(measured, runs)}


def judge_rows(measured: list[dict], runs) -> dict | None:
    from bema_cli import output

    window = max((r.schedule.window or 0 for r in runs), default=0) or WINDOW
    v = verdict(measured, window)
    if v and v["barely_moves"]:
        output.warn(
            f"the last {v['window']} checkpoints barely move: {v['last_window']:.2e} of the weights' norm a "
            f"step, {v['share']:.1%} of the run's moving phase: averaging them changes little, and nothing "
            "may beat the last checkpoint (a decayed learning rate does this)"
        )
    return v


def save(folder, plan, judged: dict) -> None:
    """`judged` (judge's document) as FOLDER/motion.json, with what it measured: `bema report` draws
    a sweep's, a later `ship --dry-run` reads a ship's."""
    from pathlib import Path

    from bema_cli import __version__
    from bema_cli.io.checkpoints import run_of
    from bema_cli.io.commit import write_json_atomic
    from bema_cli.io.provenance import record_name

    record = {
        "bema_version": __version__,
        "checkpoint_dir": record_name(run_of(plan.checkpoints[0].path), folder),
        "base": record_name(plan.base_index.folder, folder),
        "motion": judged["motion"],
        "motion_verdict": judged["motion_verdict"],
    }
    write_json_atomic(Path(folder).expanduser() / FILE, record)


def describe(v: dict | None) -> str:
    """The verdict in words (ship --dry-run's line, bema report's)."""
    if v is None:
        return "too few checkpoints to say whether the last ones still move (4 needed)"
    moves = "barely move" if v["barely_moves"] else "still move"
    return (
        f"the last {v['window']} checkpoints {moves}: {v['last_window']:.2g} of the weights' norm a step, "
        f"{v['share']:.0%} of the run's moving phase"
    )
