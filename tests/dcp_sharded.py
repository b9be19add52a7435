"""Save a state dict as two ranks would under FSDP: a real 2-process gloo group, every tensor a DTensor
sharded along dim 0 (dim 1 for names starting with "col"), written with torch.distributed.checkpoint.save (one __<rank>_0.distcp per rank).

Usage: python dcp_sharded.py STATE.pt OUT_DIR   (STATE.pt: a torch.save'd {name: tensor})
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, state_path: str, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    state = torch.load(state_path, weights_only=True)
    # FSDP shards along dim 0; names starting with "col" along dim 1 (a tensor-parallel style split)
    sharded = {
        k: distribute_tensor(v, mesh, [Shard(int(k.startswith("col")))]) if v.dim() else v
        for k, v in state.items()
    }
    dcp.save({"model": sharded}, checkpoint_id=out)
    dist.barrier()  # both ranks done before either tears gloo down (a rank torn down early aborted the other once)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    mp.spawn(_rank, args=(sys.argv[1], sys.argv[2], free_port), nprocs=2)
