"""The process that writes a rank's asynchronous checkpoints (strategy.async_save): torch's process-based writer
(torch.distributed.checkpoint._async_process_executor), started by us so that it starts lean and stays quiet.

Torch starts it in the background at the first save, as a spawned process, and a spawned process first imports
the script's main module: the whole training stack, 8 s and about a gigabyte per rank, for a process that only
writes files. Started here, with the main module hidden from multiprocessing, it imports torch and this module.
Torch's writer also sets the root logger to INFO, four lines per save and rank (a 256-rank job: a thousand per
save); here it logs warnings and errors only. This reaches into torch's private executor; where that has changed,
`start_writer` does nothing and torch starts its own process at the first save, as before.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

try:
    from torch.distributed.checkpoint import _async_process_executor as _executor

    _Process: Any = _executor._AsyncCheckpointProcess
    _InitInfo: Any = _executor._ProcessGroupInitInfo
    _executor._CHECKPOINT_PROCESS  # noqa: B018  (the slot torch's executor reuses)
except (ImportError, AttributeError):
    _executor = None


def _warnings_only(rank: int) -> None:
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"checkpoint writer of rank {rank}: %(levelname)s %(message)s"))
    root.addHandler(handler)


if _executor is not None:

    class WriterProcess(_Process):
        """torch's writer process, whose logger says only what went wrong."""

        @staticmethod
        def _checkpointing_subprocess(pg_init_info: Any, parent_conn: Any) -> None:
            _executor._init_logger = _warnings_only
            _Process._checkpointing_subprocess(pg_init_info, parent_conn)


def start_writer(group: Any) -> bool:
    """Start this rank's writing process (a collective over `group`, a gloo group); False where torch's executor is
    not the one this was written for (then torch starts its own at the first save)."""
    if _executor is None:
        return False
    if _executor._CHECKPOINT_PROCESS is not None:
        return True
    main = sys.modules["__main__"]
    hidden = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None  # multiprocessing's spawn reads it, and __file__ where it is None
    main.__dict__.pop("__file__", None)
    try:
        _executor._CHECKPOINT_PROCESS = WriterProcess(_InitInfo(group))
    finally:
        main.__dict__.update(hidden)
    return True
