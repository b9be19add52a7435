"""One trajectory in every format and folder naming bema reads gives bitwise identical outputs.

The same random-walk checkpoints are re-saved as .bin (single, sharded), DCP (as accelerate's
FSDP writes it) and safetensors, under each naming scheme and as a `STEP PATH` list on stdin,
and stabilized through the real CLI with a tiny --max-memory so tensors are read in row
chunks. Every output file must equal the safetensors run's byte for byte, which in turn is
checked against the float64 reference (1e-6 of each tensor's largest |value|).
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import BEMA
from formats import convert, save_bin, save_dcp
from reference import reference
from trajectory import load_model, tensor_section, write_trajectory

from bema_cli.errors import InputError
from bema_cli.io.checkpoints import find_checkpoints, read_checkpoint_list
from bema_cli.io.reader import open_checkpoint

STEPS = [10, 20, 30, 40]
GRID = ["--method", "bema,ema,dema", "--max-memory", "600B"]  # 600 B: rows of one tensor per unit


def stabilize_json(*args, stdin: str | None = None) -> dict:
    r = subprocess.run(
        [str(BEMA), "stabilize", *map(str, args), "--json"], input=stdin, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """{variant: (doc, out)} for the reference run and every re-saved copy of it."""
    root = tmp_path_factory.mktemp("formats")
    base, run = write_trajectory(root, STEPS, shards=2)
    layouts = {  # variant -> (weights format, folder name, theta0 format)
        "bin": ("bin", "step_{}", "safetensors"),
        "bin-sharded": ("bin3", "iter_{:07d}", "bin"),
        "dcp": ("dcp", "global_step{}", "dcp"),
        "dashes": ("safetensors", "step-{:04d}", "safetensors"),
    }
    jobs = {"safetensors": ([run, "--base", base], None)}
    for name, (fmt, naming, base_fmt) in layouts.items():
        for s in STEPS:
            convert(run / f"checkpoint-{s}", root / name / naming.format(s), fmt)
        theta0 = convert(base, root / f"base-{name}", base_fmt)
        jobs[name] = ([root / name, "--base", theta0], None)
    # stdin: any order, each checkpoint in another format and place, comments and blank lines
    listed = {10: root / "dcp" / "global_step10", 40: root / "bin" / "step_40", 20: run / "checkpoint-20"}
    listed[30] = root / "bin-sharded" / "iter_0000030"
    lines = ["# step path", ""] + [f"{s}\t{p}" for s, p in listed.items()]
    jobs["stdin"] = (["-", "--base", base], "\n".join(lines) + "\n")
    with ThreadPoolExecutor(2) as pool:
        futures = {
            k: pool.submit(stabilize_json, *args, *GRID, "--out", root / f"out-{k}", stdin=stdin)
            for k, (args, stdin) in jobs.items()
        }
        docs = {k: (f.result(), root / f"out-{k}") for k, f in futures.items()}
    return docs, base, run


def test_reference_run_matches_float64(variants):
    docs, base, run = variants
    doc, _ = docs["safetensors"]
    trajectory = [(s, load_model(run / f"checkpoint-{s}")) for s in STEPS]
    checked = 0
    for method in ("bema", "ema", "dema"):
        ref = reference(load_model(base), trajectory, method)
        for o in (o for o in doc["outputs"] if o["method"] == method):
            out = load_model(Path(o["path"]))
            for name, expect in ref[o["step"]].items():
                err = (out[name].double() - expect).abs().max()
                assert err <= 1e-6 * expect.abs().max().clamp_min(1e-30), (method, o["step"], name)
                checked += 1
    assert checked == 3 * len(STEPS) * 5


@pytest.mark.parametrize("variant", ["bin", "bin-sharded", "dcp", "dashes", "stdin"])
def test_bitwise_identical_outputs(variants, variant):
    docs, _, _ = variants
    ref_doc, ref_out = docs["safetensors"]
    doc, out = docs[variant]
    assert [(o["run"], o["step"]) for o in doc["outputs"]] == [
        (o["run"], o["step"]) for o in ref_doc["outputs"]
    ]
    compared = 0
    for o in ref_doc["outputs"]:
        rel = Path(o["path"]).relative_to(ref_out)
        for f in sorted((ref_out / rel).glob("*.safetensors")):
            # the tensors bitwise (the header's provenance names the other format's inputs)
            assert tensor_section(out / rel / f.name) == tensor_section(f), (
                f"{variant}: {rel}/{f.name} differs"
            )
            compared += 1
    assert compared == 3 * len(STEPS)


def test_dcp_reads_any_row_range_and_strips_prefix(tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {
        "model.embed.weight": torch.randn(7, 5, generator=g),
        "lm_head.weight": torch.randn(3, 5, generator=g),
    }
    state["scale"] = torch.tensor(2.5)
    save_dcp(state, tmp_path / "acc")  # accelerate nesting: keys model.model.embed.weight, model.lm_head...
    save_dcp(state, tmp_path / "plain", accelerate=False)  # keys as they are (some start with model.)
    for folder in ("acc", "plain"):
        index = open_checkpoint(tmp_path / folder, like=set(state))
        assert set(index.tensors) == set(state), folder
        with index.open() as reader:
            for a, b in [(0, 7), (2, 5), (6, 7)]:
                assert torch.equal(reader.read("model.embed.weight", a, b), state["model.embed.weight"][a:b])
            assert torch.equal(reader.read("scale", 0, 1), state["scale"])
        assert index._records and all(index._records.values()), "rows read in place, not whole chunks"


def test_dcp_sharded_by_two_ranks(tmp_path):
    """A DCP checkpoint saved by a real 2-rank group (uneven dim-0 shards, one file per rank): any row
    range, across the rank boundary or inside one shard, reads back exactly; so does a dim-1 split."""
    g = torch.Generator().manual_seed(2)
    state = {
        "w": torch.randn(7, 3, generator=g),
        "b": torch.randn(5, generator=g).bfloat16(),
        "s": torch.tensor(1.5),
        "col": torch.randn(4, 6, generator=g),  # split along dim 1: DCP's own planner reads it
    }
    torch.save(state, tmp_path / "state.pt")
    target = tmp_path / "ckpt" / "pytorch_model_fsdp_0"
    script = Path(__file__).with_name("dcp_sharded.py")
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "state.pt"), str(target)], capture_output=True
    )
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert sorted(p.name for p in target.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    index = open_checkpoint(tmp_path / "ckpt", like=set(state))
    assert len(index.metadata.state_dict_metadata["model.w"].chunks) == 2
    with index.open() as reader:
        for a, b in [(0, 7), (2, 6), (3, 4), (4, 7), (0, 1)]:
            assert torch.equal(reader.read("w", a, b), state["w"][a:b]), (a, b)
        assert torch.equal(reader.read("b", 1, 5), state["b"][1:5])
        assert torch.equal(reader.read("s", 0, 1), state["s"])
        assert torch.equal(reader.read("col", 1, 3), state["col"][1:3])
    # dim-0 chunks were read in place (one pread per chunk), the dim-1 split through the planner
    records = index._records
    assert all(records[k] is not None for k in records if k[0] in ("model.w", "model.b"))
    assert {k[0] for k in records} == {"model.w", "model.b"}


def test_raw_state_dicts_of_a_tied_model(tiny_model_dir, tmp_path):
    """model.state_dict() of a tied-embedding model (as torch.save and FSDP write it) holds lm_head.weight,
    which HF safetensors omit: it is the embedding, dropped, and the outputs load as the base does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert model.config.tie_word_embeddings and "lm_head.weight" not in load_model(tiny_model_dir)
    for step, writer in ((1, save_bin), (2, save_dcp)):
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(0.01)
        folder = tmp_path / "run" / f"step_{step}"
        writer({k: v.clone() for k, v in model.state_dict().items()}, folder)
        (folder / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    doc = stabilize_json(
        tmp_path / "run", "--base", tiny_model_dir, "--method", "vanilla", "--out", tmp_path / "out"
    )
    out = load_model(Path(doc["outputs"][-1]["path"]))
    assert set(out) == set(load_model(tiny_model_dir))
    assert torch.equal(out["model.embed_tokens.weight"], model.model.embed_tokens.weight.detach())


def test_bin_reader_reads_rows_not_files(tmp_path):
    """Contiguous tensors: rows by pread at offsets found once (no mapping held); a non-contiguous one:
    the file mapped (never read whole) while the reader is open, unmapped when it closes."""
    g = torch.Generator().manual_seed(3)
    state = {
        "w": torch.randn(64, 64, generator=g),
        "ids": torch.arange(5),
        "t": torch.randn(6, 4, generator=g).T,
    }
    state["h"] = torch.randn(9, 2, generator=g).bfloat16()
    state["tied"] = state["w"]  # shares w's storage, as a tied head does
    save_bin(state, tmp_path)
    index = open_checkpoint(tmp_path)
    assert index.tensors["w"].dtype == "F32" and index.tensors["t"].shape == (4, 6)
    assert set(index.offsets) == {"w", "ids", "h", "tied"}  # every contiguous tensor located
    f = str(tmp_path / "pytorch_model.bin")
    with index.open() as reader:
        for name, (a, b) in {"w": (3, 9), "ids": (0, 5), "h": (2, 9), "tied": (60, 64)}.items():
            assert torch.equal(reader.read(name, a, b), state[name][a:b]), name
        assert f not in Path("/proc/self/maps").read_text()
        rows = reader.read("t", 1, 3)
        assert torch.equal(rows, state["t"][1:3])
        assert f in Path("/proc/self/maps").read_text()  # mapped, not read into memory
        del rows
    assert f not in Path("/proc/self/maps").read_text()  # unmapped on close


def _folders(root: Path, names: list[str]) -> Path:
    for n in names:
        (root / n).mkdir(parents=True)
    return root


def test_layouts_found_sorted_and_checked(tmp_path):
    run = _folders(tmp_path / "a", ["iter_0000100", "iter_20", "iter_0000003", "logs", "latest"])
    assert [c.step for c in find_checkpoints(run)] == [3, 20, 100]
    run = _folders(tmp_path / "b", ["global_step5", "global_step50"])
    assert [c.path.name for c in find_checkpoints(run)] == ["global_step5", "global_step50"]
    with pytest.raises(InputError, match="mixes checkpoint naming schemes: checkpoint-10 and step_20"):
        find_checkpoints(_folders(tmp_path / "c", ["checkpoint-10", "step_20"]))
    with pytest.raises(InputError, match=r"duplicate step 10 \(step_0010 and step_10\)"):
        find_checkpoints(_folders(tmp_path / "d", ["step_0010", "step_10"]))


def test_checkpoint_list_parsing(tmp_path):
    _folders(tmp_path, ["x", "y"])
    got = read_checkpoint_list(f"20 {tmp_path / 'y'}\n\n# comment\n  3   {tmp_path / 'x'}  \n")
    assert [(c.step, c.path.name) for c in got] == [(3, "x"), (20, "y")]
    for text, message in [
        (f"ten {tmp_path / 'x'}", "line 1: expected 'STEP PATH'"),
        (f"1 {tmp_path / 'x'}\n1 {tmp_path / 'y'}", "duplicate step 1"),
        (f"1 {tmp_path / 'nope'}", "line 1: .*nope: no such directory"),
        ("# nothing\n", "no 'STEP PATH' lines"),
    ]:
        with pytest.raises(InputError, match=message):
            read_checkpoint_list(text)


def test_stdin_error_is_one_line(tmp_path):
    r = subprocess.run(
        [str(BEMA), "stabilize", "-", "--out", str(tmp_path / "out")],
        input="10\n",
        capture_output=True,
        text=True,
    )
    assert r.returncode == 3 and r.stderr.strip() == "error: <stdin> line 1: expected 'STEP PATH', got '10'"
    assert not (tmp_path / "out").exists()


def test_eval_accepts_the_same_layouts(tiny_model_dir, tmp_path):
    """`bema eval RUN` expands step_N folders like checkpoint-N ones (checked in process, no engine)."""
    from bema_cli.eval.targets import expand_inputs

    for name in ("step_0020", "step_0010"):
        convert(tiny_model_dir, tmp_path / "run" / name, "safetensors")
    targets = expand_inputs([str(tmp_path / "run")])
    assert [(t.step, t.path.name) for t in targets] == [(10, "step_0010"), (20, "step_0020")]


def test_stdin_list_from_a_terminal_is_a_usage_error(tmp_path):
    """`bema stabilize -` with stdin on a terminal would wait forever: it says what to pipe instead."""
    import os
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: stdin/stdout/stderr are the pty
        os.execv(str(BEMA), [str(BEMA), "stabilize", "-", "--out", str(tmp_path / "out")])
    text = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        text += chunk
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 2
    assert "which is a terminal here; pipe or redirect a list in" in text.decode()
    assert not (tmp_path / "out").exists()
