"""Which checkpoints a run keeps: the newest trainer.keep_checkpoints numbered ones besides last.ckpt,
for single files and sharded folders, across a resume; leftovers of a killed job are cleared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from framework.training.checkpointing import checkpoint_step
from framework.train import train
from tests.helpers import cheap, compose_cfg, fsdp, run_train, weights


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.slow
def test_keep_checkpoints_keeps_the_newest_numbered_files_across_a_resume(tmp_path, digits_shards):
    common = ["trainer.checkpoint_every_n_steps=1", "trainer.keep_checkpoints=2", "resume=auto", "logger=none"]
    train(compose_cfg(cheap(tmp_path, digits_shards, *common, steps=3)))
    ckpts = tmp_path / "run" / "checkpoints"
    assert names(ckpts) == ["last.ckpt", "step0000002.ckpt", "step0000003.ckpt"]
    # Half-written saves of a killed job (AtomicCheckpointIO's temporary names) go when training starts.
    (ckpts / "step0000004.ckpt.tmp").write_bytes(b"partial")
    (tmp_path / "run" / "hpc_ckpt_1.ckpt.tmp").write_bytes(b"partial")
    train(compose_cfg(cheap(tmp_path, digits_shards, *common, steps=5)))
    # The resumed run restored ModelCheckpoint's list, so it also removed the first run's files.
    assert names(ckpts) == ["last.ckpt", "step0000004.ckpt", "step0000005.ckpt"]
    assert [checkpoint_step(ckpts / n) for n in names(ckpts)] == [5, 4, 5]
    assert not (tmp_path / "run" / "hpc_ckpt_1.ckpt.tmp").exists()


def test_a_preemption_save_takes_the_next_free_slurm_checkpoint_name(tmp_path):
    """hpc_ckpt_N.ckpt as Lightning names them: one more than the largest N there, a half-written one counted."""
    from framework.training.checkpointing import next_hpc_path

    assert next_hpc_path(tmp_path) == str(tmp_path / "hpc_ckpt_1.ckpt")
    for name in ("hpc_ckpt_1.ckpt", "hpc_ckpt_3.ckpt.tmp", "hpc_ckpt_x.ckpt", "last.ckpt"):
        (tmp_path / name).write_bytes(b"")
    assert next_hpc_path(tmp_path) == str(tmp_path / "hpc_ckpt_4.ckpt")


def test_keep_checkpoints_zero_keeps_only_last(tmp_path, digits_shards):
    cfg = cheap(tmp_path, digits_shards, "trainer.checkpoint_every_n_steps=1", "trainer.keep_checkpoints=0", "logger=none",
                steps=2)
    train(compose_cfg(cfg))
    assert names(tmp_path / "run" / "checkpoints") == ["last.ckpt"]
    assert torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2


@pytest.mark.slow
def test_keep_checkpoints_removes_whole_sharded_folders(tmp_path, digits_shards):
    run_dir = tmp_path / "run"
    run_train(run_dir, digits_shards, *fsdp(devices=1, batch=16), "trainer.checkpoint_every_n_steps=1",
              "trainer.keep_checkpoints=1", "trainer.max_steps=3", "logger=none")
    ckpts = run_dir / "checkpoints"
    assert names(ckpts) == ["last.ckpt", "step0000003.ckpt"]
    assert all((ckpts / n / "meta.pt").is_file() for n in names(ckpts)), "fsdp writes folders"
    assert checkpoint_step(ckpts / "step0000003.ckpt") == 3


def test_last_checkpoint_links_the_numbered_one_it_equals(tmp_path, digits_shards):
    """One save writes the model once: last.ckpt is a link to the step's numbered file. A final step between
    saves gets a file of its own and leaves the numbered one as it was; resume=auto reads through the link."""
    common = ["trainer.checkpoint_every_n_steps=2", "trainer.keep_checkpoints=2", "resume=auto", "logger=none"]
    train(compose_cfg(cheap(tmp_path, digits_shards, *common, steps=4)))
    ckpts = tmp_path / "run" / "checkpoints"
    last = ckpts / "last.ckpt"
    assert last.is_symlink() and last.resolve() == (ckpts / "step0000004.ckpt").resolve()
    assert checkpoint_step(last) == 4
    numbered = (ckpts / "step0000004.ckpt").read_bytes()
    train(compose_cfg(cheap(tmp_path, digits_shards, *common, steps=5)))  # resumes at 4 through the link, ends at 5
    assert not last.is_symlink() and checkpoint_step(last) == 5
    assert (ckpts / "step0000004.ckpt").read_bytes() == numbered  # the final save did not write through the link
    assert names(ckpts) == ["last.ckpt", "step0000002.ckpt", "step0000004.ckpt"]


def test_sharded_last_checkpoint_is_a_link_to_the_numbered_folder(tmp_path, digits_shards):
    run_dir = tmp_path / "run"
    run_train(run_dir, digits_shards, *fsdp(devices=1, batch=16), "trainer.checkpoint_every_n_steps=2",
              "trainer.keep_checkpoints=1", "trainer.max_steps=3", "logger=none")
    ckpts = run_dir / "checkpoints"
    # step 2 saved with its link; the final step 3 (between saves) is a folder of its own, step 2 untouched
    assert names(ckpts) == ["last.ckpt", "step0000002.ckpt"]
    assert not (ckpts / "last.ckpt").is_symlink() and checkpoint_step(ckpts / "last.ckpt") == 3
    assert checkpoint_step(ckpts / "step0000002.ckpt") == 2


@pytest.mark.slow  # 4 launches of 2 fsdp ranks: 23 s in a full run
def test_async_saves_resume_like_sync_ones(tmp_path, digits_shards):
    """strategy.async_save=true on 2 fsdp ranks (process-based: staged while the next step runs, written by a process
    per rank): a run saved in the background, stopped and resumed, ends with the
    weights and losses of the same run saved synchronously, bit for bit; no temporary folder is left, and the
    numbered checkpoint an older save would have removed early stays until the newer one is complete."""
    from tests.helpers import losses

    common = [*fsdp(devices=2, batch=8), "trainer.checkpoint_every_n_steps=2", "trainer.keep_checkpoints=1", "logger=csv"]
    runs = {}
    for mode in ("false", "true"):
        # Short names: each run's TMPDIR is beside it, and the data loader's sockets there must fit AF_UNIX's
        # 107 characters (a longer path makes its workers fail and the loader wait for them).
        run_dir = tmp_path / mode[0]
        run_train(run_dir, digits_shards, *common, f"strategy.async_save={mode}", "trainer.max_steps=3")
        run_train(run_dir, digits_shards, *common, f"strategy.async_save={mode}", "trainer.max_steps=6")
        runs[mode] = run_dir
        ckpts = run_dir / "checkpoints"
        assert names(ckpts) == ["last.ckpt", "step0000006.ckpt"], names(ckpts)
        assert (ckpts / "last.ckpt").is_symlink() and checkpoint_step(ckpts / "last.ckpt") == 6
        # the saves took each rank's shards where they were: no copy of the whole state to host memory first, which
        # on a GPU the training thread would wait for at every save (the async one's staging does it in its thread)
        offloads = [json.loads((run_dir / f"probe_rank{r}.json").read_text())["offloads"] for r in range(2)]
        assert all(o and not any(o) for o in offloads), offloads
    assert losses(runs["true"]) == losses(runs["false"]) and sorted(losses(runs["true"])) == list(range(6))
    # each optimizer step after a save waited for its copy to host memory (FSDPStrategy.optimizer_step)
    for rank in range(2):
        probe = json.loads((runs["true"] / f"probe_rank{rank}.json").read_text())
        assert probe["staging_at_step"] == [False] * 3, probe["staging_at_step"]
    sync, background = (weights(runs[m] / "checkpoints" / "last.ckpt") for m in ("false", "true"))
    for k in sync:
        torch.testing.assert_close(background[k], sync[k], rtol=0, atol=0)


def test_a_process_based_async_save_holds_the_values_of_the_moment_it_was_asked_for(tmp_path):
    """Two ranks save through ShardedSaver's process-based async save and change the saved tensor in place as soon
    as wait_staged() returns, as the optimizer step does: what is loaded back is the tensor as it was at the save,
    twice; both copy into staging buffers that a prestage (as after a run's first optimizer step) filled with older
    values, and the second reuses the writing processes."""
    from tests.helpers import torchrun

    out = tmp_path / "staged"
    proc = torchrun(2, "-m", "tests.workers.staged_save", str(tmp_path), str(out), tmp=tmp_path, fork=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        saves = json.loads(Path(f"{out}.{rank}.json").read_text())
        assert [s["holds_the_saved_values"] for s in saves] == [True, True], saves


@pytest.mark.parametrize("strategy,saves", [("single", 1), ("ddp", 1), ("fsdp", 1), ("fsdp_async", 2)])
def test_the_grace_check_counts_the_saves_a_sigterm_may_wait_for(strategy, saves):
    """The save on SIGTERM waits for a periodic save still being written (strategy.async_save) before its own: the
    grace check then counts two saves, with each strategy the trainer builds."""
    from framework.distributed.config import StrategyConfig
    from framework.distributed.strategy import build_strategy
    from framework.training.checkpointing import emergency_saves

    name, _, mode = strategy.partition("_")
    assert emergency_saves(build_strategy(StrategyConfig(name=name, async_save=mode == "async"), "32-true")) == saves


@pytest.mark.parametrize("answers,preempted,asked", [
    # a preemption of this run: requeue, whatever state the job shows by then
    (["JobState=COMPLETING StartTime=2026-01-01T10:00:00 PreemptTime=2026-01-01T10:05:00"], True, 1),
    # a cancel of a job preempted in an earlier run (requeued since): its old PreemptTime does not count
    (["JobState=CANCELLED StartTime=2026-01-01T10:00:00 PreemptTime=2026-01-01T09:00:00"], False, 1),
    # the controller records the preemption after the signal arrived: asked again
    (["JobState=RUNNING StartTime=2026-01-01T10:00:00 PreemptTime=None",
      "JobState=RUNNING StartTime=2026-01-01T10:00:00 PreemptTime=2026-01-01T10:05:00"], True, 2),
    # still running and never preempted (a SIGTERM sent by hand): asked 3 times, then stopped
    (["JobState=RUNNING StartTime=2026-01-01T10:00:00 PreemptTime=None"] * 3, False, 3),
])
def test_a_sigterm_is_a_preemption_only_when_slurm_recorded_one_in_this_run(tmp_path, monkeypatch, answers, preempted,
                                                                           asked):
    """SlurmPreemption.preempted reads `scontrol show job` (here a script that answers `answers` in turn)."""
    import os
    import time

    from framework.training.checkpointing import SlurmPreemption

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "answers").write_text("".join(f"JobId=7 {a}\n" for a in answers))
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n'
                        f'sed -n "$(wc -l < {tmp_path}/calls)p" {tmp_path}/answers\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    assert SlurmPreemption().preempted() is preempted
    assert (tmp_path / "calls").read_text().splitlines() == ["show job -o 7"] * asked
