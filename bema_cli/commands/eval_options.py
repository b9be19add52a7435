"""The flags `bema eval` and `bema sweep` share (the protocol and the engine), declared once."""

from __future__ import annotations

from bema_cli.options import option

_T = "Protocol (defaults = the paper's)"
_E = "Engine"
DEFAULT_OUT = "results"  # `bema report results/` reads it back

TasksOpt = option(
    str,
    "--tasks",
    help="Comma list of boolq,gsm8k,mmlu_hs,loss,train_loss, then lm_eval:<task>[,<task>...] (lm-evaluation-harness tasks or groups); `list` prints them.",
)
OutOpt = option(
    str | None,
    "--out",
    "-o",
    help=f"Directory for results.jsonl (and samples.jsonl); default ./{DEFAULT_OUT}, said up front.",
)
BaseOpt = option(str | None, "--base", help="Base model, evaluated once as step 0 of every run.")
DataDirOpt = option(str | None, "--data-dir", help="Local <task>.jsonl|parquet files instead of the Hub.")
LossDataOpt = option(str | None, "--loss-data", help="Held-out jsonl ({messages} or {text}); adds task loss.")
LossTrainDataOpt = option(str | None, "--loss-train-data", help="Train jsonl; adds task train_loss.")
LossSamplesOpt = option(int, "--loss-samples", help="First N loss records.", rich_help_panel=_T)
LossMaxTokensOpt = option(
    int, "--loss-max-tokens", help="Truncate loss records to N tokens.", rich_help_panel=_T
)
NSamplesOpt = option(int, "--n-samples", help="Samples per prompt.", rich_help_panel=_T)
TemperatureOpt = option(float, "--temperature", help="Sampling temperature (0 = greedy).", rich_help_panel=_T)
SeedOpt = option(int, "--seed", help="Sampling seed.", rich_help_panel=_T)
MaxNewTokensOpt = option(
    int | None, "--max-new-tokens", help="Default: 256 boolq/mmlu_hs, 512 gsm8k.", rich_help_panel=_T
)
SelectionSeedOpt = option(int, "--selection-seed", help="Seed of the prompt subset.", rich_help_panel=_T)
LimitOpt = option(
    int | None,
    "--limit",
    help="Prompts per task (per subject for mmlu_hs); default 64/128/64.",
    rich_help_panel=_T,
)
NumFewshotOpt = option(
    int,
    "--num-fewshot",
    help="Few-shot examples per prompt from the train split (the paper's text: 5 for BoolQ); default 0, as the authors' code.",
    rich_help_panel=_T,
)
CotOpt = option(
    bool,
    "--cot",
    help="Ask BoolQ and MMLU-HS for step-by-step reasoning (GSM8K always asks).",
    rich_help_panel=_T,
)
LmEvalIncludeOpt = option(
    str | None,
    "--lm-eval-include",
    help="Folder of local lm-eval task YAMLs for lm_eval:<task>.",
    rich_help_panel=_T,
)
ChatTemplateOpt = option(
    str | None, "--chat-template", help="Jinja chat template file overriding the model's.", rich_help_panel=_T
)
BackendOpt = option(
    str,
    "--backend",
    help="auto (vllm if usable, else transformers), vllm or transformers.",
    rich_help_panel=_E,
)
DtypeOpt = option(str, "--dtype", help="auto, float32, bfloat16 or float16.", rich_help_panel=_E)
TensorParallelSizeOpt = option(int, "--tensor-parallel-size", rich_help_panel=_E)
DataParallelSizeOpt = option(int, "--data-parallel-size", rich_help_panel=_E)
GpuMemoryUtilizationOpt = option(float, "--gpu-memory-utilization", rich_help_panel=_E)
MaxModelLenOpt = option(
    int | None, "--max-model-len", help="Default: min(2048, the model's max positions).", rich_help_panel=_E
)
EnforceEagerOpt = option(
    bool, "--enforce-eager", help="No CUDA graphs (always on for CPU).", rich_help_panel=_E
)
BatchSizeOpt = option(
    int,
    "--batch-size",
    help="Prompts per transformers generate call (a prompt's samples do not depend on it).",
    rich_help_panel=_E,
)
VerifySwapOpt = option(
    bool,
    "--verify-swap",
    help="vLLM: check each swapped checkpoint's probe logprobs against a fresh engine on it.",
    rich_help_panel=_E,
)
LogSamplesOpt = option(
    bool, "--log-samples", help="Write every prompt, response, answer and gold to samples.jsonl."
)
ForceOpt = option(
    bool,
    "--force",
    help="Re-evaluate (checkpoint, task) pairs already in results.jsonl, replacing their records (also when made with another setup).",
)


def eval_settings(
    ev,
    eng,
    tasks: str,
    out: str | None,
    log_samples: bool = False,
    force: bool = False,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    enforce_eager: bool = False,
    verify_swap: bool = False,
):
    """(EvalConfig, EngineOptions) from a command's settings (`ev`: flags.EvalFlags, `eng`:
    flags.EngineFlags) and the flags some commands alone take."""
    from dataclasses import fields
    from pathlib import Path

    from bema_cli import output
    from bema_cli.eval.backends.base import EngineOptions
    from bema_cli.eval.chat import read_template
    from bema_cli.eval.job import EvalConfig
    from bema_cli.eval.tasks import parse_tasks

    names = parse_tasks(tasks)
    for path, name in ((ev.loss_data, "loss"), (ev.loss_train_data, "train_loss")):
        if path is not None and name not in names:
            names.append(name)
    # EvalFlags' fields are EvalConfig's, by name (its --chat-template reaches the engine as text too)
    given = {f.name: getattr(ev, f.name) for f in fields(ev) if f.name != "chat_template"}
    config = EvalConfig(
        tasks=names,
        out=out,
        backend=eng.backend,
        log_samples=log_samples,
        force=force,
        chat_template_file=ev.chat_template,
        **given,
    )
    engine = EngineOptions(
        dtype=eng.dtype,
        tensor_parallel_size=tensor_parallel_size,
        data_parallel_size=data_parallel_size,
        gpu_memory_utilization=eng.gpu_memory_utilization,
        max_model_len=eng.max_model_len,
        enforce_eager=enforce_eager,
        batch_size=eng.batch_size,
        chat_template=read_template(ev.chat_template) if ev.chat_template else None,
        log_file=str(Path(out) / "vllm.log") if out else None,
        debug=output.debug(),
        verify_swap=verify_swap,
    )
    return config, engine
