"""What every generation task shares: per-item scoring and the paper's metrics.

A task module is mostly data (lm-evaluation-harness style): NAME, HUB source, FIELDS,
MAX_NEW_TOKENS, DEFAULT_LIMIT, `messages(doc)`, `gold(doc)`, `extract(response)`,
`is_correct(answer, gold)`. Scoring here always pairs a response with ITS OWN item's
gold answer (the authors' code compared every item with the last item's answer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType


def score_item(task: ModuleType, responses: Sequence[str], gold) -> dict:
    """Extract and score the n responses of one prompt against that prompt's gold answer."""
    extracted = [task.extract(r) for r in responses]
    correct = [a is not None and bool(task.is_correct(a, gold)) for a in extracted]
    return {"extracted": extracted, "correct": correct}


def mean_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample std, ddof=1; 0 for one value)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def accuracy_metrics(scored: Sequence[dict]) -> dict:
    """Per-prompt accuracy = mean over its samples; task accuracy = mean over prompts, stderr over prompts."""
    per_prompt = [sum(s["correct"]) / len(s["correct"]) for s in scored if s["correct"]]
    accuracy, stderr = mean_stderr(per_prompt)
    n_samples = sum(len(s["extracted"]) for s in scored)
    failures = sum(a is None for s in scored for a in s["extracted"])
    return {
        "accuracy": accuracy,
        "accuracy_stderr": stderr,
        "parse_failure_rate": failures / n_samples if n_samples else math.nan,
    }


def per_subject_metrics(scored: Sequence[dict], subjects: Sequence[str]) -> dict:
    """{subject: {"accuracy", "accuracy_stderr"}} for MMLU-HS (subjects aligned with `scored`)."""
    groups: dict[str, list[dict]] = {}
    for s, subject in zip(scored, subjects, strict=True):
        groups.setdefault(subject, []).append(s)
    out = {}
    for subject in sorted(groups):
        m = accuracy_metrics(groups[subject])
        out[subject] = {"accuracy": m["accuracy"], "accuracy_stderr": m["accuracy_stderr"]}
    return out


def score_all(task: ModuleType, docs: Sequence[dict], responses: Sequence[Sequence[str]]) -> list[dict]:
    """Score every item's responses against that same item's gold (zip is strict: no misalignment)."""
    return [score_item(task, resp, task.gold(doc)) for doc, resp in zip(docs, responses, strict=True)]


def task_metrics(
    task: ModuleType, scored: Sequence[dict], subjects: Sequence[str] | None = None
) -> tuple[dict, dict]:
    """(metrics, extra top-level record fields): MMLU-HS adds "per_subject"."""
    extra = {}
    if getattr(task, "PER_SUBJECT", False) and subjects is not None:
        extra["per_subject"] = per_subject_metrics(scored, subjects)
    return accuracy_metrics(scored), extra
