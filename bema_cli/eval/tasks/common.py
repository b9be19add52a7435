"""What every generation task shares: per-item scoring and the paper's metrics.

A task module is mostly data (lm-evaluation-harness style): NAME, HUB source, FIELDS,
MAX_NEW_TOKENS, DEFAULT_LIMIT, PROMPT_VERSION, `messages(doc)`, `gold(doc)`, two named answer
extractions `extract_strict(response)` (only the format the prompt asks for) and
`extract_flexible(response)` (more lenient: the task's documented rule), and `is_correct(answer, gold)`
(or `is_correct_<scoring>` where a way of scoring compares differently: gsm8k's lm-eval flexible).
Both extractions are scored and reported separately, like lm-eval's strict-match and
flexible-extract. Scoring always pairs a response with ITS OWN item's gold answer (the authors'
code compared every item with the last item's answer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType

SCORINGS = ("strict", "flexible")  # metric suffixes: accuracy_strict, accuracy_flexible, ...


def build_messages(task: ModuleType, doc: dict, shots: Sequence[dict] = (), cot: bool = False) -> list[dict]:
    """The chat of one prompt: each few-shot example as a user turn and its strict-format answer, then the item."""
    chat = []
    for shot in shots:
        chat += [*task.messages(shot, cot), {"role": "assistant", "content": task.shot_reply(shot)}]
    return chat + task.messages(doc, cot)


def extractor(task: ModuleType, scoring: str):
    return getattr(task, f"extract_{scoring}")


def checker(task: ModuleType, scoring: str):
    return getattr(task, f"is_correct_{scoring}", task.is_correct)


def score_item(task: ModuleType, responses: Sequence[str], gold) -> dict:
    """Extract and score the n responses of one prompt against that prompt's gold answer, both ways.

    {"strict": {"extracted": [...], "correct": [...]}, "flexible": {...}}
    """
    out = {}
    for scoring in SCORINGS:
        extracted = [extractor(task, scoring)(r) for r in responses]
        is_correct = checker(task, scoring)
        correct = [a is not None and bool(is_correct(a, gold)) for a in extracted]
        out[scoring] = {"extracted": extracted, "correct": correct}
    return out


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


def accuracy_metrics(scored: Sequence[dict], scoring: str) -> dict:
    """Per-prompt accuracy = mean over its samples; task accuracy = mean over prompts, stderr over prompts."""
    items = [s[scoring] for s in scored]
    per_prompt = [sum(s["correct"]) / len(s["correct"]) for s in items if s["correct"]]
    accuracy, stderr = mean_stderr(per_prompt)
    n_samples = sum(len(s["extracted"]) for s in items)
    failures = sum(a is None for s in items for a in s["extracted"])
    return {
        f"accuracy_{scoring}": accuracy,
        f"accuracy_{scoring}_stderr": stderr,
        f"parse_failure_rate_{scoring}": failures / n_samples if n_samples else math.nan,
    }


def all_metrics(scored: Sequence[dict]) -> dict:
    return {k: v for scoring in SCORINGS for k, v in accuracy_metrics(scored, scoring).items()}


def per_subject_metrics(scored: Sequence[dict], subjects: Sequence[str]) -> dict:
    """{subject: {"accuracy_strict", "accuracy_strict_stderr", ...}} for MMLU-HS (aligned with `scored`)."""
    groups: dict[str, list[dict]] = {}
    for s, subject in zip(scored, subjects, strict=True):
        groups.setdefault(subject, []).append(s)
    return {
        subject: {k: v for k, v in all_metrics(groups[subject]).items() if k.startswith("accuracy")}
        for subject in sorted(groups)
    }


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
    return all_metrics(scored), extra


def prompt_items(ids: Sequence, scored: Sequence[dict]) -> dict:
    """The record's `items`: each prompt's id and its accuracy (mean over its samples), per scoring.
    `bema select` resamples prompts from these for paired bootstrap intervals; their mean is the
    record's accuracy."""
    out: dict = {"ids": list(ids)}
    for scoring in SCORINGS:
        out[scoring] = [
            sum(s[scoring]["correct"]) / len(s[scoring]["correct"]) if s[scoring]["correct"] else None
            for s in scored
        ]
    return out


def sample_fields(scored_item: dict) -> dict:
    """The samples.jsonl fields of one scored prompt: extracted_strict, correct_strict, ... ."""
    return {
        f"{k}_{scoring}": scored_item[scoring][k] for scoring in SCORINGS for k in ("extracted", "correct")
    }
