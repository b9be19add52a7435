"""Per-item scores of any candidate, evaluated from memory, only on the items asked for.

Every candidate of `bema ship` is a coefficient vector (candidate.py). All load into one engine
(`Arena`) from one weight source (`ShipSource`): the sweep's walker, advanced to the decision's
step, holds the menu's vectors and theta_s; a `fit.Combiner` streams any other vector. Nothing is
written. A scorer evaluates one task on a slice of its items and appends each slice's record,
tagged with the vector's digest, to its results file: a killed ship resumes there and evaluates no
(vector, item) twice.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

from bema_cli import output, stages
from bema_cli.decide import fit
from bema_cli.decide.candidate import Candidate
from bema_cli.errors import InputError
from bema_cli.eval.evaluate import Evaluation
from bema_cli.eval.job import Job, evaluate_task
from bema_cli.eval.results import ResultsFile
from bema_cli.eval.targets import VANILLA, Target
from bema_cli.stabilize import motion
from bema_cli.sweep.walk import steps_to, walk_to

SOURCE = "bema_cli.decide.scorer:ShipSource"
_NONE = object()  # nothing loaded yet (None is theta_s)


@dataclass(frozen=True)
class FitKey:
    """The engine's key of a vector the walker does not hold (a fit, theta0): the Combiner serves it.
    A type of its own, where a "fit:" prefix on a string once told it from a menu config's name; it
    crosses vLLM's RPC pickled, as the source's own calls do. Its records name it `fit:<digest>`."""

    digest: str

    def __str__(self) -> str:
        return f"fit:{self.digest}"


class ShipSource:
    """The engine's weight source: the walker's states (a menu config by name, None: theta_s) and a
    Combiner (a FitKey set with its vector), so the fits need no second engine."""

    def __init__(self, plan, opts, basis: list[Path], template: Path):
        from bema_cli.sweep.walk import Walker

        self.walker, self.combiner = Walker(plan, opts), fit.Combiner(basis, template)

    def advance(self, step: int) -> None:
        self.walker.advance(step)

    def finish(self) -> None:
        self.walker.finish()

    def motion_sums(self) -> dict:
        return self.walker.motion_sums()

    def set(self, key: FitKey, c: list[float]) -> None:
        self.combiner.set(key, c)

    def weights(self, key: str | FitKey | None, dtype=None):
        if isinstance(key, FitKey):
            return self.combiner.weights(key, dtype)
        return self.walker.weights(key, dtype)


class Arena:
    """One engine for the whole decision: started on the step's checkpoint, the walker advanced to
    the step (every earlier step walked and finished, as a sweep's walk does), then any candidate
    swapped in by its vector: from the walker's states where it holds that vector (the menu's configs
    and theta_s), else as the combination of the checkpoints. `targets`: the menu's and vanilla's
    Target at the step (the records carry their paths and stabilizer settings, as a sweep's do)."""

    def __init__(
        self,
        evaluation: Evaluation,
        plan,
        stab,
        basis: list[Path],
        steps: list[int],
        targets: dict,
        menu: dict[str, Candidate],
    ):
        self.evaluation, self.plan, self.stab, self.basis = evaluation, plan, stab, basis
        self.steps, self.step = steps, steps[-1]
        self.targets, self.folder = targets, targets["vanilla"].path
        self.held: dict[str, str] = {}  # a vector's digest -> the menu name the walker holds it under
        for name, cand in menu.items():
            self.held.setdefault(cand.digest, name)
        self.backend, self.loaded = None, _NONE
        self.motion: dict | None = None  # the walk's motion (motion.py), judged before any evaluation

    def start(self):
        if self.backend is None:
            args = (self.plan, self.stab, self.basis, self.folder)
            self.backend = self.evaluation.start(
                lambda b: b.open_source(SOURCE, args, self.folder), self.folder
            )
            call, indexes = self.backend.source_call, self.plan.indexes

            def advance(s: int) -> None:
                with stages.stage("walk", indexes[s].nbytes if s in indexes else 0):
                    call("advance", s)

            def finish() -> None:
                with stages.stage("walk"):
                    call("finish")

            with output.progress("steps") as bar:
                walked = steps_to(self.plan, self.step)
                task = bar.add_task("walking to the step", total=len(walked))
                for _ in walk_to(self.plan, self.step, advance, finish):
                    bar.advance(task)
            if walked:
                self.motion = motion.judge(self.backend.source_call("motion_sums"), self.plan.runs)
        return self.backend

    def load(self, cand: Candidate) -> Target:
        """`cand` into the engine; the Target its records are made under."""
        backend = self.start()
        name = self.held.get(cand.digest)
        if name is not None:
            target, key = self.targets[name], (None if name == "vanilla" else name)
        else:
            key = FitKey(cand.digest)
            target = Target(
                Path(str(key)), cand.name, self.step, {"method": "fitted", "coefficients": cand.record}
            )
        if self.loaded != key:
            if name is None:
                backend.source_call("set", key, cand.coefficients(self.steps))
            with stages.stage("swap"):
                backend.load_from_source(key, self.folder)
            self.loaded = key
        return target

    def evaluate(self, cand: Candidate, task, ids: list) -> list[dict]:
        """`cand`'s records on `task`'s items `ids` (every prompt seeded by its own id, every loss
        record its own forward: an item scores the same alone or in a batch)."""
        target = self.load(cand)
        part = slice_task(task, ids)
        job = Job(target, [part], self.evaluation.config, f"{cand.digest}@{self.step}")
        records, _ = evaluate_task(self.backend, job, part, say=False)  # ship says its rounds; no samples
        return records

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None


class ItemScorer:
    """One task's per-item scores of candidates, keyed by their vector's digest: equal vectors are
    one candidate, evaluated once whatever their names. `evaluate(cand, task, ids)` makes the records
    (the arena's engine, or a simulated world's: bench/bench_decide.py drives this same class)."""

    def __init__(self, evaluate, task, metric, results: ResultsFile):
        self.evaluate, self.task, self.metric, self.results = evaluate, task, metric, results
        self.evaluated = 0  # (candidate, item) pairs evaluated by this process
        self.cache: dict[str, dict] = {}  # digest -> {item id: (score, tokens)}
        self.records: dict[str, dict] = {}  # digest -> a record (its protocol, for select)
        self.chain = ""  # each record appended carries a digest of itself and every one before it
        for n, rec in enumerate(results.records, start=1):  # a resumed ship's
            if "candidate" not in rec:
                continue
            if rec.get("chain") != link(self.chain, rec):
                raise InputError(
                    f"{results.path}: record {n} changed since bema appended it (the records' chain breaks "
                    "there); --overwrite starts this ship afresh"
                )
            self.chain = rec["chain"]
            self._keep(rec["candidate"], rec)

    def _keep(self, key: str, rec: dict) -> None:
        items = rec["items"]
        scores = items["nll"] if self.metric.key == "loss" else items[self.metric.key]
        tokens = items["tokens"] if self.metric.key == "loss" else [1] * len(scores)
        self.cache.setdefault(key, {}).update(
            zip(items["ids"], zip(scores, tokens, strict=True), strict=True)
        )
        self.records.setdefault(key, rec)

    def scores(self, cand: Candidate, ids: list) -> list[float]:
        """Oriented per-item scores (higher is better: accuracy, or minus an item's summed NLL) of
        `cand` on `ids`, evaluating only the items not scored yet."""
        key = cand.digest
        have = self.cache.get(key, {})
        todo = [i for i in ids if i not in have]
        if todo:
            records = self.evaluate(cand, self.task, todo)
            for rec in records:
                rec["candidate"] = key
                if self.metric.key == "loss":  # positions in the slice -> positions in the loss file
                    rec["items"]["ids"] = list(todo)
                rec["chain"] = self.chain = link(self.chain, rec)
            self.results.write(records)
            self._keep(key, records[0])
            self.evaluated += len(todo)
        sign = 1.0 if self.metric.higher_is_better else -1.0
        return [sign * self.cache[key][i][0] for i in ids]

    def record(self, cand: Candidate, ids: list) -> dict:
        """A record of `cand` (under its own name) on `ids` alone, as `select` reads one."""
        self.scores(cand, ids)
        rec, got = self.records[cand.digest], self.cache[cand.digest]
        if self.metric.key == "loss":
            items = {"ids": list(ids), "nll": [got[i][0] for i in ids], "tokens": [got[i][1] for i in ids]}
        else:
            items = {"ids": list(ids), self.metric.key: [got[i][0] for i in ids]}
        return {
            **rec,
            "run": cand.name,
            "items": items,
            "n_prompts": len(ids),
            "_where": f"{cand.name} ({rec['model_path']})",
        }


def link(previous: str, rec: dict) -> str:
    """The chain's next link: a digest of the link before and of `rec` as it is written (without its
    own link). A record edited, dropped, swapped or appended twice breaks the chain on a resume."""
    body = {k: v for k, v in json.loads(output.to_json(rec, indent=None)).items() if k != "chain"}
    return hashlib.sha256((previous + json.dumps(body, sort_keys=True)).encode()).hexdigest()[:32]


def slice_task(task, ids: list):
    """The task's inputs on `ids` alone (loss: positions in the file's prefix; else the docs' ids)."""
    if task.loss_records:
        return replace(task, loss_records=[task.loss_records[i] for i in ids])
    wanted = set(ids)
    return replace(task, docs=[d for d in task.docs if d["_id"] in wanted])


def arena_targets(plan, stab, step: int, folder_of: dict) -> dict:
    """{name: Target} of vanilla and each menu config evaluated at `step` (the sweep's targets)."""
    from bema_cli.sweep.session import targets

    return {t.run: t for t in targets(plan, stab, [step], folder_of)} | {
        "vanilla": Target(folder_of[step], "vanilla", step, dict(VANILLA))
    }
