"""Nothing lost, round two: messages that name the right file, side files, eval/report edge cases, LoRA
config checks, SIGTERM under Ray. Real files and real `bema` subprocesses, like tests/test_reliability.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import BEMA, one_line_error, run_bema
from trajectory import write_trajectory

STEPS = [10, 20, 30]
RUN = "bema-k0.5-e0.2"


def _small(root: Path, **kw) -> tuple[Path, Path]:
    return write_trajectory(root, STEPS, with_int=False, **kw)


# --- side files: only the checkpoint's own ------------------------------------------------------


@pytest.mark.parametrize("name", ["tokenizer_config.json", "config.json", "chat_template.jinja"])
@pytest.mark.parametrize("where", ["checkpoint", "base"])
def test_side_file_linking_outside_is_refused(tmp_path, name, where):
    """A side file that is a symlink out of its folder (a secret, say) is never copied into OUT."""
    base, run = _small(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("do not copy me\n")
    folder = run / "checkpoint-30" if where == "checkpoint" else base
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(secret)
    out = tmp_path / "out"
    r = run_bema("stabilize", run, "--base", base, "--out", out)
    line = one_line_error(r, 3)
    assert f"{folder / name}: a symbolic link to {secret}" in line, line
    assert not out.exists()


def test_side_file_linking_inside_is_copied_as_a_file(tmp_path):
    """Links within the checkpoint, or into the base (tokenizer files shared to save space), are
    fine: their bytes land in OUT as regular files."""
    base, run = _small(tmp_path)
    ckpt = run / "checkpoint-30"
    (ckpt / "tok.json").write_text('{"x": 1}')
    (ckpt / "tokenizer.json").symlink_to("tok.json")
    (base / "merges.txt").write_text("a b\n")
    (ckpt / "merges.txt").symlink_to(base / "merges.txt")
    out = tmp_path / "out"
    r = run_bema("stabilize", run, "--base", base, "--out", out, "--steps", "30")
    assert r.returncode == 0, r.stderr
    folder = out / RUN / "checkpoint-30"
    for name, text in (("tokenizer.json", '{"x": 1}'), ("merges.txt", "a b\n")):
        assert not (folder / name).is_symlink() and (folder / name).read_text() == text, name


# --- I/O errors: the right file, read or write ----------------------------------------------------


def _start(*args):
    cmd = [str(BEMA), "stabilize", *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(cond, proc, timeout=120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


def test_bin_rotated_away_mid_read_says_cannot_read(tmp_path):
    """A trainer's save_total_limit deletes a .bin checkpoint while it is read: a read error naming it
    (exit 3), not 'cannot write'."""
    from formats import convert

    base, run = write_trajectory(tmp_path / "st", STEPS, shapes={"w": (3000, 4)}, with_int=False)
    run_bin = tmp_path / "run"
    for s in STEPS:
        convert(run / f"checkpoint-{s}", run_bin / f"checkpoint-{s}", "bin")
    out = tmp_path / "out"
    proc = _start(run_bin, "--base", base, "--out", out, "--max-memory", "200B")
    assert _wait_for(lambda: list(out.glob(".bema-tmp-*/*/checkpoint-*")), proc), proc.communicate()
    victim = run_bin / "checkpoint-30" / "pytorch_model.bin"
    victim.unlink()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 3, stderr
    assert stderr.splitlines() == [f"error: {victim}: cannot read (No such file or directory)"], stderr
    assert not out.exists()


def test_disk_full_after_the_tensors_names_the_output_file(tmp_path):
    """A write that fails after the tensor shards (a side file's copy; a file-size limit gives EFBIG as
    a full disk gives ENOSPC) names the file being written under OUT, never the input it copies."""
    import resource

    base, run = write_trajectory(tmp_path, STEPS, shapes={"w": (1000, 4)}, with_int=False)
    for s in STEPS:  # a side file bigger than the limit: its copy fails
        (run / f"checkpoint-{s}" / "tokenizer.json").write_bytes(b" " * 100_000)
    out, limit = tmp_path / "out", 60_000  # the shards (16 kB) fit, the side file does not

    def fsize_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [str(BEMA), "stabilize", run, "--base", base, "--out", out]
    r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=fsize_limit, timeout=300)
    line = one_line_error(r, 4)
    assert "cannot write (File too large)" in line, line
    assert line.startswith(f"error: {out}/.bema-tmp-") and "/tokenizer.json: " in line, line
    assert not out.exists()


def test_safetensors_gone_since_indexing_says_cannot_read(tmp_path):
    """A Ray worker opens the checkpoint by name: one rotated away since indexing is a read error."""
    from bema_cli.errors import InputError
    from bema_cli.io.reader import open_checkpoint

    _, run = _small(tmp_path)
    index = open_checkpoint(run / "checkpoint-10")
    (run / "checkpoint-10" / "model.safetensors").unlink()
    with pytest.raises(InputError, match=r"model.safetensors: cannot read \(No such file or directory\)"):
        with index.open() as reader:
            reader.read("layer.0.weight", 0, 2)


# --- SIGTERM under Ray -----------------------------------------------------------------------------


def test_sigterm_under_ray_exits_143(tmp_path):
    """SLURM/Kubernetes stop a `--executor ray` run with SIGTERM: exit 143 and the one-line message, as
    locally (ray.init had replaced the handler with sys.exit(15)). ~15 s here (a Ray start)."""
    pytest.importorskip("ray")
    base, run = write_trajectory(tmp_path, STEPS, shapes={"w": (3000, 4)}, with_int=False)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    cmd = [str(BEMA), "stabilize", run, "--base", base, "--out", out, "--max-memory", "200B"]
    proc = subprocess.Popen(
        [*map(str, cmd), "--executor", "ray", "--workers", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert _wait_for(lambda: list(out.glob(".bema-tmp-*/*/checkpoint-*")), proc, 180), proc.communicate()
    time.sleep(1)  # Ray tasks in flight
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert lines[-1] == "error: interrupted by SIGTERM; nothing half-written was kept", stderr
    assert "Traceback" not in stderr, stderr
    assert not out.exists(), "the temp folder, the lock and the OUT this run created are gone"


# --- bema eval / report edge cases ---------------------------------------------------------------


@pytest.mark.parametrize("where", ["same", "inside"])
def test_eval_out_in_an_input_checkpoint_is_refused(tiny_model_copy, tmp_path, where):
    """results.jsonl never lands in a model folder being evaluated (stabilize's rule, exit 4)."""
    from test_eval import write_data

    model, data = tiny_model_copy, write_data(tmp_path / "data")
    out = model if where == "same" else model / "results"
    before = sorted(p.name for p in model.iterdir())
    r = run_bema("eval", model, "--tasks", "boolq", "--backend", "transformers", "--data-dir", data,
                 "--limit", "1", "--n-samples", "1", "--max-new-tokens", "2", "--out", out)  # fmt: skip
    line = one_line_error(r, 4)
    assert f"--out {out.resolve()}: {'is' if where == 'same' else 'lies inside'} the input" in line, line
    assert sorted(p.name for p in model.iterdir()) == before


def test_report_reads_a_torn_last_line_as_eval_does(tmp_path):
    """A crash mid-append leaves a torn last line: `bema report` skips it with the warning `bema eval`
    gives, reports the whole records, and leaves the file as it was."""
    from test_report import write_results

    path = tmp_path / "eval" / "results.jsonl"
    write_results(path)
    whole = len(path.read_text().splitlines())
    with open(path, "a") as f:
        f.write('{"run": "vanilla", "step": 4')  # no newline: torn
    before = path.read_bytes()
    r = run_bema("report", path.parent, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n_records"] == whole
    assert r.stderr.splitlines() == [
        f"warning: {path}:{whole + 1}: skipped a torn final line (a crash in the middle of a write)"
    ], r.stderr
    assert path.read_bytes() == before


def test_eval_backend_vllm_without_vllm_says_how_to_install(tiny_model_copy, tmp_path):
    """vLLM is optional: `--backend vllm` without it is a one-line usage error with the install command,
    not "internal error: ModuleNotFoundError". A `vllm` package first on PYTHONPATH fails to import
    exactly as a missing one does (ModuleNotFoundError naming 'vllm')."""
    from test_eval import write_data

    hidden = tmp_path / "no-vllm" / "vllm"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'vllm'\", name='vllm')\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(hidden.parent), os.environ.get("PYTHONPATH", "")])}
    data, out = write_data(tmp_path / "data"), tmp_path / "results"
    r = run_bema("eval", tiny_model_copy, "--tasks", "boolq", "--backend", "vllm", "--data-dir", data,
                 "--limit", "1", "--out", out, env=env)  # fmt: skip
    line = one_line_error(r, 2)
    assert "--backend vllm: vLLM is not installed (install it with: pip install vllm (a GPU machine)" in line
    assert "--backend transformers" in line, line


# --- Ray eval: each CPU engine's KV cache sized to its share of the node ------------------------


def test_cpu_kv_cache_is_the_engines_share_of_the_node():
    from bema_cli.eval.ray_pool import KV_ENV, actors_per_node, cpu_kv_cache_env

    gib = 2**30
    assert actors_per_node(node_cpus=2, cpus_per_actor=1.0, workers=2) == 2
    assert actors_per_node(node_cpus=16, cpus_per_actor=2.0, workers=3) == 3  # workers cap it
    assert actors_per_node(node_cpus=4, cpus_per_actor=4.0, workers=8) == 1
    assert cpu_kv_cache_env(24 * gib, 2, {}) == {KV_ENV: "6"}  # half the node, split in two
    assert cpu_kv_cache_env(24 * gib, 1, {}) == {KV_ENV: "12"}
    assert cpu_kv_cache_env(3 * gib, 8, {}) == {KV_ENV: "1"}  # at least 1 GiB: vLLM needs some cache
    assert cpu_kv_cache_env(24 * gib, 2, {KV_ENV: "3"}) == {}  # the user's choice stands
    assert cpu_kv_cache_env(24 * gib, 2, {KV_ENV: ""}) == {KV_ENV: "6"}  # empty: vLLM ignores it too


# --- LoRA adapter_config.json: lora_alpha and fan_in_fan_out ---------------------------------------


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory):
    """Real PEFT adapters on the tiny Qwen2 (nn.Linear layers): q_proj square (64x64), up_proj not (128x64)."""
    from lora_run import perturbed_adapters

    root = tmp_path_factory.mktemp("lora")
    shutil.copytree(tiny_model_dir, root / "base")
    for name, targets in (("run", ["q_proj", "up_proj"]), ("square", ["q_proj"])):
        perturbed_adapters(root / "base", root / name, STEPS, target_modules=targets, modules_to_save=[])
    return root / "base", root / "run"


def _edited(run: Path, dst: Path, **changes) -> Path:
    shutil.copytree(run, dst)
    for s in STEPS:
        path = dst / f"checkpoint-{s}" / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return dst


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), 0, -8])
def test_lora_alpha_not_positive_finite_is_refused(lora_run, tmp_path, alpha):
    base, run = lora_run
    run = _edited(run, tmp_path / "run", lora_alpha=alpha)
    r = run_bema("stabilize", run, "--base", base, "--out", tmp_path / "out")
    line = one_line_error(r, 3)
    config = run / "checkpoint-10" / "adapter_config.json"
    assert f"{config}: lora_alpha must be a positive finite number" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("targets", ["run", "square"])
def test_lora_fan_in_fan_out_on_linear_layers_is_ignored_as_peft_does(lora_run, tmp_path, targets):
    """PEFT forces fan_in_fan_out off on nn.Linear targets (with a warning), so a config saying true
    stands for the same weights: the same outputs, bitwise, as with false (was: an error on up_proj,
    and a silently transposed delta on the square q_proj; with q_proj alone the base's model_type,
    qwen2, tells its layers are nn.Linear)."""
    from trajectory import load_model

    base, run = lora_run
    run = run.with_name(targets)
    flipped = _edited(run, tmp_path / "flipped", fan_in_fan_out=True)
    outs = {}
    for name, src in (("plain", run), ("flipped", flipped)):
        r = run_bema("stabilize", src, "--base", base, "--out", tmp_path / f"out-{name}", "--steps", "30")
        assert r.returncode == 0, r.stderr
        outs[name] = load_model(tmp_path / f"out-{name}" / RUN / "checkpoint-30")
    theta0 = load_model(base)
    assert not torch.equal(outs["plain"]["model.layers.0.self_attn.q_proj.weight"],
                           theta0["model.layers.0.self_attn.q_proj.weight"])  # fmt: skip
    assert outs["plain"].keys() == outs["flipped"].keys()
    for k, v in outs["plain"].items():
        assert torch.equal(v, outs["flipped"][k]), k


# -- numbers and nesting no reader expects: one line, never exit 70 --------------------------------
def test_report_refuses_an_absurd_step_and_deeply_nested_json(tmp_path):
    from test_report import record

    huge = tmp_path / "huge" / "results.jsonl"
    huge.parent.mkdir()
    huge.write_text(json.dumps(record("vanilla", 10**30, "loss", 1.0)) + "\n")
    line = one_line_error(run_bema("report", huge, "--plot", tmp_path / "p.png"), 3)
    assert "'step' must be an integer in [0, 2**53)" in line and str(huge) in line
    deep = tmp_path / "deep" / "results.jsonl"
    deep.parent.mkdir()
    deep.write_text(
        json.dumps(record("vanilla", 10, "loss", 1.0)) + "\n" + "[" * 100000 + "]" * 100000 + "\n"
    )
    line = one_line_error(run_bema("report", deep), 3)
    assert f"{deep}:2: invalid JSON (nested too deeply)" in line


@pytest.mark.parametrize("flag", ["--sigma", "--distance"])
def test_simulate_refuses_scales_that_overflow_float64(flag):
    line = one_line_error(run_bema("simulate", flag, "1e308", "--trials", "10"), 2)
    assert flag in line and "1e+308" in line


def test_only_a_real_hub_cache_layout_lets_links_reach_its_blobs(tmp_path):
    """A run folder named `snapshots` beside a `blobs/` folder is not a Hub cache: a side-file link to
    anything under its parent is refused. A real cache snapshot (models--org--name/snapshots/<rev>)
    links into its blobs/, and those links are followed (copied as files)."""
    base, run = _small(tmp_path / "t")
    fake = tmp_path / "fake"
    (fake / "blobs").mkdir(parents=True)
    shutil.copytree(run, fake / "snapshots")
    secret = fake / "secret.txt"
    secret.write_text("do not copy me\n")
    link = fake / "snapshots" / "checkpoint-30" / "tokenizer_config.json"
    link.unlink(missing_ok=True)
    link.symlink_to(secret)
    line = one_line_error(
        run_bema("stabilize", fake / "snapshots", "--base", base, "--out", tmp_path / "o1"), 3
    )
    assert f"{link}: a symbolic link to {secret}" in line
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    shutil.copytree(base, snapshot)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "0f1e").write_text('{"shared": true}')
    (snapshot / "tokenizer_config.json").unlink(missing_ok=True)
    (snapshot / "tokenizer_config.json").symlink_to(Path("../../blobs/0f1e"))
    r = run_bema("stabilize", run, "--base", snapshot, "--out", tmp_path / "o2", "--steps", "30")
    assert r.returncode == 0, r.stderr


def test_a_full_disk_during_the_manifest_write_names_the_manifest(tmp_path):
    """/dev/full answers every write with ENOSPC: the message names OUT/manifest.json, not only the errno."""
    from bema_cli.errors import OutputError
    from bema_cli.io.commit import write_synced

    with pytest.raises(OutputError) as err:
        write_synced(Path("/dev/full"), b'{"runs": []}', shown=tmp_path / "out" / "manifest.json")
    assert str(err.value) == f"{tmp_path / 'out' / 'manifest.json'}: cannot write (No space left on device)"


@pytest.mark.parametrize("json_out", [False, True])
def test_a_closed_stdout_ends_quietly_with_141(json_out):
    """`bema ... | head`: the reader is gone before bema prints. It exited 1 with no word (click's and
    rich's own handling); now as a tool killed by SIGPIPE: 141, nothing on stderr."""
    args = [str(BEMA), "simulate", "--trials", "10", "--steps", "200", *(["--json"] if json_out else [])]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err
