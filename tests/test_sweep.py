"""`bema sweep`: a grid evaluated from memory equals `bema stabilize` + `bema eval`, on both backends.

The trajectory is a real tiny Qwen2 model with noise added step by step (4 fp32 checkpoints),
so every config's weights differ. Equality is checked record by record (every field except
the ones that name the model by its path or time: model_path, resume_key.weights, created,
eval_id, seconds) and sample by sample (sampled generations, 2 per prompt, seeded), and the
walker's weights tensor by tensor against the files `bema stabilize` writes (bitwise: the
sweep runs the same recurrence code on the same bytes; stabilize itself is held against a
float64 reference in test_stabilize/test_windows).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BEMA, names, one_line_error, run_bema, vllm_available
from test_eval import read_jsonl, write_data
from trajectory import motion_reference

STEPS = (10, 20, 30, 40)
GRID = ["--method", "bema,ema,lawa,wsm", "--window", "2", "--schedule", "minus-sqrt"]
PROTOCOL = ["--tasks", "gsm8k,loss", "--n-samples", "2", "--max-new-tokens", "8", "--limit", "3",
            "--dtype", "float32", "--log-samples"]  # fmt: skip
VOLATILE = ("model_path", "created", "eval_id", "seconds")
VLLM_REL = 1e-4


def make_run(base: Path, run: Path, steps=STEPS, scale: float = 0.02) -> None:
    """Checkpoints of a noisy walk away from `base` (each step adds scale * N(0, 1) to every weight)."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for step in steps:
        weights = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in weights.items()}
        folder = run / f"checkpoint-{step}"
        shutil.copytree(base, folder)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def world(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    make_run(tiny_model_dir, root / "run")
    data = write_data(root / "data")
    common = ["--data-dir", data, "--loss-data", data / "heldout.jsonl", *PROTOCOL]
    return {"root": root, "run": root / "run", "base": tiny_model_dir, "common": common}


def disk_path(world, backend: str, out: Path, steps: str = "20,40") -> None:
    r = run_bema(
        "stabilize", world["run"], "--base", world["base"], "--out", out / "stab", *GRID, "--steps", steps
    )
    assert r.returncode == 0, r.stderr
    ckpts = [world["run"] / f"checkpoint-{s}" for s in steps.split(",")]
    r = run_bema("eval", out / "stab", *ckpts, "--base", world["base"], "--backend", backend,
                 "--out", out / "results", *world["common"])  # fmt: skip
    assert r.returncode == 0, r.stderr


def sweep(world, backend: str, out: Path, *extra, at: str = "0,20,40", env: dict | None = None):
    return run_bema("sweep", world["run"], "--base", world["base"], "--out", out, *GRID, "--at", at,
                    "--backend", backend, *world["common"], *extra, env=env)  # fmt: skip


def loss_only(world) -> list:
    return [
        "--tasks",
        "loss",
        "--loss-data",
        world["root"] / "data" / "heldout.jsonl",
        "--backend",
        "transformers",
    ]


def save_live(world, live: Path, scratch: Path, step: int) -> None:
    """A "trainer" saves checkpoint `step` into `live`: written aside, trainer_state.json (save_steps 10)
    last, then renamed into place, as the HF Trainer's checkpoints appear."""
    shutil.copytree(world["run"] / f"checkpoint-{step}", scratch)
    (scratch / "trainer_state.json").write_text(json.dumps({"global_step": step, "save_steps": 10}))
    os.rename(scratch, live / f"checkpoint-{step}")


def keyed(out: Path) -> dict:
    rows = read_jsonl(out / "results.jsonl")
    table = {(r["run"], r["step"], r["task"]): r for r in rows}
    assert len(table) == len(rows)
    return table


def samples(out: Path) -> dict:
    return {(s["run"] or "base", s["step"], s["task"], s["doc_id"]): s["responses"]
            for s in read_jsonl(out / "samples.jsonl")}  # fmt: skip


def mismatch(x, y, rel: float, at: str = "") -> str | None:
    """Where `x` and `y` first differ ("" at the top), floats within `rel` (relative; 0: bitwise) and every
    other value exactly; None when they agree."""
    if isinstance(x, dict) and isinstance(y, dict):
        if x.keys() != y.keys():
            return f"{at}: keys {sorted(x)} != {sorted(y)}"
        return next((m for k in x if (m := mismatch(x[k], y[k], rel, f"{at}.{k}")) is not None), None)
    if isinstance(x, list) and isinstance(y, list):
        if len(x) != len(y):
            return f"{at}: length {len(x)} != {len(y)}"
        pairs = enumerate(zip(x, y, strict=True))
        return next((m for i, (u, v) in pairs if (m := mismatch(u, v, rel, f"{at}[{i}]")) is not None), None)
    if isinstance(x, float) and isinstance(y, float):
        ok = x == y or math.isclose(x, y, rel_tol=rel, abs_tol=0.0)
        return None if ok else f"{at}: {x!r} != {y!r} (relative {abs(x - y) / max(abs(x), abs(y)):.2e})"
    return None if x == y else f"{at}: {x!r} != {y!r}"


def close(x, y, rel: float) -> bool:
    return mismatch(x, y, rel) is None


def same_as_disk(disk: Path, swept: Path, rel: float = 0.0) -> None:
    """`rel`: the numbers' tolerance (0 on transformers: the same bytes through the same forward)."""
    a, b = keyed(disk), keyed(swept)
    assert sorted(a) == sorted(b) and len(a) == 5 * 3 * 2  # (vanilla + 4 configs) x (0, 20, 40) x 2 tasks
    for key in a:
        x, y = dict(a[key]), dict(b[key])
        wx, wy = x.pop("resume_key").pop("weights"), y.pop("resume_key").pop("weights")
        for field in VOLATILE:
            x.pop(field), y.pop(field)
        where = mismatch(x, y, rel)  # metrics, per-item scores, stabilizer, protocol, seeds, dtype, backend
        assert where is None, (key, where)
        if key[0] == "vanilla" or key[1] == 0:  # the same files on both paths: the same fingerprint
            assert wx == wy
        else:
            assert b[key]["model_path"] == f"sweep:{key[0]}/checkpoint-{key[1]}" and wy.startswith("sweep:")
    # held-out loss equal (within `rel`: 0 on transformers, the same bytes through the same forward pass)
    assert close(
        a["bema-k0.5-e0.2", 40, "loss"]["metrics"]["loss"],
        b["bema-k0.5-e0.2", 40, "loss"]["metrics"]["loss"],
        rel,
    )
    sa, sb = samples(disk), samples(swept)
    assert sa == sb  # sampled generations, seeded: identical text
    # ... and not vacuously: the configs' weights differ, so do their samples and losses
    assert any(sb["vanilla", 40, "gsm8k", d] != sb["bema-k0.5-e0.2", 40, "gsm8k", d] for d in ("0", "1", "2", "3", "4", "5")
               if ("vanilla", 40, "gsm8k", d) in sb)  # fmt: skip
    for step in (20, 40):  # the tolerance separates the configs: some item's NLL differs by > 10x it
        nll = {key[0]: rec["items"]["nll"] for key, rec in b.items() if key[1:] == (step, "loss")}
        assert len(nll) == 5
        for x, y in itertools.combinations(nll.values(), 2):
            assert max(abs(u - v) / abs(u) for u, v in zip(x, y, strict=True)) > 10 * rel
    # nothing but records (and logs) in the sweep's folder: no weight file was ever written
    assert sorted(p.name for p in swept.iterdir()) <= [
        "libraries.log",
        "results.jsonl",
        "samples.jsonl",
        "vllm.log",
    ]


@pytest.mark.parametrize("phi, out_dtype", [(None, None), (20, "bfloat16")])
def test_walker_weights_equal_stabilize_outputs_bitwise(world, tmp_path, phi, out_dtype):
    """Every config at every step, full windows (4 members, K = 3) or a --phi cadence with a cast
    output dtype, tensor for tensor."""
    from safetensors.torch import load_file

    from bema_cli.stabilize import Options, grid
    from bema_cli.sweep.walk import Walker, plan_sweep

    flags = ["--method", "bema,ema,dema,ouema,lawa,wsm,swa,power", "--window", "3"]
    flags += (["--phi", str(phi)] if phi else []) + (["--out-dtype", out_dtype] if out_dtype else [])
    r = run_bema("stabilize", world["run"], "--base", world["base"], "--out", tmp_path / "stab", *flags)
    assert r.returncode == 0, r.stderr
    schedules = grid(["bema", "ema", "dema", "ouema", "lawa", "wsm", "swa", "power"], windows=[3], phi=phi)
    opts = Options(str(world["run"]), schedules, None, base=str(world["base"]), out_dtype=out_dtype)
    walker = Walker(plan_sweep(opts), opts)
    compared = 0
    for step in STEPS:
        walker.advance(step)
        for run in walker.plan.runs:
            folder = tmp_path / "stab" / run.name / f"checkpoint-{step}"
            if run.events[step].action == "skip":
                assert not folder.exists()
                continue
            disk = load_file(str(folder / "model.safetensors"))
            mine = dict(walker.weights(run.name))
            assert sorted(mine) == sorted(disk)
            for name, tensor in disk.items():
                assert mine[name].dtype == tensor.dtype and bool((mine[name] == tensor).all()), (
                    run.name,
                    step,
                    name,
                )
            compared += 1
        vanilla = dict(walker.weights(None))
        raw = load_file(str(world["run"] / f"checkpoint-{step}" / "model.safetensors"))
        assert all(bool((vanilla[n].float() == raw[n]).all()) for n in raw)
        walker.finish()
    assert compared == 8 * (2 if phi else 4)  # phi 20: steps 20 and 40 for each of the 8 configs


def bf16_copy(src: Path, dst: Path) -> Path:
    """`src` (a model folder) with every float tensor cast to bfloat16."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    return dst


@pytest.mark.parametrize(
    "methods, tau",
    [
        (["bema", "ema", "dema", "ouema", "lawa", "wsm"], 0),  # rings: their members read again too
        (["bema", "ema", "dema", "ouema"], 0),  # nothing held: theta0 and theta_s read again
        (["bema", "ouema"], 20),  # burn-in: theta0 becomes checkpoint-20, read again from it
    ],
)
def test_walker_holds_bf16_inputs_narrow_and_stays_bitwise(world, tmp_path, monkeypatch, methods, tau):
    """bf16 checkpoints: theta0, theta_s and a window's members are not held at all but read again
    from their files at each use (a ring holds which step each slot has, and keeps that step's files
    open: a checkpoint deleted once read, as a trainer's rotation does, is still read); every
    operation runs a block at a time in float32, and a block size that splits tensors mid-row changes
    nothing: the outputs are stabilize's, bit for bit."""
    import torch
    from safetensors.torch import load_file

    from bema_cli.io.safetensors import FLOATING
    from bema_cli.recurrence import STATE_TENSORS, Window
    from bema_cli.stabilize import Options, grid
    from bema_cli.sweep import hold, walk

    base = bf16_copy(world["base"], tmp_path / "base")
    for step in STEPS:
        bf16_copy(world["run"] / f"checkpoint-{step}", tmp_path / "run" / f"checkpoint-{step}")
    windows = [3] if "lawa" in methods else None
    r = run_bema("stabilize", tmp_path / "run", "--base", base, "--out", tmp_path / "stab", "--tau", tau,
                 "--method", ",".join(methods), *(["--window", "3"] if windows else []), "--out-dtype", "float32")  # fmt: skip
    assert r.returncode == 0, r.stderr
    monkeypatch.setattr(walk, "HOLD_BLOCK", 1000)  # smaller than most tensors: blocks end mid-tensor
    monkeypatch.setattr(hold, "HOLD_BLOCK", 1000)
    opts = Options(str(tmp_path / "run"), grid(methods, windows=windows, tau=tau), None,
                   base=str(base), out_dtype="float32")  # fmt: skip
    plan = walk.plan_sweep(opts)
    walker = walk.Walker(plan, opts)
    assert walker.theta0 is None and walker.theta is None  # read again from their files
    rings = [stab for stab in walker.stabs if isinstance(stab, Window)]
    assert len(rings) == (1 if windows else 0) and all(
        isinstance(r, walk.FileRing) and not r.slots for r in rings
    )
    # the estimate holds the float32 EMA-family states and HOLD_BLOCK-sized buffers, nothing else
    numel = sum(t.numel for t in plan.out_tensors if t.dtype in FLOATING)
    states = 4 * numel * sum(len(STATE_TENSORS[t.method]) for t in plan.tracks)
    assert 0 < hold.state_bytes(plan, "float32") - states <= (6 + 2) * walk.HOLD_BLOCK * 4
    for step in STEPS:
        walker.advance(step)
        for run in walker.plan.runs:
            disk = load_file(str(tmp_path / "stab" / run.name / f"checkpoint-{step}" / "model.safetensors"))
            mine = dict(walker.weights(run.name))
            for name, tensor in disk.items():
                assert mine[name].dtype == tensor.dtype == torch.float32
                assert torch.equal(mine[name], tensor), (run.name, step, name)
        walker.finish()
        if windows:  # rotated away once read: the ring's members are read through the files it keeps open
            shutil.rmtree(tmp_path / "run" / f"checkpoint-{step}")
    assert walker.theta is None  # theta_s was never held
    if windows:
        assert len(walker._members) == 2  # a window of 3 keeps its 2 latest members' files, no more
    walker.close()
    assert not walker._members


def test_sweep_equals_disk_path_on_transformers(world, tmp_path):
    disk_path(world, "transformers", tmp_path / "disk")
    r = sweep(world, "transformers", tmp_path / "sweep", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (
        doc["engine_starts"] == 1
        and doc["written_weight_bytes"] == 0
        and doc["walked_steps"] == [10, 20, 30, 40]
    )
    assert doc["memory"]["peak_rss"] > 0 and doc["memory"]["estimate"] >= doc["memory"]["parts"]["states"] > 0
    same_as_disk(tmp_path / "disk" / "results", tmp_path / "sweep")
    # the motion, measured as the walk read each step (float64 by hand: 1e-5), in --json and motion.json
    ref = motion_reference(world["base"], {s: world["run"] / f"checkpoint-{s}" for s in doc["walked_steps"]})
    assert [r["step"] for r in doc["motion"]] == doc["walked_steps"]
    assert all(r["relative"] == pytest.approx(ref[r["step"]], rel=1e-5) for r in doc["motion"])
    record = json.loads((tmp_path / "sweep" / "motion.json").read_text())
    assert record["motion"] == doc["motion"] and names(record["checkpoint_dir"], world["run"])
    # bema report finds it beside the results, says it and draws it as a panel of its own
    from bema_cli import report, report_plot

    rep = report.build([str(tmp_path / "sweep")])
    assert list(rep["motion"].values())[0]["motion"] == doc["motion"]
    titles = report_plot.plot(rep, str(tmp_path / "report.png"))
    assert titles[-1].startswith("checkpoint motion") and "the last 2 checkpoints still" in titles[-1]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not vllm_available(), reason="vllm is not importable")
@pytest.mark.parametrize("engine_process", ["0", "1"], ids=["engine-in-process", "engine-core-process"])
def test_sweep_equals_disk_path_on_vllm(world, tmp_path, engine_process):
    """Also with vLLM's engine core in its own process (the layout on a GPU): the states live in the
    worker there, and only the plan (once, as bytes), step numbers and config names cross to it."""
    disk_path(world, "vllm", tmp_path / "disk")
    r = sweep(
        world, "vllm", tmp_path / "sweep", "--json", env={"VLLM_ENABLE_V1_MULTIPROCESSING": engine_process}
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("starting vLLM engine") == 1
    # vLLM on CPU: bitwise in every local run (idle and loaded), but in CI once the base's loss
    # differed by 8e-9 relative between the two engines (one started on the files, one on dummy
    # weights with the same bytes reloaded) and once a config's by more than 1e-6: vLLM does not
    # promise stable logprobs across engines (docs.vllm.ai, FAQ "Can the output of a prompt vary").
    # 1e-4 still tells every config from every other: each pair's per-item NLLs differ by more than
    # 10x that on some item (asserted below), so a config scored with another's weights fails.
    same_as_disk(tmp_path / "disk" / "results", tmp_path / "sweep", rel=VLLM_REL)
    doc = json.loads(r.stdout)
    memory = doc["memory"]
    # the motion comes back from the engine's worker (its own process with "1")
    ref = motion_reference(world["base"], {s: world["run"] / f"checkpoint-{s}" for s in doc["walked_steps"]})
    assert [r["step"] for r in doc["motion"]] == doc["walked_steps"] == [10, 20, 30, 40]
    assert all(r["relative"] == pytest.approx(ref[r["step"]], rel=1e-5) for r in doc["motion"])
    # the peak counts the engine core's own process (torch, vLLM, the model: > 200 MB) when it has one
    assert memory["peak_rss"] == memory["peak_rss_bema"] + memory["peak_rss_engine"], memory
    assert memory["peak_device"] is None, memory  # nothing held on a GPU (none here): null, not 0
    if engine_process == "1":  # (in-process, short-lived helpers may still show: nothing to assert)
        assert memory["peak_rss_engine"] > 200 * 2**20, memory


@pytest.mark.slow  # 23 s: a sweep killed, then resumed
def test_a_killed_sweep_resumes_with_only_the_missing_evaluations(world, tmp_path):
    out = tmp_path / "sweep"
    first = sweep(world, "transformers", out, "--json", at="20")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["evaluated"] == 5 * 2
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    (out / "results.jsonl").write_text("".join(lines[:-3]))  # killed before its last 3 evaluations
    second = sweep(world, "transformers", out, "--json", at="20,40")
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["evaluated"] == 3 + 5 * 2
    assert f"resuming: 7 of 20 evaluations already in {out / 'results.jsonl'}" in second.stderr
    whole = sweep(world, "transformers", tmp_path / "whole", at="20,40")
    assert whole.returncode == 0, whole.stderr
    a, b = keyed(out), keyed(tmp_path / "whole")
    assert sorted(a) == sorted(b) and all(a[k]["metrics"] == b[k]["metrics"] for k in a)
    again = sweep(world, "transformers", out, at="20,40")
    assert again.returncode == 0 and "up to date" in again.stderr


def test_grid_from_a_config_file_is_the_same_sweep(world, tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text("methods:\n  bema: {kappa: [0.5], eta: [0.2]}\n  ema: {kappa: [0.5]}\n"
                    "  lawa: {window: [2]}\n  wsm: {window: [2], schedule: [minus-sqrt]}\n")  # fmt: skip
    r = run_bema("sweep", world["run"], "--base", world["base"], "--out", tmp_path / "cfg", "--config", grid,
                 "--at", "40", "--backend", "transformers", "--tasks", "loss",
                 "--loss-data", world["root"] / "data" / "heldout.jsonl", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["runs"] == ["bema-k0.5-e0.2", "ema-k0.5", "lawa-w2", "wsm-minus_sqrt-w2"]


def test_bad_input_is_one_line(world, tmp_path):
    loss = loss_only(world)
    base = ["sweep", world["run"], "--base", world["base"], "--out", tmp_path / "o"]
    line = one_line_error(run_bema(*base, "--at", "25", *loss), 2)
    assert "--at: no checkpoint at step 25 (found 10, 20, 30, 40; 0 is theta0)" in line
    line = one_line_error(run_bema(*base, "--max-memory", "64MB", *GRID, *loss), 2)
    assert "needs an estimated" in line and "states" in line and "bema stabilize then bema eval" in line
    line = one_line_error(run_bema(*base, "--follow", "--at", "last", *loss), 2)
    assert "--at last" in line
    line = one_line_error(run_bema(*base, "--follow", "--at", "20,x", *loss), 2)
    assert "--at: all, last, every:N or a comma list of steps, got '20,x'" in line
    line = one_line_error(run_bema(*base, "--follow", "--until-step", "-1", *loss), 2)  # as stabilize's
    assert "--until-step: must be a step >= 0, got -1" in line
    assert not (tmp_path / "o" / "results.jsonl").exists()


def test_follow_evaluates_each_checkpoint_of_a_rotating_run(world, tmp_path):
    """A "trainer" copies the checkpoints in one by one (trainer_state.json marks each complete) and
    keeps only the newest 2, as save_total_limit does; the followed sweep's records equal a batch
    sweep's over the whole trajectory, none lost to the rotation.

    The trainer deletes a checkpoint as soon as the sweep says it holds it ("checkpoint-N landed"),
    long before its turn (the engine has not even started for the first ones). It does not delete
    one the sweep has not taken yet: a checkpoint gone before any poll saw it is the gap check's
    case, not this one, and waiting keeps the test independent of how fast the sweep starts."""
    live = tmp_path / "live"
    live.mkdir()
    loss = loss_only(world)
    log = (tmp_path / "follow.log").open("w+")  # a file, not a pipe: nothing blocks on a full buffer
    args = ["sweep", live, "--base", world["base"], "--out", tmp_path / "f", *GRID, *loss,
            "--follow", "--poll", "0.2", "--until-step", "40", "--idle-timeout", "60"]  # fmt: skip
    proc = subprocess.Popen([str(BEMA), *map(str, args)], stdout=log, stderr=subprocess.STDOUT)
    deleted_while_held = []
    try:
        for step in STEPS:
            save_live(world, live, tmp_path / "tmp", step)
            deadline = time.monotonic() + 120
            while f"checkpoint-{step} landed" not in (tmp_path / "follow.log").read_text():
                assert proc.poll() is None and time.monotonic() < deadline, f"checkpoint-{step} never held"
                time.sleep(0.05)
            for old in sorted(live.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[:-2]:
                shutil.rmtree(old)
                deleted_while_held.append(int(old.name.split("-")[1]))
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert proc.returncode == 0, (tmp_path / "follow.log").read_text()
    assert deleted_while_held == [10, 20]
    batch = run_bema("sweep", world["run"], "--base", world["base"], "--out", tmp_path / "b", *GRID, *loss)
    assert batch.returncode == 0, batch.stderr
    a, b = keyed(tmp_path / "f"), keyed(tmp_path / "b")
    assert sorted(a) == sorted(b) and len(a) == 5 * 4
    differ = {k: (a[k]["metrics"], b[k]["metrics"]) for k in a if a[k]["metrics"] != b[k]["metrics"]}
    assert not differ, differ  # which record, followed vs batch: a timing-dependent difference shows here


def test_a_checkpoint_deleted_while_it_is_taken_is_a_named_error(world, tmp_path, monkeypatch):
    """A trainer deleting a checkpoint after its weights are held but before the rest is read (its
    config copied, its headers parsed) makes --follow stop with the folder named, not a traceback."""
    from bema_cli.errors import InputError
    from bema_cli.io.watch import Watcher
    from bema_cli.sweep import follow

    live = tmp_path / "live"
    live.mkdir()
    save_live(world, live, tmp_path / "tmp", 10)
    real_copy = follow.copy_aux_files

    def rotated_midway(aux, folders):
        shutil.rmtree(folders[0])  # the trainer's rotation, between the hold and the copy
        return real_copy(aux, folders)

    monkeypatch.setattr(follow, "copy_aux_files", rotated_midway)
    landed = follow.Landed(Watcher(live), poll=0.2, allow_gaps=False)
    try:
        with pytest.raises(InputError, match="disappeared before it could be read") as caught:
            landed.look()
    finally:
        landed.close()
    assert str(live / "checkpoint-10") in str(caught.value) and landed.steps == []


@pytest.mark.slow
def test_ray_actors_split_the_grid_and_match_local(world, tmp_path):
    ray = pytest.importorskip("ray")
    loss = loss_only(world)
    ctx = ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20)
    try:
        env = {"RAY_ADDRESS": ctx.address_info["gcs_address"]}
        r = run_bema("sweep", world["run"], "--base", world["base"], "--out", tmp_path / "ray", *GRID, *loss,
                     "--executor", "ray", "--workers", "2", "--json", env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr
        split = json.loads(r.stdout)
        assert split["engine_starts"] == 2
    finally:
        ray.shutdown()
    local = run_bema(
        "sweep", world["run"], "--base", world["base"], "--out", tmp_path / "local", *GRID, *loss, "--json"
    )
    assert local.returncode == 0, local.stderr
    # each actor walks every step; the motion is the most complete actor's, the local walk's (float32
    # dot products on an actor's share of the threads: to 1e-6), the first step's from theta0 included
    mine = json.loads(local.stdout)["motion"]
    assert [r["step"] for r in split["motion"]] == [r["step"] for r in mine] == [10, 20, 30, 40]
    assert all(
        a["relative"] == pytest.approx(b["relative"], rel=1e-6)
        for a, b in zip(split["motion"], mine, strict=True)
    )
    a, b = keyed(tmp_path / "ray"), keyed(tmp_path / "local")
    assert sorted(a) == sorted(b) and all(a[k]["metrics"] == b[k]["metrics"] for k in a)


def test_select_names_and_writes_a_swept_winner(world, tmp_path):
    """`bema select` on sweep records: the winner is said to live in memory, and --write rebuilds it from
    the run (the vanilla record at its step names the checkpoint) bitwise as `bema stabilize` writes it.
    The run is noisy iterates around an optimum (ship_runs.py), where an average clearly beats vanilla
    (with the tie rule, a winner only tied with vanilla would be vanilla)."""
    from safetensors.torch import load_file
    from ship_runs import heldout, noisy_run, optimum

    data = heldout(tmp_path / "heldout.jsonl")
    run = noisy_run(world["base"], optimum(world["base"], data, tmp_path / "star"), tmp_path / "run")
    loss = ["--tasks", "loss", "--loss-data", data, "--backend", "transformers"]
    r = run_bema("sweep", run, "--base", world["base"], "--out", tmp_path / "s", *GRID, *loss, "--at", "80")
    assert r.returncode == 0, r.stderr
    r = run_bema("select", tmp_path / "s", "--metric", "loss", "--write", tmp_path / "ship", "--json")
    assert r.returncode == 0, r.stderr
    winner = json.loads(r.stdout)["winner"]
    assert winner["path"].startswith("sweep:") and winner["run"] != "vanilla"
    text = run_bema("select", tmp_path / "s", "--metric", "loss")
    assert "evaluated in memory by bema sweep" in text.stdout
    ref = tmp_path / "ref"
    r = run_bema("stabilize", run, "--base", world["base"], "--out", ref, *GRID, "--steps", "80")
    assert r.returncode == 0, r.stderr
    a, b = (
        load_file(str(tmp_path / "ship" / "model.safetensors")),  # DIR itself is the model folder
        load_file(str(ref / winner["run"] / "checkpoint-80" / "model.safetensors")),
    )
    assert sorted(a) == sorted(b) and all(bool((a[k] == b[k]).all()) for k in a)


def test_follow_refuses_a_checkpoint_it_never_saw(world, tmp_path):
    """The trainer's cadence (save_steps 10) says step 20 was saved; the sweep saw 10, then 30: the
    average would silently skip a step, so it stops naming it (exit 3), with step 10's records kept."""
    live = tmp_path / "live"

    live.mkdir()
    save_live(world, live, tmp_path / "tmp", 10)
    loss = loss_only(world)
    proc = subprocess.Popen([str(BEMA), "sweep", live, "--base", world["base"], "--out", tmp_path / "f", "--method",
                             "ema", *loss, "--follow", "--poll", "0.2", "--idle-timeout", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    results = tmp_path / "f" / "results.jsonl"
    deadline = time.monotonic() + 120
    while (
        not (results.is_file() and len(results.read_text().splitlines()) == 2) and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    save_live(world, live, tmp_path / "tmp", 30)  # 20 never appears (rotated away between two polls)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert "checkpoint step(s) 20 missing from the run (cadence: save_steps 10" in err
    assert {(r["run"], r["step"]) for r in read_jsonl(results)} == {("vanilla", 10), ("ema-k0.5", 10)}
