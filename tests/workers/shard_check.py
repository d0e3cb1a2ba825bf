"""`torchrun --standalone --nproc_per_node=2 -m tests.workers.shard_check DATA OUT`: both ranks run the job's start-up
shard check (framework.data.shards.check_shards_once) on the dataset at DATA, counting the shard files each reads.
Each rank writes OUT.RANK.json: the files it read and the error it raised (or null)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import framework.data.shards as shards
from framework.distributed.env import init_from_env, leave


def main(data: str, out: str) -> None:
    init_from_env()
    import torch.distributed as dist

    read: list[str] = []
    size = shards._size_problem
    shards._size_problem = lambda f, index_file: read.append(f.file.name) or size(f, index_file)
    error = None
    try:
        shards.check_shards_once(Path(data), None, data, "hash")
    except (FileNotFoundError, ValueError) as err:
        error = f"{type(err).__name__}: {err}"
    Path(f"{out}.{dist.get_rank()}.json").write_text(json.dumps({"read": read, "error": error}))
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:3])
