"""`bema eval`: run the paper's benchmarks, losses and lm-eval tasks for many checkpoints on one backend.

The driver (`Evaluation`) prepares data and resume keys once, refuses results.jsonl records
made with another setup, and turns every checkpoint with work left into one `Job`.
`job.run_job(backend, job)` is a checkpoint's whole evaluation on one backend: it loads the
weights and yields each task's records and samples; the driver writes them, task by task,
so an interrupted run keeps what it finished. (An executor that runs jobs elsewhere, e.g. a
pool of engines (ray_pool.py), calls `run_job` there and hands the results to
`Evaluation.write`.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

from bema_cli import __version__, output, stages
from bema_cli.cluster import ExecutorOptions, import_ray
from bema_cli.errors import BackendError, InputError, OutputError, UsageError
from bema_cli.eval import data, resume, timings
from bema_cli.eval.backends.base import (
    VLLM_INSTALL_HINT,
    EngineOptions,
    import_vllm,
    make_backend,
    vllm_usable,
)
from bema_cli.eval.backends.vllm_engine import EngineStartError
from bema_cli.eval.job import EvalConfig, Job, TaskInput, run_job
from bema_cli.eval.protocol import seeds, task_protocol, validate
from bema_cli.eval.results import ResultsFile, SamplesLog
from bema_cli.eval.targets import Target, base_target, check_model_dir, check_out, expand_inputs
from bema_cli.eval.tasks import LOSS_TASKS, get_task, is_lm_eval
from bema_cli.eval.tasks import common as scoring
from bema_cli.io.commit import locked
from bema_cli.machine import PeakRss, return_freed_memory

PER_MESSAGE_TOKENS = 16  # a chat template's role markers around each message
LIBRARY_LOG = "libraries.log"  # OUT/libraries.log: what the libraries print on stderr (shown with -v)


class StaleRecords(OutputError):
    """OUT's results were made with another setup (`bema ship` words its own fix: --overwrite)."""

    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.detail = detail


class Evaluation:
    """Prepared once (data, protocols, resume keys), then run checkpoint by checkpoint on one backend."""

    def __init__(self, config: EvalConfig, engine: EngineOptions, executor: ExecutorOptions | None = None):
        self.config, self.engine = config, engine
        self.executor = executor or ExecutorOptions()  # where the jobs run: here, or a Ray engine pool
        self.inputs = self._prepare()  # data files first: a missing one is reported before vLLM is imported
        self.engine = replace(engine, workload=self._workload())
        self.results = ResultsFile(config.out)
        self.backend_name = self._resolve_backend()
        for name, item in self.inputs.items():
            item.resume_key.update(self._engine_key(name))
        self.samples = SamplesLog(config.out, config.log_samples)

    def _resolve_backend(self) -> str:
        from bema_cli.eval.backends.vllm_backend import route_vllm_logs

        name = self.config.backend
        if name in ("auto", "vllm"):  # before vLLM is first imported (here, or when the engine starts)
            route_vllm_logs(self.engine.log_file, self.engine.debug or output.verbose())
        if name == "auto" and all(t in LOSS_TASKS for t in self.config.tasks):
            output.log(
                "--backend auto: transformers (loss only: one forward per checkpoint, no engine to start)"
            )
            return "transformers"
        if name == "auto":
            usable = vllm_usable()
            made = {
                (r.get("resume_key") or {}).get("backend")
                for r in self.results.records
                if r.get("task") in self.inputs and r.get("task") not in LOSS_TASKS
            }
            if made == {"transformers"} or (made == {"vllm"} and usable):  # e.g. an earlier fallback
                (name,) = made  # as the records already here were made: they resume
                output.log(f"--backend auto: {name}, as the records already in {self.results.path} were made")
                return name
            if not usable:
                output.log(f"--backend auto: transformers (vLLM is not usable here; {VLLM_INSTALL_HINT})")
            return "vllm" if usable else "transformers"
        if name == "vllm" and self.executor.executor == "local":
            import_vllm()  # a missing vLLM is reported before any model is loaded
        return name

    def _workload(self) -> tuple[tuple[int, int], ...] | None:
        """Each generation task's one generate call, as (sequences, prompt + new tokens at most): what
        vLLM's KV cache needs to hold all of it at once. A prompt's characters bound its tokens (a
        byte-level BPE token covers at least one character of English text); lm-eval's calls are unknown."""
        c, calls = self.config, []
        for name, item in self.inputs.items():
            if is_lm_eval(name):
                return None
            if name in LOSS_TASKS or not item.docs:
                continue
            task = get_task(name)
            prompt = max(
                sum(
                    len(m["content"]) + PER_MESSAGE_TOKENS
                    for m in scoring.build_messages(task, d, item.shots.get(d.get("subject", ""), []), c.cot)
                )
                for d in item.docs
            )
            samples = 1 if c.temperature == 0 else c.n_samples
            calls.append((len(item.docs) * samples, prompt + (c.max_new_tokens or task.MAX_NEW_TOKENS)))
        return tuple(calls)

    def fall_back(self, exc: EngineStartError) -> None:
        """--backend auto, when vLLM cannot start: go on with transformers, saying why once; any other
        --backend: the failure stands."""
        if self.config.backend != "auto" or self.backend_name != "vllm":
            raise exc
        output.log(f"vLLM could not start ({exc.root}); --backend auto goes on with transformers{exc.where}")
        self.backend_name = "transformers"
        for name, item in self.inputs.items():
            item.resume_key.update(self._engine_key(name))

    def servable(self, model_dir) -> str | None:
        """Before any engine starts: a model vLLM cannot serve here (its config.json says so, as
        vllm_engine.unservable reads it) is refused under --backend vllm, naming the file; --backend
        auto goes on with transformers, saying why. Returns the reason (None: nothing against it)."""
        from bema_cli.eval.backends.vllm_engine import unservable
        from bema_cli.io.checkpoints import read_json

        path = Path(model_dir) / "config.json"
        if self.backend_name != "vllm" or not path.is_file():
            return None
        try:
            config = read_json(path)
        except InputError:
            return None
        import torch

        why = unservable(config if isinstance(config, dict) else {}, cpu=not torch.cuda.is_available())
        if why is None:
            return None
        if self.config.backend != "auto":
            raise BackendError(
                f"{path}: vLLM cannot serve this model here: {why}; use --backend transformers"
            )
        output.log(f"--backend auto: transformers ({path}: {why})")
        self.backend_name = "transformers"
        for name, item in self.inputs.items():
            item.resume_key.update(self._engine_key(name))
        return why

    def start(self, start: Callable, model_dir=None):
        """A backend on which `start(backend)` (loading the first model: the engine's start) succeeded;
        with --backend auto, transformers when vLLM cannot start (or cannot serve `model_dir`: said
        before the engine starts)."""
        if model_dir is not None:
            self.servable(model_dir)
        with stages.stage("engine_start"):
            try:
                backend = make_backend(self.backend_name, self.engine)
                start(backend)
            except EngineStartError as exc:
                self.fall_back(exc)
                backend = make_backend(self.backend_name, self.engine)
                start(backend)
        return backend

    def _prepare(self) -> dict[str, TaskInput]:
        c, inputs = self.config, {}
        gen = [get_task(n) for n in c.tasks if n not in LOSS_TASKS and not is_lm_eval(n)]
        files = data.resolve_sources(gen, c.data_dir)
        shot_files = data.resolve_sources(gen, c.data_dir, shots=True) if c.num_fewshot else {}
        template = (
            f"file:sha256:{resume.file_sha256(Path(c.chat_template_file))}"
            if c.chat_template_file
            else "model"
        )
        for name in c.tasks:
            if is_lm_eval(name):
                from bema_cli.eval import lm_eval_bridge

                lm_eval_bridge.check_tasks([name.split(":", 1)[1]], c.lm_eval_include)
                lm_eval_bridge.check_data(
                    name.split(":", 1)[1], c.lm_eval_include
                )  # before any engine starts
                source = c.name(c.lm_eval_include) if c.lm_eval_include else "lm_eval"
                digest = resume.folder_sha256(c.lm_eval_include) if c.lm_eval_include else None
                item = TaskInput(name, task_protocol(c, name, source), {})
            elif name in LOSS_TASKS:
                path, flag = (
                    (c.loss_data, "--loss-data")
                    if name == "loss"
                    else (c.loss_train_data, "--loss-train-data")
                )
                if path is None:
                    raise UsageError(f"task {name} needs {flag} FILE.jsonl")
                item = TaskInput(name, task_protocol(c, name, c.name(path)), {})
                item.loss_records = data.read_loss_records(path, c.loss_samples, c.selection_seed)
                if len(data.read_rows(Path(path))) > c.loss_samples:  # which records: part of the key
                    item.protocol["loss_sample_seed"] = c.selection_seed
                digest = resume.file_sha256(Path(path))
            else:
                task = get_task(name)
                sources = files[name] + shot_files.get(name, [])
                item = TaskInput(name, task_protocol(c, name, ", ".join(map(c.name, files[name]))), {})
                item.docs = data.load_docs(task, files[name], c.limit or task.DEFAULT_LIMIT, c.selection_seed)
                if c.num_fewshot:
                    item.shots = data.load_shots(task, shot_files[name], c.num_fewshot, c.selection_seed)
                digest = resume.sha256_of_files(sources)
            item.resume_key = {
                "protocol": item.protocol,
                "data_sha256": digest,
                "chat_template": template,
                "seeds": None if name in LOSS_TASKS else seeds(c, name),
            }
            inputs[name] = item
        return inputs

    def _engine_key(self, name: str) -> dict:
        """The resume-key fields that come from the backend and engine flags."""
        return {
            # losses come from the backend's own forward (vLLM: prompt logprobs), which differ in the
            # last digits between backends
            "backend": self.backend_name,
            # "auto" means the checkpoint's own dtype on every backend (base.resolve_dtype)
            "dtype": "auto:checkpoint" if self.engine.dtype == "auto" else self.engine.dtype,
            # bema's own tasks seed each prompt's samples apart from its batch (base.prompt_seed), so the
            # batch size changes nothing there; lm-eval batches (and pads) its requests itself
            **(
                {"batch_size": self.engine.batch_size}
                if is_lm_eval(name) and self.backend_name == "transformers"
                else {}
            ),
            # vLLM refuses prompts longer than its max_model_len (None: min(2048, positions))
            "max_model_len": self.engine.max_model_len
            if self.backend_name == "vllm" and name not in LOSS_TASKS
            else None,
        }

    def plan(self, targets: list[Target], fingerprints: dict[Path, str] | None = None) -> list[Job]:
        """The jobs left to do. Records made with another resume key refuse the run (unless --force);
        a base record with the same key is copied to a run new to results.jsonl instead of redone.
        `fingerprints`: the weights' identity per target path (default: its files', `bema sweep` has none)."""
        jobs, refused, copies = [], [], []
        for target in targets:
            fingerprint = (fingerprints or {}).get(target.path) or resume.weights_fingerprint(target.path)
            self.results.rehome(self.config.name(target.path), fingerprint)
            todo = []
            for name, item in self.inputs.items():
                key = {**item.resume_key, "weights": fingerprint}
                runs = target.record_runs()
                have = {run: self.results.find((self.config.name(target.path), run, name)) for run, _ in runs}
                old = [r for r in have.values() if r is not None]
                if target.is_base and not old:  # the base evaluated earlier for other runs counts too
                    old = [
                        r
                        for r in self.results.records
                        if r["model_path"] == self.config.name(target.path)
                        and r["task"] == name
                        and r.get("is_base")
                    ][-1:]
                # a record of bema < 0.5 lacks the per-item scores `bema select` needs: evaluated again
                old = [r for r in old if "items" in r or is_lm_eval(name)]
                if self.config.force or not old:
                    todo.append(item)
                    continue
                diffs = [d for d in (resume.differences(r.get("resume_key"), key) for r in old) if d]
                if diffs:
                    refused.append(f"{target.label} {name}: {', '.join(diffs[0][:4])}")
                    continue
                copies += [{**old[-1], "run": run, "stabilizer": st} for run, st in runs if have[run] is None]
            if todo:
                jobs.append(Job(target, todo, self.config, fingerprint))
        if refused:
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            raise StaleRecords(
                f"{self.results.path}: results made with another setup ({refused[0]}){more}; "
                "--force re-evaluates them into this file, replacing them, or use another --out",
                f"{refused[0]}{more}",
            )
        self.results.write(copies)  # the base stands in for every run: no second generation of it
        return jobs

    def write(self, records: list[dict], samples: list[dict]) -> None:
        self.samples.write(samples)
        self.results.write(records, replace=self.config.force)

    def run(self, targets: list[Target]) -> list[dict]:
        jobs = self.plan(targets)
        done = {str(t.path) for t in targets} - {str(j.target.path) for j in jobs}
        for path in sorted(done):
            output.log(f"skip {path} (all tasks in results.jsonl)")
        if self.executor.executor == "ray":
            from bema_cli.eval.ray_pool import run_pool

            run_pool(self, jobs, self.executor)  # calls run_job on its engines, self.write here
            jobs = []  # all done: the local loop below has nothing left
        backend = None
        try:
            with output.countdown(sum(len(job.tasks) for job in jobs), "evaluations"):
                for job in jobs:
                    if backend is None:  # the engine starts on the first job's model
                        backend = self.start(lambda b, j=job: b.load(j.target.path), job.target.path)
                    for records, samples in run_job(backend, job):
                        self.write(records, samples)
            if self.engine.verify_swap and backend is not None and hasattr(backend, "verify_swaps"):
                backend.verify_swaps()
        finally:
            if backend is not None:
                backend.close()
        keys = {
            (self.config.name(t.path), r, n) for t in targets for r, _ in t.record_runs() for n in self.inputs
        }
        return [r for r in self.results.records if (r["model_path"], r["run"], r["task"]) in keys]


def run_eval(
    inputs: list[str],
    base: str | None,
    config: EvalConfig,
    engine: EngineOptions,
    executor: ExecutorOptions | None = None,
    validated=None,
) -> list[dict]:
    """Evaluate every input (and the base); returns the records of all requested (checkpoint, task).
    `validated()` is called once the inputs and flags are checked, before any library loads."""
    validate(config, engine)
    if executor is not None and executor.executor == "ray":
        import_ray()  # a missing extra is reported before anything is read
    targets = expand_inputs(inputs)
    if base is not None:
        targets.insert(0, base_target(base, targets))
    if not targets:
        raise UsageError("no checkpoints to evaluate (give model folders and/or --base)")
    for target in targets:  # before any data is downloaded or OUT is created
        check_model_dir(target.path)
    if config.out is not None:
        check_out(Path(config.out).expanduser(), targets)
    # one writer of OUT at a time (results, samples, libraries.log): taken before anything lands there
    with nullcontext() if config.out is None else locked(Path(config.out).expanduser()):
        if validated is not None:
            validated()  # the CLI: the libraries' own stderr output goes to OUT/libraries.log from here on
        return Evaluation(config, engine, executor).run(targets)


def eval_document(*run_eval_args, **run_eval_kwargs) -> dict:
    """`run_eval(...)` measured, as `bema eval --json` prints it: the records (as results.jsonl holds
    them) and where the run's time and memory went, the same fields as sweep's document: `stages`
    (engine_start, swap, generate, loss, lm_eval: seconds, bytes, GB/s), `seconds`, and `memory`
    (peak RSS of bema and of the engine's own processes, vLLM's engine core runs apart)."""
    t0 = time.perf_counter()
    stages.reset()
    return_freed_memory()
    with PeakRss() as peak:
        records = run_eval(*run_eval_args, **run_eval_kwargs)
    measured = stages.report()
    used = {r.get("backend") for r in records} - {None}
    if len(used) == 1:  # this machine's floors for the next projection, under the backend that ran
        timings.save(used.pop(), measured)
    return {
        "bema_version": __version__,
        "records": records,
        "seconds": time.perf_counter() - t0,
        "stages": measured,
        "memory": peak.parts(),
    }
