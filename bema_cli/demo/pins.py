"""Same software, same seed, the same numbers on any x86-64 machine: the demo's training is pinned
to code paths that do not depend on the CPU, before torch loads.

torch's vector kernels (ATen) and MKL's matrix products choose their code by CPU, and AVX-512 sums
in another order than AVX2, which a chaotic training run amplifies. ATen is pinned to AVX2 (every
x86-64 CPU of the last decade has it; its subprocesses keep it). MKL is pinned to its COMPATIBLE
branch, the only one it honours on AMD CPUs as well as Intel: an `AVX2` pin is silently ignored
on AMD, which then dispatches by the CPU (the demo's weights differed between two VMs of one
kind). Its SSE2 kernels make training slower (60 steps: 8.4 -> 10.5 s pretraining, 4.2 -> 6.2 s
fine-tuning) and vLLM's evaluation too (eval 141 -> 212 s), so the pin holds for the demo's own
process, where it trains, and not for the `bema` subprocesses that evaluate, whose numbers are not
pinned anyway (vLLM's CPU kernels choose by CPU). An environment that sets either keeps its own
value, in every process.

One more setting is not a pin of numbers but of manners: OpenMP threads that wait at a barrier
sleep (`OMP_WAIT_POLICY=PASSIVE`) instead of spinning. The training runs on 2 threads whatever the
machine; on cores shared with other jobs, a spinning thread burns the time slice its partner needs
to reach the barrier, and every one of the thousands of barriers per step costs a scheduler tick.
Measured on 2 cores beside 2 busy processes, 40 pretraining steps of the full demo: 29.4 s
spinning, 17.0 s sleeping, 9.8 s idle (either policy); beside 6: 79.1 s against 39.6 s, the fair
share. The weights are bitwise the same: the policy changes who waits, not what is summed. It holds
in the subprocesses too (vLLM's CPU threads are OpenMP threads as well).
"""

from __future__ import annotations

import os
import sys

PINS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "OMP_WAIT_POLICY": "PASSIVE"}
TRAINING_ONLY = ("MKL_CBWR",)
_pinned_here: set[str] = set()  # the pins this process set (not the environment's own values)


def pin_instruction_set() -> None:
    """Set the pins the environment does not set; only before torch loads (MKL reads its variable
    once)."""
    if "torch" in sys.modules:
        return
    for key, value in PINS.items():
        if key not in os.environ:
            os.environ[key] = value
            _pinned_here.add(key)


def subprocess_env(env: dict) -> dict:
    """`env` for a `bema` subprocess of the demo: without the training-only pins this process set."""
    return {k: v for k, v in env.items() if not (k in TRAINING_ONLY and k in _pinned_here)}
