"""`bema rescore`: scores recomputed from logged samples with today's extraction rules."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from bema_cli import __version__, output
from bema_cli.errors import UsageError
from bema_cli.eval.results import read_jsonl
from bema_cli.eval.tasks import common as scoring
from bema_cli.eval.tasks import get_task, is_lm_eval


def rescore(samples_path: str | Path, results_path: str | Path | None = None) -> list[dict]:
    """Recompute scores from logged samples with today's extraction rules, without generating.

    Provenance comes from the matching results.jsonl records (the samples file's sibling by
    default); without one, a minimal record is built from the samples themselves. A torn final
    line (a crash in the middle of a write) is skipped with a warning.
    """
    from bema_cli.errors import InputError

    samples_path = Path(samples_path)
    lines = read_jsonl(samples_path, skip_torn=True)
    kept = [x for x in lines if not (isinstance(x, dict) and is_lm_eval(str(x.get("task", ""))))]
    if len(kept) < len(lines):  # lm-eval scores its own samples (filters, metrics): no bema rule to re-apply
        output.log(
            f"rescore: {len(lines) - len(kept)} lm_eval: sample lines left as they are (lm-eval scores them)"
        )
    lines = kept
    results_path = Path(results_path) if results_path else samples_path.with_name("results.jsonl")
    old = read_jsonl(results_path, skip_torn=True) if results_path.is_file() else []
    latest: dict[tuple, str] = {}
    for line in lines:
        for key in ("model_path", "task", "responses", "gold"):
            if not isinstance(line, dict) or key not in line:
                raise InputError(f"{samples_path}: a line lacks {key!r} (not a bema samples file)")
        latest[(line["model_path"], line["task"])] = line.get("eval_id")
    records = []
    for (model_path, name), eval_id in latest.items():
        group = [
            x for x in lines if (x["model_path"], x["task"], x.get("eval_id")) == (model_path, name, eval_id)
        ]
        try:
            task = get_task(name)
        except UsageError as exc:  # e.g. "unknown task": about the file, which has no --tasks flag
            raise InputError(f"{samples_path}: {str(exc).removeprefix('--tasks: ')}") from None
        scored = [scoring.score_item(task, x["responses"], x["gold"]) for x in group]
        metrics, extra = scoring.task_metrics(task, scored, [x.get("subject") or "" for x in group])
        extra["items"] = scoring.prompt_items([x.get("doc_id") for x in group], scored)
        matches = [
            r
            for r in old
            if r.get("model_path") == model_path and r.get("task") == name and r.get("eval_id") == eval_id
        ] or [
            {
                "model_path": model_path,
                "run": group[0].get("run"),
                "step": group[0].get("step"),
                "task": name,
                "is_base": group[0].get("is_base", False),
                "n_prompts": len(group),
                "n_samples": len(group[0]["responses"]),
            }
        ]
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        for r in matches:
            records.append({**r, "metrics": metrics, **extra, "rescored": now, "bema_version": __version__})
    return records
