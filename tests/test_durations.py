"""Durations (bema_cli/durations.py): every duration against the count, step or exponent it resolves
to, computed here independently (brute force over the saved steps; float64 for the half-life)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import names

from bema_cli import durations
from bema_cli.errors import UsageError
from bema_cli.io.checkpoints import Checkpoint

STEPS = [100 * i for i in range(1, 21)] + [2050]  # every 100 to 2000, then one more save at 2050


@pytest.mark.parametrize(
    ("text", "amount", "unit"),
    [("2000steps", 2000, "steps"), ("1step", 1, "steps"), ("5Btok", 5e9, "tokens"), ("500Mtok", 5e8, "tokens"),
     ("1.5Ttokens", 1.5e12, "tokens"), ("300tok", 300, "tokens"), ("5%", 0.05, "fraction"), ("100%", 1.0, "fraction")],
)  # fmt: skip
def test_parse(text, amount, unit):
    d = durations.parse(text)
    assert (d.amount, d.unit, d.text) == (pytest.approx(amount), unit, text)


@pytest.mark.parametrize("text", ["8", 8, "12.0"])
def test_a_bare_number_keeps_its_old_meaning(text):
    assert durations.parse(text) is None


@pytest.mark.parametrize("text", ["5 apples", "-3steps", "5Gtok", "steps"])
def test_a_malformed_duration_is_refused_saying_the_forms(text):
    with pytest.raises(UsageError, match="steps .2000steps., tokens .5Btok"):
        durations.parse(text)


@pytest.mark.parametrize("text", ["0%", "120%"])
def test_a_fraction_outside_the_run_is_refused(text):
    with pytest.raises(UsageError, match=r"a fraction of the run is in \(0%, 100%\]"):
        durations.parse(text)


def brute_window(steps, span):
    last = max(steps)
    return [s for s in steps if last - span < s <= last]


@pytest.mark.parametrize(("text", "span"), [("550steps", 550), ("25%", 0.25 * 2050), ("550Mtok", 550),
                                            ("1step", 1), ("100%", 2050)])  # fmt: skip
def test_a_window_is_the_checkpoints_inside_its_span(text, span):
    clock = durations.RunClock(tuple(STEPS), 1e6, "test")
    k, record = durations.window_members(durations.parse(text), clock)
    inside = brute_window(STEPS, span)
    assert k == len(inside) and record["first_step"] == inside[0] and record["last_step"] == 2050
    assert record["steps"] == pytest.approx(span) and record["duration"] == text


def test_a_start_is_the_first_saved_step_at_or_after_its_position():
    clock = durations.RunClock(tuple(STEPS), 2e6, "test")
    for text, at in (("80%", 0.8 * 2050), ("1000steps", 1000), ("1001steps", 1001), ("3Btok", 1500)):
        step, record = durations.swa_start_step(durations.parse(text), clock)
        assert step == min(s for s in STEPS if s >= at) and record["position_steps"] == pytest.approx(at)
    with pytest.raises(UsageError, match="after the run's last checkpoint"):
        durations.swa_start_step(durations.parse("2051steps"), clock)


def test_half_life_is_torchtitans_dynamic_ema_as_a_power_ema():
    """torchtitan decays by 0.5 ** (1 / (h t)) per step (half-life h t); the power EMA's decay is
    (1 - 1/t) ** (gamma + 1). With gamma = ln 2 / h - 1 the two update weights agree to O(1/t)."""
    clock = durations.RunClock((1000, 2000), None)
    for text, h in (("5%", 0.05), ("100steps", 0.05), ("50%", 0.5)):
        gamma, record = durations.half_life_gamma(durations.parse(text), clock)
        assert gamma == pytest.approx(math.log(2) / h - 1, rel=1e-15) and record["half_life_fraction"] == h
        for t in (10**3, 10**4, 10**5):
            titan = 1 - 0.5 ** (1 / (h * t))
            power = 1 - (1 - 1 / t) ** (gamma + 1)
            assert abs(titan - power) / power < 3 * (gamma + 2) / t  # the O(1/t) gap shrinks with t


def test_tokens_per_step_from_the_trainers_own_records(tmp_path):
    hf = tmp_path / "checkpoint-400"
    hf.mkdir()
    (hf / "trainer_state.json").write_text(
        json.dumps({"global_step": 400, "num_input_tokens_seen": 400 * 8192})
    )
    clock = durations.clock([Checkpoint(400, hf)])
    assert clock.tokens_per_step == 8192 and "num_input_tokens_seen" in clock.tokens_source
    assert durations.clock([Checkpoint(400, hf)], tokens_per_step=100).tokens_per_step == 100
    mb = tmp_path / "iter_0000300"
    (mb / "hf").mkdir(parents=True)
    (mb / "run_config.yaml").write_text(
        "train:\n  global_batch_size: 512\ndataset:\n  sequence_length: 4096\n"
    )
    clock = durations.clock([Checkpoint(300, mb / "hf")])  # Megatron-Bridge: run_config.yaml beside hf/
    assert clock.tokens_per_step == 512 * 4096 and "run_config.yaml" in clock.tokens_source
    bare = durations.clock([Checkpoint(300, tmp_path)])
    with pytest.raises(UsageError, match="--tokens-per-step"):
        durations.window_members(durations.parse("1Btok"), bare)


# -- through the real CLI: a duration writes the same bytes as the count, step or exponent it resolves to
def _stabilize(run, base, out, *flags):
    from conftest import run_bema

    r = run_bema("stabilize", run, "--base", base, "--out", out, "--json", *flags)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _same_outputs(a, b, run_a, run_b, step):
    import torch

    wa, wb = _weights(a / run_a / f"checkpoint-{step}"), _weights(b / run_b / f"checkpoint-{step}")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def run10(tmp_path_factory):
    from trajectory import write_trajectory

    root = tmp_path_factory.mktemp("durations")
    base, run = write_trajectory(root, [10 * i for i in range(1, 11)])  # steps 10..100
    for i in range(1, 11):  # as the HF Trainer records it with include_num_input_tokens_seen
        state = run / f"checkpoint-{10 * i}" / "trainer_state.json"
        state.write_text(json.dumps({"global_step": 10 * i, "num_input_tokens_seen": 10 * i * 4096}))
    return root, base, run


@pytest.mark.slow  # real bema stabilize runs (a few seconds each)
def test_a_window_duration_is_the_window_of_its_count(run10, tmp_path):
    root, base, run = run10
    by_count = _stabilize(run, base, tmp_path / "count", "--method", "lawa", "--window", "3", "--final-only")
    for text in (
        "25%",
        "30steps",
        "122880tok",
    ):  # (75, 100], (70, 100], 30 steps of 4096 tokens: 3 checkpoints
        out = tmp_path / text.replace("%", "pct")
        doc = _stabilize(run, base, out, "--method", "lawa", "--window", text, "--final-only")
        _same_outputs(tmp_path / "count", out, "lawa-w3", "lawa-w3", 100)
        record = json.loads((out / "lawa-w3" / "checkpoint-100" / "bema.json").read_text())
        (resolved,) = record["durations"]["window"]
        assert resolved["duration"] == text and resolved["checkpoints"] == 3 and resolved["first_step"] == 80
        assert doc["durations"] == record["durations"] and record["member_steps"] == [80, 90, 100]
    assert "durations" not in json.loads(
        (tmp_path / "count" / "lawa-w3" / "checkpoint-100" / "bema.json").read_text()
    )
    assert by_count["outputs"]


@pytest.mark.slow  # real bema stabilize runs (a few seconds each)
def test_a_start_and_a_half_life_are_their_step_and_exponent(run10, tmp_path):
    root, base, run = run10
    _stabilize(run, base, tmp_path / "a", "--method", "swa", "--swa-start", "50%", "--final-only")
    _stabilize(run, base, tmp_path / "b", "--method", "swa", "--swa-start", "50", "--final-only")
    _same_outputs(tmp_path / "a", tmp_path / "b", "swa-s50", "swa-s50", 100)
    gamma = math.log(2) / 0.2 - 1
    doc = _stabilize(run, base, tmp_path / "c", "--method", "power", "--half-life", "20%", "--final-only")
    (name,) = {o["run"] for o in doc["outputs"]}
    record = json.loads((tmp_path / "c" / name / "checkpoint-100" / "bema.json").read_text())
    assert record["power_gamma"] == pytest.approx(gamma, rel=1e-12)
    _stabilize(run, base, tmp_path / "d", "--method", "power", "--power-gamma", repr(gamma), "--final-only")
    _same_outputs(tmp_path / "c", tmp_path / "d", name, name, 100)


def test_durations_are_refused_where_they_cannot_be_resolved(run10, tmp_path):
    from conftest import one_line_error, run_bema

    root, base, run = run10
    line = one_line_error(run_bema("stabilize", run, "--base", base, "--out", tmp_path / "x", "--method", "ema",
                                   "--half-life", "5%"))  # fmt: skip
    assert "--half-life" in line and "power" in line
    line = one_line_error(run_bema("stabilize", run, "--base", base, "--out", tmp_path / "x", "--method", "lawa",
                                   "--window", "5 apples"))  # fmt: skip
    assert "--window" in line and "2000steps" in line


@pytest.mark.slow  # real bema stabilize runs (a few seconds each)
def test_megatron_bridge_iter_folders_are_read_from_their_hf_export(run10, tmp_path):
    """Megatron-Bridge writes iter_<N>/hf/ (safetensors, config, tokenizer) beside its native
    checkpoint: that folder is the checkpoint of step N, and run_config.yaml gives tokens per step."""
    import shutil

    root, base, run = run10
    mb = tmp_path / "mb"
    for step in (10, 20, 30):
        shutil.copytree(run / f"checkpoint-{step}", mb / f"iter_{step:07d}" / "hf")
        (mb / f"iter_{step:07d}" / "hf" / "trainer_state.json").unlink()
        (mb / f"iter_{step:07d}" / "common.pt").write_bytes(b"native megatron state, not read")
        (mb / f"iter_{step:07d}" / "run_config.yaml").write_text(
            "train:\n  global_batch_size: 8\ndataset:\n  sequence_length: 512\n"
        )
    doc = _stabilize(mb, base, tmp_path / "out", "--method", "lawa", "--window", "61440tok", "--final-only")
    record = json.loads((tmp_path / "out" / "lawa-w2" / "checkpoint-30" / "bema.json").read_text())
    assert names(record["source_checkpoint"], mb / "iter_0000030" / "hf") and record["member_steps"] == [
        20,
        30,
    ]
    (resolved,) = doc["durations"]["window"]
    assert resolved["checkpoints"] == 2 and resolved["tokens_per_step"] == 8 * 512
    assert "run_config.yaml" in resolved["tokens_source"]
    # bema verify rebuilds it from the record in its weights: the inputs named are the iter_N/hf folders
    from conftest import run_bema

    r = run_bema("verify", tmp_path / "out" / "lawa-w2" / "checkpoint-30")
    assert r.returncode == 0 and "bitwise identical to its rebuild" in r.stdout, r.stderr


# -- Megatron-LM's merge selection controls: thinning, a minimum count, scrambled coefficients
def test_thinning_keeps_the_target_and_checkpoints_at_least_the_interval_apart():
    from bema_cli.stabilize.prepare import thin

    steps = [10, 20, 35, 40, 55, 70, 80, 100]
    for interval in (1, 15, 30, 100):
        kept = [c.step for c in thin([Checkpoint(s, None) for s in steps], interval)]
        ref, last = [], None  # by hand: from the last step back, greedily
        for s in reversed(steps):
            if last is None or last - s >= interval:
                ref.append(s)
                last = s
        assert kept == ref[::-1] and kept[-1] == 100
        assert all(b - a >= interval for a, b in zip(kept, kept[1:], strict=False))


@pytest.mark.slow  # real bema stabilize runs (a few seconds each)
def test_a_thinned_run_is_the_run_of_its_kept_checkpoints(run10, tmp_path):
    import subprocess

    from conftest import BEMA, one_line_error, run_bema

    root, base, run = run10
    _stabilize(run, base, tmp_path / "thin", "--method", "ema", "--min-interval", "30", "--final-only")
    listed = "".join(f"{s} {run / f'checkpoint-{s}'}\n" for s in (10, 40, 70, 100))
    r = subprocess.run([str(BEMA), "stabilize", "-", "--base", base, "--out", tmp_path / "list", "--method", "ema",
                        "--final-only"], input=listed, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    _same_outputs(tmp_path / "thin", tmp_path / "list", "ema-k0.5", "ema-k0.5", 100)
    record = json.loads((tmp_path / "thin" / "ema-k0.5" / "checkpoint-100" / "bema.json").read_text())
    assert record["averaged_steps"] == [10, 40, 70, 100]
    line = one_line_error(run_bema("stabilize", run, "--base", base, "--out", tmp_path / "few", "--method", "ema",
                                   "--min-interval", "40", "--min-checkpoints", "4"))  # fmt: skip
    assert f"{run}: 3 checkpoint(s) after thinning to every 40 steps, fewer than --min-checkpoints 4" in line


@pytest.mark.slow  # real bema stabilize runs (a few seconds each)
def test_scrambled_coefficients_are_a_seeded_permutation(run10, tmp_path):
    import torch

    from bema_cli.schedule import merge_coefficients

    base_c = merge_coefficients("minus-sqrt", 6)
    one, two = (
        merge_coefficients("minus-sqrt:scrambled-7", 6),
        merge_coefficients("minus-sqrt:scrambled-7", 6),
    )
    assert one == two and sorted(one) == sorted(base_c) and one != base_c
    assert merge_coefficients("minus-sqrt:scrambled-8", 6) != one
    root, base, run = run10
    _stabilize(run, base, tmp_path / "s", "--method", "wsm", "--window", "6", "--schedule", "minus-sqrt:scrambled-7",
               "--final-only")  # fmt: skip
    got = _weights(tmp_path / "s" / "wsm-minus_sqrt_scrambled_7-w6" / "checkpoint-100")
    members = [_weights(run / f"checkpoint-{s}") for s in (50, 60, 70, 80, 90, 100)]
    for name, value in got.items():
        if value.is_floating_point():  # float64 reference: the members weighted by the permuted coefficients
            ref = sum(c * m[name].double() for c, m in zip(one, members, strict=True))
            assert torch.allclose(value.double(), ref, rtol=1e-6, atol=1e-6), name


# -- "can averaging help here?": the motion measured in the read pass
def _motion_reference(run, base, steps):
    from trajectory import motion_reference

    return motion_reference(base, {s: run / f"checkpoint-{s}" for s in steps})


@pytest.mark.slow  # real bema stabilize runs (a few seconds each)
def test_motion_is_measured_in_the_read_pass_against_float64(run10, tmp_path):
    root, base, run = run10
    steps = [10 * i for i in range(1, 11)]
    doc = _stabilize(
        run, base, tmp_path / "m", "--method", "ema,lawa", "--window", "4", "--max-memory", "300KiB"
    )
    ref = _motion_reference(run, base, steps)
    assert [r["step"] for r in doc["motion"]] == steps
    for row in doc["motion"]:  # float32 accumulation against float64: 1e-5 relative
        assert row["relative"] == pytest.approx(ref[row["step"]], rel=1e-5)
        assert set(row["groups"]) <= {"embeddings", "attention", "mlp", "norms", "other"}
    # a continued call measures from its second step on (its first one's predecessor was read before)
    more = [10 * i for i in range(11, 14)]
    from trajectory import write_trajectory

    _, longer = write_trajectory(tmp_path / "longer", steps + more)
    doc = _stabilize(longer, base, tmp_path / "n", "--method", "ema")
    assert [r["step"] for r in doc["motion"]][:1] == [10]


@pytest.mark.parametrize("held", [False, True], ids=["read-again", "held"])
@pytest.mark.parametrize(
    "methods,tau",
    [(("ema", "lawa"), 0), (("bema",), 30), (("lawa",), 0)],
    ids=["ema-lawa", "burnin", "windows-alone"],
)
def test_the_sweeps_walk_measures_the_same_motion_against_float64(run10, monkeypatch, held, methods, tau):
    """`bema sweep`'s walker measures the motion as it walks (no read of its own): theta_s read
    again from its file or held, the previous checkpoint kept open or copied, a burn-in moving theta0
    meanwhile. Against float64 by hand, 1e-5 relative (float32 sums of squares)."""
    from bema_cli.stabilize import Options, grid, motion
    from bema_cli.sweep import walk

    root, base, run = run10
    if held:  # what a GPU walk or a checkpoint read whole does: theta_s and theta0 held
        monkeypatch.setattr(walk, "reread", lambda plan, device="cpu": (False, False))
    windows = [4] if "lawa" in methods else None
    opts = Options(str(run), grid(list(methods), windows=windows, tau=tau), None, base=str(base))
    plan = walk.plan_sweep(opts)
    walker = walk.Walker(plan, opts)
    assert (walker.theta is not None) is held
    steps = [10 * i for i in range(1, 11)]
    for step in steps:
        walker.advance(step)
        walker.finish()
    rows = motion.rows(walker.motion_sums())
    walker.close()
    # the previous checkpoint is read again from its files a block at a time, never held as a second
    # model beside a held theta_s (it was: +1 model of memory on a GPU sweep)
    assert "theta-prev" not in walker.ws.buffers, sorted(walker.ws.buffers)
    ref = _motion_reference(run, base, steps)
    # a grid of windows alone never reads theta0: its first step is not measured (as stabilize's)
    assert [r["step"] for r in rows] == (steps[1:] if methods == ("lawa",) else steps)
    for row in rows:
        assert row["relative"] == pytest.approx(ref[row["step"]], rel=1e-5), row["step"]


@pytest.mark.parametrize("block", [1 << 22, 7], ids=["whole-tensors", "rows-at-a-time"])
def test_the_dry_runs_read_pass_measures_the_same_motion_against_float64(run10, monkeypatch, block):
    """`ship --dry-run` measures the motion alone, a block of rows at a time (motion.measure), up to its step."""
    from bema_cli.stabilize import Options, grid, motion
    from bema_cli.sweep import walk

    monkeypatch.setattr(motion, "MEASURE_BLOCK", block)
    root, base, run = run10
    plan = walk.plan_sweep(Options(str(run), grid(["ema"]), None, base=str(base)))
    rows = motion.rows(motion.measure(plan, 70))
    ref = _motion_reference(run, base, [10 * i for i in range(1, 8)])
    assert [r["step"] for r in rows] == sorted(ref)
    assert all(r["relative"] == pytest.approx(ref[r["step"]], rel=1e-5) for r in rows)


def test_the_barely_moves_rule_never_warns_where_averaging_helps_in_simulation():
    """bench/bench_motion_rule.py: SGD worlds whose truth is known. The warning must not fire where
    averaging helps (false alarms 0 of 80, upper 95% bound < 5%), and must fire on a learning rate
    decayed to zero; its misses (quiet where averaging cannot help) are measured there, not bounded."""
    import subprocess
    import sys

    bench = Path(__file__).resolve().parents[1] / "bench" / "bench_motion_rule.py"
    r = subprocess.run([sys.executable, str(bench), "--reps", "40", "--json"], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    alarms = doc["false_alarms"]
    assert alarms["n"] == 80 and alarms["k"] == 0 and alarms["interval"][1] < 0.05, alarms
    assert doc["schedules"]["cos0.0"]["warned"] >= 38 and not doc["schedules"]["cos0.0"]["helps"]
    assert doc["schedules"]["constant"]["helps"] and doc["schedules"]["linear0"]["gain_share"] < 0.1


def _moving_run(root, scales):
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g)
    (root / "base").mkdir(parents=True)
    save_file({"mlp.weight": w}, root / "base" / "model.safetensors")
    for i, scale in enumerate(scales, start=1):
        w = w + scale * 0.01 * torch.randn(64, 64, generator=g)
        (root / "run" / f"checkpoint-{10 * i}").mkdir(parents=True)
        save_file({"mlp.weight": w}, root / "run" / f"checkpoint-{10 * i}" / "model.safetensors")
    return root / "run", root / "base"


def test_a_run_that_stops_moving_is_said_to_before_any_evaluation(tmp_path):
    """A learning rate decayed to ~0: the last checkpoints barely move; said on stderr and in --json.
    The same run at a constant learning rate moves to the end: nothing is said."""
    from conftest import run_bema

    for name, scales, barely in (
        ("decayed", [1.0] * 10 + [1e-4] * 10, True),
        ("constant", [1.0] * 20, False),
    ):
        run, base = _moving_run(tmp_path / name, scales)
        r = run_bema("stabilize", run, "--base", base, "--out", tmp_path / name / "out", "--method", "lawa",
                     "--window", "4", "--json")  # fmt: skip
        assert r.returncode == 0, r.stderr
        verdict = json.loads(r.stdout)["motion_verdict"]
        assert verdict["barely_moves"] is barely and ("barely move" in r.stderr) is barely, (
            verdict,
            r.stderr,
        )
        assert (verdict["share"] < 0.01) if barely else (0.5 < verdict["share"] < 2)
