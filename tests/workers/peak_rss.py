"""`python -m tests.workers.peak_rss MIB`: hold MIB MiB, then spawn one fresh process (as the benches run each arm)
that reports its peak resident memory; prints {"parent": bytes, "child": bytes}, both from harness.peak_rss_bytes."""

from __future__ import annotations

import json
import sys

import torch

from framework.bench.harness import in_fresh_processes, peak_rss_bytes


def report(cfg: int, name: str, out: str) -> None:
    with open(out, "w") as f:
        json.dump({"child": peak_rss_bytes()}, f)


if __name__ == "__main__":
    held = torch.ones(int(sys.argv[1]) * 2**18)  # MiB of float32, every page written
    (row,) = in_fresh_processes(report, 0, ["child"], "lf-peak-rss-")
    print(json.dumps({"parent": peak_rss_bytes(), "child": row["child"], "held": held.numel() * 4}))
