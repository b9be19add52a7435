"""Per-item scores of any average, evaluated from memory, a few items at a time.

`bema ship`'s fits and finalists are coefficient vectors over (theta0, checkpoints). One engine
holds a `fit.Combiner` as its weight source (as a sweep's engine holds the walker): a vector's
weights stream into the engine, nothing is written, and only the items asked for are evaluated
(`evaluate_task` on a slice of the task's items: every prompt is seeded by its own id, so an item
scores the same alone or in a batch). Each slice's record is appended to `results.jsonl` in the
work folder: a killed ship resumes there and evaluates no (vector, item) twice.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bema_cli import stages
from bema_cli.decide import fit
from bema_cli.eval.evaluate import Evaluation
from bema_cli.eval.job import EvalConfig, Job, evaluate_task
from bema_cli.eval.targets import Target

SOURCE = "bema_cli.decide.fit:Combiner"


class ItemScorer:
    """Scores of the metric's task, item by item, for coefficient vectors over `basis`."""

    def __init__(
        self, config: EvalConfig, engine, metric, basis: list[Path], template: Path, out: Path, step: int
    ):
        self.metric, self.basis, self.template, self.step = metric, basis, template, step
        self.evaluation = Evaluation(
            replace(config, tasks=[metric.task], out=str(out), log_samples=False), engine
        )
        self.task = self.evaluation.inputs[metric.task]
        self.backend = None
        self.evaluated = 0  # (vector, item) pairs evaluated by this process
        self.cache: dict[str, dict] = {}  # vector digest -> {item id: (score, tokens)}
        self.records: dict[str, dict] = {}  # vector digest -> a record (its protocol, for select)
        for rec in self.evaluation.results.records:  # a resumed ship's
            if rec.get("task") == metric.task and str(rec.get("model_path", "")).startswith("fit:"):
                self._keep(rec["model_path"].removeprefix("fit:"), rec)

    def seed(self, c: list[float], rec: dict) -> None:
        """`c`'s item scores from a record made elsewhere (the sweep's, of the same average)."""
        self._keep(fit.digest(c), rec)

    def _keep(self, key: str, rec: dict) -> None:
        items = rec["items"]
        scores = items["nll"] if self.metric.key == "loss" else items[self.metric.key]
        tokens = items["tokens"] if self.metric.key == "loss" else [1] * len(scores)
        self.cache.setdefault(key, {}).update(
            zip(items["ids"], zip(scores, tokens, strict=True), strict=True)
        )
        self.records.setdefault(key, rec)

    def scores(self, c: list[float], ids: list, name: str) -> list[float]:
        """Oriented per-item scores of vector `c` on `ids` (higher is better: accuracy, or minus an
        item's summed NLL), evaluating only the items not scored before."""
        key = fit.digest(c)
        have = self.cache.get(key, {})
        todo = [i for i in ids if i not in have]
        if todo:
            self._evaluate(c, key, todo, name)
        sign = 1.0 if self.metric.higher_is_better else -1.0
        return [sign * self.cache[key][i][0] for i in ids]

    def record(self, c: list[float], ids: list, name: str) -> dict:
        """A record of `c` on `ids` alone, as `select` reads one (run, items, protocol)."""
        self.scores(c, ids, name)
        key = fit.digest(c)
        rec, got = self.records[key], self.cache[key]
        if self.metric.key == "loss":
            items = {"ids": list(ids), "nll": [got[i][0] for i in ids], "tokens": [got[i][1] for i in ids]}
        else:
            items = {"ids": list(ids), self.metric.key: [got[i][0] for i in ids]}
        return {
            **rec,
            "run": name,
            "items": items,
            "n_prompts": len(ids),
            "_where": f"{name} ({rec['model_path']})",
        }

    def _evaluate(self, c: list[float], key: str, ids: list, name: str) -> None:
        if self.backend is None:
            self.backend = self.evaluation.start(
                lambda b: b.open_source(SOURCE, (self.basis, self.template), self.template)
            )
        self.backend.source_call("set", key, c)
        with stages.stage("swap"):
            self.backend.load_from_source(key, self.template)
        if self.metric.key == "loss":
            part = replace(self.task, loss_records=[self.task.loss_records[i] for i in ids])
        else:
            wanted = set(ids)
            part = replace(self.task, docs=[d for d in self.task.docs if d["_id"] in wanted])
        target = Target(Path(f"fit:{key}"), name, self.step, {"method": "fitted", "coefficients": c})
        records, samples = evaluate_task(self.backend, Job(target, [part], self.evaluation.config, key), part)
        for rec in records:
            if self.metric.key == "loss":  # positions in the slice -> positions in the loss file
                rec["items"]["ids"] = list(ids)
            rec["model_path"] = f"fit:{key}"
        self.evaluation.write(records, samples)
        self._keep(key, records[0])
        self.evaluated += len(ids)

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None
