"""Measure the predictor from the basis (#50.5): how well is a candidate's per-item paired difference
to vanilla predicted from the checkpoints' own per-item scores?

Every candidate is a vector c over (theta0, checkpoints). Its per-item loss is predicted by the same
combination of the checkpoints' per-item losses, sum_j c_j nll_ij (exact where the loss is linear in
the weights, as in bench_decide's simulated worlds, where rho is 1 by construction), and its paired
difference to vanilla by that minus vanilla's. This measures, on a real model (the tests' tiny Qwen2
and its two runs with a known answer, tests/ship_runs.py), the correlation rho between the predicted
and the actual per-item differences, over the held-out items, for each menu candidate at the last
step. A control variate with correlation rho cuts an interval's variance by 1 - rho^2.

    .venv/bin/python bench/bench_predictor.py [--items 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def per_item_nll(model, tok, texts: list[str]) -> np.ndarray:
    """Each held-out text's summed next-token NLL (float64 sum of float32 log-probs)."""
    import torch

    out = []
    with torch.no_grad():
        for text in texts:
            ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
            logits = model(ids).logits[0, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
            out.append(-float(logp.double().sum()))
    return np.array(out)


def measure(run: Path, base: Path, data: Path, work: Path) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bema_cli.decide import candidate
    from bema_cli.decide.request import DEFAULT_GRID
    from bema_cli.stabilize import Options, grid
    from bema_cli.sweep.walk import plan_sweep

    opts = Options(checkpoint_dir=str(run), schedules=grid(**DEFAULT_GRID), out=None, base=str(base))
    plan = plan_sweep(opts)
    steps = [c.step for c in plan.checkpoints]
    menu = candidate.menu(plan, steps[-1])
    folders = {"theta0": base, **{str(s): run / f"checkpoint-{s}" for s in steps}}
    weights = {k: load_file(str(f / "model.safetensors")) for k, f in folders.items()}
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    texts = [
        tok.apply_chat_template(json.loads(x)["messages"], tokenize=False)
        for x in data.read_text().splitlines()
    ]

    def nll_of(vector: dict) -> np.ndarray:
        state = {
            name: sum(c * weights[k][name].double() for k, c in vector.items()).to(t.dtype)
            for name, t in weights["theta0"].items()
        }
        model.load_state_dict(state, strict=False)
        return per_item_nll(model, tok, texts)

    basis = {k: nll_of({k: 1.0}) for k in folders}
    vanilla = basis[str(steps[-1])]
    rows = {}
    for name, cand in menu.items():
        if name == "vanilla":
            continue
        actual = nll_of(cand.record) - vanilla
        predicted = sum(c * basis[k] for k, c in cand.record.items()) - vanilla
        rows[name] = {"rho": float(np.corrcoef(predicted, actual)[0, 1]),
                      "mean_actual": float(actual.mean()), "mean_predicted": float(predicted.mean())}  # fmt: skip
    return rows


def main(argv=None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from ship_runs import drift_run, heldout, noisy_run, optimum

    from bema_cli.demo.tinymodel import make_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = make_tiny_model(root / "base", seed=0)
        data = heldout(root / "heldout.jsonl", n=a.items)
        star = optimum(base, data, root / "star")
        result = {
            "noisy": measure(noisy_run(base, star, root / "noisy"), base, data, root / "w1"),
            "drift": measure(drift_run(base, star, root / "drift"), base, data, root / "w2"),
        }
    lines = [f"predictor from the basis: rho of predicted vs actual per-item differences to vanilla, "
             f"{a.items} held-out items, tiny Qwen2, {time.perf_counter() - t:.0f} s"]  # fmt: skip
    for world, rows in result.items():
        for name, r in rows.items():
            lines.append(f"{world:6s} {name:22s} rho {r['rho']:+.3f}  mean diff actual {r['mean_actual']:+.4f}"
                         f"  predicted {r['mean_predicted']:+.4f}")  # fmt: skip
        rhos = [r["rho"] for r in rows.values()]
        lines.append(f"{world:6s} median rho {np.median(rhos):+.3f} (variance left by a control variate: "
                     f"{1 - np.median(rhos) ** 2:.2f})")  # fmt: skip
    print("\n".join(lines), file=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
