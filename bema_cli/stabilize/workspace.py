"""The buffers and the device of the fused pass (unit.py): what is allocated once per process and
reused by every unit and step, and where it lives.

`--device` picks the device (auto: the faster one for this work on this machine, device_choice.py);
on a GPU the unit's theta0 and states live in its memory, the block buffers are larger (GPU_BLOCK),
and the host side's pool and ring are pinned (io/transfer.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from bema_cli.errors import UsageError
from bema_cli.io.safetensors import FLOATING
from bema_cli.io.transfer import Transfers
from bema_cli.io.write_behind import WriteBehind
from bema_cli.stabilize.plan import Options, Piece, Plan

# Elements per block on a GPU: 32 MiB of float32. Cache-sized blocks gain a GPU nothing, and each
# block costs ~15 kernel launches (~75 us); at 8M elements that is under 1% of a block's copies.
GPU_BLOCK = 1 << 23


def torch_device(name: str, need_torch: bool = True):
    """The torch device of --device; with need_torch False (a dry run) only the name is checked
    unless it says cuda, so a dry run does not pay torch's ~1-2 s import."""
    if name not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device: choose auto, cpu or cuda, got {name!r}")
    if not need_torch and name != "cuda":
        return None
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    return torch.device(name)


class Workspace:
    """Buffers sized for the largest work unit, allocated once and reused by every unit and step.

    Fresh multi-MB tensors per step cost a page fault per page on first touch (measured ~3.5x
    slower copies), so theta0, the states, theta_s, theta_s - theta0 and one output live here;
    `view(name, n)` is the first n elements of a unit-sized buffer, `block_view` of a block-sized
    one (pages never touched are never resident). Outputs being written live in the write-behind
    pool; the copies between host and device are `transfers`' (io/transfer.py).
    """

    def __init__(self, size: int, acc, device, block: int | None = None):
        self.size, self.acc, self.device = size, acc, device
        self.transfers = Transfers(device)
        self.block = max(1, min(size, GPU_BLOCK if self.transfers.staged else block or size))
        self.buffers: dict = {}
        self._writes: WriteBehind | None = None

    @classmethod
    def for_plan(cls, plan: Plan, opts: Options) -> Workspace:
        """A workspace that fits every unit of `plan`."""
        import torch

        size = max((p.hi for u in plan.units for p in u), default=0)
        return cls(size, getattr(torch, opts.accum_dtype), torch_device(opts.device), plan.block)

    def view(self, name: str, n: int, dtype=None):
        return self._view(name, n, self.size, dtype)

    def block_view(self, name: str, n: int, dtype=None):
        return self._view(name, n, self.block, dtype)

    def _view(self, name: str, n: int, size: int, dtype=None):
        import torch

        if name not in self.buffers or self.buffers[name].numel() < size:
            self.buffers[name] = torch.empty(size, dtype=dtype or self.acc, device=self.device)
        return self.buffers[name][:n]

    def write_behind(self, block: int):
        """The write-behind pool and thread of this workspace (made once: see io/write_behind.py),
        its buffers where the device copies into them fastest (pinned on a GPU)."""
        if self._writes is None or self._writes.block < block:
            self.close()
            self._writes = WriteBehind(block, empty=self.transfers.host_empty)
        return self._writes

    @contextmanager
    def batch(self) -> Iterator[None]:
        """The units run inside: what they queue is written by the end (write errors raised here), or
        dropped where one fails. No unit waits for its own writes: the next one reads meanwhile."""
        with self.write_behind(self.block).batch():
            yield

    def close(self) -> None:
        """End the write-behind thread (after a batch: its queue is empty)."""
        if self._writes is not None:
            self._writes.close()
            self._writes = None

    def scratch(self, unit: list[Piece]):
        """A CPU byte buffer for inputs that must be cast (bf16 read, f32 accumulated): the largest
        float piece's bytes, grown as needed (the plan's memory budget counts the input as read)."""
        import torch

        need = max(
            (p.info.row_bytes * (p.stop - p.start) for p in unit if p.info.dtype in FLOATING), default=0
        )
        old = self.buffers.get("scratch")
        if old is None or old.numel() < need:
            self.buffers["scratch"] = old = torch.empty(need, dtype=torch.uint8)
        return old


@contextmanager
def compute_threads(ws: Workspace, threads: int | None = None) -> Iterator[None]:
    """torch's CPU threads while units run: one fewer than the cores (`threads`, default torch's own
    count), leaving a core to the write-behind thread and the kernel's page-cache copies. On 2 cores
    that is 1 thread: OpenMP workers that spin between the many short block ops (the GNU runtime's
    default) measured as a third of all CPU time, and slower wall time (docs/performance.md)."""
    import torch

    before = torch.get_num_threads()
    if ws.device.type == "cpu":
        torch.set_num_threads(max(1, (threads or before) - 1))
    try:
        yield
    finally:
        torch.set_num_threads(before)
