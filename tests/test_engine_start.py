"""vLLM must start, or say why: a KV cache sized to the run on CPU (not vLLM's 70% of RAM), the root
cause of a failed start read back from vLLM's log, --backend auto falling back to transformers,
and a peak RSS that counts the engine's own processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import one_line_error, run_bema, vllm_available
from test_eval import read_jsonl, write_data

from bema_cli.eval.backends import vllm_engine
from bema_cli.machine import PeakRss, descendants

QWEN25_05B = {  # the published Qwen2.5-0.5B dimensions (config.json)
    "hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24,
}  # fmt: skip
MiB, GiB = 1 << 20, 1 << 30


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer():
    # 24 layers x (K and V) x 2 KV heads x head_dim 64 (896 / 14) x 2 bytes (bf16)
    assert vllm_engine.kv_bytes_per_token(QWEN25_05B, "bfloat16") == 24 * 2 * 2 * 64 * 2 == 12288
    explicit = {**QWEN25_05B, "head_dim": 128}
    assert vllm_engine.kv_bytes_per_token(explicit, "float32") == 24 * 2 * 2 * 128 * 4
    mha = {"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2}  # no GQA field: KV = heads
    assert vllm_engine.kv_bytes_per_token(mha, "float32") == 2 * 2 * 2 * 32 * 4


def test_cpu_kv_cache_is_the_workload_with_a_floor_and_a_cap():
    per = 12288
    # 4 prompts x 50 samples x (200 prompt + 512 new) tokens: every sequence resident at once
    size, why = vllm_engine.cpu_kv_cache(QWEN25_05B, "bfloat16", ((200, 712),), 2048, 64 * GiB)
    assert size == int(200 * 712 * per * 1.1) and "142,400 tokens" in why
    # the largest call counts, and a sequence is at most max_model_len tokens
    size, _ = vllm_engine.cpu_kv_cache(QWEN25_05B, "bfloat16", ((10, 5000), (3, 100)), 2048, 64 * GiB)
    assert size == int(10 * 2048 * per * 1.1)
    # tiny work: the floor (at least one whole sequence, and KV_FLOOR)
    size, _ = vllm_engine.cpu_kv_cache(QWEN25_05B, "bfloat16", ((1, 10),), 2048, 64 * GiB)
    assert size == max(vllm_engine.KV_FLOOR, int(2048 * per * 1.1))
    # the paper's protocol (128 prompts x 50 samples) would want ~80 GB: capped to a quarter of what is free
    size, why = vllm_engine.cpu_kv_cache(QWEN25_05B, "bfloat16", ((6400, 812),), 2048, 16 * GiB)
    assert size == 4 * GiB and "capped at 25%" in why
    # unknown calls (lm-eval): UNKNOWN_SEQUENCES full-length sequences
    size, _ = vllm_engine.cpu_kv_cache(QWEN25_05B, "bfloat16", None, 1024, 64 * GiB)
    assert size == int(vllm_engine.UNKNOWN_SEQUENCES * 1024 * per * 1.1)
    # no generate call at all (held-out loss only): one full-length sequence, not the unknown 64
    size, _ = vllm_engine.cpu_kv_cache(QWEN25_05B, "bfloat16", (), 2048, 64 * GiB)
    assert size == max(vllm_engine.KV_FLOOR, int(2048 * per * 1.1))


LOG = """INFO 2026-11-26 04:18:01 vllm.config: something
ERROR 2026-11-26 04:18:05 vllm.v1.executor: WorkerProc failed to start.
Traceback (most recent call last):
  File "cpu_worker.py", line 221, in determine_available_memory
    raise ValueError(
ValueError: Available memory on node 0 (6.92/8.59 GiB) is less than requested memory for kv (40.0 GiB).
RuntimeError: Worker failed with error 'Available memory ...', please check the stack trace above for the root cause
"""


def test_root_cause_is_the_first_exception_logged_since_the_start(tmp_path):
    log = tmp_path / "vllm.log"
    earlier = "KeyError: 'an older run in the same log'\n"
    log.write_text(earlier + LOG)
    wrapper = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    root = vllm_engine.root_cause(str(log), len(earlier), wrapper, str)
    assert root.startswith("ValueError: Available memory on node 0") and "40.0 GiB" in root
    assert "memory" in vllm_engine.fix_for(root) and "--backend transformers" in vllm_engine.fix_for(root)
    # nothing logged (an in-process engine raising at once): the exception's own text
    assert vllm_engine.root_cause(str(log), log.stat().st_size, ValueError("bad"), str) == "ValueError: bad"
    assert vllm_engine.root_cause(None, 0, ValueError("bad"), str) == "ValueError: bad"


def test_peak_rss_counts_child_processes():
    """A child holding ~300 MB is below this process, and in PeakRss's engine part while it lives."""
    hold = "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ok', flush=True); import time; time.sleep(30)"
    with PeakRss(every=0.05) as peak:
        child = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ok"
            assert child.pid in descendants(os.getpid())
            time.sleep(0.3)
        finally:
            child.kill()
            child.wait()
    parts = peak.parts()
    assert (
        parts["peak_rss_engine"] > 280 * MiB
        and parts["peak_rss"] == parts["peak_rss_bema"] + parts["peak_rss_engine"]
    )


def test_own_peak_is_not_the_parents():
    """bema started from a big process (here this test, holding ~600 MB) reports its own peak: Linux
    carries ru_maxrss across fork and exec, so the old measure reported the parent's (CI: 17.8 GB
    for a sweep that peaked at 8)."""
    held = bytearray(600 * MiB)
    held[::4096] = b"x" * len(held[::4096])  # touched: resident in this process
    script = "from bema_cli.machine import PeakRss; print(PeakRss().parts()['peak_rss_bema'])"
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert int(child.stdout) < 300 * MiB, (int(child.stdout) / MiB, len(held))


FRAGMENTED_HEAP = """
import sys, torch
from bema_cli.machine import proc_bytes, return_freed_memory
if sys.argv[1] == "returned":
    return_freed_memory()
rss = lambda: proc_bytes("/proc/self/status", "VmRSS")
x = torch.ones(4 << 20); del x  # a 16 MB block freed: glibc raises its mmap threshold to 16 MB
before, big, small = rss(), [], []
for _ in range(24):
    big.append(torch.ones(2 << 20))  # 8 MB each: under the raised threshold, from glibc's heap
    # a live 64 KB block after each, carved from the heap's top (4 KB ones came from free chunks
    # left by the imports, so how many big blocks stayed varied by machine: 64, 32, 0 MB of 192)
    small.append(torch.ones(16 << 10))
big.clear()
print((rss() - before) // (1 << 20))
"""


def test_freed_blocks_go_back_to_the_os():
    """A sweep's swaps free large per-tensor copies between small live blocks; glibc kept such
    memory as slack (0.5 GB of a 0.5B sweep's peak). After `return_freed_memory` the freed 192 MB
    are gone from the process; without it (the premise, checked) they all stay."""

    # glibc's default, whatever the environment the tests run in sets
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}

    def held(mode: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", FRAGMENTED_HEAP, mode], capture_output=True, text=True, env=env
        )
        assert run.returncode == 0, run.stderr
        return int(run.stdout)

    assert held("kept") >= 160  # MB: glibc's default keeps them (measured 193 of the 192 + 1.5 live)
    assert held("returned") <= 4
    script = (
        "import os; from bema_cli.machine import return_freed_memory; return_freed_memory(); "
        "print(os.environ['MALLOC_MMAP_THRESHOLD_'])"
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert child.stdout.strip() == str(1 << 20), child.stderr  # what vLLM's engine processes inherit


def needs_vllm(test):
    """A real vLLM engine on CPU (slow: an engine start each)."""
    skip = pytest.mark.skipif(not vllm_available(), reason="vllm is not importable")
    return pytest.mark.slow(pytest.mark.vllm(skip(test)))


SMALL = ["--tasks", "gsm8k", "--limit", "2", "--n-samples", "2", "--max-new-tokens", "8"]
# the user's own shell: vLLM's engine core in its own process (its default), no KV setting of ours
USER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": ""}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("engine") / "data")


@needs_vllm
def test_a_users_own_eval_gets_a_kv_cache_sized_to_the_run(tiny_model_dir, data, tmp_path):
    env = {**os.environ, **USER_ENV}
    env.pop("VLLM_CPU_KVCACHE_SPACE")
    out = tmp_path / "out"
    r = run_bema(
        "eval", tiny_model_dir, "--data-dir", data, "--backend", "vllm", "--out", out, *SMALL, env=env
    )
    assert r.returncode == 0, r.stderr
    said = next(line for line in r.stderr.splitlines() if line.startswith("vLLM KV cache:"))
    assert "64 MiB reserved on CPU" in said, said  # the floor: 2 prompts x 2 samples of a tiny model
    assert "this can take a minute" in r.stderr
    # the engine (in its own process) used that size, not 70% of the machine's RAM
    log = (out / "vllm.log").read_text()
    assert "Explicitly set (0.06/" in log or "Explicitly set (0.0625/" in log, log[-2000:]
    assert {x["backend"] for x in read_jsonl(out / "results.jsonl")} == {"vllm"}


@needs_vllm
def test_a_failed_start_names_the_root_cause_and_auto_falls_back(tiny_model_dir, data, tmp_path):
    too_much = {**USER_ENV, "VLLM_CPU_KVCACHE_SPACE": "100000"}  # 100 TB: the worker refuses it
    out = tmp_path / "vllm"
    r = run_bema("eval", tiny_model_dir, "--data-dir", data, "--backend", "vllm", "--out", out, *SMALL,
                 "-q", env=too_much)  # fmt: skip
    line = one_line_error(r, 5)
    assert "vLLM could not start (ValueError: Available memory" in line, line
    assert "See root cause above" not in line and f"vLLM's log: {out / 'vllm.log'}" in line
    assert "lower VLLM_CPU_KVCACHE_SPACE" in line and "--backend transformers" in line
    auto = tmp_path / "auto"
    r = run_bema("eval", tiny_model_dir, "--data-dir", data, "--out", auto, *SMALL, "--json", env=too_much)
    assert r.returncode == 0, r.stderr
    fell = [x for x in r.stderr.splitlines() if "--backend auto goes on with transformers" in x]
    assert len(fell) == 1 and "ValueError: Available memory" in fell[0], r.stderr
    records = json.loads(r.stdout)["records"]
    assert records and {x["backend"] for x in records} == {"transformers"}
    assert {x["resume_key"]["backend"] for x in records} == {"transformers"}
    # the same command again (vLLM would start now): auto follows the records there, nothing redone
    again = run_bema("eval", tiny_model_dir, "--data-dir", data, "--out", auto, *SMALL, "--json")
    assert again.returncode == 0, again.stderr
    assert "--backend auto: transformers, as the records already in" in again.stderr
    assert [x["eval_id"] for x in json.loads(again.stdout)["records"]] == [x["eval_id"] for x in records]


@needs_vllm
def test_an_engine_that_dies_while_generating_is_one_line_exit_5(tiny_model_dir, data, tmp_path):
    """vLLM's engine core (its own process, the user's default) killed mid-generation: one line naming
    the engine's death and vLLM's log, exit 5, instead of an internal error or a hang (vLLM 0.32's
    client notices the death but leaves generate() waiting: vllm_backend._dead_engine_watch)."""
    import signal

    from conftest import BEMA

    out, err = tmp_path / "out", tmp_path / "stderr"
    env = {**os.environ, **USER_ENV, "VLLM_CPU_KVCACHE_SPACE": "1"}
    long = ["--tasks", "gsm8k", "--limit", "4", "--n-samples", "64", "--max-new-tokens", "512"]
    with open(err, "w") as stderr:
        proc = subprocess.Popen([str(BEMA), "eval", tiny_model_dir, "--data-dir", data, "--backend", "vllm",
                                 "--out", out, *long, "-q"], stderr=stderr, stdout=subprocess.DEVNULL, env=env)  # fmt: skip
    deadline, core = time.time() + 240, None
    while time.time() < deadline and proc.poll() is None and core is None:
        time.sleep(0.5)
        if "VLLM::EngineCore" in subprocess.run(["ps", "-o", "args=", "--ppid", str(proc.pid)],
                                                capture_output=True, text=True).stdout and (out / "vllm.log").is_file() and "init engine" in (out / "vllm.log").read_text(errors="replace"):  # fmt: skip
            time.sleep(4)  # generating by now
            found = subprocess.run(
                ["pgrep", "-P", str(proc.pid), "-f", "VLLM::EngineCore"], capture_output=True, text=True
            )
            core = int(found.stdout.split()[0]) if found.stdout.split() else None
    assert core is not None, err.read_text()
    os.kill(core, signal.SIGKILL)
    proc.wait(timeout=120)
    line = one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, "", err.read_text()), 5)
    assert "vLLM's engine died while generating (its engine core process exited unexpectedly" in line, line
    assert f"vLLM's log: {out / 'vllm.log'}" in line


def test_n_samples_past_vllms_limit_is_refused_before_any_engine(tiny_model_dir, data, tmp_path):
    """vLLM takes at most VLLM_MAX_N_SEQUENCES (16384) samples per prompt and said so only after
    sizing its KV cache for the run (8.3 GB here): bema refuses up front, exit 2, nothing written."""
    out = tmp_path / "out"
    r = run_bema(
        "eval",
        tiny_model_dir,
        "--data-dir",
        data,
        "--out",
        out,
        "--tasks",
        "gsm8k",
        "--n-samples",
        "1000000000000",
    )
    line = one_line_error(r, 2)
    assert "--n-samples: at most 16384 samples per prompt" in line and "1000000000000" in line, line
    assert not out.exists()


def test_the_cpu_head_sizes_are_the_installed_vllms():
    """vllm_engine.CPU_HEAD_SIZES is read before vLLM is imported (a dry run imports none): it must be
    the list the installed vLLM's CPU attention runs."""
    if not vllm_available():
        pytest.skip("vllm is not importable")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from bema_cli.eval.backends.vllm_engine import CPU_HEAD_SIZES

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == CPU_HEAD_SIZES


def test_a_head_size_the_engine_cannot_run_is_said_before_any_engine_starts(data, tmp_path):
    """hidden 64 and 4 heads (head size 16) on vLLM's CPU backend failed 85 s into the engine's start:
    --backend vllm is refused from config.json before any engine starts (exit 5, naming the file and
    the sizes it runs), and --backend auto goes on with transformers saying why."""
    from bema_cli.demo.tinymodel import make_tiny_model

    model = make_tiny_model(tmp_path / "h16", num_heads=4)
    r = run_bema("eval", model, "--data-dir", data, "--backend", "vllm", "--out", tmp_path / "v", *SMALL)
    line = one_line_error(r, 5)
    assert f"{model / 'config.json'}: vLLM cannot serve this model here: head size 16" in line, line
    assert "--backend transformers" in line and "vLLM KV cache" not in r.stderr
    auto = run_bema("eval", model, "--data-dir", data, "--out", tmp_path / "a", *SMALL, "--json")
    assert auto.returncode == 0, auto.stderr
    assert "--backend auto: transformers (" in auto.stderr and "head size 16" in auto.stderr
    assert {x["backend"] for x in json.loads(auto.stdout)["records"]} == {"transformers"}
