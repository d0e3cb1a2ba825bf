"""trainer.hang_timeout_s: a rank that waits too long in one place ends the job, naming where, instead of idling
every GPU of the allocation until the process group's own timeout (strategy.timeout_s, 30 minutes by default).

A thread of each rank watches what the training loop is doing, from Lightning's hooks:
    a training step     from a batch's start to its end: forward, backward, the gradient collectives, the optimizer
    the data loader     from a step's end to the next batch's start: the other callbacks' end-of-step work (a save
                        is timed on its own, sampling and evaluation not at all), the fetch and the transfer of the next batch
    a checkpoint save   around trainer.save_checkpoint (periodic, preemption and final saves)
When one of them has lasted longer than the timeout, the thread prints which rank on which host waited how long in
what, and every thread's Python stack, writes the same into run.dir/hangs/rank<r>.txt, and ends the
process with exit code HANG_EXIT. A rank waiting on a stalled peer and the stalled rank itself both report; the
launcher (torchrun, srun --kill-on-bad-exit) then ends the job as failed, and launch/train.sbatch's requeue of failed
jobs takes over. A process's first batch is watched from the start of training (a resumed run's: once its checkpoint
is restored) to its arrival, as the data loader's; its first step is not (compilation and autotuning take as long
as they take), and the watch pauses while the run samples or evaluates, which progresses at its own pace.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import lightning.pytorch as pl

HANG_EXIT = 86  # the exit code of a rank ended by the watchdog (distinct from a crash's 1 and a signal's 128 + n)

# This process's watchdog while a run trains (for `paused`), held weakly as its thread holds it: Lightning gives each
# callback the module's `log`, so a watchdog kept alive would keep a failed run's module, trainer and StreamingDataset.
_active: Callable[[], "HangWatchdog | None"] = lambda: None


@contextmanager
def paused() -> Iterator[None]:
    """Work the watchdog must not time: sampling and evaluation during training (framework.training.callbacks)."""
    dog = _active()
    if dog is None:
        yield
        return
    with dog.waiting_in(None):
        yield


class HangWatchdog(pl.Callback):
    def __init__(self, timeout_s: float, run_dir: Path, poll_s: float = 1.0) -> None:
        self.timeout_s, self.run_dir, self.poll_s = timeout_s, run_dir, min(poll_s, timeout_s / 4)
        self._what: str | None = None  # what the rank waits in now (None: not watched)
        self._since = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rank = 0
        self._started = False  # the first micro-batch of this process has ended

    # -- what the rank is doing ---------------------------------------------------------------------------------

    def _set(self, what: str | None) -> str | None:
        with self._lock:
            before, self._what, self._since = self._what, what, time.monotonic()
        return before

    @contextmanager
    def waiting_in(self, what: str | None) -> Iterator[None]:
        before = self._set(what)
        try:
            yield
        finally:
            self._set(before)  # the time spent here does not count towards what was watched before

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        global _active
        if stage != "fit":
            return
        self._rank = trainer.global_rank
        save = trainer.save_checkpoint

        def watched_save(*args: Any, **kwargs: Any) -> Any:
            with self.waiting_in(f"a checkpoint save at step {trainer.global_step}"):
                return save(*args, **kwargs)

        trainer.save_checkpoint = watched_save  # every save goes through it: ModelCheckpoint's, preemption's, final
        _active = weakref.ref(self)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_watch, args=(weakref.ref(self), self._stop, self.poll_s),
                                        name="latentforge-hang-watchdog", daemon=True)
        self._thread.start()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        global _active
        self._stop.set()
        if _active() is self:
            _active = lambda: None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")  # (Lightning's teardown hooks do not run after a failure)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The loader's workers start, open their shards and collate the first batch: a stall there (a worker
        # waiting on a dead peer's shared memory, a stuck mount) would otherwise go unwatched forever.
        self._set(f"the data loader's first batch (of step {trainer.global_step + 1}: workers starting, shards "
                  "opening)")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self._started:
            self._set(None)  # the first step compiles and autotunes: not timed
            return
        self._set(f"training step {trainer.global_step + 1} (forward, backward, gradient collectives, optimizer)")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._started = True
        self._set(f"the end of step {trainer.global_step} or the data loader (the batch of step "
                  f"{trainer.global_step + 1})")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set(None)

    # -- the watch ----------------------------------------------------------------------------------------------

    def check(self) -> None:
        with self._lock:
            what, waited = self._what, time.monotonic() - self._since
        if what is not None and waited > self.timeout_s:
            self._fire(what, waited)

    def _fire(self, what: str, waited: float) -> None:
        host = socket.gethostname()
        head = (f"hang: rank {self._rank} on {host} (pid {os.getpid()}) waited {waited:.0f} s in {what}, more than "
                f"trainer.hang_timeout_s={self.timeout_s:g}; ending the job (exit {HANG_EXIT}). Every thread's stack:")
        report = f"{head}\n{stacks()}"
        print(report, file=sys.stderr, flush=True)
        try:
            folder = self.run_dir / "hangs"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank{self._rank}.txt").write_text(report)
        except OSError:
            pass
        os._exit(HANG_EXIT)


def stacks() -> str:
    """Every thread's Python stack, innermost call last as a traceback prints it: text, which any stream takes (a
    notebook's stderr has no file descriptor for faulthandler)."""
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"Thread {names.get(ident, ident)} (most recent call last):\n"
                   + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


def _watch(dog: Callable[[], HangWatchdog | None], stop: threading.Event, poll_s: float) -> None:
    """The watchdog's thread: holds it only while checking, so that it never keeps a finished run alive."""
    while not stop.wait(poll_s):
        watching = dog()
        if watching is None:
            return
        watching.check()
        del watching
