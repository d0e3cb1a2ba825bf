"""`python -m tests.workers.peak_rss MIB`: hold MIB MiB, then spawn one fresh process (as the benches run each arm)
that reports its peak resident memory; prints {"parent": bytes, "child": bytes, "held": bytes}, both peaks from
framework.bench.fresh.peak_rss_bytes. Nothing heavy is imported, by either process."""

from __future__ import annotations

import json
import sys

from framework.bench.fresh import in_fresh_processes, peak_rss_bytes


def report(cfg: int, name: str, out: str) -> None:
    with open(out, "w") as f:
        json.dump({"child": peak_rss_bytes()}, f)


if __name__ == "__main__":
    held = b"\x01" * (int(sys.argv[1]) * 2**20)  # every page written
    (row,) = in_fresh_processes(report, 0, ["child"], "lf-peak-rss-")
    print(json.dumps({"parent": peak_rss_bytes(), "child": row["child"], "held": len(held)}))
