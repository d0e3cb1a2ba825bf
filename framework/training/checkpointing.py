"""Checkpoints that survive being killed, resume=auto, Slurm preemption, reading sharded folders.

A checkpoint is either one file (Lightning's torch.save dict) or, under fsdp, a folder written by
torch.distributed.checkpoint (DCP): `.metadata` + one `__<rank>_0.distcp` file per rank with the
sharded `state_dict` and `optimizer_0`, plus Lightning's `meta.pt` with everything else (loop
state, data-loader state, our `latentforge` entry). Lightning writes both in place; the gaps filled
here are atomic replacement, picking the newest of last.ckpt and the Slurm `hpc_ckpt_*.ckpt`,
removing preemption checkpoints once a newer one exists, saving on Slurm's warning signal at the
same step on every rank, and turning a folder back into one plain dict without a process group.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from framework.inference.checkpoint import CKPT_KEY, METADATA_FILE, checkpoint_step, is_complete

# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to `<path>.tmp`, then os.replace: a reader never sees a half-written file.

    The file is written as torch.save serialises it. Lightning's own TorchCheckpointIO first serialises the whole
    checkpoint into an in-memory buffer and then copies it out (lightning.fabric's _atomic_save): on a host that holds
    the weights, the EMA and AdamW's moments (16 bytes a parameter) that is about as much again at every save, what
    pushed a 0.6B-parameter run on a 24 GiB machine out of memory (docs/training.md "Memory")."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)  # object stores are atomic per put
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options for a local checkpoint")
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a sharded checkpoint folder; set strategy.sharded_checkpoint=true "
                                    "or write the single-file checkpoint under another run.dir")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(checkpoint, tmp)
        os.replace(tmp, path)


class FinalCheckpoint(pl.Callback):
    """Write checkpoints/last.ckpt when training ends, unless ModelCheckpoint just did at this step.

    Saved in on_train_end, while the fit loop still holds the data loader: after `fit` returns, a
    multi-rank StreamingDataLoader reports 0 samples seen and the checkpoint would restart the data.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        finish_saves(trainer)  # strategy.async_save: this step's save may still be in flight
        mc = trainer.checkpoint_callback
        if mc is not None and getattr(mc, "_last_global_step_saved", -1) == trainer.global_step and is_complete(self.path):
            return
        # last.ckpt links an older numbered checkpoint: write beside it, not into it. Rank 0 decides for all (a rank
        # that looked after rank 0 unlinked it would skip the barrier the others wait in).
        if trainer.strategy.broadcast(self.path.is_symlink()):
            if trainer.is_global_zero:
                self.path.unlink()
            trainer.strategy.barrier()
        trainer.save_checkpoint(self.path)
        finish_saves(trainer)  # strategy.async_save: the final state is on disk before anything else runs


def finish_saves(trainer: pl.Trainer) -> None:
    """Wait for checkpoints still being written in the background (strategy.async_save)."""
    finish = getattr(trainer.strategy, "finish_saves", None)
    if finish is not None:
        finish()


def save_and_wait(trainer: pl.Trainer, path: str | Path) -> float:
    """Save a checkpoint to `path` and wait until every rank's part is on disk (an asynchronous save included); the
    seconds it took."""
    start = time.perf_counter()
    trainer.save_checkpoint(path)
    finish_saves(trainer)
    trainer.strategy.barrier()
    return time.perf_counter() - start


def checkpoint_bytes(path: Path) -> int:
    """A checkpoint's size on disk: the file, or every file of a sharded folder."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def save_derived(path: str | os.PathLike, weights: dict[str, torch.Tensor], source: dict[str, Any],
                 model: dict[str, Any], record: dict[str, Any]) -> Path:
    """Write the weights of a model derived from checkpoint `source` (grown, pruned) as a checkpoint of ours.

    One file with the `model.*` state dict and the source's `latentforge` entry (config, dataset, empty
    caption), its model config updated with `model` and `record` appended to its `derived` list; no
    optimizer or loop state. sample, eval and export read it as they read any checkpoint, and training
    starts from it with `init_from=PATH` (a new run: fresh optimizer and schedule).
    """
    import copy

    path = Path(path)
    if path.suffix != ".ckpt":
        raise ValueError(f"out={path}: give a file name ending in .ckpt")
    extra = {k: v for k, v in source[CKPT_KEY].items() if k in ("config", "dataset", "empty_text", "derived")}
    extra["config"] = copy.deepcopy(extra["config"])
    extra["config"]["model"].update(model)
    extra["config"]["adapter"] = {"kind": "none"}  # whole weights (an adapter run's merged into its base)
    extra["derived"] = [*extra.get("derived", []), record]
    path.parent.mkdir(parents=True, exist_ok=True)
    AtomicCheckpointIO().save_checkpoint({"state_dict": {f"model.{k}": v.contiguous() for k, v in weights.items()},
                                          CKPT_KEY: extra}, path)
    return path


# --------------------------------------------------------------------------------------------
# resume=auto
# --------------------------------------------------------------------------------------------


def _stamp(path: Path) -> float:
    return (path / METADATA_FILE).stat().st_mtime if path.is_dir() else path.stat().st_mtime


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() else path.unlink()


def find_resumable(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run: checkpoints/last.ckpt or Lightning's Slurm hpc_ckpt_*.ckpt.

    A `.old` copy counts too: it exists only when a job died while swapping a new folder in.
    """
    candidates = [run_dir / "checkpoints" / "last.ckpt", run_dir / "checkpoints" / "last.ckpt.old"]
    candidates += sorted(run_dir.glob("hpc_ckpt_*.ckpt"))
    # The numbered ones too: last.ckpt links one of them, and points at nothing while an asynchronous save of
    # that step is still being written when a job dies.
    candidates += sorted((run_dir / "checkpoints").glob("step*.ckpt"))
    found = [p for p in candidates if is_complete(p)]
    return max(found, key=_stamp) if found else None


# --------------------------------------------------------------------------------------------
# Old checkpoints
# --------------------------------------------------------------------------------------------


class PruneHpcCheckpoints(pl.Callback):
    """Remove run.dir/hpc_ckpt_*.ckpt once checkpoints/last.ckpt holds a later step (global rank 0).

    A preemption checkpoint is needed only until the requeued run has written a newer last.ckpt,
    and Lightning never removes one: each requeue would leave another full copy of the state.
    Numbered checkpoints are ModelCheckpoint's (trainer.keep_checkpoints); half-written `.tmp`
    files or folders that a killed job left behind are removed when training starts.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.last = self.run_dir / "checkpoints" / "last.ckpt"
        self.pending: dict[Path, int] = {}
        self._seen: float | None = None  # stamp of the last.ckpt already compared

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        # No save is in flight here: the previous job is gone and this one saves at batch ends only.
        for leftover in [*self.run_dir.glob("hpc_ckpt_*.ckpt.tmp"), *self.last.parent.glob("*.ckpt.tmp")]:
            _remove(leftover)
        self.pending = {p: checkpoint_step(p) for p in self.run_dir.glob("hpc_ckpt_*.ckpt") if is_complete(p)}
        self._prune()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.is_global_zero:
            self._prune()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._prune()  # build_trainer puts this callback after FinalCheckpoint

    def _prune(self) -> None:
        if not self.pending or not is_complete(self.last) or _stamp(self.last) == self._seen:
            return
        self._seen = _stamp(self.last)
        step = checkpoint_step(self.last)
        for path, hpc_step in list(self.pending.items()):
            if step > hpc_step:
                _remove(path)
                del self.pending[path]
                rank_zero_info(f"removed {path}: {self.last} holds a later step ({step} > {hpc_step})")


# --------------------------------------------------------------------------------------------
# Preemption: Slurm's warning signal
# --------------------------------------------------------------------------------------------


def slurm_task() -> bool:
    """Whether this process is a task of a Slurm job step (its ranks from srun's variables, Slurm's signals handled).

    Lightning's own test (SLURMEnvironment.detect: SLURM_NTASKS set) skips jobs named `bash` or `interactive`, the
    names salloc shells often get, so `srun python -m framework.train ...` from such a shell would start tasks that
    each think they are alone; any srun step (SLURM_STEP_ID) counts here too. A plain command in an salloc shell (no
    step) is one process, as Lightning has it."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect() or ("SLURM_STEP_ID" in os.environ and "SLURM_NTASKS" in os.environ)


def slurm_job_id() -> str:
    """The id `scontrol requeue` takes: <array job>_<task> inside a job array, else the job id."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ["SLURM_JOB_ID"]



def next_hpc_path(run_dir: Path) -> str:
    """run_dir/hpc_ckpt_N.ckpt, N one more than the largest there (1 for the first): Lightning's name for a Slurm
    checkpoint, which resume_path reads beside checkpoints/last.ckpt. Unfinished `.ckpt.tmp` files count too, so
    a save that died half-way is never written over."""
    numbers = [int(m.group(1)) for p in run_dir.glob("hpc_ckpt_*") if (m := re.match(r"hpc_ckpt_(\d+)\.ckpt", p.name))]
    return str(run_dir / f"hpc_ckpt_{max(numbers, default=0) + 1}.ckpt")


# What a signal asks for, in order of precedence when ranks got different ones (agreed as the max over ranks).
STOP, REQUEUE = 1, 2


class SlurmPreemption(pl.Callback):
    """On a Slurm signal, save run.dir/hpc_ckpt_N.ckpt at one step on every rank, then requeue or stop.

    Each signal has its meaning (`actions`, from preemption_callbacks):
    - the time-limit warning (sbatch's --signal, USR1): save, requeue the job (`scontrol requeue`), exit;
    - SIGTERM, which Slurm sends on `scancel` and when it preempts a job: save, then requeue only a job that
      Slurm is preempting (`preempted`); a cancelled job ends CANCELLED and stays ended (`resume=auto` continues
      it when it is submitted again). SIGKILL follows KillWait (a cancel) or GraceTime + KillWait (a preemption)
      after SIGTERM, so the save has that long.

    Lightning's own handler (SLURMEnvironment(auto_requeue=True)) saves inside the signal handler,
    wherever each rank happens to be; a sharded (DCP) or DDP save is collective, so the ranks could
    deadlock or save different steps. Here the handler only records the signal. At every optimizer-step
    boundary the ranks take the max of what they got (one scalar all-reduce), so all of them save
    the same step together and do the same after it. Once that step's metrics are logged (at the next batch
    start), global rank 0 requeues the job when asked to, and every rank leaves fit through Lightning's SIGTERM
    exit (callbacks' on_exception, teardown, loggers finalized, exit status 0).
    """

    def __init__(self, actions: dict[int, int] | None = None) -> None:
        self.actions = dict(actions or {signal.SIGUSR1: REQUEUE})
        self.flag, self.saved = 0, 0  # the action asked for in this process / agreed and saved for (0: none)
        self._previous: dict[int, Any] = {}
        self._step = -1
        self._group: Any = None  # the gloo group the flag is agreed on (several ranks)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Installed before the data-loader workers start: they inherit it and so are not killed by
        # the signal (Slurm's --signal reaches every process of the job step). Lightning's own SIGTERM
        # handler (installed earlier in fit) would stop the run at the next step without a checkpoint:
        # this one replaces it while training runs.
        for signum in self.actions:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning installs its SIGTERM handler after setup() (it would end the run at the next step with no
        # checkpoint, and it calls the handler it found, ours, too late): take the signals back for training.
        for signum in self.actions:
            current = signal.getsignal(signum)
            if current != self._on_signal:
                self._previous[signum] = current
                signal.signal(signum, self._on_signal)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for signum, handler in self._previous.items():
            if handler is not None and not (signum == signal.SIGTERM and self.saved):  # saved: SIGTERM stays ignored
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.flag = max(self.flag, self.actions[signum])

    def _agreed_action(self, trainer: pl.Trainer) -> int:
        """What the ranks' signals ask for, agreed by all: one number all-reduced over a gloo group in host memory,
        so the per-step check never waits for the GPU (a reduce on the device would queue behind the step's kernels
        and the host would wait for all of them)."""
        flag = torch.tensor([float(self.flag)])
        if trainer.world_size > 1:
            import torch.distributed as dist

            if self._group is None:  # created on every rank's first step end: a collective
                self._group = dist.new_group(backend="gloo")
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self._step:
            return  # mid-accumulation: a checkpoint here would lose the gradients summed so far
        self._step = trainer.global_step
        action = self._agreed_action(trainer)
        if not action or 0 < trainer.max_steps <= trainer.global_step:
            return  # no signal, or the last step: the run ends now and writes last.ckpt itself
        # One name for all ranks: each rank listing the folder while rank 0 writes could pick N+1.
        path = trainer.strategy.broadcast(next_hpc_path(Path(trainer.default_root_dir)))
        then = "requeue the job" if action == REQUEUE else "requeue if Slurm is preempting the job, else stop"
        rank_zero_info(f"Slurm signal: saving step {trainer.global_step} to {path}, then {then}")
        seconds = save_and_wait(trainer, path)  # every rank's part is on disk before the job is requeued or ends
        rank_zero_info(f"Slurm signal: step {trainer.global_step} saved in {seconds:.1f} s")
        self.saved = action

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self.saved:
            return
        # The saved step's metrics are logged by now. Requeueing makes Slurm SIGTERM the whole job (and a cancel or a
        # preemption has sent it already); nothing is left to protect, so SIGTERM is ignored for the rest of this
        # process (also after Lightning's teardown puts back the handlers it found), and the exit finishes: loggers
        # flushed, Streaming's shared memory released. Slurm's SIGKILL still follows KillWait later.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        found = getattr(getattr(trainer, "_signal_connector", None), "_original_handlers", None)
        if isinstance(found, dict):
            found[signal.SIGTERM] = signal.SIG_IGN
        if self.saved == REQUEUE or (trainer.is_global_zero and self.preempted()):
            self.requeue(trainer)
        else:
            rank_zero_info("stopped on SIGTERM without requeueing (scancel): the job stays ended; submit the same "
                           "command again to continue (resume=auto)")
        raise SIGTERMException

    def preempted(self) -> bool:
        """Whether the SIGTERM came with a preemption rather than a cancel: Slurm records a PreemptTime (this run's:
        not before its StartTime, so one left from a preemption of an earlier run of a requeued job does not count),
        while a cancelled job shows none and is CANCELLED or COMPLETING at once. Such a job is requeued here like on
        the time-limit warning: Slurm requeues a preempted job only if it still runs when its GraceTime is up, and one
        that saved and ended sooner would otherwise end COMPLETED and never come back (seen on Slurm 22.05). A job
        still RUNNING with no PreemptTime is asked again, for 2 s: the controller may not have recorded it
        yet when the signal arrives (CI once saw a preempted job stop as if cancelled)."""
        job = slurm_job_id()
        fields: dict[str, str] = {}
        for _ in range(3):
            try:
                out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                                     timeout=60).stdout
            except (FileNotFoundError, subprocess.TimeoutExpired):
                return False
            fields = dict(re.findall(r"(\w+)=(\S*)", out))
            when, start = fields.get("PreemptTime", "None"), fields.get("StartTime", "")
            if when not in ("None", "Unknown", "") and when >= start:  # ISO times: their order is the text's
                rank_zero_info(f"SIGTERM came with Slurm's preemption of job {job} (PreemptTime={when})")
                return True
            if fields.get("JobState") != "RUNNING":
                break
            time.sleep(1.0)
        rank_zero_info(f"no preemption of job {job} recorded (JobState={fields.get('JobState')}, "
                       f"PreemptTime={fields.get('PreemptTime')})")
        return False

    def requeue(self, trainer: pl.Trainer) -> None:
        """Put the job back in the queue (global rank 0); Slurm then ends this run of it."""
        if not trainer.is_global_zero:
            return
        job = slurm_job_id()
        try:
            result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
            ok, why = result.returncode == 0, result.stderr.strip()
        except FileNotFoundError:
            ok, why = False, "scontrol is not on PATH"
        if ok:
            rank_zero_info(f"requeued Slurm job {job}")
        else:
            rank_zero_warn(f"could not requeue Slurm job {job} ({why}); the checkpoint is saved: resubmit "
                           "the same command with resume=auto (and sbatch --requeue) to continue")


class SubmititPreemption(SlurmPreemption):
    """The same save on submitit's signal (hydra/launcher=slurm); submitit then requeues the job.

    submitit installs its handler for USR2 (or $SUBMITIT_PREEMPT_SIGNAL) when the job starts; it is
    called after the save. On global rank 0 it pickles the job, runs `scontrol requeue` and exits;
    on the other ranks it returns, and they leave like the sbatch path.
    """

    def __init__(self) -> None:
        # SIGTERM stays submitit's: it ignores it on purpose ("bypassing SIGTERM") and requeues on its own signal.
        self.signum = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"))
        super().__init__({self.signum: REQUEUE})

    def requeue(self, trainer: pl.Trainer) -> None:
        if callable(self._previous.get(self.signum)):
            self._previous[self.signum](self.signum, None)


def kill_wait_s() -> int | None:
    """Slurm's KillWait (`scontrol show config`): the seconds from the SIGTERM of `scancel`, of a preemption's end or
    of the time limit to SIGKILL. None when scontrol cannot say."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=60).stdout
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"^KillWait\s*=\s*(\d+)", out, re.MULTILINE)
    return int(found.group(1)) if found else None


class GraceCheck(pl.Callback):
    """Refuse a Slurm run whose save on SIGTERM cannot finish before SIGKILL (trainer.grace_check).

    SIGTERM is acted on at the next step boundary, so a cancelled job needs up to a step plus a save within KillWait
    (a preemption has GraceTime + KillWait, the time limit USR1's lead + KillWait: KillWait is the shortest). The
    checkpoint holds only what cannot be rebuilt (the trained weights, the EMA, the optimizer's state, the loop and
    data-loader counters), so what it needs is measured: at the second optimizer step of each job the step is timed
    and a probe save is written, timed until it is complete on every rank, and removed. When step + save (two saves
    under strategy.async_save, whose periodic save may still be in flight at the signal), with a fifth more for a
    busier file system, exceed KillWait, every rank stops with an error naming the KillWait it needs."""

    MARGIN = 1.2

    def __init__(self, run_dir: Path) -> None:
        self.probe = Path(run_dir) / "grace_probe.ckpt"
        self._steps, self._last, self._then = 0, -1, 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self._last:
            return  # mid-accumulation: the optimizer step is not over
        self._last, self._steps, now = trainer.global_step, self._steps + 1, time.perf_counter()
        if self._steps == 1 or (0 < trainer.max_steps <= trainer.global_step):
            self._then = now  # the first step compiles and warms up; the last one is followed by the final save
            return
        if self._steps != 2:
            return
        step_s = now - self._then
        kill_wait = trainer.strategy.broadcast(kill_wait_s() if trainer.is_global_zero else None)
        if kill_wait is None:
            rank_zero_info("trainer.grace_check: `scontrol show config` gave no KillWait; the save on SIGTERM is not timed")
            return
        if trainer.is_global_zero and self.probe.exists():
            _remove(self.probe)  # left by a job killed during its probe
        trainer.strategy.barrier()
        save_s = save_and_wait(trainer, self.probe)  # complete on every rank
        if trainer.is_global_zero:
            size = checkpoint_bytes(self.probe)
            _remove(self.probe)
        step_s, save_s = trainer.strategy.broadcast((step_s, save_s))
        saves = emergency_saves(trainer.strategy)
        need = math.ceil(self.MARGIN * (step_s + saves * save_s))
        what = "a save" if saves == 1 else "two saves (strategy.async_save: the periodic save in flight finishes first)"
        if need > kill_wait:
            raise RuntimeError(
                f"trainer.grace_check: a step takes {step_s:.1f} s and a save {save_s:.1f} s here, so the save on "
                f"SIGTERM (scancel, preemption, the time limit), a step and {what}, "
                f"needs KillWait >= {need} s with a fifth to spare; this "
                f"cluster's KillWait is {kill_wait} s, after which SIGKILL would cut the save and the run would fall back "
                f"to its last periodic checkpoint. Ask the administrators for KillWait={need} (slurm.conf), spread the "
                f"save over more ranks (strategy=fsdp) or write run.dir to a faster file system; or set "
                f"trainer.grace_check=false to train anyway.")
        if trainer.is_global_zero:
            rank_zero_info(f"trainer.grace_check: a step {step_s:.1f} s + {saves} x a save {save_s:.1f} s "
                           f"({size / 2**30:.2f} GiB) fit in Slurm's KillWait of {kill_wait} s")


def emergency_saves(strategy: Any) -> int:
    """How many saves the save on SIGTERM may wait for: its own, and under strategy.async_save the periodic one that
    may still be in flight (a save waits for the previous one)."""
    return 2 if getattr(strategy, "async_save", False) and getattr(strategy, "_save_distributed_checkpoint", False) else 1


def preemption_callbacks(run_dir: Path, grace_check: bool = True) -> list[pl.Callback]:
    """What handles Slurm's signals in this process: none outside Slurm; under hydra/launcher=slurm (submitit sets
    SUBMITIT_EXECUTOR) submitit's USR2 (save and requeue); else sbatch's SIGUSR1 (save and requeue) and SIGTERM (save,
    then requeue a preempted job and stop a cancelled one), with GraceCheck timing that save unless `grace_check` is
    false."""
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        return [SubmititPreemption()]
    if not slurm_task():
        return []
    return [SlurmPreemption({signal.SIGUSR1: REQUEUE, signal.SIGTERM: STOP}), *([GraceCheck(run_dir)] if grace_check else [])]


def check_global_batch(saved: int | None, now: int | None, allowed: bool) -> None:
    """A resumed run keeps the global batch its checkpoint was trained at (`saved`), unless `allowed`
    (trainer.allow_global_batch_change)."""
    if saved is not None and now is not None and saved != now and not allowed:
        raise ValueError(
            f"resuming a run whose global batch was {saved} samples per step with {now} (data.batch_size x "
            f"data-parallel ranks x trainer.accumulate_grad_batches): the data order, the noise drawn per sample "
            f"and the learning-rate schedule's meaning of a step would change mid-run. Resume with the same global "
            f"batch (e.g. raise trainer.accumulate_grad_batches on fewer ranks), or set "
            f"trainer.allow_global_batch_change=true to continue anyway."
        )
