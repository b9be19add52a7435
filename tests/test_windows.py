"""lawa, wsm, swa and power (issue 21): exact against a float64 reference and real libraries.

The reference (tests/reference.py: window_reference, megatron_coefficients) is written from the
issue's formulas, not from bema's code. `bema stabilize` accumulates in float32 here: outputs agree
with the float64 reference to 2e-6 relative + 1e-6 absolute (a K-term float32 sum of O(1) values).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import one_line_error, run_bema
from reference import edm2_gamma, megatron_coefficients, window_reference
from safetensors.torch import load_file
from trajectory import tensor_section, write_trajectory

from bema_cli.errors import UsageError
from bema_cli.schedule import Schedule, merge_coefficients, run_name, sigma_rel_to_gamma

STEPS = [10, 20, 30, 40, 50, 60, 70]
RTOL, ATOL = 2e-6, 1e-6


def _load(folder):
    return load_file(str(folder / "model.safetensors"))


def _trajectory(root, steps=STEPS, **kw):
    base, run = write_trajectory(root, steps, **kw)
    return base, run, [(s, _load(run / f"checkpoint-{s}")) for s in steps]


def _close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for name, w in want.items():
        g = got[name]
        if w.is_floating_point():
            torch.testing.assert_close(g.double(), w.double(), rtol=RTOL, atol=ATOL, msg=f"{what} {name}")
        else:
            assert torch.equal(g, w), f"{what} {name}"


@pytest.mark.parametrize("schedule", ["linear", "minus-sqrt", "cosine"])
@pytest.mark.parametrize("reverse", [False, True])
def test_coefficient_table_matches_the_definition(schedule, reverse):
    """merge_coefficients for n = 1..20 against Megatron's definition, computed here."""
    name = schedule + (":reverse" if reverse else "")
    for n in range(1, 21):
        got, want = merge_coefficients(name, n), megatron_coefficients(name, n)
        assert len(got) == n
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (name, n)
        assert math.fsum(got) == pytest.approx(1.0, abs=1e-12)
    if schedule == "linear":  # the uniform mean: LAWA
        assert merge_coefficients(name, 8) == pytest.approx([1 / 8] * 8)
    if schedule == "minus-sqrt" and not reverse:  # oldest first: the oldest weighs most (sqrt(1/n))
        c = merge_coefficients(name, 4)
        assert c[0] == pytest.approx(0.5) and c[-1] == pytest.approx(1 - math.sqrt(3 / 4))


def test_sigma_rel_matches_edm2():
    for sr in (0.01, 0.05, 0.1, 0.2, 0.28):
        assert sigma_rel_to_gamma(sr) == pytest.approx(edm2_gamma(sr), rel=1e-9)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"method": "lawa", "window": 0}, "--window"),
        ({"method": "wsm", "merge_schedule": "sqrt"}, "--schedule"),
        ({"method": "wsm", "merge_schedule": "linear:backwards"}, "--schedule"),
        ({"method": "power", "sigma_rel": math.nan}, "--sigma-rel"),
        ({"method": "power", "sigma_rel": 0.5}, "--sigma-rel"),
        ({"method": "power", "power_gamma": -2.0}, "--power-gamma"),
        ({"method": "swa", "swa_start": -1}, "--swa-start"),
    ],
)
def test_invalid_parameters(kwargs, flag):
    with pytest.raises(UsageError, match=flag):
        Schedule(**kwargs).resolved()


def test_run_names():
    def name(**kw):
        return run_name(Schedule(**kw).resolved())

    assert name(method="lawa", window=8) == "lawa-w8"
    assert name(method="wsm", window=8, merge_schedule="minus-sqrt") == "wsm-minus_sqrt-w8"
    assert name(method="wsm", window=4, merge_schedule="cosine:reverse") == "wsm-cosine_reverse-w4"
    assert name(method="swa", swa_start=1000) == "swa-s1000"
    assert name(method="power", sigma_rel=0.05) == "power-sr0.05"
    assert name(method="power", power_gamma=6.94) == "power-g6.94"


# (flags, {run: reference kwargs}) of one `bema stabilize` call each
CASES = {
    "grid": (
        ["--method", "bema,lawa,wsm,swa,power", "--window", "3,8", "--schedule", "minus-sqrt,cosine:reverse"],
        {
            "lawa-w3": {"method": "lawa", "window": 3},
            "lawa-w8": {"method": "lawa", "window": 8},  # larger than the run: it only grows
            "wsm-minus_sqrt-w3": {"method": "wsm", "window": 3, "schedule": "minus-sqrt"},
            "wsm-minus_sqrt-w8": {"method": "wsm", "window": 8, "schedule": "minus-sqrt"},
            "wsm-cosine_reverse-w3": {"method": "wsm", "window": 3, "schedule": "cosine:reverse"},
            "wsm-cosine_reverse-w8": {"method": "wsm", "window": 8, "schedule": "cosine:reverse"},
            "swa": {"method": "swa"},
            "power-sr0.05": {"method": "power", "power_gamma": edm2_gamma(0.05)},
        },
    ),
    "phi-burnin": (
        [
            "--method",
            "lawa,wsm,swa,power",
            "--window",
            "2",
            "--tau",
            "20",
            "--phi",
            "20",
            "--power-gamma",
            "3",
        ],
        {
            "lawa-w2": {"method": "lawa", "window": 2, "tau": 20, "phi": 20},
            "wsm-minus_sqrt-w2": {
                "method": "wsm",
                "window": 2,
                "schedule": "minus-sqrt",
                "tau": 20,
                "phi": 20,
            },
            "swa": {"method": "swa", "tau": 20, "phi": 20},
            "power-g3.0": {"method": "power", "power_gamma": 3.0, "tau": 20, "phi": 20},
        },
    ),
    "swa-start": (
        ["--method", "swa", "--swa-start", "40,45"],
        {"swa-s40": {"method": "swa", "swa_start": 40}, "swa-s45": {"method": "swa", "swa_start": 45}},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_matches_float64_reference(tmp_path, case):
    flags, runs = CASES[case]
    base, run, trajectory = _trajectory(tmp_path)
    out = tmp_path / "out"
    proc = run_bema("stabilize", run, "--base", base, "--out", out, "--max-memory", "700B", "--json", *flags)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert {o["run"] for o in doc["outputs"]} - {"bema-k0.5-e0.2"} == set(runs)  # every combination
    for name, kw in runs.items():
        want = window_reference(trajectory, **kw)
        steps = sorted(o["step"] for o in doc["outputs"] if o["run"] == name)
        assert steps == sorted(want), name
        for step in steps:
            folder = out / name / f"checkpoint-{step}"
            _close(_load(folder), want[step], f"{name}@{step}")
            record = json.loads((folder / "bema.json").read_text())
            assert record["method"] == kw["method"]
            if kw["method"] in ("lawa", "wsm") and step > kw.get("tau", 0):
                # how many were merged: fewer than K while the window fills
                members = [s for s in sorted(want) if s <= step and s > kw.get("tau", 0)]
                assert record["members"] == min(kw["window"], len(members)), (name, step)
                assert record["member_steps"] == members[-kw["window"] :]
                assert record["window"] == kw["window"]
    if case == "grid":
        record = json.loads((out / "power-sr0.05/checkpoint-70/bema.json").read_text())
        assert record["sigma_rel"] == 0.05 and record["power_gamma"] == pytest.approx(edm2_gamma(0.05))
        assert json.loads((out / "wsm-cosine_reverse-w8/checkpoint-70/bema.json").read_text())[
            "schedule"
        ] == ("cosine:reverse")


def test_swa_matches_torch_averaged_model(tmp_path):
    """torch.optim.swa_utils.AveragedModel's default (equal weights) over the same checkpoints."""
    base, run, trajectory = _trajectory(tmp_path, with_int=False)
    out = tmp_path / "out"
    proc = run_bema("stabilize", run, "--base", base, "--out", out, "--method", "swa", "--swa-start", "30")
    assert proc.returncode == 0, proc.stderr
    model = torch.nn.ParameterDict(
        {k.replace(".", "_"): torch.nn.Parameter(v) for k, v in trajectory[0][1].items()}
    )
    averaged = torch.optim.swa_utils.AveragedModel(model)
    for step, state in trajectory:
        if step < 30:
            continue
        with torch.no_grad():
            for k, v in state.items():
                model[k.replace(".", "_")].copy_(v)
        averaged.update_parameters(model)
        got = _load(out / "swa-s30" / f"checkpoint-{step}")
        for k in state:
            want = averaged.module[k.replace(".", "_")].detach()
            torch.testing.assert_close(got[k], want, rtol=2e-6, atol=1e-6, msg=f"step {step} {k}")


def test_power_matches_ema_pytorch_karras_ema(tmp_path):
    """ema-pytorch's KarrasEMA (EDM2's power EMA) on a trajectory that saves every step.

    KarrasEMA's t-th update weighs the model by 1 - (t/(t+1))**(gamma+1) (its step counter is
    incremented before `beta` reads step + 1), which is EDM2's (s_(k-1)/s_k)**(gamma+1) with s_k = k + 1:
    a run that saves every step from step 2 on. The first update takes the model whole in both."""
    ema_pytorch = pytest.importorskip("ema_pytorch")
    steps = list(range(2, 14))
    base, run, trajectory = _trajectory(tmp_path, steps=steps, with_int=False)
    out = tmp_path / "out"
    # a run that saves every step but not step 1: by its own spacing step 1 is missing (gaps.py), so
    # this deliberate start is said with --allow-gaps
    proc = run_bema("stabilize", run, "--base", base, "--out", out, "--method", "power", "--sigma-rel", "0.1",
                    "--allow-gaps")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    model = torch.nn.ParameterDict(
        {k.replace(".", "_"): torch.nn.Parameter(v.clone()) for k, v in _load(base).items()}
    )
    karras = ema_pytorch.KarrasEMA(model, sigma_rel=0.1, update_every=1)
    for step, state in trajectory:
        with torch.no_grad():
            for k, v in state.items():
                model[k.replace(".", "_")].copy_(v)
        karras.update()
        got = _load(out / "power-sr0.1" / f"checkpoint-{step}")
        for k in state:
            want = karras.ema_model[k.replace(".", "_")].detach()
            torch.testing.assert_close(got[k], want, rtol=2e-6, atol=1e-6, msg=f"step {step} {k}")


def test_one_read_pass_and_units_shrink_with_window(tmp_path):
    """Bytes read equal the inputs' tensor bytes for any K (theta0 only where a method needs it); the
    ring (K-1 slices) is counted in --max-memory, so units shrink (more of them) as K grows."""
    base, run, _ = _trajectory(tmp_path, shapes={"w": (256, 64), "b": (64,)})

    def tensor_bytes(files):
        return sum(f.stat().st_size - 8 - int.from_bytes(f.read_bytes()[:8], "little") for f in files)

    checkpoints = tensor_bytes(run.glob("*/model.safetensors"))
    theta0 = tensor_bytes([base / "model.safetensors"])
    units = []
    for window in (1, 4, 16):
        flags = ("--window", str(window), "--max-memory", "300KiB", "--json")
        out = tmp_path / f"out{window}"
        windows = ("--method", "lawa,wsm", *flags)
        plan = json.loads(
            run_bema("stabilize", run, "--base", base, "--out", out, *windows, "--dry-run").stdout
        )
        units.append(plan["plan"]["work_units"])
        proc = run_bema("stabilize", run, "--base", base, "--out", out, *windows)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["read_bytes"] == checkpoints, window  # windows never read theta0
        grid = ("--method", "lawa,wsm,bema", *flags)
        proc = run_bema("stabilize", run, "--base", base, "--out", tmp_path / f"grid{window}", *grid)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["read_bytes"] == checkpoints + theta0, window  # bema's drift needs it
    assert units[0] < units[1] < units[2], units


def test_continued_window_is_bitwise_one_shot_even_when_checkpoints_rotate(tmp_path):
    """Three calls (the middle one after the trainer deleted old checkpoints: save_total_limit 2 < K)
    give the bytes of one call over the whole run; the ring comes from the run or from the state."""
    base, run, _ = _trajectory(tmp_path)
    flags = ("--method", "lawa,wsm,swa,power,bema", "--window", "4", "--max-memory", "900B")
    whole = tmp_path / "whole"
    assert run_bema("stabilize", run, "--base", base, "--out", whole, *flags).returncode == 0
    part = tmp_path / "part"
    part.mkdir()
    out = tmp_path / "out"
    for batch in ([10, 20, 30], [40, 50], [60, 70]):
        for s in batch:
            shutil.copytree(run / f"checkpoint-{s}", part / f"checkpoint-{s}")
        proc = run_bema("stabilize", part, "--base", base, "--out", out, *flags)
        assert proc.returncode == 0, proc.stderr
        for s in sorted(int(p.name.split("-")[1]) for p in part.glob("checkpoint-*"))[:-2]:
            shutil.rmtree(part / f"checkpoint-{s}")  # save_total_limit 2
    for folder in whole.glob("*/checkpoint-*"):
        got = out / folder.relative_to(whole)
        assert tensor_section(got / "model.safetensors") == tensor_section(folder / "model.safetensors"), (
            folder
        )


def test_bad_input_is_one_line(tmp_path):
    base, run, _ = _trajectory(tmp_path)
    out = tmp_path / "out"
    cases = [
        (["--method", "lawa", "--window", "0"], "--window"),
        (["--method", "wsm", "--schedule", "sqrt"], "--schedule"),
        (["--method", "power", "--sigma-rel", "nan"], "--sigma-rel"),
        (["--method", "swa", "--swa-start", "1000"], "--swa-start 1000: after the last checkpoint step (70)"),
        (["--method", "bema", "--window", "4"], "--window: applies to lawa, wsm"),
        (["--method", "lawa", "--kappa", "0.3"], "--kappa: applies to"),
    ]
    for flags, message in cases:
        line = one_line_error(run_bema("stabilize", run, "--base", base, "--out", out, *flags))
        assert message in line, line
    assert not out.exists()


@pytest.mark.slow  # ~30 s: a --follow process beside a "trainer" that keeps 2 checkpoints
def test_follow_with_a_window_larger_than_save_total_limit(tmp_path):
    """--follow continues lawa/wsm over checkpoints the trainer already deleted (the ring kept in the
    state); its outputs are the bytes of a one-shot run."""
    import subprocess
    import time

    from conftest import BEMA

    base, full, _ = _trajectory(tmp_path / "traj")
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    flags = ["--method", "lawa,wsm", "--window", "4", "--max-memory", "900B"]
    cmd = [str(BEMA), "stabilize", str(run), "--base", str(base), "--out", str(out), *flags]
    proc = subprocess.Popen(
        [*cmd, "--follow", "--json", "--poll", "0.2", "--settle", "0", "--until-step", "70"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for i, step in enumerate(STEPS):
        shutil.copytree(full / f"checkpoint-{step}", run / f"checkpoint-{step}")
        deadline = time.monotonic() + 60
        while not (out / "lawa-w4" / f"checkpoint-{step}").is_dir() and time.monotonic() < deadline:
            time.sleep(0.1)
        if i >= 2:  # save_total_limit 2: the trainer deletes the oldest
            shutil.rmtree(run / f"checkpoint-{STEPS[i - 2]}")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert sorted({json.loads(x)["step"] for x in stdout.splitlines()}) == STEPS
    one = tmp_path / "one"
    assert run_bema("stabilize", full, "--base", base, "--out", one, *flags).returncode == 0
    for folder in sorted(one.glob("*/checkpoint-*")):
        got = out / folder.relative_to(one) / "model.safetensors"
        assert tensor_section(got) == tensor_section(folder / "model.safetensors"), folder


def test_a_member_neither_on_disk_nor_in_the_state_is_refused(tmp_path):
    """A continued window whose ring member is gone from the run and missing from the state (here: a
    state written without it, sealed as bema would) is one line naming the step and --window."""

    from bema_cli.stabilize import state_doc

    base, full, _ = _trajectory(tmp_path / "traj")
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    for s in (10, 20, 30, 40):
        shutil.copytree(full / f"checkpoint-{s}", run / f"checkpoint-{s}")
    flags = ("--method", "lawa", "--window", "4")
    assert run_bema("stabilize", run, "--base", base, "--out", out, *flags).returncode == 0
    doc_path = out / ".bema-state" / "state.json"
    doc = json.loads(doc_path.read_text())
    folder = out / ".bema-state" / doc["runs"][0]["state"]
    # each member's tensors lie in files of their own (state_store.state_layout): drop step 30's
    gone = [f for f in folder.glob("*.safetensors") if any(k.startswith("s30/") for k in load_file(str(f)))]
    assert len(gone) == 1  # the ring held step 30
    gone[0].unlink()
    doc["checksums"][folder.name] = state_doc.checksums(folder)
    doc["seal"] = state_doc.seal(doc)
    doc_path.write_text(json.dumps(doc))
    shutil.rmtree(run / "checkpoint-30")
    shutil.copytree(full / "checkpoint-50", run / "checkpoint-50")
    line = one_line_error(run_bema("stabilize", run, "--base", base, "--out", out, *flags, "--allow-gaps"))
    assert "lawa-w4 (--window 4) needs checkpoint step(s) 30" in line, line
    # with checkpoint-30 back on disk the same call goes on: the member is read from the run
    shutil.copytree(full / "checkpoint-30", run / "checkpoint-30")
    proc = run_bema("stabilize", run, "--base", base, "--out", out, *flags)
    assert proc.returncode == 0, proc.stderr
    want = window_reference([(s, _load(full / f"checkpoint-{s}")) for s in STEPS[:5]], "lawa", window=4)
    _close(_load(out / "lawa-w4" / "checkpoint-50"), want[50], "lawa-w4@50")


def test_a_yaml_grid_config_is_the_same_grid_as_the_flags(tmp_path):
    """--config grid.yaml (each method with its own lists, mergekit-style) writes the runs the
    equivalent flags write, byte for byte; bad files and flags beside it are one line."""
    base, run, _ = _trajectory(tmp_path)
    config = tmp_path / "grid.yaml"
    config.write_text(
        "tau: 0\n"
        "methods:\n"
        "  bema: {kappa: 0.5, eta: [0.2, inf]}\n"  # eta inf: the EMA, written once as ema-k0.5
        "  wsm: {window: [2, 4], schedule: [minus-sqrt, 'cosine:reverse']}\n"
        "  power: {sigma_rel: [0.1]}\n"
    )
    a, b = tmp_path / "a", tmp_path / "b"
    proc = run_bema("stabilize", run, "--base", base, "--out", a, "--config", config, "--json")
    assert proc.returncode == 0, proc.stderr
    names = {o["run"] for o in json.loads(proc.stdout)["outputs"]}
    assert names == {"bema-k0.5-e0.2", "ema-k0.5", "wsm-minus_sqrt-w2", "wsm-minus_sqrt-w4",
                     "wsm-cosine_reverse-w2", "wsm-cosine_reverse-w4", "power-sr0.1"}  # fmt: skip
    flags = ("--method", "bema,wsm,power", "--eta", "0.2,inf", "--window", "2,4",
             "--schedule", "minus-sqrt,cosine:reverse", "--sigma-rel", "0.1")  # fmt: skip
    assert run_bema("stabilize", run, "--base", base, "--out", b, *flags).returncode == 0
    for folder in sorted(a.glob("*/checkpoint-*")):
        other = b / folder.relative_to(a) / "model.safetensors"
        assert (folder / "model.safetensors").read_bytes() == other.read_bytes(), folder
    bad = [
        ("methods:\n  lawa: {kappa: 0.5}\n", "methods.lawa.kappa is not a lawa parameter (allowed: window)"),
        ("methods:\n  nope: {}\n", "unknown method 'nope'"),
        ("methods:\n  lawa: {window: 2.5}\n", "methods.lawa.window: a whole number, got 2.5"),
        ("methods: [bema]\n", "expected a mapping with a non-empty 'methods:' mapping"),
        ("methods: {bema: {}}\nkapa: 1\n", "unknown key 'kapa'"),
        ("methods: {bema: {\n", "not valid YAML"),
    ]
    for i, (text, message) in enumerate(bad):
        config.write_text(text)
        line = one_line_error(
            run_bema("stabilize", run, "--base", base, "--out", tmp_path / f"x{i}", "--config", config), 3
        )
        assert message in line and str(config) in line, line
    config.write_text("methods: {bema: {}}\n")
    line = one_line_error(
        run_bema(
            "stabilize", run, "--base", base, "--out", tmp_path / "y", "--config", config, "--eta", "0.3"
        ),
        2,
    )
    assert "drop --eta" in line
