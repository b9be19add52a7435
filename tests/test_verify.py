"""Provenance inside the weights (io/provenance.py) and `bema verify`: every safetensors file bema
writes carries its record, its inputs' fingerprints and its coefficients over (theta0, checkpoints);
the coefficients are checked against the paper's recurrence in float64, and `bema verify` rebuilds
the model from the header alone (bema.json may be lost in a copy) and names what differs."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import one_line_error, run_bema
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from trajectory import write_trajectory

from bema_cli.io import provenance

STEPS = [10, 20, 30, 40]


@pytest.fixture(scope="module")
def stabilized(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    base, run = write_trajectory(root / "t", STEPS, with_int=True)
    out = root / "out"
    r = run_bema(
        "stabilize", run, "--base", base, "--out", out, "--method", "ema,bema,dema,lawa", "--window", "3"
    )
    assert r.returncode == 0, r.stderr
    return {"base": base, "run": run, "out": out, "root": root}


def _reference(method: str, step: int, kappa=0.5, eta=0.2, rho=10.0, gamma=1.0) -> dict[str, float]:
    """The paper's EMA/BEMA as coefficients over (theta0, theta_s), in float64, written out here."""
    ema = {"theta0": 1.0}
    last = None
    for s in [x for x in STEPS if x <= step]:
        w = rho + gamma * s
        beta = w**-kappa
        ema = {k: (1 - beta) * v for k, v in ema.items()}
        ema[str(s)] = ema.get(str(s), 0.0) + beta
        last = s
    if method == "ema":
        return ema
    alpha = (rho + gamma * last) ** -eta
    out = dict(ema)
    out[str(last)] = out.get(str(last), 0.0) + alpha
    out["theta0"] = out["theta0"] - alpha
    return out


@pytest.mark.parametrize("run_name", ["ema-k0.5", "bema-k0.5-e0.2"])
@pytest.mark.parametrize("step", [10, 40])
def test_coefficients_in_the_header_match_the_paper_in_float64(stabilized, run_name, step):
    folder = stabilized["out"] / run_name / f"checkpoint-{step}"
    doc = provenance.read(folder)
    want = _reference(run_name.split("-")[0], step)
    got = doc["coefficients"]
    assert set(got) == {k for k, v in want.items() if v}, got
    for k, v in want.items():
        assert got.get(k, 0.0) == pytest.approx(v, rel=1e-12, abs=1e-15), k  # float64 both: to rounding
    assert math.fsum(got.values()) == pytest.approx(1.0, abs=1e-12)
    assert doc["record"]["run"] == run_name and doc["record"]["step"] == step
    assert set(doc["inputs"]) == {"theta0", *(str(s) for s in STEPS if s <= step)}
    # the written float32 weights are that combination of the inputs (float32 arithmetic: 1e-5)
    inputs = {"theta0": load_file(stabilized["base"] / "model.safetensors")}
    inputs.update(
        {str(s): load_file(stabilized["run"] / f"checkpoint-{s}" / "model.safetensors") for s in STEPS}
    )
    written = load_file(folder / "model.safetensors")
    for name, t in written.items():
        if t.is_floating_point():
            combo = sum(c * inputs[k][name].double() for k, c in got.items())
            torch.testing.assert_close(t.double(), combo, rtol=1e-5, atol=1e-6)


def test_every_window_and_dema_output_is_a_combination_summing_to_one(stabilized):
    for folder in sorted(stabilized["out"].glob("*/checkpoint-*")):
        c = provenance.read(folder)["coefficients"]
        assert math.fsum(c.values()) == pytest.approx(1.0, abs=1e-12), folder
    lawa = provenance.read(stabilized["out"] / "lawa-w3" / "checkpoint-40")["coefficients"]
    assert lawa == pytest.approx({"20": 1 / 3, "30": 1 / 3, "40": 1 / 3})


def test_verify_rebuilds_from_the_weights_alone_and_names_what_differs(stabilized, tmp_path):
    src = stabilized["out"] / "bema-k0.5-e0.2" / "checkpoint-30"
    r = run_bema("verify", src)
    assert r.returncode == 0 and "bitwise identical to its rebuild (5 tensors)" in r.stdout, r.stderr
    copy = tmp_path / "copied"  # only the weights travelled (an upload of the safetensors alone)
    copy.mkdir()
    shutil.copy(src / "model.safetensors", copy)
    r = run_bema("verify", copy, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["identical"] and doc["differ"] == [] and doc["changed_inputs"] == []
    path = copy / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    weights = load_file(path)
    name = sorted(k for k, v in weights.items() if v.is_floating_point())[0]
    weights[name].view(-1)[3] += 1e-3
    save_file(weights, str(path), metadata=meta)
    line = one_line_error(run_bema("verify", copy), 1)
    assert f"1 of 5 tensors differ from its rebuild: {name}" in line, line


def test_verify_lays_a_difference_at_an_input_that_changed(tmp_path):
    base, run = write_trajectory(tmp_path / "t", STEPS, with_int=False)
    out = tmp_path / "out"
    assert run_bema("stabilize", run, "--base", base, "--out", out, "--method", "ema").returncode == 0
    ckpt = run / "checkpoint-20" / "model.safetensors"
    weights = load_file(ckpt)
    save_file({k: v * 1.01 for k, v in weights.items()}, str(ckpt))  # retrained since
    line = one_line_error(run_bema("verify", out / "ema-k0.5" / "checkpoint-40"), 1)
    assert (
        "tensors differ from its rebuild" in line and "inputs changed since it was written: 20 (" in line
    ), line


def test_a_fitted_average_carries_its_coefficients_and_verifies(stabilized, tmp_path):
    """One record shape: the vector keyed by theta0 and step, in bema.json and the header alike;
    verify rebuilds it in memory (nothing beside the folder) and a changed weight is caught."""
    from bema_cli.decide.candidate import Candidate
    from bema_cli.publish.write import model_record, write_vector

    run = stabilized["run"]
    folders = {"theta0": stabilized["base"], **{str(s): run / f"checkpoint-{s}" for s in STEPS}}
    cand = Candidate.of("soup-x", [0.1, 0.0, 0.2, 0.3, 0.4], STEPS)
    record = model_record(cand, 40, {"method": "soup"}, folders, str(stabilized["base"]), tmp_path / "soup")
    out = write_vector(cand, folders, folders["40"], tmp_path / "soup", record)
    doc = provenance.read(out)
    want = {"theta0": 0.1, "20": 0.2, "30": 0.3, "40": 0.4}
    assert doc["coefficients"] == want == json.loads((out / "bema.json").read_text())["coefficients"]
    before = sorted(p.name for p in tmp_path.iterdir())
    r = run_bema("verify", out)
    assert r.returncode == 0 and "bitwise identical" in r.stdout, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # verify wrote nothing beside it


def test_a_folder_without_provenance_is_one_line(tmp_path, tiny_model_dir):
    line = one_line_error(run_bema("verify", tiny_model_dir), 3)
    assert "carries no bema provenance" in line, line


def test_inputs_are_found_in_any_checkpoint_layout(tmp_path):
    """step_N folders (not checkpoint-N): an unchanged run verifies with no input called changed."""
    base, run = write_trajectory(tmp_path / "t", STEPS, with_int=False)
    steps = tmp_path / "steps"
    steps.mkdir()
    for s in STEPS:
        shutil.copytree(run / f"checkpoint-{s}", steps / f"step_{s}")
    out = tmp_path / "out"
    assert run_bema("stabilize", steps, "--base", base, "--out", out, "--method", "ema").returncode == 0
    r = run_bema("verify", out / "ema-k0.5" / "checkpoint-40", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["changed_inputs"] == []


@pytest.mark.parametrize("run_name", ["bema-k0.5-e0.2", "lawa-w3"])
def test_a_forged_vector_in_the_header_is_caught(stabilized, tmp_path, run_name):
    """The header's coefficients rewritten to put all the weight on one step: the weights are still
    what the method makes, but the stored vector is not the method's, and verify says so (exit 1)."""
    folder = tmp_path / "forged"
    shutil.copytree(stabilized["out"] / run_name / "checkpoint-40", folder)
    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    doc = json.loads(meta[provenance.KEY])
    doc["coefficients"] = {"40": 1.0}
    save_file(tensors, str(path), metadata={**meta, provenance.KEY: json.dumps(doc)})
    r = run_bema("verify", folder)
    assert r.returncode == 1, r.stderr
    assert "coefficients it records are not the ones its method" in r.stderr, r.stderr
    untouched = run_bema("verify", stabilized["out"] / run_name / "checkpoint-40")
    assert untouched.returncode == 0, untouched.stderr


def test_a_stabilize_record_holds_its_vector_and_an_older_one_still_verifies(stabilized, tmp_path):
    """bema.json of a stabilize output holds its vector under `coefficients` as every record does
    (the header's, the paper's in float64), says it was walked, and keeps a window's merge weights
    under their own name; a record an older bema wrote (the window's list under `coefficients`, no
    `written_from`) is still walked again by verify, and identical."""
    folder = stabilized["out"] / "lawa-w3" / "checkpoint-40"
    record = json.loads((folder / "bema.json").read_text())
    assert record["written_from"] == "walk"
    assert (
        record["coefficients"]
        == provenance.read(folder)["coefficients"]
        == pytest.approx({"20": 1 / 3, "30": 1 / 3, "40": 1 / 3}, abs=1e-12)
    )
    assert record["member_steps"] == [20, 30, 40] and record["merge_weights"] == pytest.approx([1 / 3] * 3)
    bema = json.loads((stabilized["out"] / "bema-k0.5-e0.2" / "checkpoint-30" / "bema.json").read_text())
    assert bema["coefficients"] == pytest.approx(_reference("bema", 30), abs=1e-12)
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    path = old / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    doc = json.loads(meta[provenance.KEY])
    rec = {k: v for k, v in doc["record"].items() if k not in ("written_from", "merge_weights")}
    doc["record"] = {**rec, "coefficients": record["merge_weights"]}  # as bema 0.9 wrote it
    save_file(load_file(str(path)), str(path), metadata={**meta, provenance.KEY: json.dumps(doc)})
    r = run_bema("verify", old, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["identical"] and got["rebuilt"] == "in memory" and got["vector_differs"] == [], got


@pytest.mark.parametrize(
    "doc,said",
    [
        ({}, "has no record"),
        ({"record": {"run": "x", "step": 1}, "inputs": {}}, "names no source checkpoint"),
        ({"record": {"run": "x", "step": "abc", "source_checkpoint": "c"}}, "has step 'abc'"),
        ({"record": {"run": "x", "step": 1, "source_checkpoint": "c"}, "inputs": [1, 2]}, "not fingerprints"),
        ({"record": {"step": 1, "source_checkpoint": "c", "coefficients": {"theta0": "x"}}}, "not a finite"),
        ({"record": {"step": 1, "source_checkpoint": "c", "method": "ema", "kappa": "nan"}}, "kappa 'nan'"),
        ("[" * 100_000 + "]" * 100_000, "is not JSON"),
    ],
)
def test_a_malformed_record_is_one_line_exit_3(tmp_path, doc, said):
    folder = tmp_path / "m"
    folder.mkdir()
    text = doc if isinstance(doc, str) else json.dumps(doc)
    save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"), metadata={provenance.KEY: text})
    line = one_line_error(run_bema("verify", folder), 3)
    assert said in line, line


def test_an_input_gone_is_exit_3_as_the_help_says(stabilized, tmp_path):
    base, run = write_trajectory(tmp_path / "t", STEPS, with_int=False)
    out = tmp_path / "out"
    assert run_bema("stabilize", run, "--base", base, "--out", out, "--method", "ema").returncode == 0
    shutil.rmtree(run / "checkpoint-20")
    line = one_line_error(run_bema("verify", out / "ema-k0.5" / "checkpoint-40"), 3)
    assert "an input it was made from is gone: 20" in line, line


@pytest.mark.parametrize("theta0", ["base", "checkpoint-0"])
def test_inputs_are_named_and_found_again_when_moved_with_run_and_base(tmp_path, theta0):
    """Nothing of the machine in the record: the inputs are named inside the folder the output shares
    with them (t/run/checkpoint-40) and verify finds them from the folder's place; moved away, it says
    to pass --run and --base (exit 3), and with them it rebuilds bitwise. theta0 a folder of its own,
    or the run's checkpoint-0 (found in --run)."""
    steps = [0, *STEPS] if theta0 == "checkpoint-0" else STEPS  # seed 7: no other test's identical copy
    base, run = write_trajectory(tmp_path / "t", steps, seed=7)
    out = tmp_path / "out"
    flags = ["--base", base] if theta0 == "base" else []
    assert run_bema("stabilize", run, *flags, "--out", out, "--method", "bema").returncode == 0
    folder = out / "bema-k0.5-e0.2" / "checkpoint-40"
    record = provenance.read(folder)["record"]
    want = "t/base" if theta0 == "base" else "t/run/checkpoint-0"
    assert record["source_checkpoint"] == "t/run/checkpoint-40" and record["theta0_source"] == want
    assert record == json.loads((folder / "bema.json").read_text())
    assert run_bema("verify", folder).returncode == 0
    moved = tmp_path / "elsewhere" / "deeper"
    moved.mkdir(parents=True)
    shutil.move(str(tmp_path / "t"), str(moved / "t2"))
    line = one_line_error(run_bema("verify", folder), 3)
    assert "t/run/checkpoint-40 is not found near it" in line and "--run" in line, line
    r = run_bema("verify", folder, "--run", moved / "t2" / "run")  # theta0 found beside the run or in it
    assert r.returncode == 0 and "bitwise identical" in r.stdout, r.stderr
    if theta0 == "base":  # theta0 moved apart: said as such, and --base finds it
        shutil.move(str(moved / "t2" / "base"), str(tmp_path / "elsewhere" / "b"))
        line = one_line_error(run_bema("verify", folder, "--run", moved / "t2" / "run"), 3)
        assert "its theta0 t/base is not found" in line and "--base" in line, line
        again = ["--run", moved / "t2" / "run", "--base", tmp_path / "elsewhere" / "b"]
        r = run_bema("verify", folder, *again)
        assert r.returncode == 0 and "bitwise identical" in r.stdout, r.stderr


def test_verify_of_a_stabilize_output_writes_nothing(stabilized, tmp_path):
    """Rebuilt in memory by the sweep's walker: no folder beside the output (a user's folder named
    like bema's staging stays), nothing in TMPDIR, and two verifies of one folder at once both pass."""
    import subprocess

    from conftest import BEMA

    folder = stabilized["out"] / "bema-k0.5-e0.2" / "checkpoint-40"
    mine = folder.parent / f".bema-tmp-verify-{folder.name}"  # a user's folder of that name
    mine.mkdir(exist_ok=True)
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    before = sorted(p.name for p in folder.parent.iterdir())
    env = {**__import__("os").environ, "TMPDIR": str(tmp)}
    procs = [subprocess.Popen([str(BEMA), "verify", str(folder), "--json"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert json.loads(out)["rebuilt"] == "in memory"
    assert sorted(p.name for p in folder.parent.iterdir()) == before and mine.is_dir()
    assert not list(tmp.iterdir())


def test_the_rebuild_in_a_temporary_folder_agrees_and_names_what_differs(stabilized, tmp_path, monkeypatch):
    """A model whose walk would not fit in memory is rebuilt by the stabilize engine in a private
    temporary folder: bitwise what the walk gives, a changed tensor named, and the folder gone after."""
    import tempfile

    from bema_cli.publish import verify

    monkeypatch.setattr(verify, "WALK_SHARE", 0.0)  # no walk fits: the other rebuild
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for run in ("ema-k0.5", "bema-k0.5-e0.2", "dema-k0.5", "lawa-w3"):
        folder = stabilized["out"] / run / "checkpoint-30"
        doc = verify.verify(folder)
        assert doc["identical"] and doc["rebuilt"].startswith("in a temporary folder"), (run, doc)
    copy = tmp_path / "copied"
    shutil.copytree(stabilized["out"] / "dema-k0.5" / "checkpoint-30", copy)
    path = copy / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    weights = load_file(path)
    name = sorted(k for k, v in weights.items() if v.is_floating_point())[-1]
    weights[name].view(-1)[0] += 1e-3
    save_file(weights, str(path), metadata=meta)
    doc = verify.verify(copy)
    assert not doc["identical"] and doc["differ"] == [name], doc
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("bema-verify-")]


def _written(stabilized, tmp_path, cand_steps, step, name="model"):
    """A model written by the one writer from the vector {s: 1} over `cand_steps` (vanilla's shape),
    recorded as vanilla at `step`; its run a copy whose checkpoint-40 names a local base path."""
    from bema_cli.decide.candidate import Candidate
    from bema_cli.publish.write import model_record, write_vector

    run = tmp_path / "run"
    if not run.exists():
        shutil.copytree(stabilized["run"], run)
        for s in STEPS:
            ck = run / f"checkpoint-{s}"
            cfg = json.loads((ck / "config.json").read_text())
            (ck / "config.json").write_text(
                json.dumps({**cfg, "_name_or_path": "/home/alice/models/base-secret"})
            )
            (ck / "tokenizer_config.json").write_text(
                json.dumps({"name_or_path": "/home/alice/models/base-secret"})
            )
            (ck / "chat_template.jinja").write_text("{{ messages }}")
    folders = {"theta0": stabilized["base"], **{str(s): run / f"checkpoint-{s}" for s in STEPS}}
    cand = Candidate("vanilla", tuple((str(s), 1.0) for s in cand_steps))
    record = model_record(
        cand, step, {"method": "vanilla"}, folders, str(stabilized["base"]), tmp_path / name
    )
    return write_vector(cand, folders, folders[str(cand_steps[0])], tmp_path / name, record)


def test_a_vanilla_record_is_held_to_its_own_step(stabilized, tmp_path):
    """checkpoint-20's weights in a folder recorded as vanilla at step 40, its vector set to {20: 1} in
    bema.json and the header alike: verify said "bitwise identical" (vanilla's vector was never
    checked); vanilla is {step: 1} at the record's step, and this one is not (exit 1)."""
    good = _written(stabilized, tmp_path, [40], 40, "good")
    r = run_bema("verify", good)
    assert r.returncode == 0 and "bitwise identical" in r.stdout, r.stderr
    forged = _written(stabilized, tmp_path, [20], 40, "forged")
    r = run_bema("verify", forged)
    assert r.returncode == 1 and "coefficients it records are not the ones its method" in r.stderr, r.stderr


def test_verify_reads_the_side_files_and_no_local_path_is_written_or_pushed(stabilized, tmp_path):
    """config.json's rms_norm_eps, hidden_act and the chat template edited after bema wrote the folder:
    the tensors are bitwise their rebuild, yet the model loads and prompts differently; verify names
    the files (exit 1). The run's own config named its base by an absolute path: the output writes it
    as a name, and push refuses a side file that names one again."""
    out = _written(stabilized, tmp_path, [40], 40)
    for name, key in (("config.json", "_name_or_path"), ("tokenizer_config.json", "name_or_path")):
        assert json.loads((out / name).read_text())[key] == "base-secret"
    assert "/home/alice" not in "".join(p.read_text(errors="replace") for p in out.iterdir() if p.is_file())
    ok = run_bema("verify", out)
    assert ok.returncode == 0 and "its config and tokenizer files are as written" in ok.stdout, ok.stdout
    assert run_bema("push", out, "--repo-id", "org/m", "--dry-run").returncode == 0
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 0.5, "hidden_act": "relu"}))
    (out / "chat_template.jinja").write_text("{{ 'edited' }}")
    line = one_line_error(run_bema("verify", out), 1)
    assert "side files differ from what bema wrote: chat_template.jinja, config.json" in line, line
    doc = json.loads(run_bema("verify", out, "--json").stdout)
    assert doc["identical"] is False and doc["files_differ"] == ["chat_template.jinja", "config.json"]
    (out / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "/home/alice/models/base-secret"}))
    line = one_line_error(run_bema("push", out, "--repo-id", "org/m", "--dry-run"), 3)
    assert "config.json: _name_or_path is a local path" in line, line
