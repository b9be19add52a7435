"""`bema eval` and `bema rescore`: thin wrappers over bema_cli.eval.evaluate."""

from __future__ import annotations

from typing import Annotated

import typer

from bema_cli import output
from bema_cli.options import ExecutorOpt, JsonOpt, RayAddressOpt, WorkersOpt

_T = "Protocol (defaults = the paper's)"
_E = "Engine"


DEFAULT_OUT = "results"  # `bema report results/` reads it back


def evaluate(
    inputs: Annotated[
        list[str] | None, typer.Argument(help="Checkpoint folders, bema stabilize outputs or OUT dirs.")
    ] = None,
    tasks: Annotated[
        str,
        typer.Option(
            "--tasks",
            help="Comma list of boolq,gsm8k,mmlu_hs,loss,train_loss, then lm_eval:<task>[,<task>...] (lm-evaluation-harness tasks or groups).",
        ),
    ] = "boolq,gsm8k,mmlu_hs",
    out: Annotated[
        str | None,
        typer.Option(
            "--out",
            "-o",
            help=f"Directory for results.jsonl (and samples.jsonl); default ./{DEFAULT_OUT}, said up front.",
        ),
    ] = None,
    base: Annotated[
        str | None, typer.Option("--base", help="Base model, evaluated once as step 0 of every run.")
    ] = None,
    data_dir: Annotated[
        str | None, typer.Option("--data-dir", help="Local <task>.jsonl|parquet files instead of the Hub.")
    ] = None,
    loss_data: Annotated[
        str | None, typer.Option("--loss-data", help="Held-out jsonl ({messages} or {text}); adds task loss.")
    ] = None,
    loss_train_data: Annotated[
        str | None, typer.Option("--loss-train-data", help="Train jsonl; adds task train_loss.")
    ] = None,
    loss_samples: Annotated[
        int, typer.Option("--loss-samples", help="First N loss records.", rich_help_panel=_T)
    ] = 200,
    loss_max_tokens: Annotated[
        int, typer.Option("--loss-max-tokens", help="Truncate loss records to N tokens.", rich_help_panel=_T)
    ] = 1024,
    n_samples: Annotated[
        int, typer.Option("--n-samples", help="Samples per prompt.", rich_help_panel=_T)
    ] = 50,
    temperature: Annotated[
        float, typer.Option("--temperature", help="Sampling temperature (0 = greedy).", rich_help_panel=_T)
    ] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="Sampling seed.", rich_help_panel=_T)] = 13337,
    max_new_tokens: Annotated[
        int | None,
        typer.Option("--max-new-tokens", help="Default: 256 boolq/mmlu_hs, 512 gsm8k.", rich_help_panel=_T),
    ] = None,
    selection_seed: Annotated[
        int, typer.Option("--selection-seed", help="Seed of the prompt subset.", rich_help_panel=_T)
    ] = 37371,
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit",
            help="Prompts per task (per subject for mmlu_hs); default 64/128/64.",
            rich_help_panel=_T,
        ),
    ] = None,
    num_fewshot: Annotated[
        int,
        typer.Option(
            "--num-fewshot",
            help="Few-shot examples per prompt from the train split (the paper's text: 5 for BoolQ); default 0, as the authors' code.",
            rich_help_panel=_T,
        ),
    ] = 0,
    cot: Annotated[
        bool,
        typer.Option(
            "--cot",
            help="Ask BoolQ and MMLU-HS for step-by-step reasoning (GSM8K always asks).",
            rich_help_panel=_T,
        ),
    ] = False,
    lm_eval_include: Annotated[
        str | None,
        typer.Option(
            "--lm-eval-include",
            help="Folder of local lm-eval task YAMLs for lm_eval:<task>.",
            rich_help_panel=_T,
        ),
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(
            "--chat-template", help="Jinja chat template file overriding the model's.", rich_help_panel=_T
        ),
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            help="auto (vllm if usable, else transformers), vllm or transformers.",
            rich_help_panel=_E,
        ),
    ] = "auto",
    dtype: Annotated[
        str, typer.Option("--dtype", help="auto, float32, bfloat16 or float16.", rich_help_panel=_E)
    ] = "auto",
    tensor_parallel_size: Annotated[int, typer.Option("--tensor-parallel-size", rich_help_panel=_E)] = 1,
    data_parallel_size: Annotated[int, typer.Option("--data-parallel-size", rich_help_panel=_E)] = 1,
    gpu_memory_utilization: Annotated[
        float, typer.Option("--gpu-memory-utilization", rich_help_panel=_E)
    ] = 0.7,
    max_model_len: Annotated[
        int | None,
        typer.Option(
            "--max-model-len", help="Default: min(2048, the model's max positions).", rich_help_panel=_E
        ),
    ] = None,
    enforce_eager: Annotated[
        bool, typer.Option("--enforce-eager", help="No CUDA graphs (always on for CPU).", rich_help_panel=_E)
    ] = False,
    batch_size: Annotated[
        int,
        typer.Option(
            "--batch-size",
            help="Prompts per transformers generate call (changes its samples).",
            rich_help_panel=_E,
        ),
    ] = 8,
    verify_swap: Annotated[
        bool,
        typer.Option(
            "--verify-swap",
            help="vLLM: check each swapped checkpoint's probe logprobs against a fresh engine on it.",
            rich_help_panel=_E,
        ),
    ] = False,
    log_samples: Annotated[
        bool,
        typer.Option("--log-samples", help="Write every prompt, response, answer and gold to samples.jsonl."),
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Re-evaluate (checkpoint, task) pairs already in results.jsonl, replacing their records (also when made with another setup).",
        ),
    ] = False,
    executor: ExecutorOpt = "local",
    workers: WorkersOpt = 1,
    ray_address: RayAddressOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Evaluate checkpoints with the paper's protocol: BoolQ, GSM8K, MMLU-HS (50 samples/prompt) and held-out loss."""
    from pathlib import Path

    from bema_cli import cli  # the global --debug flag
    from bema_cli.cluster import ExecutorOptions
    from bema_cli.eval.backends.base import EngineOptions
    from bema_cli.eval.chat import read_template
    from bema_cli.eval.evaluate import LIBRARY_LOG, EvalConfig, run_eval
    from bema_cli.eval.results import records_table
    from bema_cli.eval.tasks import parse_tasks

    if out is None:  # ten minutes of evaluation must never end in nothing kept
        out = DEFAULT_OUT
        output.log(f"results go to ./{DEFAULT_OUT}/ (the default; --out DIR chooses)")
    names = parse_tasks(tasks)
    for path, name in ((loss_data, "loss"), (loss_train_data, "train_loss")):
        if path is not None and name not in names:
            names.append(name)
    config = EvalConfig(
        tasks=names, out=out, data_dir=data_dir, loss_data=loss_data, loss_train_data=loss_train_data,
        loss_samples=loss_samples, loss_max_tokens=loss_max_tokens, n_samples=n_samples, temperature=temperature,
        seed=seed, max_new_tokens=max_new_tokens, selection_seed=selection_seed, limit=limit, backend=backend,
        log_samples=log_samples, force=force, chat_template_file=chat_template, num_fewshot=num_fewshot, cot=cot,
        lm_eval_include=lm_eval_include,
    )  # fmt: skip
    engine = EngineOptions(
        dtype=dtype, tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, enforce_eager=enforce_eager,
        batch_size=batch_size, chat_template=read_template(chat_template) if chat_template else None,
        log_file=str(Path(out) / "vllm.log") if out else None, debug=cli._debug, verify_swap=verify_swap,
    )  # fmt: skip
    records = run_eval(
        inputs or [], base, config, engine, ExecutorOptions(executor, workers, ray_address),
        validated=lambda: output.send_library_output(Path(out) / LIBRARY_LOG),
    )  # fmt: skip
    if json_:
        output.print_json(records)
    else:
        output.print_table(records_table(records))


def rescore(
    samples: Annotated[str, typer.Argument(help="samples.jsonl written by bema eval --log-samples.")],
    results: Annotated[
        str | None,
        typer.Option(
            "--results", help="results.jsonl with the records' provenance (default: next to SAMPLES)."
        ),
    ] = None,
    out: Annotated[
        str | None, typer.Option("--out", "-o", help="Write the new records to this jsonl file.")
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Recompute the scores of logged samples with the current answer-extraction rules (no generation)."""
    from pathlib import Path

    from bema_cli.eval.evaluate import rescore as rescore_samples
    from bema_cli.eval.results import records_table, write_jsonl_atomic

    records = rescore_samples(samples, results)
    if out is not None:
        write_jsonl_atomic(Path(out), records)
        output.log(f"wrote {len(records)} records to {out}")
    if json_:
        output.print_json(records)
    else:
        output.print_table(records_table(records, title="bema rescore"))
