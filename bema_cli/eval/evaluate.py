"""`bema eval`: run the paper's benchmarks and losses for many checkpoints on one backend.

Inputs are any mix of raw `checkpoint-<s>` folders (run "vanilla"), `bema stabilize`
checkpoint folders (run and hyperparameters from bema.json) and `bema stabilize` output
directories (expanded through manifest.json). `--base` is evaluated once and recorded as
step 0 of every run. Every (checkpoint, run, task) gives one results.jsonl record.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from bema_cli import __version__, output
from bema_cli.errors import InputError, UsageError
from bema_cli.eval import data
from bema_cli.eval.backends.base import EngineOptions, Sampling, make_backend
from bema_cli.eval.chat import has_tokenizer, render
from bema_cli.eval.results import ResultsFile, SamplesLog, read_jsonl
from bema_cli.eval.tasks import LOSS_TASKS, get_task
from bema_cli.eval.tasks import common as scoring
from bema_cli.eval.tasks import loss as loss_task
from bema_cli.io.checkpoints import find_checkpoints, model_weight_files, read_json, resolve_model, step_of

# bema.json keys that describe the stabilizer (per-step alpha/beta and paths are not hyperparameters)
STABILIZER_KEYS = (
    "method", "preset", "kappa", "eta", "gamma", "rho", "tau", "phi", "beta_min",
    "accum_dtype", "out_dtype", "theta0_source",
)  # fmt: skip
VANILLA = {"method": "vanilla"}


@dataclass
class Target:
    """One model folder to evaluate and where its results go."""

    path: Path
    run: str
    step: int | None
    stabilizer: dict
    is_base: bool = False
    runs: list = field(default_factory=list)  # base only: every (run, stabilizer) it stands in for


@dataclass
class EvalConfig:
    tasks: list[str]
    out: str | None = None
    data_dir: str | None = None
    loss_data: str | None = None
    loss_train_data: str | None = None
    loss_samples: int = loss_task.DEFAULT_SAMPLES
    loss_max_tokens: int = loss_task.MAX_TOKENS
    n_samples: int = 50  # the paper's protocol: 50 samples per prompt
    temperature: float = 1.0
    seed: int = 13337  # sampling seed, the paper's
    max_new_tokens: int | None = None  # None: per task (256 BoolQ/MMLU-HS, 512 GSM8K)
    selection_seed: int = 37371  # prompt subset seed, the paper's
    limit: int | None = None  # None: per task (64 BoolQ, 128 GSM8K, 64 per MMLU-HS subject)
    backend: str = "auto"
    log_samples: bool = False
    force: bool = False
    chat_template_file: str | None = None


def check_model_dir(path: Path) -> None:
    """Fail early, before any engine starts, on folders that cannot be evaluated."""
    if not path.is_dir():
        raise InputError(f"{path}: not a directory")
    if not (path / "config.json").is_file():
        raise InputError(f"{path}: no config.json (not a model folder)")
    model_weight_files(path)  # the rule stabilize and the vLLM weight swap use: safetensors only
    if not has_tokenizer(path):
        raise InputError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json)")


def _model_target(path: Path) -> Target:
    bema = path / "bema.json"
    if bema.is_file():
        meta = read_json(bema)
        stabilizer = {k: meta[k] for k in STABILIZER_KEYS if k in meta}
        step = meta["step"] if "step" in meta else step_of(path)
        return Target(path, str(meta.get("run", "vanilla")), step, stabilizer or dict(VANILLA))
    return Target(path, "vanilla", step_of(path), dict(VANILLA))


def expand_inputs(inputs: list[str]) -> list[Target]:
    """Model folders, stabilize outputs (manifest.json) and training dirs (checkpoint-* children)."""
    targets = []
    for text in inputs:
        path = Path(text).resolve()
        if not path.exists():
            raise InputError(f"{text}: no such file or directory")
        if (path / "manifest.json").is_file():
            manifest = read_json(path / "manifest.json")
            for run in manifest.get("runs", []):
                for out in run.get("outputs", []):
                    target = _model_target((path / out["path"]).resolve())
                    target.run, target.step = run.get("run", target.run), out.get("step", target.step)
                    targets.append(target)
        elif not (path / "config.json").is_file() and path.is_dir():
            if not any(p.is_dir() and p.name.startswith("checkpoint-") for p in path.iterdir()):
                raise InputError(f"{path}: no config.json, manifest.json or checkpoint-* folders")
            targets += [_model_target(c.path) for c in find_checkpoints(path)]
        else:
            targets.append(_model_target(path))
    seen, unique = set(), []
    for t in targets:
        if (t.path, t.run) not in seen:
            seen.add((t.path, t.run))
            unique.append(t)
    return unique


def base_target(base: str, targets: list[Target]) -> Target:
    """The base model (a folder or Hub repo id), standing in as step 0 of every run among the targets."""
    path = resolve_model(base).path
    runs = {}
    for t in targets:
        runs.setdefault(t.run, t.stabilizer)
    return Target(
        path, "base", 0, dict(VANILLA), is_base=True, runs=list(runs.items()) or [("vanilla", VANILLA)]
    )


def _protocol(config: EvalConfig, name: str, source: str) -> dict:
    if name in LOSS_TASKS:
        return {"data": source, "loss_samples": config.loss_samples, "max_tokens": config.loss_max_tokens}
    task = get_task(name)
    return {
        "n_samples": config.n_samples, "temperature": config.temperature, "top_p": 1.0,
        "max_new_tokens": config.max_new_tokens or task.MAX_NEW_TOKENS,
        "limit": config.limit or task.DEFAULT_LIMIT, "selection_seed": config.selection_seed,
        "data": source, "prompt_version": task.PROMPT_VERSION, "zero_shot": True,
    }  # fmt: skip


def _core(protocol: dict) -> dict:
    """A record's protocol without what is only known after loading the model."""
    return {k: v for k, v in protocol.items() if k != "chat_template"}


class Evaluation:
    """Prepared once (data, protocol), then run checkpoint by checkpoint on one backend."""

    def __init__(self, config: EvalConfig, engine: EngineOptions):
        self.config, self.engine = config, engine
        self.results = ResultsFile(config.out)
        self.samples = SamplesLog(config.out, config.log_samples)
        self.modules = {name: get_task(name) for name in config.tasks}
        self.docs, self.loss_records, self.sources = {}, {}, {}
        self._load_data()
        self.backend = None

    def _load_data(self) -> None:
        c = self.config
        gen = [m for n, m in self.modules.items() if n not in LOSS_TASKS]
        files = data.resolve_sources(gen, c.data_dir)
        for task in gen:
            self.docs[task.NAME] = data.load_docs(
                task, files[task.NAME], c.limit or task.DEFAULT_LIMIT, c.selection_seed
            )
            self.sources[task.NAME] = ", ".join(str(f) for f in files[task.NAME])
        for name, path, flag in (
            ("loss", c.loss_data, "--loss-data"),
            ("train_loss", c.loss_train_data, "--loss-train-data"),
        ):
            if name in self.modules:
                if path is None:
                    raise UsageError(f"task {name} needs {flag} FILE.jsonl")
                self.loss_records[name] = data.read_loss_records(path, c.loss_samples)
                self.sources[name] = str(Path(path).resolve())

    def pending(self, target: Target) -> list[str]:
        runs = target.runs if target.is_base else [(target.run, target.stabilizer)]
        todo = []
        for name in self.modules:
            done = {run: self.results.find((str(target.path), run, name)) for run, _ in runs}
            have = [r for r in done.values() if r is not None]
            if target.is_base and not have:  # the base evaluated earlier for other runs counts too
                have = [r for r in self.results.records if r["model_path"] == str(target.path)
                        and r["task"] == name and r.get("is_base")]  # fmt: skip
            if self.config.force or not have:
                todo.append(name)
                continue
            protocol = _protocol(self.config, name, self.sources[name])
            same = [r for r in have if _core(r.get("protocol", {})) == protocol]
            missing = [(run, st) for run, st in runs if done[run] is None]
            if missing and same:
                # the base stands in for every run: a run new to results.jsonl gets a copy of its
                # record (same protocol), not a second generation of the same outputs
                self.results.write([{**same[-1], "run": run, "stabilizer": st} for run, st in missing])
            elif missing:
                todo.append(name)
            if len(same) < len(have):
                output.warn(
                    f"kept the {name} result of {target.path} made with another protocol; --force redoes it"
                )
        return todo

    def run(self, targets: list[Target]) -> list[dict]:
        try:
            for target in targets:
                todo = self.pending(target)
                if not todo:
                    output.log(f"skip {target.path} (all tasks in results.jsonl)")
                    continue
                if self.backend is None:
                    name = self.config.backend
                    if name == "auto" and all(t in LOSS_TASKS for t in self.modules):
                        name = "transformers"  # losses are transformers forward passes: no engine needed
                    self.backend = make_backend(name, self.engine)
                self.backend.load(target.path)
                for name in todo:
                    self._run_task(target, name)
        finally:
            if self.backend is not None:
                self.backend.close()
        keys = {
            (str(t.path), r, n)
            for t in targets
            for r in ([x for x, _ in t.runs] if t.is_base else [t.run])
            for n in self.modules
        }
        return [r for r in self.results.records if (r["model_path"], r["run"], r["task"]) in keys]

    def _run_task(self, target: Target, name: str) -> None:
        c, backend = self.config, self.backend
        output.log(
            f"{name}: {target.path} (run {target.run if not target.is_base else 'base'}, step {target.step})"
        )
        start = time.perf_counter()
        created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        eval_id = uuid.uuid4().hex  # ties samples.jsonl lines to their results.jsonl records (for rescore)
        template = (
            f"file:{Path(c.chat_template_file).resolve()}"
            if c.chat_template_file
            else backend.template_source
        )
        protocol = {**_protocol(c, name, self.sources[name]), "chat_template": template}
        extra, samples = {}, []
        if name in LOSS_TASKS:
            seqs = [
                loss_task.encode_record(r, backend.tokenizer, c.loss_max_tokens)
                for r in self.loss_records[name]
            ]
            metrics = loss_task.loss_metrics(backend.loss(seqs))
            n_prompts, n_samples, seeds = len(seqs), 1, {"sampling": None, "selection": None}
        else:
            task, docs = self.modules[name], self.docs[name]
            prompts = [render(backend.tokenizer, task.messages(d)) for d in docs]
            sampling = Sampling(c.n_samples, c.temperature, c.seed, c.max_new_tokens or task.MAX_NEW_TOKENS)
            responses = backend.generate(prompts, sampling)
            scored = scoring.score_all(task, docs, responses)
            metrics, extra = scoring.task_metrics(task, scored, [d.get("subject", "") for d in docs])
            n_prompts, n_samples = len(docs), c.n_samples
            seeds = {"sampling": c.seed, "selection": c.selection_seed}
            samples = [
                {"eval_id": eval_id, "model_path": str(target.path), "run": None if target.is_base else target.run,
                 "step": target.step, "is_base": target.is_base, "task": name, "doc_id": d["_id"],
                 "subject": d.get("subject"), "prompt": p, "responses": resp, "gold": task.gold(d),
                 **scoring.sample_fields(s)}
                for d, p, resp, s in zip(docs, prompts, responses, scored, strict=True)
            ]  # fmt: skip
        seconds = round(time.perf_counter() - start, 3)
        runs = target.runs if target.is_base else [(target.run, target.stabilizer)]
        if not c.force:  # the base may already have records for some runs: add only the missing ones
            runs = [(r, st) for r, st in runs if self.results.find((str(target.path), r, name)) is None]
        records = [
            {"bema_version": __version__, "created": created, "eval_id": eval_id, "model_path": str(target.path), "run": run,
             "step": target.step, "stabilizer": stabilizer, "task": name, "metrics": metrics, **extra,
             "n_prompts": n_prompts, "n_samples": n_samples, "backend": backend.name, "dtype": backend.dtype,
             "seeds": seeds, "protocol": protocol, "seconds": seconds, "is_base": target.is_base}
            for run, stabilizer in runs
        ]  # fmt: skip
        self.samples.write(samples)
        self.results.write(records, replace=c.force)


def run_eval(inputs: list[str], base: str | None, config: EvalConfig, engine: EngineOptions) -> list[dict]:
    """Evaluate every input (and the base); returns the records of all requested (checkpoint, task)."""
    targets = expand_inputs(inputs)
    if base is not None:
        targets.insert(0, base_target(base, targets))
    if not targets:
        raise UsageError("no checkpoints to evaluate (give model folders and/or --base)")
    for target in targets:  # before any data is downloaded or OUT is created
        check_model_dir(target.path)
    if config.log_samples and config.out is None:
        raise UsageError("--log-samples needs --out")
    return Evaluation(config, engine).run(targets)


def rescore(samples_path: str | Path, results_path: str | Path | None = None) -> list[dict]:
    """Recompute scores from logged samples with today's extraction rules, without generating.

    Provenance comes from the matching results.jsonl records (the samples file's sibling by
    default); without one, a minimal record is built from the samples themselves.
    """
    samples_path = Path(samples_path)
    lines = read_jsonl(samples_path, skip_torn=True)
    results_path = Path(results_path) if results_path else samples_path.with_name("results.jsonl")
    old = read_jsonl(results_path, skip_torn=True) if results_path.is_file() else []
    latest: dict[tuple, str] = {}
    for line in lines:
        for key in ("model_path", "task", "responses", "gold"):
            if key not in line:
                raise InputError(f"{samples_path}: a line lacks {key!r} (not a bema samples file)")
        latest[(line["model_path"], line["task"])] = line.get("eval_id")
    records = []
    for (model_path, name), eval_id in latest.items():
        group = [
            x for x in lines if (x["model_path"], x["task"], x.get("eval_id")) == (model_path, name, eval_id)
        ]
        task = get_task(name)
        scored = [scoring.score_item(task, x["responses"], x["gold"]) for x in group]
        metrics, extra = scoring.task_metrics(task, scored, [x.get("subject") or "" for x in group])
        matches = [r for r in old if r.get("model_path") == model_path and r.get("task") == name
                   and r.get("eval_id") == eval_id] or [
            {"model_path": model_path, "run": group[0].get("run"), "step": group[0].get("step"), "task": name,
             "is_base": group[0].get("is_base", False), "n_prompts": len(group),
             "n_samples": len(group[0]["responses"])}]  # fmt: skip
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        for r in matches:
            records.append({**r, "metrics": metrics, **extra, "rescored": now, "bema_version": __version__})
    return records
