"""What the sweep's walk holds, and where it reads again instead (walk.py): the estimate `bema
sweep` checks before reading anything (`state_bytes`), the held dtype, and the ring that holds
checkpoint steps instead of weights."""

from __future__ import annotations

from bema_cli.io.reader import ModelIndex
from bema_cli.io.safetensors import DTYPES, FLOATING, TAG_OF
from bema_cli.recurrence import STATE_TENSORS, Window
from bema_cli.stabilize.plan import Plan

HOLD_BLOCK = 1 << 22  # elements upcast at a time from the held dtype (16 MB of float32 per buffer)


def hold_dtype(plan: Plan, accum_dtype: str) -> str:
    """The dtype theta0, theta_s and window rings are held in: the inputs' own float dtype when base
    and checkpoints all have the same one and it is narrower than the accumulation dtype (every
    bf16/f16/f32 value is exact in a wider float), else the accumulation dtype."""
    indexes = [plan.base_index, *plan.indexes.values()]
    tags = {t.dtype for index in indexes for t in index.tensors.values() if t.dtype in FLOATING}
    (tag,) = tags if len(tags) == 1 else (TAG_OF[accum_dtype],)
    return DTYPES[tag][0] if DTYPES[tag][1] < DTYPES[TAG_OF[accum_dtype]][1] else accum_dtype


def reread(plan: Plan, device: str = "cpu") -> tuple[bool, bool]:
    """Whether the walk reads (theta_s and the windows' members, theta0) again from their files at
    each use instead of holding them: host RAM is what a sweep runs short of, so on the CPU, where
    the files are safetensors (any element range is one pread). theta0 is held where it comes from a
    state folder (a burn-in's copy) or is not needed."""
    if device != "cpu":
        return False, False
    theta = all(index_streams(index) for index in plan.indexes.values())
    return theta, plan.theta0_index is plan.base_index and index_streams(plan.base_index)


class FileRing(Window):
    """A window's ring that holds, per slot, which checkpoint step it has (member j in slot j % K-1),
    not its weights: the walk keeps those checkpoints' files open and reads a block of each again
    where the merge needs it (`Walker._ring_view`)."""

    def __init__(self, slots: int):
        super().__init__([])
        self.steps: list[int | None] = [None] * slots

    def advance(self, event, step) -> None:  # `step` where a Window takes theta_s
        if event.action == "update" and self.steps:
            self.steps[event.member % len(self.steps)] = step


def index_streams(index: ModelIndex) -> bool:
    return type(index).open is ModelIndex.open  # safetensors' ChunkReader (other formats compute rows)


def state_bytes(plan: Plan, accum_dtype: str, device: str = "cpu") -> int:
    """What the walk holds (the estimate `bema sweep` checks before reading anything): theta0, theta_s
    and ring slices where held (`reread`), in the held dtype, and the previous checkpoint beside a
    held theta_s only where its files cannot be read by element range; EMA-family states in the
    accumulation dtype; the blocks."""
    numel = sum(t.numel for t in plan.out_tensors if t.dtype in FLOATING)
    again_theta, again_theta0 = reread(plan, device)
    rings = sum(t.ring for t in plan.tracks if t.window)
    burnin = any(step <= plan.runs[0].schedule.tau for step in plan.read_steps)  # theta0 = theta_s
    theta0 = not again_theta0 and (plan.theta0_index is not None or burnin)  # windows alone: none
    # the motion (motion.py) reads the previous checkpoint again from its files, a block at a time;
    # a held theta_s of a checkpoint that cannot be read so has a held copy of it beside it
    streams = all(index_streams(index) for index in plan.indexes.values())
    held = (not again_theta) * (1 + (not streams)) + theta0 + (0 if again_theta else rings)
    accumulated = sum(len(STATE_TENSORS[t.method]) for t in plan.tracks if not t.window)
    hold, accum = DTYPES[TAG_OF[hold_dtype(plan, accum_dtype)]][1], DTYPES[TAG_OF[accum_dtype]][1]
    blocks = 6 + (max((t.ring for t in plan.tracks if t.window), default=0) if again_theta else 0)
    return (held * hold + accumulated * accum) * numel + blocks * HOLD_BLOCK * accum
