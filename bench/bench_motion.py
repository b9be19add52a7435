"""Does the motion measure tell "averaging can help" from "nothing will beat vanilla"?

Two fine-tunes of the demo's base model on the demo's data, the same seed and steps: the demo's own
(constant learning rate: the paper's regime) and one whose learning rate decays linearly to zero.
For each: `bema stabilize --json` (the motion of every step, the last window's verdict), then
`bema ship` on held-out loss (what the decision says). Uses an existing demo folder (`bema demo`
first: its data, base and constant-rate run), trains the decayed run beside it (~1.5 min).

    .venv/bin/python bench/bench_motion.py DEMO_DIR [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

BEMA = Path(sys.executable).with_name("bema")


def bema(*args) -> dict:
    r = subprocess.run([str(BEMA), *map(str, args), "--json"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bema {args[0]} failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout)


def decayed_run(demo: Path, out: Path) -> Path:
    """The demo's fine-tune again, its learning rate decaying linearly to zero."""
    if (out / "sft" / "checkpoint-1000").is_dir():
        return out / "sft"
    from bema_cli.demo.pins import pin_instruction_set

    pin_instruction_set()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bema_cli.demo import training
    from bema_cli.demo.pipeline import DemoConfig
    from bema_cli.eval.results import read_jsonl

    cfg = DemoConfig()
    tokenizer = AutoTokenizer.from_pretrained(demo / "base")
    model = AutoModelForCausalLM.from_pretrained(demo / "base")
    examples = training.encode_chat(
        tokenizer, [r["messages"] for r in read_jsonl(demo / "data" / "train.jsonl")]
    )
    training.train(model, tokenizer, examples, out / "sft", steps=cfg.steps, batch_size=cfg.batch, lr=cfg.lr,
                   scheduler="linear", save_every=cfg.save_every, seed=cfg.seed, description="fine-tune, decaying")  # fmt: skip
    return out / "sft"


def measure(name: str, run: Path, demo: Path, work: Path) -> dict:
    stab = bema(
        "stabilize",
        run,
        "--base",
        demo / "base",
        "--out",
        work / f"{name}-motion",
        "--method",
        "ema",
        "--final-only",
        "--overwrite",
    )  # fmt: skip (an EMA reads every step: the whole run's motion)
    ship = bema("ship", run, "--base", demo / "base", "--out", work / f"{name}-ship", "--tasks", "loss",
                "--loss-data", demo / "data" / "heldout.jsonl", "--loss-samples", "288", "--holdout", "0.5",
                "--backend", "transformers", "--overwrite")  # fmt: skip
    motion = {r["step"]: r["relative"] for r in stab["motion"]}
    return {"run": name, "verdict": stab["motion_verdict"], "motion_at": {s: motion.get(s) for s in (100, 500, 900, 1000)},
            "shipped": ship["decision"]["run"], "ship_verdict": ship["verdict"]}  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("demo", type=Path)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    work = a.demo / "motion-bench"
    rows = [measure("constant", a.demo / "sft", a.demo, work),
            measure("decayed", decayed_run(a.demo, work / "decayed"), a.demo, work)]  # fmt: skip
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        v = r["verdict"]
        print(f"{r['run']:>9}: last 8 steps move {v['last_window']:.2e} of the weights' norm a step, "
              f"{v['share']:.1%} of the run's moving phase (barely moves: {v['barely_moves']}); ship: {r['shipped']}")  # fmt: skip
        print(f"           {r['ship_verdict']}")


if __name__ == "__main__":
    main()
