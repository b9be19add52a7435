"""Host <-> device copies of the fused pass: every CUDA-only call of `bema stabilize` is in this file.

The pass (stabilize/unit.py) is one pipeline on either device: reader threads fill a ring of
preallocated host buffers in file order, the compute stage runs block by block, and the outputs go
to the write-behind thread in pool buffers. On the CPU the two copies below are plain `copy_`s and
`ready` is None. On a GPU (the shape of the 2026 loaders, docs/design.md "The GPU path"):
- host buffers are pinned and allocated once (pinning per tensor, or copying from pageable or
  memory-mapped memory, serialises every copy through one driver buffer);
- `to_device` copies a block's raw bytes, in the file's dtype, on a copy stream into one of two
  device staging slots; the compute stream waits for that copy's event only, and casts on the GPU
  (a cross-device `copy_` that changes the dtype converts on the CPU, into fresh pageable memory);
- `to_host` casts an output block on the GPU into one of DEPTH device slots and copies it into a
  pinned pool buffer on a third stream; the event it returns is what the write-behind thread waits
  for before its `pwrite`, so the main thread never synchronises the device inside the loop.
A slot is reused only after the event of its last copy (the ring and the pool bound host memory).

BEMA_GPU_PIPELINE=1 runs the GPU's shape on the CPU (the staging slots, the deferred finite check,
GPU-sized blocks; no streams, no events), so its order and offsets are tested where no GPU is:
the outputs are bitwise those of the CPU path (tests/test_gpu_pipeline.py).
"""

from __future__ import annotations

import os
from contextlib import nullcontext

SLOT_ALIGN = 64  # bytes: each part of a staged block starts aligned for any dtype's view


def aligned(n: int) -> int:
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN


class Transfers:
    """The copies between this process's host buffers and the compute device."""

    def __init__(self, device, depth: int = 4):
        import torch

        self.device, self.cuda, self.depth = device, device.type == "cuda", depth
        self.staged = self.cuda or os.environ.get("BEMA_GPU_PIPELINE") == "1"  # the GPU's pipeline
        self._in: list = []  # device staging slots for inbound raw bytes: [buffer, event of its last use]
        self._out: list = []  # device slots for outbound casts: [buffer, event of its last copy]
        self._next_in = self._next_out = 0
        self.compute = self.h2d = self.d2h = None
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.h2d, self.d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)

    # the stream and event calls, each a no-op without CUDA (BEMA_GPU_PIPELINE on the CPU)
    def _on(self, stream):
        import torch

        return torch.cuda.stream(stream) if self.cuda else nullcontext()

    def _record(self, stream):
        import torch

        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _after(self, stream, event) -> None:
        """Work queued on `stream` from now on starts only after `event`."""
        if self.cuda and event is not None:
            stream.wait_event(event)

    def host_empty(self, n: int, dtype):
        """A host buffer the device copies to and from at full speed (pinned on a GPU)."""
        import torch

        return torch.empty(n, dtype=dtype, pin_memory=self.cuda)

    def _slot(self, slots: list, which: str, nbytes: int):
        import torch

        count = 2 if which == "in" else self.depth
        if not slots or slots[0][0].numel() < nbytes:
            for _, event in slots:  # a larger block: the old slots go only after their last copies
                wait(event)
            slots[:] = [
                [torch.empty(aligned(nbytes), dtype=torch.uint8, device=self.device), None]
                for _ in range(count)
            ]
        i = self._next_in if which == "in" else self._next_out
        if which == "in":
            self._next_in = (i + 1) % count
        else:
            self._next_out = (i + 1) % count
        return slots[i]

    def to_device(self, parts: list, out, lo: int):
        """Copy each (a, b, host data) of `parts` into out[a - lo : b - lo], cast to out's dtype.
        Returns the event after which the host data may be overwritten (None: at once)."""
        if not self.staged:
            for a, b, data in parts:
                out[a - lo : b - lo].copy_(data)
            return None
        nbytes = sum(aligned(d.numel() * d.element_size()) for _, _, d in parts)
        slot = self._slot(self._in, "in", nbytes)
        staged, pos = [], 0
        with self._on(self.h2d):
            self._after(self.h2d, slot[1])  # the slot's last cast has read it
            for a, b, data in parts:
                n = data.numel() * data.element_size()
                view = slot[0][pos : pos + n].view(data.dtype)
                view.copy_(data, non_blocking=self.cuda)  # same dtype, pinned: a DMA
                staged.append((a, b, view))
                pos += aligned(n)
            copied = self._record(self.h2d)
        self._after(self.compute, copied)
        for a, b, view in staged:
            out[a - lo : b - lo].copy_(view)  # the cast, on the device
        slot[1] = self._record(self.compute)
        return copied

    def to_host(self, result, host):
        """`result` (on the device) cast into the host buffer `host` (of the output dtype). Returns the
        event the writer waits for before reading `host` (None: copied already)."""
        if not self.staged:
            host.copy_(result)
            return None
        slot = self._slot(self._out, "out", host.numel() * host.element_size())
        self._after(self.compute, slot[1])  # its last outbound copy is done
        cast = slot[0][: host.numel() * host.element_size()].view(host.dtype)
        cast.copy_(result)  # on the compute stream
        ready = self._record(self.compute)
        with self._on(self.d2h):
            self._after(self.d2h, ready)
            host.copy_(cast, non_blocking=self.cuda)
            copied = self._record(self.d2h)
        slot[1] = copied
        return copied

    def sums(self, n: int):
        """A device vector of n block sums (the deferred finite check: one read back per step)."""
        import torch

        return torch.empty(n, dtype=torch.float64, device=self.device)


def wait(event) -> None:
    """Block this thread until `event` (from `to_device`/`to_host`) has happened; None: already."""
    if event is not None:
        event.synchronize()  # releases the GIL while it waits
