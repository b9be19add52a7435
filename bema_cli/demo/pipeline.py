"""`bema demo`: the whole pipeline, offline, on a small model trained here.

    1. data       generated tasks in the `bema eval --data-dir` schemas + a held-out loss split
    2. base       BPE tokenizer + small Qwen2, pretrained on generated text      -> OUT/base   (theta0)
    3. finetune   HF Trainer, constant LR, small batch, checkpoint-<s> every k  -> OUT/sft
    4. stabilize  `bema stabilize` (EMA, BEMA at two etas, LAWA and WSM windows)  -> OUT/stabilized
    5. eval       `bema eval` of vanilla/EMA/BEMA on loss + the three tasks      -> OUT/results
    6. report     `bema report --plot`, then the summary      -> OUT/curves.png, OUT/summary.{json,png}

Steps 4-6 run the real CLI in subprocesses and print each command line, so the demo shows
exactly what a user would type. Steps 2-3 use the library in-process.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bema_cli import output
from bema_cli.demo import world
from bema_cli.demo.pins import PINS, subprocess_env
from bema_cli.demo.summary import plot_summary, summarize
from bema_cli.errors import BemaError, OutputError
from bema_cli.eval.results import read_jsonl, write_jsonl_atomic
from bema_cli.machine import environment

MARKER = ".bema-demo"  # marks a folder as a demo output, so --overwrite may replace it
TASKS = ("gsm8k", "boolq", "mmlu_hs")


@dataclass(frozen=True)
class DemoConfig:
    """Sizes and hyperparameters. Defaults fit well within 10 minutes on 2 CPU cores (138 s measured idle, 2-3x that under load)."""

    # model: head_dim = hidden/heads = 32, which vLLM's CPU attention supports (16 is not)
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    intermediate: int = 384
    vocab: int = 768
    # pretraining: a cosine schedule and a large batch; it only has to give a decent theta0
    pretrain_docs: int = 8000
    pretrain_steps: int = 500
    pretrain_batch: int = 32
    pretrain_lr: float = 3e-3
    # fine-tuning the paper's way: constant LR, no decay, a small batch -> a noisy trajectory
    train_per_task: int = 3000
    test_per_task: int = 96  # eval prompts are drawn from these; also the held-out loss records
    steps: int = 1000
    batch: int = 8
    lr: float = 2e-3
    save_every: int = 10  # every checkpoint is one EMA/BEMA update
    eval_every: int = 100  # the steps that are evaluated (and written by stabilize)
    # evaluation: far smaller than the paper's 50 samples x 64-128 prompts, to fit the time
    eval_prompts: int = 48  # --limit (per subject for mmlu_hs, which has two here)
    n_samples: int = 4
    max_new_tokens: int = 24
    etas: tuple[float, ...] = (0.2, 0.5)  # default eta and one stronger-decaying correction
    window: int = 8  # LAWA and WSM (minus-sqrt) merge the last 8 checkpoints (80 steps) beside them
    seed: int = 0


QUICK = replace(
    DemoConfig(),
    hidden=64, layers=2, heads=2, intermediate=128, vocab=512,
    pretrain_docs=800, pretrain_steps=30, pretrain_batch=16,
    train_per_task=200, test_per_task=16, steps=40, batch=4, save_every=10, eval_every=20,
    eval_prompts=4, n_samples=2, max_new_tokens=12,
)  # fmt: skip


# -- stages -----------------------------------------------------------------------------------
def write_data(out: Path, cfg: DemoConfig) -> dict:
    """Task files (eval prompts), the held-out loss file and the SFT conversations."""
    data = out / "data"
    train, heldout = [], []
    for task in TASKS:
        tr, te = world.split_items(task, cfg.train_per_task, cfg.test_per_task, cfg.seed)
        write_jsonl_atomic(data / f"{task}.jsonl", te)
        train += [{"messages": world.chat(task, r)} for r in tr]
        heldout += [{"messages": world.chat(task, r)} for r in te]
    random.Random(cfg.seed).shuffle(train)
    random.Random(cfg.seed + 1).shuffle(heldout)  # every task in any prefix `--loss-samples` takes
    write_jsonl_atomic(data / "train.jsonl", train)
    write_jsonl_atomic(data / "heldout.jsonl", heldout)
    output.log(f"  {len(train)} training conversations, {len(heldout)} held-out, tasks {', '.join(TASKS)}")
    return {"dir": data, "train": train, "heldout": data / "heldout.jsonl"}


def build_base(out: Path, cfg: DemoConfig, train: list[dict]) -> Path:
    """Tokenizer trained on the corpus, a random Qwen2, pretrained on generated prose -> theta0."""
    import torch

    from bema_cli.demo import tinymodel, training

    torch.manual_seed(cfg.seed)
    docs = world.pretrain_documents(cfg.pretrain_docs, cfg.seed)
    chat_text = [m["content"] for r in train[: len(docs) // 4] for m in r["messages"]]
    tokenizer = tinymodel.build_tokenizer(docs + chat_text, vocab_size=cfg.vocab)
    model = tinymodel.build_model(
        tokenizer, hidden_size=cfg.hidden, num_layers=cfg.layers, num_heads=cfg.heads,
        intermediate_size=cfg.intermediate, seed=cfg.seed,
    )  # fmt: skip
    n_params = sum(p.numel() for p in model.parameters())
    output.log(
        f"  Qwen2 {cfg.layers} layers x {cfg.hidden} hidden, {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}"
    )
    training.train(
        model, tokenizer, training.encode_text(tokenizer, docs), out / "pretrain-tmp",
        steps=cfg.pretrain_steps, batch_size=cfg.pretrain_batch, lr=cfg.pretrain_lr,
        scheduler="cosine", warmup_steps=max(1, cfg.pretrain_steps // 20), save_every=None,
        seed=cfg.seed, description="pretrain",
    )  # fmt: skip
    shutil.rmtree(out / "pretrain-tmp", ignore_errors=True)
    return tinymodel.save_model(model, tokenizer, out / "base")


def finetune(out: Path, cfg: DemoConfig, base: Path, train: list[dict]) -> Path:
    """SFT from theta0 with the HF Trainer: constant LR, batch `cfg.batch`, checkpoint-<s> every k steps."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bema_cli.demo import training

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    examples = training.encode_chat(tokenizer, [r["messages"] for r in train])
    training.train(
        model, tokenizer, examples, out / "sft", steps=cfg.steps, batch_size=cfg.batch, lr=cfg.lr,
        scheduler="constant", save_every=cfg.save_every, seed=cfg.seed, description="fine-tune",
    )  # fmt: skip
    return out / "sft"


def bema_cli(args: list[str], display: str | None = None) -> None:
    """Run `bema ARGS` as a real subprocess of this Python, showing the command first."""
    output.stderr.print(f"$ bema {display or shlex.join(args)}", style="bold", highlight=False, markup=False)
    env = subprocess_env(
        {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    )
    env.setdefault("HF_HUB_OFFLINE", "1")  # everything the demo needs is local
    # the child's tables are the demo's log: its stdout joins our stderr, keeping stdout for the summary
    proc = subprocess.run([sys.executable, "-m", "bema_cli.cli", *args], env=env, stdout=sys.stderr)
    if proc.returncode != 0:
        raise BemaError(f"`bema {args[0]}` failed with exit code {proc.returncode} (its message is above)")


def eval_steps(cfg: DemoConfig) -> list[int]:
    return list(range(cfg.eval_every, cfg.steps + 1, cfg.eval_every))


def stabilize_args(out: Path, cfg: DemoConfig) -> list[str]:
    return [
        "stabilize", str(out / "sft"), "--base", str(out / "base"), "--out", str(out / "stabilized"),
        "--method", "ema,bema,lawa,wsm", "--eta", ",".join(map(str, cfg.etas)),
        "--window", str(cfg.window), "--schedule", "minus-sqrt",
        "--steps", ",".join(map(str, eval_steps(cfg))),
    ]  # fmt: skip


def ship_args(out: Path, cfg: DemoConfig, backend: str) -> list[str]:
    """The one command a user runs: judge the menu in memory at the last step, pick on half of the
    held-out loss records and report on the other half, fit simplex weights (loss's default fit), write
    the model folder to ship (an average only if it beats vanilla beyond its interval)."""
    return [
        "ship", str(out / "sft"), "--base", str(out / "base"), "--out", str(out / "ship"), "--tasks", "loss",
        "--loss-data", str(out / "data" / "heldout.jsonl"), "--loss-samples", str(3 * cfg.test_per_task),
        "--holdout", "0.5", "--backend", backend, "--overwrite",
    ]  # fmt: skip


def eval_args(out: Path, cfg: DemoConfig, backend: str) -> list[str]:
    vanilla = [str(out / "sft" / f"checkpoint-{s}") for s in eval_steps(cfg)]
    return [
        "eval", *vanilla, str(out / "stabilized"), "--base", str(out / "base"),
        "--tasks", ",".join([*TASKS, "loss"]), "--data-dir", str(out / "data"),
        "--loss-data", str(out / "data" / "heldout.jsonl"), "--loss-samples", str(3 * cfg.test_per_task),
        "--limit", str(cfg.eval_prompts), "--n-samples", str(cfg.n_samples),
        "--max-new-tokens", str(cfg.max_new_tokens), "--backend", backend, "--out", str(out / "results"),
    ]  # fmt: skip


def _short(args: list[str], out: Path, cfg: DemoConfig) -> str:
    """The eval command as printed: the vanilla checkpoints as one (unquoted) shell brace list."""
    steps = eval_steps(cfg)
    first = args.index(str(out / "sft" / f"checkpoint-{steps[0]}"))
    brace = shlex.quote(str(out / "sft")) + "/checkpoint-{" + ",".join(map(str, steps)) + "}"
    return " ".join([shlex.join(args[:first]), brace, shlex.join(args[first + len(steps) :])])


# -- the pipeline -------------------------------------------------------------------------------
def prepare_out(out: Path, overwrite: bool, settings: dict) -> dict:
    """Refuse to touch a folder that is not ours. An earlier demo with the same settings is
    continued (its finished stages kept); other settings, or --overwrite, start over.
    Returns the marker document: {"settings", "done": [finished stages]}."""
    import json

    marker = out / MARKER
    settings = json.loads(output.to_json(settings))  # as stored (tuples are lists there)
    if out.exists() and any(out.iterdir()):
        if not marker.exists():
            raise OutputError(f"{out}: exists and is not a bema demo folder; choose another --out")
        doc = _read_marker(marker)
        if (
            not overwrite
            and doc.get("settings") != settings
            and _same_training(doc.get("settings"), settings)
        ):
            return _restart_after_training(out, doc, settings)
        if not overwrite and doc.get("settings") != settings:
            raise OutputError(
                f"{out}: a demo made with other settings (or by an older bema) is there; "
                "pass --overwrite to replace it, or choose another --out"
            )
        if not overwrite:
            if doc.get("done"):
                output.log(f"continuing the demo in {out}: {', '.join(doc['done'])} already done")
            return doc
        theirs = sorted(
            p.name for p in out.iterdir() if p.name not in DEMO_ENTRIES and not p.name.startswith(".bema")
        )
        if theirs:  # --overwrite replaces the demo, never what a user put beside it
            raise OutputError(
                f"{out}: holds {', '.join(theirs[:5])}{' ...' if len(theirs) > 5 else ''}, which the demo did not "
                "write; --overwrite replaces only a demo folder: move them out, or choose another --out"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"note": "created by `bema demo`; `bema demo --overwrite` may delete this folder",
           "settings": settings, "done": []}  # fmt: skip
    _write_marker(marker, doc)
    return doc


# The settings the data, base-model and fine-tuning stages depend on; the others (what is stabilized,
# evaluated, selected) only change stages that are rerun from the kept checkpoints.
TRAINING_FIELDS = (
    "hidden", "layers", "heads", "intermediate", "vocab", "pretrain_docs", "pretrain_steps", "pretrain_batch",
    "pretrain_lr", "train_per_task", "test_per_task", "steps", "batch", "lr", "save_every", "seed",
)  # fmt: skip
LATER_OUTPUTS = ("stabilized", "results", "ship", "curves.png", "summary.png", "summary.json")
# every top-level entry a demo writes (its ship's work and lock folders, `bema ship`'s, beside it)
DEMO_ENTRIES = {MARKER, "data", "base", "sft", "pretrain-tmp", *LATER_OUTPUTS, ".ship.bema-ship", ".ship.bema-lock"}  # fmt: skip


def _same_training(old: dict | None, new: dict) -> bool:
    if not isinstance(old, dict) or old.get("quick") != new.get("quick"):
        return False
    before, now = old.get("config") or {}, new["config"]
    return all(before.get(f) == now.get(f) for f in TRAINING_FIELDS)


def _restart_after_training(out: Path, doc: dict, settings: dict) -> dict:
    """An earlier demo trained with these settings but stabilized or evaluated otherwise (or with an
    older bema): keep its data, base model and fine-tuning run, redo everything after them."""
    for name in LATER_OUTPUTS:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    kept = [d for d in doc.get("done", []) if d in STAGE_FOLDERS]
    doc = {**doc, "settings": settings, "done": kept}
    _write_marker(out / MARKER, doc)
    output.log(
        f"continuing the demo in {out} with its {', '.join(kept) or 'nothing'}: its stabilize, eval and "
        "select settings changed (or an older bema made it), so those stages start over"
    )
    return doc


def _read_marker(marker: Path) -> dict:
    import json

    try:
        doc = json.loads(marker.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _write_marker(marker: Path, doc: dict) -> None:
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(output.to_json(doc) + "\n")
    os.replace(tmp, marker)


STAGE_FOLDERS = {
    "data": ("data",),
    "base": ("base", "pretrain-tmp"),
    "finetune": ("sft",),
}  # what each writes


def run_demo(
    out: str | Path,
    quick: bool = False,
    backend: str = "auto",
    overwrite: bool = False,
    keep_failed: bool = False,
    seed: int = 0,
) -> dict:
    """Run every stage not finished yet; returns the summary. An interrupted or failed run keeps the
    finished stages (a rerun continues from them); the unfinished stage's files are removed
    unless keep_failed. stabilize, eval and report continue by themselves (state, resume keys)."""
    out = Path(out)
    cfg = replace(QUICK if quick else DemoConfig(), seed=seed)
    marker = prepare_out(out, overwrite, {"config": asdict(cfg), "quick": quick})
    current: list[str] = []
    try:
        return _stages(out, cfg, backend, quick, marker, current)
    except BaseException:
        for name in current:  # the stage that was running: never half a model or half a run
            if not keep_failed:
                for folder in STAGE_FOLDERS.get(name, ()):
                    shutil.rmtree(out / folder, ignore_errors=True)
        output.warn(f"kept the finished stages in {out} ({', '.join(marker['done']) or 'none'}); "
                    "run the same command again to continue")  # fmt: skip
        raise


def _stages(out: Path, cfg: DemoConfig, backend: str, quick: bool, marker: dict, current: list[str]) -> dict:
    started = time.perf_counter()
    timings: dict[str, float] = {}

    def stage(name: str, title: str) -> bool:
        """Start stage `name`; False when an earlier run finished it (its outputs are there)."""
        from rich.text import Text

        timings[name] = time.perf_counter()
        if name in marker["done"] and name in STAGE_FOLDERS:
            output.stderr.rule(Text(f"{title} (done earlier)", style="bold"), align="left")
            return False
        for folder in STAGE_FOLDERS.get(name, ()):  # what an interrupted attempt left
            shutil.rmtree(out / folder, ignore_errors=True)
        output.stderr.rule(Text(title, style="bold"), align="left")
        current[:] = [name]
        return True

    def done(name: str) -> None:
        marker["done"] = [*marker["done"], name] if name not in marker["done"] else marker["done"]
        _write_marker(out / MARKER, marker)
        current.clear()

    if stage("data", "1/7 data: generated tasks in the `bema eval --data-dir` schemas"):
        write_data(out, cfg)
        done("data")
    train = read_jsonl(out / "data" / "train.jsonl")
    if stage("base", "2/7 base model: tokenizer + small Qwen2, pretrained on generated text"):
        build_base(out, cfg, train)
        done("base")
    title = f"3/7 fine-tune: HF Trainer, constant LR {cfg.lr}, batch {cfg.batch}, save every {cfg.save_every} steps"
    if stage("finetune", title):
        finetune(out, cfg, out / "base", train)
        done("finetune")
    stage("stabilize", "4/7 stabilize: EMA, BEMA, LAWA and WSM from the saved checkpoints")
    bema_cli(stabilize_args(out, cfg))
    done("stabilize")
    stage("eval", "5/7 eval: vanilla and every stabilized run on held-out loss and the three tasks")
    args = eval_args(out, cfg, backend)  # auto: vLLM when installed and usable, else transformers
    bema_cli(args, display=_short(args, out, cfg))
    done("eval")
    stage("report", "6/7 report: tables and curves")
    bema_cli(["report", str(out / "results"), "--plot", str(out / "curves.png")])
    done("report")
    stage(
        "ship",
        "7/7 ship: the model to ship, decided with intervals (menu, then fitted averages), with its card",
    )
    bema_cli(ship_args(out, cfg, backend))
    done("ship")
    ends = [*list(timings.values())[1:], time.perf_counter()]
    seconds = {name: round(end - start, 1) for (name, start), end in zip(timings.items(), ends, strict=True)}
    summary = summarize(read_jsonl(out / "results" / "results.jsonl"))
    from bema_cli.demo.training import TRAIN_THREADS

    pins = {k: os.environ.get(k) for k in PINS}  # set by `bema demo`
    summary.update(
        out=str(out), config=asdict(cfg), quick=quick, seconds=seconds,
        total_seconds=round(time.perf_counter() - started, 1),
        environment={**environment(), "pins": pins, "train_threads": TRAIN_THREADS},
    )  # fmt: skip
    plot_summary(summary, out / "summary.png")
    (out / "summary.json").write_text(output.to_json(summary) + "\n")
    return summary
