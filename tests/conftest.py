"""Shared fixtures: a tiny real Qwen2 model built offline, and a runner for the real `bema` CLI."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from zygote import Zygote

BEMA = Path(sys.executable).with_name("bema")

# Never reach the Hub from tests; keep vLLM in-process and small on CPU.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# what engines measure (eval/timings.py) stays in this run's own cache, never the user's
os.environ["BEMA_CACHE"] = tempfile.mkdtemp(prefix="bema-cache-")
atexit.register(shutil.rmtree, os.environ["BEMA_CACHE"], True)


_ZYGOTE = Zygote(BEMA)
atexit.register(_ZYGOTE.close)


def without_zygote() -> None:
    """No zygote below this process until the next call needs one: a test that measures the
    processes below it (machine.PeakRss) sees bema's alone."""
    _ZYGOTE.close()
    _ZYGOTE.proc = None


# `bema demo` pins torch's kernels before torch is imported (demo/pins.py): a fresh interpreter only
FRESH_COMMANDS = ("demo",)


def run_bema(
    *args: str,
    cwd: str | Path | None = None,
    env: dict | None = None,
    timeout: float = 600,
    fresh: bool = False,
):
    """Run the installed `bema` console script as a process of its own; returns CompletedProcess
    (text). Forked from the zygote (torch and transformers imported once: tests/zygote.py) unless the
    call needs another environment, or `fresh` (a test of the process's own memory or start-up) or a
    FRESH_COMMANDS command asks for an interpreter that has imported nothing; BEMA_TEST_SUBPROCESS=1
    makes every call a fresh subprocess."""
    fresh = fresh or (bool(args) and str(args[0]) in FRESH_COMMANDS)
    if env is None and not fresh and _ZYGOTE.usable():
        with tempfile.TemporaryDirectory(prefix="bema-call-") as tmp:
            done = _ZYGOTE.run(
                list(map(str, args)), str(Path(cwd or os.getcwd()).resolve()), timeout, Path(tmp)
            )
        if done is not None:
            return done
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [str(BEMA), *map(str, args)], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def names(name: str, folder: str | Path) -> bool:
    """A record's name for an input (provenance.input_name) is `folder`'s path inside a folder it
    shares with the output: relative, and a tail of the real path (never the absolute path itself)."""
    return not Path(name).is_absolute() and Path(folder).resolve().as_posix().endswith("/" + name)


def one_line_error(proc: subprocess.CompletedProcess, code: int | None = None) -> str:
    """The one stderr line of a refused run, checked: non-zero exit (`code` when given), `error: ...`,
    nothing else on stderr, no traceback. Returns the line for the caller's own checks."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 if code is None else proc.returncode == code, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2ForCausalLM + BPE tokenizer with chat template (fp32, tied embeddings, head_dim 32)."""
    from bema_cli.demo.tinymodel import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "base", seed=0)


@pytest.fixture
def tiny_model_copy(tiny_model_dir, tmp_path) -> Path:
    dst = tmp_path / "base"
    shutil.copytree(tiny_model_dir, dst)
    return dst


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:
        return False
    return True


def train_tiny(
    src: Path, dst: Path, steps: int = 40, dtypes: tuple[str, ...] = ("float32",)
) -> dict[str, Path]:
    """Fine-tune a copy of a tiny model on one fixed chat exchange (a few seconds) so its greedy
    output clearly differs from the base; saved once per dtype as dst/<dtype>."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "the cat sees the dog. Answer: true #### 42"},
    ]
    ids = tok(
        tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False, return_tensors="pt"
    ).input_ids
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    out = {}
    for dtype in dtypes:
        path = dst / dtype
        # each dtype is cast from the fp32 weights (casting in place would round them for the next one)
        copy.deepcopy(model).to(getattr(torch, dtype)).save_pretrained(path)
        tok.save_pretrained(path)
        out[dtype] = path
    return out


@pytest.fixture(scope="session")
def tiny_trained_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """`tiny_model_dir` fine-tuned for 40 steps on one exchange (fp32): greedy output differs from the base."""
    return train_tiny(tiny_model_dir, tmp_path_factory.mktemp("trained"))["float32"]
