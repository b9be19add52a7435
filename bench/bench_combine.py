"""Benchmark the sum every fitted candidate costs a swap (and ship's writer): `fit.combined`, the
float64 sum of c_j theta_j over bf16 checkpoints cast once, against the plain way (each tensor whole:
safetensors' load_file, .double(), a fresh float64 sum) and against reading the terms' bytes alone.

    .venv/bin/python bench/bench_combine.py [--params 200] [--terms 4] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, INTER = 896, 4864  # the 0.5B shape's layer


def build(folder: Path, params_m: int, terms: int) -> list[Path]:
    import torch
    from safetensors.torch import save_file

    layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER
    shapes = {"embed": (32768, HIDDEN)} | {
        f"l{i}.{k}": s
        for i in range(max(1, (params_m * 10**6 - 32768 * HIDDEN) // layer))
        for k, s in (("qkvo", (4 * HIDDEN, HIDDEN)), ("up", (INTER, HIDDEN)), ("gate", (INTER, HIDDEN)),
                     ("down", (HIDDEN, INTER)), ("norm", (HIDDEN,)))
    }  # fmt: skip
    out = []
    for j in range(terms):
        f = folder / f"checkpoint-{j}"
        f.mkdir(parents=True)
        g = torch.Generator().manual_seed(j)
        save_file({k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()},
                  str(f / "model.safetensors"))  # fmt: skip
        (f / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        out.append(f)
    return out


def plain(terms: list[tuple[Path, float]]) -> dict:
    """Each tensor whole, as a plain implementation sums it: the same float64 sums, in the same order."""
    import torch
    from safetensors.torch import load_file

    loaded = [(load_file(str(f / "model.safetensors")), c) for f, c in terms]
    out = {}
    for name, like in loaded[-1][0].items():
        acc = torch.zeros(like.shape, dtype=torch.float64)
        for tensors, c in loaded:
            acc.add_(tensors[name].double(), alpha=c)
        out[name] = acc.to(like.dtype)
    return out


def read_floor(terms: list[tuple[Path, float]]) -> float:
    t = time.perf_counter()
    for f, _ in terms:
        with open(f / "model.safetensors", "rb") as fh:
            while fh.read(1 << 24):
                pass
    return time.perf_counter() - t


def main(argv=None) -> None:
    import torch

    from bema_cli.decide import fit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=200, help="millions of parameters per checkpoint")
    ap.add_argument("--terms", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folders = build(Path(tmp), a.params, a.terms)
        terms = [(f, 0.1 * (j + 1) - (0.3 if j == 0 else 0.0)) for j, f in enumerate(folders)]
        timed = {"combined": [], "plain": [], "read": []}
        for _ in range(a.repeats):  # interleaved: this VM drifts; the minimum of each (page cache warm)
            timed["read"].append(read_floor(terms))
            t = time.perf_counter()
            ours = {info.name: v for info, v in fit.combined(terms, folders[-1])}
            timed["combined"].append(time.perf_counter() - t)
            t = time.perf_counter()
            ref = plain(terms)
            timed["plain"].append(time.perf_counter() - t)
        same = all(torch.equal(ours[k].view(torch.int16), ref[k].view(torch.int16)) for k in ref)
        numel = sum(v.numel() for v in ref.values())
    best = {k: min(v) for k, v in timed.items()}
    rows = {
        "params": numel, "terms": a.terms, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "combined_s": round(best["combined"], 3), "plain_s": round(best["plain"], 3),
        "read_s": round(best["read"], 3), "combined_over_plain": round(best["combined"] / best["plain"], 2),
        "combined_over_read": round(best["combined"] / best["read"], 2), "bitwise_equal_to_plain": same,
    }  # fmt: skip
    text = (f"fit.combined, {numel / 1e6:.0f}M bf16 params x {a.terms} terms ({a.repeats} repeats, min): "
            f"{rows['combined_s']} s; plain whole-tensor sums {rows['plain_s']} s "
            f"(ratio {rows['combined_over_plain']}); reading the bytes {rows['read_s']} s "
            f"(ratio {rows['combined_over_read']}); bitwise equal: {same}")  # fmt: skip
    print(json.dumps(rows) if a.json else text)
    if not same:
        sys.exit("fit.combined differs from the plain float64 sums")


if __name__ == "__main__":
    main()
