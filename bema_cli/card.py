"""The model card (README.md) in every checkpoint folder bema writes.

The Hub reads a model card's YAML metadata (base_model, library_name, tags, model-index) for
search, the model tree and the evaluation widget; a user reads the text below it. The metadata
is built with huggingface_hub's own `ModelCardData`, so it is what the Hub's parser expects; the
text gives the provenance that bema.json records (method, hyperparameters, step, source run,
theta0, bema version) and the citation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

PAPER = "https://arxiv.org/abs/2508.00180"
CITATION = """@article{block2025ema,
  title         = {EMA Without the Lag: Bias-Corrected Iterate Averaging Schemes},
  author        = {Block, Adam and Zhang, Cyril},
  year          = {2025},
  eprint        = {2508.00180},
  archivePrefix = {arXiv},
  primaryClass  = {cs.LG},
}"""
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "org/name", as the Hub spells a model id
METHOD_NAMES = {
    "bema": "BEMA (bias-corrected EMA)",
    "ema": "EMA",
    "dema": "DEMA",
    "ouema": "OUEMA",
    "lawa": "LAWA (latest weight averaging)",
    "wsm": "WSM (schedule-weighted checkpoint merge)",
    "swa": "SWA (equal-weight running mean)",
    "power": "power EMA (EDM2)",
    "vanilla": "the checkpoint itself",
}
PROVENANCE = ("run", "step", "source_checkpoint", "theta0_source", "accum_dtype", "out_dtype", "bema_version")


def hub_base_model(theta0_source: str, theta0_dir: Path | None = None) -> str | None:
    """The Hub id theta0 came from: the source itself when it is one, else the `_name_or_path` of
    theta0's config.json when that is one (a local copy of a Hub model); None otherwise (the Hub
    refuses a local path as base_model)."""
    if REPO_ID.match(theta0_source) and not Path(theta0_source).exists():
        return theta0_source
    config = (theta0_dir or Path(theta0_source)) / "config.json"
    try:
        name = json.loads(config.read_text()).get("_name_or_path", "")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and REPO_ID.match(name) and not Path(name).exists() else None


PATH_KEYS = ("source_checkpoint", "theta0_source")


def shown_path(value: str) -> str:
    """A path as a card shows it: a Hub id, or a name as records write it (relative: run/sft/
    checkpoint-40, as bema.json says it), as it is; an absolute path (an older bema's records hold
    them) as its last two parts, never the absolute path a push would publish."""
    if not Path(value).is_absolute() and not value.startswith("~"):
        return value
    parts = Path(value).parts
    return "/".join(parts[-2:]) if len(parts) >= 2 else value


CARD_WEIGHTS = 12  # the card names the largest weights (an EMA over a long run has hundreds)


def recipe(coefficients: dict, most: int | None = None) -> str:
    """The vector in words: `0.5 x checkpoint-285 + 0.5 x checkpoint-300` (theta0 named as such);
    with `most`, only the largest weights, and how many more there are."""
    by_size = sorted(coefficients, key=lambda k: -abs(float(coefficients[k])))
    keep = set(by_size[:most] if most else by_size)
    parts = [f"{float(c):.4g} x {_input_name(key)}" for key, c in coefficients.items() if key in keep]
    more = len(coefficients) - len(keep)
    return " + ".join(parts).replace("+ -", "- ") + (f" (and {more} smaller weights)" if more else "")


def _input_name(key: str) -> str:
    if key == "theta0":
        return "theta0 (the base)"
    return f"checkpoint-{key}" if key.isdigit() else shown_path(key)


def _cell(value) -> str:
    """A table cell that cannot break the table: `|` escaped, a backtick shown as an entity."""
    text = str(value).replace("|", "\\|")
    return f"`{text}`" if "`" not in text else text.replace("`", "&#96;")


def card(
    record: dict,
    base_model: str | None,
    adapter: bool = False,
    evaluation: list[dict] | None = None,
    selected: bool = False,
    why: str | None = None,
    notes: list[str] | None = None,
) -> str:
    """README.md text for one output folder described by its bema.json `record`.

    `evaluation`: model-index results, each {"task", "dataset", "metric", "value"} with optional
    "interval" ([lo, hi], a 95% paired-bootstrap interval) and "vs" (what it is a difference to).
    `selected`: chosen by `bema select`/`bema ship` (a vanilla one is the raw checkpoint, not an
    average); `why`: the decision's own verdict sentence, rendered as it is (the card never words the
    decision itself, so it cannot tell another story than the verdict and `--json`); `notes`: the
    decision's warnings (held-out rows in another shape, ...), each said on the card too."""
    from huggingface_hub import EvalResult, ModelCardData

    method = record.get("method", "vanilla")
    record = {k: shown_path(v) if k in PATH_KEYS and isinstance(v, str) else v for k, v in record.items()}
    results = [
        EvalResult(
            task_type="text-generation",
            dataset_type=e["dataset"],
            dataset_name=e["dataset"],
            metric_type=e["metric"],
            metric_value=e["value"],
            metric_name=e["metric"]
            + (f" (95% CI {e['interval'][0]:.4g} to {e['interval'][1]:.4g})" if e.get("interval") else ""),
        )
        for e in evaluation or []
    ]
    data = ModelCardData(
        base_model=base_model,
        library_name="peft" if adapter else "transformers",
        tags=list(dict.fromkeys(["bema", method, "checkpoint-averaging"])),
        model_name=record.get("run"),
        eval_results=results or None,
    )
    params = {k: v for k, v in record.items() if k not in PROVENANCE and k not in ("method",) and _plain(v)}
    load = f"Load it like any {'PEFT adapter' if adapter else 'transformers model'}; `bema.json` beside it holds the same record as JSON."
    if method == "vanilla":  # the raw checkpoint: no averaging, so no averaging parameters
        params = {}
        what = (
            f"The raw checkpoint at step {record.get('step')}"
            + (
                ", selected by bema (why: below)"
                if selected and why
                else ", selected by bema"
                if selected
                else ""
            )
            + f", written by bema {record.get('bema_version', '')}. {load}"
        )
    else:
        what = (
            f"{METHOD_NAMES.get(method, method)} of a fine-tuning run's checkpoints, written by bema "
            f"{record.get('bema_version', '')}: the weights at training step {record.get('step')}, averaged "
            f"as below. {load}"
        )
    lines = [
        "---",
        data.to_yaml(),
        "---",
        "",
        f"# {record.get('run', 'bema output')} at step {record.get('step')}",
        "",
        what,
        "",
        "## Provenance",
        "",
        "| | |",
        "|---|---|",
        f"| method | {_cell(method)} |",
        *[f"| {k} | {_cell(v)} |" for k, v in params.items()],
        *[f"| {k.replace('_', ' ')} | {_cell(record[k])} |" for k in PROVENANCE if k in record],
        *(
            [f"| averaged steps | {_cell(steps_text(record['averaged_steps']))} |"]
            if record.get("averaged_steps")
            else []
        ),
        *(
            [f"| weights | {_cell(recipe(record['coefficients'], most=CARD_WEIGHTS))} |"]
            if isinstance(record.get("coefficients"), dict)
            else []
        ),
        *(
            ["| allow gaps | true: steps missing from the run's cadence were skipped |"]
            if record.get("allow_gaps")
            else []
        ),
        "",
    ]
    if why:
        lines += ["## Why this model", "", f"bema's decision: {why}.", ""]
        lines += [f"Note: {n}." for n in notes or []] + ([""] if notes else [])
    if evaluation:
        lines += ["## Evaluation", "", "| task | metric | value | 95% interval | |", "|---|---|---|---|---|"]
        for e in evaluation:
            lo_hi = f"{e['interval'][0]:.4g} to {e['interval'][1]:.4g}" if e.get("interval") else ""
            lines.append(
                f"| {_cell(e['dataset'])} | {_cell(e['metric'])} | {e['value']:.4g} | {lo_hi} | {e.get('vs', '')} |"
            )
        lines.append("")
    lines += [
        "## Citation",
        "",
        f'The averaging follows Block & Zhang, "EMA Without the Lag: Bias-Corrected Iterate Averaging '
        f'Schemes" ({PAPER}).',
        "",
        "```bibtex",
        CITATION,
        "```",
        "",
    ]
    return "\n".join(lines)


def steps_text(steps: list[int]) -> str:
    """The checkpoint steps an output averaged, short: `30 to 60 every 10 (4)`, else the list."""
    gaps = {b - a for a, b in zip(steps, steps[1:], strict=False)}
    if len(steps) > 2 and len(gaps) == 1:
        return f"{steps[0]} to {steps[-1]} every {gaps.pop()} ({len(steps)})"
    return ", ".join(map(str, steps))


def _plain(value) -> bool:
    """A hyperparameter worth a table row: numbers and short strings (per-step lists stay in bema.json)."""
    return (
        value is not None and value == value and isinstance(value, int | float | str) and len(str(value)) < 80
    )
