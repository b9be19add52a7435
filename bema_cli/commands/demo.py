"""`bema demo`: train a small model here, then stabilize, evaluate and report it (bema_cli/demo.py)."""

from __future__ import annotations

from bema_cli import output
from bema_cli.demo.pins import pin_instruction_set
from bema_cli.options import JsonOpt, OverwriteOpt, option


def demo(
    out: option(str, "--out", "-o", help="Output directory.") = "demo",
    quick: option(
        bool, "--quick", help="A tiny model and a few steps (about a minute): checks the pipeline."
    ) = False,
    backend: option(
        str,
        "--backend",
        help="bema eval backend: auto (vllm if usable, else transformers), vllm or transformers.",
    ) = "auto",
    overwrite: OverwriteOpt = False,
    keep_failed: option(
        bool,
        "--keep-failed",
        help="Also keep the unfinished stage's files when a stage fails or is interrupted (finished stages are always kept; rerun to continue).",
    ) = False,
    seed: option(
        int, "--seed", help="Seed of the data, the models' initialisation and the training order."
    ) = 0,
    json_out: JsonOpt = False,
) -> None:
    """Run the whole pipeline offline on a small model trained here: 4-11 minutes on 2 CPU cores.

    1. pretrain a small Qwen2 on generated text: the base model theta0 (OUT/base)
    2. fine-tune it with the HF Trainer, constant LR, a checkpoint every 10 steps (OUT/sft)
    3-7. run the real `bema stabilize`, `bema eval`, `bema report` and `bema ship` on it, printing
    each command. Ends with held-out loss and accuracy per step for every run, OUT/curves.png, and
    the model to ship in OUT/ship. Training is pinned (2 threads, deterministic kernels, CPU-independent
    code paths) so a --seed repeats on other x86-64 machines.
    """
    pin_instruction_set()
    from bema_cli.demo.pipeline import run_demo
    from bema_cli.demo.summary import print_summary

    summary = run_demo(
        out, quick=quick, backend=backend, overwrite=overwrite, keep_failed=keep_failed, seed=seed
    )
    if json_out:
        output.print_json(summary)
    else:
        from pathlib import Path

        print_summary(summary, Path(out))
        output.log(
            f"done in {summary['total_seconds']:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in summary['seconds'].items())})"
        )
