"""Benchmarks of `bema eval`, one small module each, imported lazily by name."""

from __future__ import annotations

import importlib
from types import ModuleType

from bema_cli.errors import UsageError

GENERATION_TASKS = ("boolq", "gsm8k", "mmlu_hs")
LOSS_TASKS = ("loss", "train_loss")  # held-out loss (--loss-data) and train loss (--loss-train-data)
TASKS = GENERATION_TASKS + LOSS_TASKS
SELECTION_SEED = 37371  # the prompt subset's seed, the paper's (also picks the few-shot examples)


LM_EVAL_PREFIX = "lm_eval:"  # --tasks lm_eval:<task or group>: run by lm-evaluation-harness's evaluator


def is_lm_eval(name: str) -> bool:
    return name.startswith(LM_EVAL_PREFIX)


def task_list() -> list[dict]:
    """`bema eval --tasks list`: each task's name and the first line of its module's docstring."""
    rows = []
    for name in TASKS:
        doc = (get_task(name).__doc__ or "").strip().splitlines()
        line = doc[0] if doc else ""
        if name == "train_loss":
            line = "Train loss: the same as loss, on --loss-train-data (a check on memorisation)."
        elif name == "loss":
            line = "Held-out loss: mean next-token NLL on --loss-data (jsonl of {messages} or {text})."
        rows.append({"task": name, "description": line})
    rows.append({"task": f"{LM_EVAL_PREFIX}<task>", "description": "any lm-evaluation-harness task or group"})
    return rows


def get_task(name: str) -> ModuleType:
    """The task module for `name` (e.g. bema_cli.eval.tasks.gsm8k); loss tasks share tasks/loss.py."""
    if name not in TASKS:
        known = ", ".join(TASKS)
        raise UsageError(
            f"--tasks: unknown task {name!r} (known: {known}, or {LM_EVAL_PREFIX}<lm-eval task>)"
        )
    return importlib.import_module(f"bema_cli.eval.tasks.{'loss' if name in LOSS_TASKS else name}")


def parse_tasks(text: str) -> list[str]:
    """'boolq,loss,lm_eval:arc_easy,hellaswag' -> ['boolq', 'loss', 'lm_eval:arc_easy', 'lm_eval:hellaswag']:
    after the first lm_eval: item, the names that follow are lm-eval tasks too."""
    names, lm_eval = [], False
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise UsageError(f"--tasks: an empty item in {text!r}")
        lm_eval = lm_eval or is_lm_eval(part)
        names.append(part if is_lm_eval(part) or not lm_eval else LM_EVAL_PREFIX + part)
    return names
