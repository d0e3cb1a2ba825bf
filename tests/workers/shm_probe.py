"""One rank of a simulated multi-node job (tests/test_zygote.py): leaves a file named by its RANK in /dev/shm, waits
until every rank of the job has, then writes which ranks' files its /dev/shm holds (its node's, if the nodes are
apart)."""

import json
import os
import sys
import time
from pathlib import Path

out, tag = Path(sys.argv[1]), sys.argv[2]
rank, world = os.environ["RANK"], int(os.environ["WORLD_SIZE"])
(Path("/dev/shm") / f"{tag}_{rank}").write_text(rank)
(out / f"started{rank}").touch()
while len(list(out.glob("started*"))) < world:
    time.sleep(0.01)
seen = sorted(int(p.name.rsplit("_", 1)[1]) for p in Path("/dev/shm").glob(f"{tag}_*"))
(out / f"seen{rank}.json").write_text(json.dumps(seen))
