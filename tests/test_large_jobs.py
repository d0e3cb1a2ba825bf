"""What a job of many ranks needs beyond a small one: a rank that stalls ends the job saying where (the hang watchdog,
framework/training/watchdog.py), and the logging steps say which rank the others wait for (per-rank figures)."""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys

import pytest

from framework.config import to_object, validate
from framework.training.watchdog import HANG_EXIT
from tests import zygote
from tests.helpers import compose_cfg, run_train, train_args, train_env


def test_a_stalled_rank_ends_the_job_naming_its_host_and_where_each_rank_waited(tmp_path, digits_shards):
    """Rank 1 stops at step 3 (as on a dead GPU); rank 0 waits for it in the step's gradient all-reduce. After the
    hang timeout (4 s) both end with the watchdog's exit code, each naming its host, what it waited in and every
    thread's stack, on stderr and in run.dir/hangs/; the exit code says the process group's own timeout (60 s here)
    did not end them first."""
    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    args = train_args(run_dir, digits_shards, tmp / "cache", "strategy=ddp", "trainer.devices=2", "data.batch_size=8",
                      "trainer.max_steps=6", "trainer.hang_timeout_s=4", "strategy.timeout_s=60", "logger=none")
    ranks = zygote.lightning_ranks("tests.workers.dist_train", args, 2, train_env(tmp, {"PROBE_STALL": "1:2"}), tmp,
                                   timeout=120)
    out = [r.stdout + r.stderr for r in ranks]
    assert [r.returncode for r in ranks] == [HANG_EXIT, HANG_EXIT], out
    host = socket.gethostname()
    for rank in range(2):  # rank 1 in its stall, rank 0 in the all-reduce waiting for rank 1
        assert f"hang: rank {rank} on {host} (pid " in out[rank] and " in training step 3 (forward, backward" in out[rank]
    assert "more than trainer.hang_timeout_s=4;" in out[1]  # (not a third of strategy.timeout_s)
    assert "in on_train_batch_start" in out[1]  # its stack shows where it stalled: the probe's sleep
    for rank in range(2):
        assert (run_dir / "hangs" / f"rank{rank}.txt").read_text().startswith(f"hang: rank {rank} on {host}")


def test_a_loader_that_never_delivers_the_first_batch_ends_the_run(tmp_path, digits_shards):
    """The first batch never comes (the loader sleeps ten minutes in its collation, as a worker waiting on a dead
    job's shared memory would): the watchdog ends the run after the hang timeout, naming the first batch's wait,
    though no step has run yet. (It was once unwatched until the first micro-batch ended.)"""
    run_dir, tmp = tmp_path / "run", tmp_path / "tmp"
    tmp.mkdir()
    args = train_args(run_dir, digits_shards, tmp / "cache", "trainer.max_steps=2", "trainer.hang_timeout_s=4",
                      "strategy.timeout_s=60", "logger=none")
    try:
        done, = zygote.lightning_ranks("tests.workers.dist_train", args, 1, train_env(tmp, {"PROBE_SLOW": "0:600"}),
                                       tmp, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("the run still waited for its first batch after 90 s: nothing timed the wait")
    out = done.stdout + done.stderr
    assert done.returncode == HANG_EXIT, out[-3000:]
    assert " in the data loader's first batch (of step 1: " in out, out[-3000:]
    assert "in <lambda>\n    datamodule.LatentCollate.__call__" in (run_dir / "hangs" / "rank0.txt").read_text()


def test_a_hang_timeout_the_process_group_would_outlast_is_refused():
    with pytest.raises(ValueError, match="trainer.hang_timeout_s=300 must be below strategy.timeout_s=300"):
        validate(to_object(compose_cfg(["trainer.hang_timeout_s=300", "strategy.timeout_s=300"])))
    validate(to_object(compose_cfg(["trainer.hang_timeout_s=299", "strategy.timeout_s=300"])))


@pytest.mark.parametrize("slow", ["PROBE_SLOW", "PROBE_BUSY"])
def test_logging_steps_name_the_rank_the_others_wait_for(tmp_path, digits_shards, slow):
    """Rank 1 is slow, 0.25 s a step, in its loader (PROBE_SLOW) or in its step before the forward (PROBE_BUSY, as a
    slow device): the gathered figures name rank 1 the slowest, with its loader's wait the maximum in the first case
    and rank 0's wait for it at the barrier in the second."""
    run_dir = tmp_path / "run"
    run_train(run_dir, digits_shards, "strategy=ddp", "trainer.devices=2", "data.batch_size=8", "trainer.max_steps=4",
              "trainer.log_every_n_steps=2", env={slow: "1:0.25"})
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/slowest_rank")]
    assert [int(r["step"]) for r in rows] == [1, 3]  # (0-based: the 2nd and 4th steps)
    # (In the 2nd step's forward DDP rebuilds its gradient buckets once, a collective before the arrival barrier.)
    for r in rows[1:]:
        assert float(r["train/slowest_rank"]) == 1
        if slow == "PROBE_SLOW":
            assert float(r["train/data_wait_max"]) >= 250 > float(r["train/data_wait_min"])
        else:
            assert float(r["train/arrival_wait_max"]) >= 200 > float(r["train/arrival_wait_min"])
            assert float(r["train/data_wait_max"]) < 200
        values = [float(r[f"train/step_time_{k}"]) for k in ("min", "median", "max")]
        assert 0 < values[0] <= values[1] <= values[2]
    assert not rows[0].get("train/rank_gather_ms") and float(rows[1]["train/rank_gather_ms"]) > 0


def test_a_watching_evaluation_scores_each_checkpoint_as_the_run_writes_it(tmp_path, digits_shards):
    """`framework.eval watch=RUN_DIR`, started before the run: it evaluates checkpoints 2 and 4 as they appear, logs
    them into the run's TensorBoard at those steps and ends with the run; each checkpoint's metrics are what
    `framework.eval ckpt=` gives for it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from framework.train import train
    from tests.helpers import cheap

    run_dir = tmp_path / "run"
    settings = ["seeds=1", "phrasings=1", "steps=2", "device=cpu"]
    watcher = zygote.popen([sys.executable, "-m", "framework.eval", f"watch={run_dir}", "watch_poll_s=0.2",
                            "watch_idle_s=600", *settings], env={**os.environ})
    train(compose_cfg(cheap(tmp_path, digits_shards, "logger=tensorboard", "trainer.checkpoint_every_n_steps=2",
                            steps=4)))
    out, _ = watcher.communicate(timeout=300)
    assert watcher.returncode == 0, out[-3000:]
    assert "watch: the run has ended; 2 checkpoints evaluated" in out
    watched = json.loads((run_dir / "eval" / "watched.json").read_text())
    assert sorted(watched) == ["2", "4"]
    alone = zygote.run([sys.executable, "-m", "framework.eval", f"ckpt={run_dir / 'checkpoints' / 'step0000004.ckpt'}",
                        f"out={tmp_path / 'alone'}", *settings], env={**os.environ}, timeout=300)
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    timeless = lambda m: {k: v for k, v in m.items() if k != "images_per_s"}  # noqa: E731
    assert timeless(watched["4"]) == timeless(json.loads((tmp_path / "alone" / "metrics.json").read_text()))
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    accuracy = events.Scalars("eval/prompt_accuracy")
    assert [(e.step, round(e.value, 6)) for e in accuracy] == [(s, round(watched[str(s)]["prompt_accuracy"], 6))
                                                                for s in (2, 4)]


@pytest.mark.slow  # 16 + 4 x 2 simulated ranks and the one-process reference: 87 s alone on 2 cores
def test_a_16_node_job_starts_and_continues_hybrid_sharded_on_4_nodes_like_one_process(tmp_path, digits_shards):
    """16 simulated nodes of one rank each (forked, each with its own /dev/shm and local cache, as hosts have) start
    the shipped shard config (num_canonical_nodes=auto), train 2 FSDP2 steps of 1 sample a rank (weights and AdamW
    moments sharded 16 ways) and save; the run continues on 4 nodes of 2 ranks under HYBRID_SHARD (sharded within a
    node, replicated across the 4), 2 samples a rank, from that checkpoint re-split. Every step's loss is the
    one-process run's of the same global batch of 16: the 16-node start and the change of node count and of sharding
    keep the sample order and the optimizer's state."""
    import torch

    from tests.helpers import TOL, losses, probe, run_nodes

    common = ["strategy=fsdp", "data.num_workers=0", "trainer.checkpoint_every_n_steps=2", "logger=csv"]
    run = tmp_path / "n"
    out = run_nodes(run, digits_shards, 16, 1, *common, "data.batch_size=1", "trainer.max_steps=2", timeout=600)
    assert out.stdout.count("--- launch") == 16
    # FSDP2 over the 16 nodes: each rank writes its own part of the sharded checkpoint
    assert len({p.name for p in (run / "checkpoints").rglob("*.distcp")}) == 16
    out = run_nodes(run, digits_shards, 4, 2, *common, "strategy.sharding=HYBRID_SHARD", "data.batch_size=2",
                    "trainer.max_steps=4", timeout=600)
    assert f"Restoring states from the checkpoint path at {run / 'checkpoints' / 'last.ckpt'}" in out.stdout
    for rank in range(8):  # the node is the replicate dimension, its 2 ranks the shard one
        mesh = probe(run, rank)["mesh"]
        assert mesh["dims"] == [4, 2, 1] and mesh["param_mesh"] == ["replicate", "fsdp_shard"], (rank, mesh)
    ref = tmp_path / "r"
    run_train(ref, digits_shards, "data.batch_size=16", "trainer.checkpoint_every_n_steps=2", "trainer.max_steps=4")
    got, want = losses(run), losses(ref)
    with open(run / "metrics.csv", newline="") as f:  # each step logged once: 0-1 on 16 nodes, 2-3 on 4
        assert [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")] == [0, 1, 2, 3]
    torch.testing.assert_close(torch.tensor([got[s] for s in range(4)]), torch.tensor([want[s] for s in range(4)]),
                               **TOL)
