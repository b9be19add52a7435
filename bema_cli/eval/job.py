"""One checkpoint's evaluation, the unit every executor runs (here, a Ray engine actor, a sweep's
walk): the settings (`EvalConfig`), a job's plain-data inputs, and `run_job`/`evaluate_task`.
Nothing here drives a run, so the executors below the driver import it without importing
the driver (eval/evaluate.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from bema_cli import __version__, output, stages
from bema_cli.eval import timings
from bema_cli.eval.backends.base import Sampling, prompt_seed
from bema_cli.eval.chat import render
from bema_cli.eval.targets import Target
from bema_cli.eval.tasks import LOSS_TASKS, SELECTION_SEED, get_task, is_lm_eval
from bema_cli.eval.tasks import common as scoring
from bema_cli.eval.tasks import loss as loss_task


@dataclass
class EvalConfig:
    tasks: list[str]
    out: str | None = None
    data_dir: str | None = None
    loss_data: str | None = None
    loss_train_data: str | None = None
    loss_samples: int = loss_task.DEFAULT_SAMPLES
    loss_max_tokens: int = loss_task.MAX_TOKENS
    n_samples: int = Sampling.n  # the paper's protocol: 50 samples per prompt
    temperature: float = Sampling.temperature
    seed: int = Sampling.seed  # sampling seed, the paper's
    max_new_tokens: int | None = None  # None: per task (256 BoolQ/MMLU-HS, 512 GSM8K)
    selection_seed: int = SELECTION_SEED
    limit: int | None = None  # None: per task (64 BoolQ, 128 GSM8K, 64 per MMLU-HS subject)
    num_fewshot: int = 0  # the authors' configs: zero-shot (the paper's text: 5-shot BoolQ)
    cot: bool = False  # ask BoolQ/MMLU-HS for step-by-step reasoning (GSM8K always asks)
    backend: str = "auto"
    log_samples: bool = False
    force: bool = False
    chat_template_file: str | None = None
    lm_eval_include: str | None = None  # a folder of local lm-eval task YAMLs

    def read_paths(self) -> list[Path]:
        """The files and folders this evaluation reads besides the models (held-out data, the data
        folder, a chat template, lm-eval includes): an output must never replace or lie inside them."""
        named = (
            self.loss_data,
            self.loss_train_data,
            self.data_dir,
            self.chat_template_file,
            self.lm_eval_include,
        )
        return [Path(p).expanduser() for p in named if p]

    def name(self, path: str | Path) -> str:
        """How the records name a model or a data file: by its path inside the folder it shares with
        --out (provenance.record_name), never by an absolute path of this machine."""
        from bema_cli.io.provenance import record_name

        return record_name(path, self.out)


@dataclass
class TaskInput:
    """One task's prepared inputs (plain data, so a job can be sent to another process)."""

    name: str
    protocol: dict
    resume_key: dict  # without the model's fingerprint
    docs: list = field(default_factory=list)  # generation: the selected items
    shots: dict = field(default_factory=dict)  # generation: subject ("" if none) -> few-shot items
    loss_records: list = field(default_factory=list)  # loss tasks


@dataclass
class Job:
    """One checkpoint's evaluation: the model, its pending tasks and the settings they run with."""

    target: Target
    tasks: list[TaskInput]
    config: EvalConfig
    fingerprint: str


def run_job(backend, job: Job) -> Iterator[tuple[list[dict], list[dict]]]:
    """A checkpoint's whole evaluation on `backend`: load it, then each task's (records, samples)."""
    with stages.stage("swap"):
        backend.load(job.target.path)
    for item in job.tasks:
        yield evaluate_task(backend, job, item)


def evaluate_task(backend, job: Job, item: TaskInput, say: bool = True) -> tuple[list[dict], list[dict]]:
    """One task's records for the loaded model; `say`: a progress line (ship says its rounds instead)."""
    c, target, name = job.config, job.target, item.name
    model = c.name(target.path)
    if say:
        output.step(f"{name}: {target.path} ({target.label})")
    start = time.perf_counter()
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    eval_id = uuid.uuid4().hex  # ties samples.jsonl lines to their results.jsonl records (for rescore)
    template = f"file:{c.name(c.chat_template_file)}" if c.chat_template_file else backend.template_source
    extra, samples, record_seeds = {}, [], item.resume_key["seeds"]
    # what every samples.jsonl line of this evaluation starts with
    sample_of = {"eval_id": eval_id, "model_path": model, "run": None if target.is_base else target.run,
                 "step": target.step, "is_base": target.is_base, "task": name}  # fmt: skip
    if is_lm_eval(name):
        from bema_cli.eval import lm_eval_bridge

        with stages.stage("lm_eval"):
            metrics, extra, n_prompts, n_samples, logged = lm_eval_bridge.evaluate(backend, name, c)
        samples = [{**sample_of, **x} for x in logged]
    elif name in LOSS_TASKS:
        encoded = [
            loss_task.encode_record(r, backend.tokenizer, c.loss_max_tokens) for r in item.loss_records
        ]
        seqs, starts = [ids for ids, _ in encoded], [start for _, start in encoded]
        t = time.perf_counter()
        with stages.stage("loss"):
            pairs = backend.loss(seqs, starts)
        timings.note("loss_record", time.perf_counter() - t, len(seqs))
        metrics = loss_task.loss_metrics(pairs)
        extra["items"] = loss_task.loss_items(pairs)
        n_prompts, n_samples = len(seqs), 1
    else:
        task, docs = get_task(name), item.docs
        prompts = [
            render(
                backend.tokenizer,
                scoring.build_messages(task, d, item.shots.get(d.get("subject", ""), []), c.cot),
            )
            for d in docs
        ]
        sampling = Sampling(c.n_samples, c.temperature, c.seed, c.max_new_tokens or task.MAX_NEW_TOKENS)
        seeds = [prompt_seed(c.seed, name, d["_id"]) for d in docs]
        t = time.perf_counter()
        with stages.stage("generate"):
            responses = backend.generate(prompts, sampling, seeds)
        timings.note("decode_step", time.perf_counter() - t, sampling.max_new_tokens)  # steps, batched
        scored = scoring.score_all(task, docs, responses)
        metrics, extra = scoring.task_metrics(task, scored, [d.get("subject", "") for d in docs])
        extra["items"] = scoring.prompt_items([d["_id"] for d in docs], scored)
        n_prompts, n_samples = len(docs), c.n_samples
        samples = [
            {
                **sample_of,
                "doc_id": d["_id"],
                "subject": d.get("subject"),
                "prompt": p,
                "seed": None if c.temperature == 0 else seed,
                "responses": resp,
                "gold": task.gold(d),
                **scoring.sample_fields(s),
            }
            for d, p, seed, resp, s in zip(docs, prompts, seeds, responses, scored, strict=True)
        ]
    seconds = round(time.perf_counter() - start, 3)
    records = [
        {
            "bema_version": __version__,
            "created": created,
            "eval_id": eval_id,
            "model_path": model,
            "run": run,
            "step": target.step,
            **({"label": target.label} if target.step is None else {}),
            "stabilizer": stabilizer,
            "task": name,
            "metrics": metrics,
            **extra,
            "n_prompts": n_prompts,
            "n_samples": n_samples,
            "backend": backend.name,
            "dtype": backend.dtype,
            "batch_size": backend.options.batch_size if backend.name == "transformers" else None,
            "seeds": record_seeds,
            "protocol": {**item.protocol, "chat_template": template},
            "resume_key": {**item.resume_key, "weights": job.fingerprint},
            "seconds": seconds,
            "is_base": target.is_base,
        }
        for run, stabilizer in target.record_runs()
    ]
    return records, samples
