"""`torchrun --standalone --nproc_per_node=2 -m tests.workers.staged_save DIR OUT`: each rank saves a 64 MiB tensor
through ShardedSaver's process-based async save, into staging buffers a prestage filled with older values, changes
it in place as the optimizer step would once `wait_staged()` returns, lets the save finish, and loads it back. Each
rank writes OUT.RANK.json: whether the checkpoint holds the values of the moment of the save, and how long the save
call and the copy took."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from framework.distributed.env import init_from_env, leave
from framework.distributed.strategy import ShardedSaver


def main(folder: str, out: str) -> None:
    init_from_env()
    import torch.distributed as dist

    rank = dist.get_rank()
    weight = torch.arange(16 * 2**20, dtype=torch.float32) + rank  # 64 MiB
    saver = ShardedSaver(rank, dist.barrier, async_save="process")
    path = Path(folder) / "step.ckpt"
    # As after the run's first optimizer step: the buffers filled once with values no save asks for.
    saver.prestage(lambda: {"state_dict": {f"w{rank}": weight}})
    saver.wait_staged()
    weight.add_(1.0)
    saved = weight.clone()
    times = []
    for _ in range(2):  # the second save reuses the first's staging buffers and writing process
        t0 = time.perf_counter()
        saver.save({"state_dict": {f"w{rank}": weight}}, {"global_step": 1}, path)
        returned = time.perf_counter() - t0
        saver.wait_staged()
        times.append({"returned_s": returned, "staged_s": time.perf_counter() - t0})
        weight.add_(1.0)  # the optimizer step, after the copy
        saver.finish()
        back = {f"w{rank}": torch.zeros_like(weight)}
        dcp.load({"state_dict": back}, checkpoint_id=str(path))
        saved_ok = torch.equal(back[f"w{rank}"], saved)
        saved = weight.clone()
        times[-1]["holds_the_saved_values"] = saved_ok
    saver.close()
    Path(f"{out}.{rank}.json").write_text(json.dumps(times))
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:])
