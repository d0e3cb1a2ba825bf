"""Benchmark arms each in a fresh process, and a process's own peak memory: what the suites that compare peak memory
share (finetune, roles, decode, init_memory). Imports nothing heavy, so a spawned arm pays only for what it imports
itself.
"""

from __future__ import annotations

import json
import multiprocessing
import resource
import tempfile
from pathlib import Path
from typing import Any, Callable


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far: VmHWM on Linux, ru_maxrss elsewhere. Not ru_maxrss on Linux: a
    spawned process is forked before it runs exec, and exec keeps the larger of its own peak and the forked copy's, so
    a bench arm spawned by a 1.3 GiB parent (pytest, a forked test process) reported 1.3 GiB whatever it used itself."""
    status = Path("/proc/self/status")
    if status.exists():
        return 1024 * next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def in_fresh_processes(target: Callable[[Any, str, str], None], cfg: Any, names: list[str],
                       prefix: str) -> list[dict[str, Any]]:
    """`target(cfg, name, out)` for each name in a process of its own (spawned: a process's peak memory is its own),
    each writing its JSON row to `out`; the rows, in order. `target` is a module-level function. A process that fails
    prints its traceback and stops the run here."""
    spawn = multiprocessing.get_context("spawn")
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            out = f"{tmp}/{name}.json"
            process = spawn.Process(target=target, args=(cfg, name, out), name=f"{prefix}{name}")
            process.start()
            process.join()
            if process.exitcode != 0:
                raise RuntimeError(f"{name}: its process exited with code {process.exitcode} (its error is above)")
            rows.append(json.loads(Path(out).read_text()))
    return rows
