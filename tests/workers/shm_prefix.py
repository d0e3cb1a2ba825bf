"""`torchrun --standalone --nproc_per_node=2 -m tests.workers.shm_prefix DATA CACHE OUT`: both ranks open the dataset
at DATA through framework.data.shards.open_streaming (CACHE its local folder), rank 1's own search for a free
shared-memory prefix made to find another prefix than its leader's, as when another process frees a segment between
the two searches. Rank 0 writes OUT: each rank's prefix and the samples it sees."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist


def main(data: str, cache: str, out: str) -> None:
    from streaming import StreamingDataset
    from streaming.base.shared import prefix as shm

    from framework.data.shards import open_streaming
    from framework.distributed.env import init_from_env, leave

    init_from_env()
    if dist.get_rank() == 1:
        search = shm._check_and_find_retrying
        shm._check_and_find_retrying = lambda *args, **kwargs: search(*args, **kwargs) + 1
    dataset = open_streaming(lambda: StreamingDataset(remote=data, local=cache, shuffle=False, batch_size=1))
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (dataset._shm_prefix_int, len(dataset)))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"prefixes": [p for p, _ in seen], "samples": [n for _, n in seen]}, f)
    del dataset
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:4])
