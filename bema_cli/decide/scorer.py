"""Per-item scores of any candidate, evaluated from memory, only on the items asked for.

`bema ship`'s candidates (the menu's configs, vanilla, fitted coefficient vectors) all load into
one engine (`Arena`) from one weight source (`ShipSource`): the sweep's walker, advanced to the
decision's step, gives the menu and theta_s; a `fit.Combiner` gives any vector. Nothing is
written. A scorer evaluates one task on a slice of its items (`evaluate_task` on the slice: every
prompt is seeded by its own id, every loss record is its own forward, so an item scores the same
alone or in a batch) and appends each slice's record to its results file: a killed ship resumes
there and evaluates no (candidate, item) twice.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bema_cli import output, stages
from bema_cli.decide import fit
from bema_cli.eval.evaluate import Evaluation
from bema_cli.eval.job import Job, evaluate_task
from bema_cli.eval.results import ResultsFile
from bema_cli.eval.targets import VANILLA, Target
from bema_cli.stabilize import motion

SOURCE = "bema_cli.decide.scorer:ShipSource"
_NONE = object()  # nothing loaded yet (None is theta_s)


class ShipSource:
    """The engine's weight source: the walker's states (a menu config by name, None: theta_s) and a
    Combiner (a key `fit:<digest>` set with its vector), so the fits need no second engine."""

    def __init__(self, plan, opts, basis: list[Path], template: Path):
        from bema_cli.sweep.walk import Walker

        self.walker, self.combiner = Walker(plan, opts), fit.Combiner(basis, template)

    def advance(self, step: int) -> None:
        self.walker.advance(step)

    def finish(self) -> None:
        self.walker.finish()

    def motion_sums(self) -> dict:
        return self.walker.motion_sums()

    def set(self, key: str, c: list[float]) -> None:
        self.combiner.set(key, c)

    def weights(self, key: str | None, dtype=None):
        if key is not None and key.startswith("fit:"):
            return self.combiner.weights(key, dtype)
        return self.walker.weights(key, dtype)


class Arena:
    """One engine for the whole decision: started on the step's checkpoint, the walker advanced to
    the step (every earlier step walked and finished, as a sweep's walk does), then any candidate
    swapped in by name or vector. `targets`: the menu's and vanilla's Target at the step (paths and
    stabilizer settings the records carry, as a sweep's do)."""

    def __init__(self, evaluation: Evaluation, plan, stab, basis: list[Path], step: int, targets: dict):
        self.evaluation, self.plan, self.stab, self.basis, self.step = evaluation, plan, stab, basis, step
        self.targets, self.folder = targets, targets["vanilla"].path
        self.backend, self.loaded = None, _NONE
        self.motion: dict | None = None  # the walk's motion (motion.py), judged before any evaluation

    def start(self):
        if self.backend is None:
            args = (self.plan, self.stab, self.basis, self.folder)
            self.backend = self.evaluation.start(lambda b: b.open_source(SOURCE, args, self.folder))
            with output.progress("steps") as bar:
                walked = [s for s in self.plan.read_steps if s <= self.step]
                task = bar.add_task("walking to the step", total=len(walked))
                for s in walked:
                    with stages.stage("walk", self.plan.indexes[s].nbytes if s in self.plan.indexes else 0):
                        self.backend.source_call("advance", s)
                        if s != self.step:
                            self.backend.source_call("finish")
                    bar.advance(task)
            if walked:
                self.motion = motion.judge(self.backend.source_call("motion_sums"), self.plan.runs)
        return self.backend

    def load(self, name: str, c: list[float] | None) -> Target:
        """Candidate `name` (a menu config, "vanilla", or a vector `c`) into the engine; its Target."""
        backend = self.start()
        if c is None:
            target = self.targets[name]
            key = None if name == "vanilla" else name
        else:
            key = f"fit:{fit.digest(c)}"
            target = Target(Path(key), name, self.step, {"method": "fitted", "coefficients": c})
        if self.loaded != key:
            if c is not None:
                backend.source_call("set", key, c)
            with stages.stage("swap"):
                backend.load_from_source(key, self.folder)
            self.loaded = key
        return target

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
            self.backend = None


def candidate_path(arena: Arena, name: str, c: list[float] | None) -> str:
    return str(arena.targets[name].path) if c is None else f"fit:{fit.digest(c)}"


class ItemScorer:
    """One task's per-item scores for candidates named by menu run or given as vectors."""

    def __init__(self, arena: Arena, metric, out: Path):
        self.arena, self.metric = arena, metric
        self.task = arena.evaluation.inputs[metric.task]  # prepared once, with the engine's resume key
        self.results = ResultsFile(out / metric.task)
        self.evaluated = 0  # (candidate, item) pairs evaluated by this process
        self.cache: dict[str, dict] = {}  # model_path -> {item id: (score, tokens)}
        self.records: dict[str, dict] = {}  # model_path -> a record (its protocol, for select)
        self.alias: dict[str, str] = {}  # a menu config's vector digest -> that config's name
        for rec in self.results.records:  # a resumed ship's
            self._keep(rec["model_path"], rec)

    def same(self, c: list[float], name: str) -> None:
        """Vector `c` is menu config `name`: its scores are that config's, not evaluated again."""
        self.alias[fit.digest(c)] = name

    def _resolve(self, name: str, c) -> tuple[str, list[float] | None]:
        """(name, c) as the engine knows it: a vector equal to a menu config's is that config."""
        if c is not None and (menu := self.alias.get(fit.digest(c))) is not None:
            return menu, None
        return name, c

    def _path(self, name: str, c) -> str:
        return candidate_path(self.arena, *self._resolve(name, c))

    def _keep(self, path: str, rec: dict) -> None:
        items = rec["items"]
        scores = items["nll"] if self.metric.key == "loss" else items[self.metric.key]
        tokens = items["tokens"] if self.metric.key == "loss" else [1] * len(scores)
        self.cache.setdefault(path, {}).update(
            zip(items["ids"], zip(scores, tokens, strict=True), strict=True)
        )
        self.records.setdefault(path, rec)

    def scores(self, c, ids: list, name: str) -> list[float]:
        """Oriented per-item scores (higher is better: accuracy, or minus an item's summed NLL) of
        vector `c`, or of menu config / vanilla `name` when `c` is None, on `ids`."""
        name, c = self._resolve(name, c)
        path = self._path(name, c)
        have = self.cache.get(path, {})
        todo = [i for i in ids if i not in have]
        if todo:
            self._evaluate(c, name, todo, path)
        sign = 1.0 if self.metric.higher_is_better else -1.0
        return [sign * self.cache[path][i][0] for i in ids]

    def record(self, c, ids: list, name: str) -> dict:
        """A record of the candidate on `ids` alone, as `select` reads one."""
        self.scores(c, ids, name)
        path = self._path(name, c)
        rec, got = self.records[path], self.cache[path]
        if self.metric.key == "loss":
            items = {"ids": list(ids), "nll": [got[i][0] for i in ids], "tokens": [got[i][1] for i in ids]}
        else:
            items = {"ids": list(ids), self.metric.key: [got[i][0] for i in ids]}
        return {**rec, "run": name if c is not None else rec["run"], "items": items, "n_prompts": len(ids),
                "_where": f"{name} ({rec['model_path']})"}  # fmt: skip

    def _evaluate(self, c, name: str, ids: list, path: str) -> None:
        target = self.arena.load(name, c)
        part = slice_task(self.task, ids)
        key = path.removeprefix("fit:") if c is not None else f"{path}@{self.arena.step}"
        job = Job(target, [part], self.arena.evaluation.config, key)
        records, _ = evaluate_task(self.arena.backend, job, part)  # samples are not logged by ship
        for rec in records:
            if self.metric.key == "loss":  # positions in the slice -> positions in the loss file
                rec["items"]["ids"] = list(ids)
        self.results.write(records)
        self._keep(path, records[0])
        self.evaluated += len(ids)


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
