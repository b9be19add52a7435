"""Benchmark `--executor ray` (docs/scale-out.md): Ray's overhead and what 2 workers buy on this machine.

Stabilize, on bench_stabilize's synthetic trajectory (base + N checkpoints, one config, all
steps written): `--executor local` vs `--executor ray --workers 1` and `--workers 2`, both
against a Ray cluster started once by this script (as on SLURM: the cluster outlives one
command), plus one run that starts its own Ray in-process. Outputs of every Ray run are
checked bitwise against local's. Eval, with the real vLLM engine on CPU: one local engine
vs a pool of 2 engine actors (each 1 of the 2 cores) on >= 6 checkpoints of a tiny model.
Times are whole-process wall clock (best of --repeats), page cache warm at every run.

    .venv/bin/python bench/bench_ray.py [--quick] [--size-mb 250] [--eval-checkpoints 6] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import common_args, run_measured, set_cache, tensor_bytes  # noqa: E402
from synth import make_trajectory  # noqa: E402

BEMA = Path(sys.executable).with_name("bema")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as `make bench` and the tests run vLLM
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
TARGET_OVERHEAD = 1.3  # issue: `--executor ray --workers 1` within 1.3x of local


def log(msg: str) -> None:
    print(f"[bench-ray {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.rglob("*.safetensors")):
        h.update(str(p.relative_to(out)).encode() + tensor_bytes(p))
    return h.hexdigest()


def timed(name: str, cmd: list[str], env: dict, inputs: list[Path] | None = None) -> dict:
    if inputs:
        set_cache(inputs, "warm")
    run = run_measured(cmd, env=env)  # raises with the tool's stderr on failure
    doc = json.loads(run.stdout) if run.stdout.strip().startswith(("{", "[")) else {}
    log(f"{name}: {run.seconds:.2f} s")
    return {"wall": run.seconds, "doc": doc, "stderr": run.stderr}


def bench_stabilize(work: Path, args, env_cluster: dict, env_local: dict) -> dict:
    size = int(args.size_mb * 1e6)
    log(f"writing base + {args.checkpoints} checkpoints of {size / 1e6:.0f} MB")
    traj = make_trajectory(work / "traj", size, args.checkpoints)
    inputs = traj.input_files()
    out = work / "out"
    base = [str(BEMA), "stabilize", str(traj.run), "--base", str(traj.base), "--out", str(out)]
    base += ["--max-memory", args.max_memory, "--json"]
    plan = timed("dry run", [*base, "--dry-run"], env_local)["doc"]["plan"]
    variants = {  # name -> (extra flags, environment)
        "local": ([], env_local),
        "ray1": (["--executor", "ray", "--workers", "1"], env_cluster),
        "ray2": (["--executor", "ray", "--workers", "2"], env_cluster),
    }
    res: dict = {k: {"wall": [], "engine": []} for k in variants}
    res.update({"units": plan["work_units"], "read_bytes": 0, "bitwise": {}})
    for rep in range(args.repeats):
        for name, (flags, env) in variants.items():
            r = timed(f"stabilize {name} #{rep + 1}", [*base, *flags], env, inputs)
            res[name]["wall"].append(r["wall"])
            res[name]["engine"].append(r["doc"]["seconds"])
            res["read_bytes"], res["written_bytes"] = r["doc"]["read_bytes"], r["doc"]["written_bytes"]
            if rep == 0:
                res["bitwise"][name] = digest(out)
            shutil.rmtree(out)
    r = timed("stabilize ray1, Ray started in-process", [*base, "--executor", "ray"], env_local, inputs)
    res["ray1_inprocess"] = {"wall": [r["wall"]], "engine": [r["doc"]["seconds"]]}
    res["bitwise"]["ray1_inprocess"] = digest(out)
    shutil.rmtree(out)
    shutil.rmtree(work / "traj")
    return res


def eval_checkpoints(work: Path, n: int) -> tuple[Path, Path]:
    """A tiny Qwen2 base and n checkpoints: the base plus growing noise (outputs differ per step)."""
    import torch
    from safetensors.torch import load_file, save_file

    from bema_cli.demo.tinymodel import make_tiny_model

    base = make_tiny_model(work / "base", seed=0)
    state = load_file(base / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    run = work / "run"
    for i in range(1, n + 1):
        folder = run / f"checkpoint-{100 * i}"
        shutil.copytree(base, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        noisy = {
            k: v + 0.01 * i * v.std().nan_to_num() * torch.randn(v.shape, generator=g)
            for k, v in state.items()
        }
        save_file(noisy, folder / "model.safetensors", metadata={"format": "pt"})
    return base, run


def eval_data(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rows = {
        "boolq": [{"question": f"does the cat {i} run", "passage": f"the cat {i} runs.", "answer": i % 2 == 0}
                  for i in range(64)],
        "gsm8k": [{"question": f"what is {i} plus {i}", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}
                  for i in range(64)],
    }  # fmt: skip
    for name, items in rows.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    return root


def bench_eval(work: Path, args, env_cluster: dict, env_local: dict) -> dict:
    log(f"writing a tiny model and {args.eval_checkpoints} checkpoints")
    _, run = eval_checkpoints(work / "eval", args.eval_checkpoints)
    data = eval_data(work / "eval" / "data")
    cmd = [str(BEMA), "eval", str(run), "--backend", "vllm", "--dtype", "float32", "--data-dir", str(data)]
    cmd += ["--tasks", "gsm8k,boolq", "--limit", str(args.limit), "--n-samples", str(args.n_samples)]
    cmd += ["--max-new-tokens", "48", "--json"]
    res: dict = {"local": [], "ray2": [], "checkpoints": args.eval_checkpoints}
    metrics = {}
    for rep in range(args.eval_repeats):
        for name, flags, env in (
            ("local", [], env_local),
            ("ray2", ["--executor", "ray", "--workers", "2"], env_cluster),
        ):
            out = work / "eval" / f"out-{name}"
            r = timed(f"eval {name} #{rep + 1}", [*cmd, "--out", str(out), *flags], env)
            res[name].append(r["wall"])
            metrics[name] = sorted(
                (d["model_path"], d["task"], json.dumps(d["metrics"], sort_keys=True))
                for d in r["doc"]["records"]
            )
            shutil.rmtree(out)
    res["same_records"] = metrics["local"] == metrics["ray2"]
    return res


def rows(res: dict) -> list[tuple[str, str, str, str]]:
    out = []
    s = res.get("stabilize")
    if s:
        best = {k: min(s[k]["wall"]) for k in ("local", "ray1", "ray2", "ray1_inprocess")}
        eng = {k: min(s[k]["engine"]) for k in ("local", "ray1", "ray2", "ray1_inprocess")}
        r1 = best["ray1"] / best["local"]
        out.append(("stabilize --executor ray --workers 1 / local (wall, running cluster)",
                    f"{r1:.2f}  ({best['ray1']:.2f} s vs {best['local']:.2f} s)", f"<= {TARGET_OVERHEAD}",
                    "PASS" if r1 <= TARGET_OVERHEAD else "FAIL"))  # fmt: skip
        out.append(
            (
                "  same, engine time (--json seconds)",
                f"{eng['ray1'] / eng['local']:.2f}  ({eng['ray1']:.2f} s vs {eng['local']:.2f} s)",
                "",
                "",
            )
        )
        out.append(
            (
                "stabilize --workers 2 / local (wall)",
                f"{best['ray2'] / best['local']:.2f}  ({best['ray2']:.2f} s)",
                "report",
                "",
            )
        )
        out.append(("stabilize --workers 1, Ray started in-process / local (wall)",
                    f"{best['ray1_inprocess'] / best['local']:.2f}  ({best['ray1_inprocess']:.2f} s)", "report", ""))  # fmt: skip
        same = len(set(s["bitwise"].values())) == 1
        out.append(
            (
                "Ray outputs bitwise identical to local",
                "yes" if same else "NO",
                "yes",
                "PASS" if same else "FAIL",
            )
        )
        per_unit, moved = eng["local"] / s["units"], s["read_bytes"] + s["written_bytes"]
        out.append(("per-worker throughput, local ((read + written bytes) / engine s)",
                    f"{moved / eng['local'] / 1e9:.2f} GB/s  ({s['units']} units, {per_unit:.2f} s each)", "report", ""))  # fmt: skip
    e = res.get("eval")
    if e:
        speedup = min(e["local"]) / min(e["ray2"])
        out.append((f"eval, {e['checkpoints']} checkpoints: 1 local engine / 2 Ray engine actors (wall)",
                    f"{speedup:.2f}x  ({min(e['local']):.1f} s vs {min(e['ray2']):.1f} s)", "report", ""))  # fmt: skip
        out.append(("eval records (metrics) equal to local", "yes" if e["same_records"] else "NO", "yes",
                    "PASS" if e["same_records"] else "FAIL"))  # fmt: skip
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap, size_mb=250, checkpoints=10)
    ap.add_argument("--eval-checkpoints", type=int, default=6)
    ap.add_argument("--eval-repeats", type=int, default=1)
    ap.add_argument("--limit", type=int, default=16, help="prompts per task")
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument("--skip", choices=["stabilize", "eval"], action="append", default=[])
    args = ap.parse_args(argv)
    if args.quick:
        args.size_mb, args.checkpoints, args.repeats, args.max_memory = 8, 3, 1, "16MiB"
        args.eval_checkpoints, args.limit, args.n_samples = 2, 2, 1
    return args


def main(argv=None) -> None:
    import ray

    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bema-bench-ray-", dir=args.workdir))
    cpus = os.cpu_count() or 1
    res: dict = {
        "machine": {"cpus": cpus, "date": time.strftime("%Y-%m-%d %H:%M")},
        "loadavg_start": os.getloadavg(),
    }
    t0 = time.perf_counter()
    ctx = ray.init(address="local", num_cpus=cpus, include_dashboard=False, object_store_memory=256 * 2**20)
    # after ray.init: it sets RAY_AUTH_MODE=token, which a client of its token-authenticated cluster needs
    env_local = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env_cluster = {**env_local, "RAY_ADDRESS": ctx.address_info["gcs_address"]}
    try:
        if "stabilize" not in args.skip:
            res["stabilize"] = bench_stabilize(work, args, env_cluster, env_local)
        if "eval" not in args.skip:
            res["eval"] = bench_eval(work, args, env_cluster, env_local)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    res["loadavg_end"] = os.getloadavg()
    res["bench_seconds"] = time.perf_counter() - t0
    table = rows(res)
    res["rows"] = [dict(zip(("check", "measured", "target", "result"), r, strict=True)) for r in table]
    header = [
        f"bema --executor ray benchmark — {res['machine']['date']}, {cpus} CPUs; Ray cluster of {cpus} CPUs started once;"
        f" load avg {res['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}",
        f"stabilize: base + {args.checkpoints} x {args.size_mb:.0f} MB fp32, --max-memory {args.max_memory}, best of {args.repeats};"
        f" eval: {args.eval_checkpoints} checkpoints, gsm8k+boolq, {args.limit} prompts x {args.n_samples} samples, vLLM CPU fp32",
        "",
    ]
    widths = [max(len(r[i]) for r in [("check", "measured", "target", "result"), *table]) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    print("\n".join(header + lines), file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps(res, indent=2, default=str))


if __name__ == "__main__":
    main()
