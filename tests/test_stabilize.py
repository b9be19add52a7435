"""`bema stabilize` end to end (real CLI in a subprocess, real files) against the float64 reference.

Tolerances: float32 outputs within 1e-6 of the reference relative to the tensor's largest
|value| (float32 accumulation over a few steps costs ~1e-7); bfloat16/float16 outputs, and
float32 outputs accumulated in float64, within one ulp of the reference (rounding alone costs half).
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import BEMA, names, run_bema, vllm_available
from reference import reference, ulp
from trajectory import finetune_trajectory, load_model, write_trajectory

STEPS = [10, 20, 30, 40, 50]
ALL_METHODS = "vanilla,ema,bema,dema,ouema"


def stabilize(*args) -> dict:
    r = run_bema("stabilize", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def assert_close_to_reference(out: dict, ref: dict, accum64: bool = False) -> None:
    assert set(out) == set(ref)
    for name, value in out.items():
        expect = ref[name]
        if not value.is_floating_point():
            assert torch.equal(value, expect), f"{name}: non-float tensor must be copied from theta_s"
            continue
        err = (value.double() - expect).abs()
        if value.dtype in (torch.float32, torch.float64) and not accum64:
            tol = 1e-6 * expect.abs().max().clamp_min(1e-30)
            assert err.max() <= tol, f"{name}: max error {err.max():.3g} > {tol:.3g}"
        else:
            bound = ulp(torch.maximum(expect.abs(), value.double().abs()), value.dtype)
            assert bool((err <= bound).all()), f"{name}: off by more than 1 ulp (max error {err.max():.3g})"


def check_outputs(doc: dict, base_dir: Path, run_dir: Path, accum64: bool = False, ref_dtype=None) -> int:
    """Compare every output in the --json document with the reference; returns how many were checked."""
    theta0 = load_model(base_dir)
    trajectory = [
        (s, load_model(run_dir / f"checkpoint-{s}"))
        for s in sorted(int(p.name[11:]) for p in run_dir.iterdir())
    ]
    refs: dict[str, dict] = {}
    for o in doc["outputs"]:
        folder = Path(o["path"])
        record = json.loads((folder / "bema.json").read_text())
        for key in ("run", "method", "kappa", "eta", "gamma", "rho", "tau", "phi", "step", "alpha", "beta"):
            # bema.json keeps the file format's "inf" (eta of an EMA); --json numbers are numbers or null
            assert record[key] == o[key] or (record[key], o[key]) == ("inf", None), key
        assert names(record["source_checkpoint"], run_dir / f"checkpoint-{o['step']}")
        if o["run"] not in refs:
            hyper = {
                k: record[k] for k in ("method", "preset", "gamma", "rho", "tau", "phi", "beta_min", "kappa")
            }
            hyper["eta"] = float(record["eta"])
            refs[o["run"]] = reference(theta0, trajectory, **hyper)
        assert o["step"] in refs[o["run"]], (
            f"{o['run']} wrote step {o['step']}, which the reference does not output"
        )
        assert_close_to_reference(load_model(folder), refs[o["run"]][o["step"]], accum64)
    expected = sum(len(r) for r in refs.values())
    return expected


CASES = {
    "fp32-grid-paper": (
        torch.float32,
        1,
        ["--method", ALL_METHODS, "--kappa", "0.5,0.3", "--eta", "0.2,inf"],
    ),
    "bf16-sharded-chunked-tau-phi": (
        torch.bfloat16,
        2,
        [
            "--method",
            "bema,dema,ouema",
            "--tau",
            "10",
            "--phi",
            "20",
            "--max-memory",
            "300B",
            "--max-shard-size",
            "150B",
        ],
    ),
    "fp16-reference-preset": (
        torch.float16,
        1,
        ["--method", ALL_METHODS, "--preset", "reference", "--phi", "20", "--tau", "10", "--rho", "5"],
    ),
    "fp32-reference-defaults-accum64": (
        torch.float32,
        3,
        ["--method", "bema,ema", "--preset", "reference", "--accum-dtype", "float64", "--max-memory", "1KiB"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(tmp_path, case):
    dtype, shards, args = CASES[case]
    base_dir, run_dir = write_trajectory(tmp_path, STEPS, dtype=dtype, shards=shards, seed=len(case))
    out = tmp_path / "out"
    doc = stabilize(run_dir, "--base", base_dir, "--out", out, *args)
    expected = check_outputs(doc, base_dir, run_dir, accum64="float64" in args)
    assert len(doc["outputs"]) == expected > 0
    assert doc["read_bytes"] > 0 and doc["written_bytes"] > 0
    if "--max-shard-size" in args:
        folder = Path(doc["outputs"][0]["path"])
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    # Trainer leftovers are never copied; configs are
    for o in doc["outputs"]:
        names = {p.name for p in Path(o["path"]).iterdir()}
        assert "config.json" in names and not names & {"optimizer.pt", "scheduler.pt", "rng_state.pth"}
    assert not list(out.glob(".bema-tmp-*"))


def test_out_dtype_steps_and_manifest(tmp_path):
    base_dir, run_dir = write_trajectory(tmp_path, STEPS, dtype=torch.float32)
    out = tmp_path / "out"
    doc = stabilize(run_dir, "--base", base_dir, "--out", out, "--steps", "20,40", "--out-dtype", "bfloat16")
    assert [o["step"] for o in doc["outputs"]] == [20, 40]
    for o in doc["outputs"]:
        folder = Path(o["path"])
        assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
        assert load_model(folder)["layer.0.weight"].dtype == torch.bfloat16
        assert json.loads((folder / "bema.json").read_text())["out_dtype"] == "bfloat16"
    check_outputs(doc, base_dir, run_dir)  # bf16 outputs of fp32 inputs: within 1 ulp
    manifest = json.loads((out / "manifest.json").read_text())
    assert str(tmp_path) not in (out / "manifest.json").read_text()  # inputs named as bema.json names them
    assert names(manifest["theta0_source"], base_dir)
    assert [c["step"] for c in manifest["checkpoints"]] == STEPS
    assert all(names(c["path"], run_dir / f"checkpoint-{c['step']}") for c in manifest["checkpoints"])
    (run,) = manifest["runs"]
    assert run["run"] == "bema-k0.5-e0.2" and [o["path"] for o in run["outputs"]] == [
        "bema-k0.5-e0.2/checkpoint-20",
        "bema-k0.5-e0.2/checkpoint-40",
    ]
    # a second call with another config adds its run to the manifest and leaves the first alone
    doc2 = stabilize(run_dir, "--base", base_dir, "--out", out, "--method", "ema", "--final-only")
    assert [(o["run"], o["step"]) for o in doc2["outputs"]] == [("ema-k0.5", 50)]
    runs = json.loads((out / "manifest.json").read_text())["runs"]
    assert [r["run"] for r in runs] == ["bema-k0.5-e0.2", "ema-k0.5"]


def test_implicit_checkpoint_0_and_base_first(tmp_path):
    base_dir, run_dir = write_trajectory(tmp_path, [0, 10, 20])
    doc = stabilize(run_dir, "--out", tmp_path / "a", "--final-only")
    (o,) = doc["outputs"]
    record = json.loads((Path(o["path"]) / "bema.json").read_text())
    assert names(record["theta0_source"], run_dir / "checkpoint-0")
    check_outputs(doc, run_dir / "checkpoint-0", run_dir)
    doc = stabilize(run_dir, "--base", "first", "--out", tmp_path / "b", "--final-only", "--eta", "inf")
    assert json.loads((Path(doc["outputs"][0]["path"]) / "bema.json").read_text())["eta"] == "inf"
    check_outputs(doc, run_dir / "checkpoint-0", run_dir)


def test_dry_run_writes_nothing(tmp_path):
    base_dir, run_dir = write_trajectory(tmp_path, STEPS)
    out = tmp_path / "out"
    doc = stabilize(
        run_dir, "--base", base_dir, "--out", out, "--dry-run", "--phi", "20", "--method", "bema,ema"
    )
    assert not out.exists()
    assert doc["dry_run"] is True and len(doc["outputs"]) == 4  # steps 20 and 40 for two runs
    events = doc["plan"]["runs"][0]["events"]
    assert [e["action"] for e in events] == ["skip", "update", "skip", "update", "skip"]
    assert events[1]["alpha"] == pytest.approx(30**-0.2) and events[1]["beta"] == pytest.approx(30**-0.5)
    assert doc["plan"]["shards"][0]["file"] == "model.safetensors"
    # steps after the last processed one (50 is skipped) are not read
    assert [c["read"] for c in doc["plan"]["checkpoints"]] == [False, True, False, True, False]
    human = run_bema("stabilize", run_dir, "--base", base_dir, "--out", out, "--dry-run")
    assert human.returncode == 0 and "would read" in human.stdout and not out.exists()


@pytest.fixture(scope="module")
def tiny_run(tiny_model_dir, tmp_path_factory):
    """A tiny real Qwen2 + fine-tune-like checkpoints, stabilized with BEMA (all steps)."""
    root = tmp_path_factory.mktemp("tinyrun")
    run_dir = finetune_trajectory(tiny_model_dir, root, [10, 20, 30])
    doc = stabilize(run_dir, "--base", tiny_model_dir, "--out", root / "out", "--max-memory", "64KiB")
    return tiny_model_dir, run_dir, doc


def test_transformers_loads_output_with_reference_logits(tiny_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir, run_dir, doc = tiny_run
    final = Path(doc["outputs"][-1]["path"])
    theta0 = load_model(base_dir)
    trajectory = [(s, load_model(run_dir / f"checkpoint-{s}")) for s in (10, 20, 30)]
    ref = reference(theta0, trajectory, "bema")[30]
    ref_model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    missing, unexpected = ref_model.load_state_dict({k: v.float() for k, v in ref.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.chat_template  # tokenizer and chat template travel with the output
    ids = tok("the cat sees 12 + 30 = 42", return_tensors="pt").input_ids
    with torch.no_grad():
        got, want = model(ids).logits, ref_model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base_logits = AutoModelForCausalLM.from_pretrained(base_dir)(ids).logits.detach()
    assert (got - base_logits).abs().max() > 1e-3  # the check above could fail: outputs differ from theta0


@pytest.mark.vllm  # ~20 s on 2 CPU cores: part of the default suite
@pytest.mark.skipif(not vllm_available(), reason="vllm is not importable")
def test_vllm_serves_output_like_transformers(tiny_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    final = Path(tiny_run[2]["outputs"][-1]["path"])
    tok = AutoTokenizer.from_pretrained(final)
    prompt = "the cat sees 12 + 30 ="
    ids = tok(prompt).input_ids
    hf = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    hf_tokens = hf_out[0, len(ids) :].tolist()
    llm = LLM(
        model=str(final),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        kv_cache_memory_bytes=64 * 2**20,
    )  # as bema sizes it on CPU (not 70% of RAM)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (result,) = llm.generate([{"prompt_token_ids": ids}], params)
    assert list(result.outputs[0].token_ids) == hf_tokens


def test_base_from_hub_cache_offline_and_name_or_path(tmp_path):
    """--base REPO_ID resolves through the real huggingface_hub cache (HF_HOME, HF_HUB_OFFLINE=1);
    without --base, a config.json `_name_or_path` that resolves is used."""
    base_dir, run_dir = write_trajectory(tmp_path, [10, 20])
    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    shutil.copytree(base_dir, repo / "snapshots" / "0123abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    r = run_bema("stabilize", run_dir, "--base", "org/tiny", "--out", tmp_path / "a", "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["theta0_source"] == "org/tiny"
    check_outputs(doc, base_dir, run_dir)
    for step in (10, 20):
        cfg = run_dir / f"checkpoint-{step}" / "config.json"
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "_name_or_path": str(base_dir)}))
    doc = stabilize(run_dir, "--out", tmp_path / "b")
    assert names(
        json.loads((Path(doc["outputs"][0]["path"]) / "bema.json").read_text())["theta0_source"], base_dir
    )
    check_outputs(doc, base_dir, run_dir)


def test_interrupt_leaves_nothing_behind(tmp_path):
    """Ctrl-C in the middle of the walk removes the temp folder and the OUT folder it created."""
    shapes = {"w": (3000, 4)}
    base_dir, run_dir = write_trajectory(tmp_path, STEPS, shapes=shapes, with_int=False)
    out = tmp_path / "out"
    cmd = [str(BEMA), "stabilize", run_dir, "--base", base_dir, "--out", out, "--max-memory", "200B"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not list(out.glob(".bema-tmp-*/*/checkpoint-*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "finished before it could be interrupted; make the input larger"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr  # bema maps SIGINT to exit 130
    assert not out.exists()


def test_cast_base_bf16_base_fp32_checkpoints(tmp_path):
    """A bf16 Hub-style base with fp32 fine-tune checkpoints: an error naming --cast-base, then exact with it."""
    from safetensors.torch import save_file

    base_dir, run_dir = write_trajectory(tmp_path, STEPS[:3], torch.float32, with_int=False)
    base = load_model(base_dir)
    save_file({k: v.to(torch.bfloat16) for k, v in base.items()}, base_dir / "model.safetensors")
    refused = run_bema("stabilize", run_dir, "--base", base_dir, "--out", tmp_path / "o1")
    assert refused.returncode == 3 and "--cast-base" in refused.stderr
    assert not (tmp_path / "o1").exists()
    doc = stabilize(
        run_dir, "--base", base_dir, "--out", tmp_path / "out", "--method", "bema,ema", "--cast-base"
    )
    assert check_outputs(doc, base_dir, run_dir) == 6
    out = load_model(Path(doc["outputs"][0]["path"]))
    assert all(v.dtype == torch.float32 for v in out.values()), "outputs keep the checkpoints' dtype"
    record = json.loads((Path(doc["outputs"][0]["path"]) / "bema.json").read_text())
    assert record["out_dtype"] == "float32"


def test_bema_with_eta_inf_is_the_ema_written_once(tmp_path):
    """--method bema,ema --eta 0.1,inf: BEMA at eta inf is the EMA bit for bit, so one ema-k0.5 run,
    said on stderr (it wrote bema-k0.5-einf and ema-k0.5, identical)."""
    base_dir, run_dir = write_trajectory(tmp_path, [10, 20])
    r = run_bema("stabilize", run_dir, "--base", base_dir, "--out", tmp_path / "o", "--method", "bema,ema",
                 "--eta", "0.1,inf", "--final-only", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert sorted(o["run"] for o in json.loads(r.stdout)["outputs"]) == ["bema-k0.5-e0.1", "ema-k0.5"]
    assert "bema with --eta inf is ema-k0.5 (no bias correction): written once, as ema-k0.5" in r.stderr


def test_degenerate_kappas_are_warned_about(capsys):
    """kappa 0 makes the EMA the current iterate; kappa > 1 never forgets theta0: each is said."""
    from bema_cli.stabilize.grids import grid

    grid(["bema"], [0.0, 0.5, 2.0], [0.2])
    err = capsys.readouterr().err
    assert "--kappa 0: beta = 1 at every step" in err and "--kappa 2 > 1:" in err and "0.5" not in err
    grid(["bema"], [0.5], [0.2])
    assert capsys.readouterr().err == ""


def test_a_stabilizer_parameter_is_listed_once_in_its_schedule_field():
    """Schedule's fields (each a `param`) are the one list: the records, the grid's axes and shared
    settings, --config's keys and the grid flags all read it. Each axis and shared setting has its
    flag, with the field's default; each config key builds the run the flag builds; a method's record
    carries the fields it uses and no other."""
    import dataclasses

    from bema_cli.commands.flags import GridFlags
    from bema_cli.schedule import AXES, METHODS, RECORD_NAMES, SHARED, Schedule, used_by
    from bema_cli.stabilize.grids import CONFIG_COMMON, CONFIG_KEYS, grid

    flags = {f.name: f.default for f in dataclasses.fields(GridFlags)}
    defaults = {f.name: f.default for f in dataclasses.fields(Schedule)}
    assert {RECORD_NAMES[n] for n in AXES} | set(SHARED) == set(flags) - {
        "half_life",
        "tokens_per_step",
        "config",
    }
    assert all(flags[n] == defaults[n] for n in SHARED)  # one default, the Schedule's
    assert CONFIG_COMMON == ("preset", "gamma", "rho", "tau", "phi", "beta_min")
    assert CONFIG_KEYS["bema"] == ("kappa", "eta") and CONFIG_KEYS["wsm"] == ("window", "schedule")
    assert CONFIG_KEYS["vanilla"] == () and CONFIG_KEYS["power"] == ("sigma_rel", "power_gamma")
    for method in METHODS:
        keys = set(Schedule(method=method).resolved().params())
        assert keys == {RECORD_NAMES[n] for n in used_by(method)}, method
    assert set(Schedule(method="lawa").resolved().params()) == {"method", "preset", "tau", "phi", "window"}
    # power's two axes are alternatives (one config each), wsm's are crossed
    assert [s.sigma_rel for s in grid(["power"], sigma_rels=[0.05, 0.1], power_gammas=[7.0])] == [
        0.05,
        0.1,
        None,
    ]
    wsm = grid(["wsm"], windows=[3, 5], schedules=["linear", "cosine"])
    assert [(s.window, s.merge_schedule) for s in wsm] == [
        (3, "linear"),
        (3, "cosine"),
        (5, "linear"),
        (5, "cosine"),
    ]
    # ema records eta = inf (no correction), whatever --eta the grid's bema takes
    assert {s.method: s.eta for s in grid(["ema", "bema"], [0.5], [0.3])} == {"ema": math.inf, "bema": 0.3}


def test_help_reads_as_the_usage():
    """Flags show no `<bool>` value; the argument is named in capitals."""
    r = run_bema("stabilize", "--help", env={"COLUMNS": "200"})
    assert r.returncode == 0
    assert "{checkpoint_dir}" not in r.stdout and "CHECKPOINT_DIR" in r.stdout
    flags = [line for line in r.stdout.splitlines() if "--final-only" in line or "--dry-run" in line]
    assert flags and not any("<bool>" in line for line in flags)
    from bema_cli.commands.flags import ExecutorFlags, FollowFlags, GridFlags, InputFlags

    def panel(title: str) -> str:  # options grouped in panels, as eval's are: each settings class its own
        return r.stdout.split(f"─ {title} ─")[1].split("╰")[0]

    assert "--method" in panel(GridFlags.PANEL) and "--kappa" in panel(GridFlags.PANEL)
    assert "--follow" in panel(FollowFlags.PANEL) and "--allow-gaps" in panel(InputFlags.PANEL)
    assert "--workers" in panel(ExecutorFlags.PANEL) and "--readers" in panel(ExecutorFlags.PANEL)
    assert "--final-only" in panel("What to write") and "--restart" in panel("Incremental runs")
    assert "--kappa" not in panel(FollowFlags.PANEL)
    sweep = run_bema("sweep", "--help", env={"COLUMNS": "200"}).stdout  # the class's panel, not the alias's
    assert "─ Stabilizer (the grid: comma lists) ─" in sweep and "─ What to write ─" not in sweep


def test_overwrite_keeps_the_files_a_user_put_in_a_run_folder(tmp_path):
    """`stabilize --overwrite` replaces bema's run folders: a user's notes in OUT/<run>/ and in one of
    its checkpoint folders come through, byte for byte, and are said (they were deleted with the
    folder); bema's own files are the new run's (verify agrees)."""
    from trajectory import write_trajectory

    base, run = write_trajectory(tmp_path / "t", [10, 20, 30, 40], with_int=False)
    out = tmp_path / "out"
    args = ["stabilize", run, "--base", base, "--out", out, "--method", "ema"]
    assert run_bema(*args).returncode == 0
    folder = out / "ema-k0.5"
    (folder / "notes.txt").write_text("mine\n")
    (folder / "checkpoint-40" / "evals").mkdir()
    (folder / "checkpoint-40" / "evals" / "r.jsonl").write_text("{}\n")
    before = (folder / "checkpoint-40" / "model.safetensors").stat().st_ino
    r = run_bema(*args, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert (folder / "checkpoint-40" / "model.safetensors").stat().st_ino != before  # replaced, not kept
    assert (folder / "notes.txt").read_text() == "mine\n"
    assert (folder / "checkpoint-40" / "evals" / "r.jsonl").read_text() == "{}\n"
    assert "kept 2 file(s) bema did not write: checkpoint-40/evals/r.jsonl, notes.txt" in r.stderr, r.stderr
    v = run_bema("verify", folder / "checkpoint-40")
    assert v.returncode == 0 and "bitwise identical" in v.stdout, v.stderr
