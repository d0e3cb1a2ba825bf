"""fsdp/ddp against one process, exact resumption, world-size changes and Slurm preemption, on CPU.

Every training here is a subprocess (`python -m tests.workers.dist_train`, framework.train plus a probe
callback), its ranks forked at once as a launcher would start them (tests/zygote.py). The runs that
several tests read are built on first use and kept for the module (`runs`), so a selected test
trains only what it reads:

    ref      1 process,  global batch 16, 4 steps                    (the reference)
    sgo      2 ranks x 8, fsdp SHARD_GRAD_OP, 1 loader worker each, 4 steps (also "uninterrupted")
    full     2 ranks x 8, fsdp FULL_SHARD, 4 steps
    split    as sgo, stopped at step 2, then resumed with resume=auto to step 4
    to1      split's step-2 sharded checkpoint resumed on 1 rank (fsdp) to step 4
    to2      1 rank fsdp (batch 16) to step 2, then resumed on 2 ranks x 8 to step 4
    ddp      2 ranks x 8, ddp, 1 loader worker each, 4 steps
    ddp_split  as ddp, stopped at step 2, then resumed with resume=auto to step 4

All of them freeze one projection (PROBE_FREEZE) to check that frozen parameters get neither
gradients nor optimizer state, sharded or not. They train at a constant lr 1e-3 from the first step,
so four Adam steps move each weight by about 4e-3: a rank whose optimizer does not step, or a resume
that lost the Adam moments, changes the update by far more than the float round-off that separates
two correct runs (compared as updates, w - w_init, relative to the reference's: same_updates).
"""

from __future__ import annotations

import csv
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from framework.inference.sampling import SamplingPlan
from tests.helpers import FROZEN, STEPS, TOL, fsdp, losses, probe, run_nodes, run_train, same_updates, train_args, weights
from tests import zygote
from tests.zygote import free_port

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # multi-process runs: not in the fast tier (pytest -m "not slow")


class Runs:
    """The module's training runs, each built the first time a test reads it (`runs["sgo"]` -> its folder)."""

    def __init__(self, root: Path, data: Path, val: Path) -> None:
        self.root, self.data, self.built = root, data, set()
        # The validation loss on the held-out digits at steps 0 and 4 of ref, sgo, ddp and sp_ddp.
        self.val = [f"data.val_path={val}", "eval.val_every_n_steps=4"]

    def __getitem__(self, name: str) -> Path:
        if name not in self.built:
            getattr(self, f"_{name}")(self.root / name)
            self.built.add(name)
        return self.root / name

    def _ref(self, d: Path) -> None:
        run_train(d, self.data, "data.batch_size=16", "trainer.checkpoint_every_n_steps=2", f"trainer.max_steps={STEPS}",
                  *self.val)

    def _sgo(self, d: Path) -> None:
        run_train(d, self.data, *fsdp(), f"trainer.max_steps={STEPS}", *self.val)

    def _full(self, d: Path) -> None:
        run_train(d, self.data, *fsdp("FULL_SHARD"), f"trainer.max_steps={STEPS}")

    def _split(self, d: Path) -> None:
        run_train(d, self.data, *fsdp(), "trainer.max_steps=2")
        # What to1 resumes from: the step-2 folder as this run left it, before it is resumed itself.
        shutil.copytree(d / "checkpoints" / "step0000002.ckpt", self.root / "split_at2" / "checkpoints" / "last.ckpt")
        shutil.copy(d / "metrics.csv", self.root / "split_at2" / "metrics.csv")
        run_train(d, self.data, *fsdp(), f"trainer.max_steps={STEPS}")

    def _to1(self, d: Path) -> None:
        self["split"]
        shutil.copytree(self.root / "split_at2", d)
        run_train(d, self.data, *fsdp(devices=1, batch=16), f"trainer.max_steps={STEPS}")

    def _to2(self, d: Path) -> None:
        run_train(d, self.data, *fsdp(devices=1, batch=16), "trainer.max_steps=2")
        run_train(d, self.data, *fsdp(), f"trainer.max_steps={STEPS}")

    def _ddp(self, d: Path) -> None:
        run_train(d, self.data, *DDP, f"trainer.max_steps={STEPS}", *self.val)

    def _ddp_split(self, d: Path) -> None:
        run_train(d, self.data, *DDP, "trainer.max_steps=2")
        run_train(d, self.data, *DDP, f"trainer.max_steps={STEPS}")

    # A LoRA (rank 4) on the reference's final weights: one process (the reference of the adapter runs); fsdp on 2 ranks
    # stopped at step 2 (its sharded checkpoint holds the adapter alone) and resumed on 1 rank.
    def _lora(self) -> list[str]:
        return ["adapter=lora", "adapter.rank=4", f"init_from={self['ref'] / 'checkpoints' / 'last.ckpt'}"]

    def _lora_ref(self, d: Path) -> None:
        run_train(d, self.data, *self._lora(), "data.batch_size=16", "trainer.checkpoint_every_n_steps=2",
                  f"trainer.max_steps={STEPS}")

    def _lora_fsdp(self, d: Path) -> None:
        run_train(d, self.data, *self._lora(), *fsdp(), "trainer.max_steps=2")
        run_train(d, self.data, *self._lora(), *fsdp(devices=1, batch=16), f"trainer.max_steps={STEPS}")

    def _lora_ddp(self, d: Path) -> None:  # DDP leaves the frozen base out of its broadcast and its reducer
        run_train(d, self.data, *self._lora(), *DDP, f"trainer.max_steps={STEPS}")

    # Sequence parallelism: one group of 2 ranks (the whole batch of 16 on both); 2 data x 2 sequence ranks
    # under fsdp (8 per group), its all-to-all in 2 overlapped head groups.
    def _sp_ddp(self, d: Path) -> None:
        run_train(d, self.data, *DDP[:2], "data.batch_size=16", "data.num_workers=1", "strategy.sequence_parallel=2",
                  f"trainer.max_steps={STEPS}", *self.val)

    def _sp_2x2(self, d: Path) -> None:
        run_train(d, self.data, *fsdp(devices=4), "strategy.sequence_parallel=2", "strategy.sequence_parallel_head_groups=2",
                  f"trainer.max_steps={STEPS}", timeout=400)


    # Two nodes x 2 ranks (two launches, a local cache each), HYBRID_SHARD: sharded within a node, replicated
    # across; 4 per rank = the reference's 16 per step. Saved at step 2 and continued on 1 node x 2 ranks.
    def _nodes(self, d: Path) -> None:
        hybrid = ["strategy=fsdp", "strategy.sharding=HYBRID_SHARD", "data.batch_size=4", "data.num_workers=1",
                  "trainer.checkpoint_every_n_steps=2"]
        run_nodes(d, self.data, 2, 2, *hybrid, "trainer.max_steps=2")
        shutil.copytree(d, self.root / "nodes_at2")
        run_train(d, self.data, *fsdp(), f"trainer.max_steps={STEPS}")

    # One sequence group of 2 nodes x 2 ranks (two launches): Ulysses within a node, ring attention across; the
    # whole batch of 16 on every rank.
    def _sp_nodes(self, d: Path) -> None:
        run_nodes(d, self.data, 2, 2, *DDP[:1], "data.batch_size=16", "data.num_workers=1",
                  "trainer.checkpoint_every_n_steps=2", "strategy.sequence_parallel=4", f"trainer.max_steps={STEPS}")


DDP = ["strategy=ddp", "trainer.devices=2", "data.batch_size=8", "data.num_workers=1", "trainer.checkpoint_every_n_steps=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, digits_shards, digits_val) -> Runs:
    return Runs(tmp_path_factory.mktemp("dist"), digits_shards, digits_val)


# --------------------------------------------------------------------------------------------
# Same global batch, same trajectory
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sgo", "full", "ddp", "sp_ddp", "sp_2x2", "sp_nodes"])
def test_two_ranks_follow_the_single_process_losses(runs, name):
    ref, got = losses(runs["ref"]), losses(runs[name])
    assert sorted(got) == list(range(STEPS))
    torch.testing.assert_close(torch.tensor([got[s] for s in range(STEPS)]),
                               torch.tensor([ref[s] for s in range(STEPS)]), **TOL)
    same_updates(runs[name], runs["ref"])


@pytest.mark.parametrize("name", ["sgo", "ddp", "sp_ddp"])
def test_the_validation_loss_on_two_ranks_is_the_one_process_loss(runs, name):
    """eval.val_every_n_steps=2 on 2 ranks (fsdp, ddp: each rank half the held-out samples; one sequence group: both
    the same ones) logs the 1-process val/loss and val/loss_t0..3 at steps 0 and 4."""
    def rows(d: Path) -> dict[int, dict[str, float]]:
        with open(d / "metrics.csv", newline="") as f:
            return {int(r["step"]): {k: float(v) for k, v in r.items() if k.startswith("val/") and v}
                    for r in csv.DictReader(f) if r.get("val/loss")}

    ref, got = rows(runs["ref"]), rows(runs[name])
    assert sorted(ref) == sorted(got) == [0, 4] and len(ref[0]) == 5
    for step in ref:
        assert got[step].keys() == ref[step].keys()
        torch.testing.assert_close(torch.tensor([got[step][k] for k in ref[step]]),
                                   torch.tensor([ref[step][k] for k in ref[step]]), **TOL)


def test_an_adapter_sharded_on_two_ranks_follows_one_process_and_resumes_on_one(runs):
    """adapter=lora under fsdp: the 2-rank run (the frozen base sharded with its adapter) logs the 1-process losses,
    writes a step-2 sharded checkpoint of the adapter alone, and resumed from it on 1 rank ends with the 1-process
    run's adapter updates."""
    import torch.distributed.checkpoint as dcp

    from framework.models.adapters import is_adapter_key

    ref, got = losses(runs["lora_ref"]), losses(runs["lora_fsdp"])
    assert sorted(got) == list(range(STEPS))
    torch.testing.assert_close(torch.tensor([got[s] for s in range(STEPS)]),
                               torch.tensor([ref[s] for s in range(STEPS)]), **TOL)
    same_updates(runs["lora_fsdp"], runs["lora_ref"])
    stored = dcp.FileSystemReader(str(runs["lora_fsdp"] / "checkpoints" / "step0000002.ckpt")).read_metadata()
    model_keys = [k for k in stored.state_dict_metadata if k.startswith("state_dict.")]
    assert model_keys and all(is_adapter_key(k) for k in model_keys)
    assert set(weights(runs["lora_fsdp"] / "checkpoints" / "last.ckpt")) == set(torch.load(
        runs["lora_ref"] / "init_weights.pt", weights_only=True))


def test_an_adapter_on_two_ddp_ranks_follows_one_process(runs):
    """adapter=lora under ddp, whose broadcast and gradient reducer skip the frozen base: the adapter's gradients are
    still averaged over the ranks, so the 2-rank run logs the 1-process losses and ends with its adapter updates."""
    ref, got = losses(runs["lora_ref"]), losses(runs["lora_ddp"])
    assert sorted(got) == list(range(STEPS))
    torch.testing.assert_close(torch.tensor([got[s] for s in range(STEPS)]),
                               torch.tensor([ref[s] for s in range(STEPS)]), **TOL)
    same_updates(runs["lora_ddp"], runs["lora_ref"])


def test_fsdp_and_sequence_parallelism_share_the_job_mesh(runs):
    """4 ranks, fsdp with sequence_parallel=2: one mesh (1 replicate x 2 shard x 2 sequence) from the strategy
    config; the parameters are sharded over its flattened dims (every rank) and each sequence group is its
    ulysses dim, ranks 0-1 and 2-3 holding data-parallel slices 0 and 1."""
    for rank in range(4):
        m = probe(runs["sp_2x2"], rank)["mesh"]
        assert m["dims"] == [1, 2, 2]
        assert m["param_mesh"] == ["fsdp"] and m["param_mesh_from_job_mesh"], m
        assert m["sequence_group_from_job_mesh"], m
        assert m["data_parallel"] == [rank // 2, 2]
    for rank in range(4):  # one group across 2 nodes: its ring dim is the node, each rank's ring position its node's
        m = probe(runs["sp_nodes"], rank)["mesh"]
        assert m["dims"] == [1, 1, 4] and m["ring"] == [2, rank // 2, 2] and m["data_parallel"] == [0, 1], m
    plain = probe(runs["sgo"], 0)["mesh"]
    assert plain["dims"] == [1, 2, 1] and plain["param_mesh_from_job_mesh"] and plain["data_parallel"] is None


def test_two_nodes_hybrid_sharded_follow_one_process_and_resume_on_one_node(runs):
    """2 nodes x 2 ranks under HYBRID_SHARD (one launch per node, each with its own shard cache) follow the
    1-process losses for the first 2 steps; the job resumed on 1 node x 2 ranks (SHARD_GRAD_OP) finishes on them."""
    ref, got = losses(runs["ref"]), losses(runs["nodes"])
    assert sorted(got) == list(range(STEPS))
    torch.testing.assert_close(torch.tensor([got[s] for s in range(STEPS)]),
                               torch.tensor([ref[s] for s in range(STEPS)]), **TOL)
    same_updates(runs["nodes"], runs["ref"])
    for rank in range(4):
        m = probe(runs.root / "nodes_at2", rank)["mesh"]
        assert m["dims"] == [2, 2, 1] and m["param_mesh"] == ["replicate", "fsdp_shard"], (rank, m)
        assert m["param_mesh_from_job_mesh"], m
    for node in (0, 1):  # each node read the shards into its own cache
        assert list((runs.root / "nodes_tmp" / f"node{node}_cache").rglob("shard.*.mds*")), node


@pytest.mark.parametrize("name", ["sgo", "full"])
def test_fsdp_parameters_are_sharded_dtensors_and_frozen_ones_get_no_state(runs, name):
    for rank in (0, 1):
        p = probe(runs[name], rank)
        assert p["world_size"] == 2
        for pname, info in p["params"].items():
            assert info["dtensor"], pname
            dim0 = info["shape"][0]
            # fully_shard splits dim 0 like torch.chunk: rank 0 takes ceil(n / 2), rank 1 the rest.
            assert info["local_shape"][0] == ((dim0 + 1) // 2 if rank == 0 else dim0 - (dim0 + 1) // 2), pname
            assert info["local_shape"][1:] == info["shape"][1:]
            frozen = pname.startswith(FROZEN)
            assert info["trains"] is not frozen and info["grad"] is not frozen, pname
            assert info["optimizer_state"] is not frozen, pname
    # The two ranks saw disjoint halves of each global batch, together the reference's batch.
    ref, r0, r1 = probe(runs["ref"])["keys"], probe(runs[name], 0)["keys"], probe(runs[name], 1)["keys"]
    for step in ref:
        assert sorted(r0[step] + r1[step]) == sorted(ref[step])


def test_the_final_grid_is_decoded_on_rank_zero_only(runs):
    """Every rank denoises a share of the final grid; only rank 0 loads the image codec and decodes."""
    assert [probe(runs["sgo"], r)["grid_codec_loaded"] for r in (0, 1)] == [True, False]
    assert (runs["sgo"] / "samples" / f"step{STEPS:07d}.png").is_file()


def test_single_process_frozen_parameters_get_no_state(runs):
    params = probe(runs["ref"])["params"]
    assert not any(v["dtensor"] for v in params.values())
    assert all(v["optimizer_state"] is not k.startswith(FROZEN) for k, v in params.items())


# --------------------------------------------------------------------------------------------
# Resumption
# --------------------------------------------------------------------------------------------


def test_fsdp_resume_with_workers_continues_like_an_uninterrupted_run(runs):
    full, split = losses(runs["sgo"]), losses(runs["split"])
    assert sorted(split) == list(range(STEPS))
    assert [split[s] for s in range(STEPS)] == [full[s] for s in range(STEPS)]  # bit-identical
    assert (runs["split"] / "checkpoints" / "last.ckpt" / "meta.pt").is_file(), "fsdp writes a sharded folder"
    wf, ws = weights(runs["sgo"] / "checkpoints" / "last.ckpt"), weights(runs["split"] / "checkpoints" / "last.ckpt")
    for k in wf:
        torch.testing.assert_close(ws[k], wf[k], rtol=0, atol=0)
    # Resumed batches are the uninterrupted run's batches.
    assert probe(runs["split"])["keys"] == {k: v for k, v in probe(runs["sgo"])["keys"].items() if int(k) >= 2}


def test_ddp_resume_with_workers_continues_like_an_uninterrupted_run(runs):
    full, split = losses(runs["ddp"]), losses(runs["ddp_split"])
    assert [split[s] for s in range(STEPS)] == [full[s] for s in range(STEPS)]  # bit-identical
    wf = weights(runs["ddp"] / "checkpoints" / "last.ckpt")
    ws = weights(runs["ddp_split"] / "checkpoints" / "last.ckpt")
    for k in wf:
        torch.testing.assert_close(ws[k], wf[k], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["to1", "to2"])
def test_sharded_checkpoint_resumes_on_another_world_size(runs, name):
    ref, got = losses(runs["ref"]), losses(runs[name])
    torch.testing.assert_close(torch.tensor([got[s] for s in range(2, STEPS)]),
                               torch.tensor([ref[s] for s in range(2, STEPS)]), **TOL)
    same_updates(runs[name], runs["ref"])  # the Adam moments came through the reshard: the last two steps match


# --------------------------------------------------------------------------------------------
# Slurm preemption (the sbatch path; scontrol replaced by a recorder; tests/test_slurm.py: real Slurm)
# --------------------------------------------------------------------------------------------


def fake_scontrol(tmp_path: Path, show: str = "", kill_wait: int = 3600) -> dict[str, str]:
    """PATH with an `scontrol` that appends its arguments to tmp_path/scontrol_calls.txt, prints `show` for
    `scontrol show job` and a KillWait of `kill_wait` seconds for `scontrol show config`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol_calls.txt"}\n'
                        f'[ "$1 $2" = "show config" ] && echo "KillWait                = {kill_wait} sec" && exit 0\n'
                        f'[ "$1" = show ] && echo "{show}"\nexit 0\n')
    scontrol.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def scontrol_calls(tmp_path: Path, config: bool = False) -> list[str]:
    """What the fake scontrol was asked, in order; `scontrol show config` (the grace check's) left out unless `config`."""
    called = tmp_path / "scontrol_calls.txt"
    calls = called.read_text().splitlines() if called.exists() else []
    return [c for c in calls if config or c != "show config"]


def slurm_task_env(job: str, rank: int = 0, ntasks: int = 1, name: str = "train") -> dict[str, str]:
    """The variables srun gives task `rank` of a one-node job step. Lightning's SLURMEnvironment.detect() ignores
    jobs named bash or interactive (salloc shells); an srun step (SLURM_STEP_ID) of one is still a Slurm job here."""
    return {"SLURM_JOB_ID": job, "SLURM_JOB_NAME": name, "SLURM_STEP_ID": "0", "SLURM_NTASKS": str(ntasks),
            "SLURM_NTASKS_PER_NODE": str(ntasks), "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1"}


# What `scontrol show job` says of a job Slurm is preempting (its GraceTime running) and of a cancelled one.
PREEMPTED = "JobId=4242 JobState=RUNNING Reason=None Restarts=0 PreemptTime=2026-11-27T05:19:24"
CANCELLED = "JobId=4242 JobState=COMPLETING Reason=None Restarts=0 PreemptTime=None"


@pytest.mark.parametrize("signum,show", [(signal.SIGUSR1, CANCELLED), (signal.SIGTERM, CANCELLED),
                                         (signal.SIGTERM, PREEMPTED)], ids=["USR1", "TERM-scancel", "TERM-preempted"])
def test_slurm_signal_saves_a_checkpoint_requeues_or_stops_and_the_rerun_resumes_there(tmp_path, digits_shards, signum,
                                                                                         show):
    """sbatch's --signal (USR1): save and requeue. SIGTERM: save, then requeue if Slurm is preempting the job, else
    (scancel) stop. tests/test_slurm.py does each on a real Slurm."""
    run_dir = tmp_path / "run"
    common = ["data.batch_size=16", "trainer.checkpoint_every_n_steps=1000"]
    env = {**fake_scontrol(tmp_path, show), **slurm_task_env("4242")}
    proc = run_train(run_dir, digits_shards, *common, "trainer.max_steps=10000", env=env, wait=False)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(losses(run_dir) if (run_dir / "metrics.csv").exists() else {}) < 2:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.5)
        proc.send_signal(signum)
        # The run saves at the next step, requeues (USR1 only) and leaves fit by itself, exit status 0.
        assert proc.wait(timeout=120) == 0, proc.stdout.read()[-3000:]
        out = proc.stdout.read()
        calls = scontrol_calls(tmp_path)
        if signum == signal.SIGUSR1:
            assert calls == ["requeue 4242"] and "then requeue the job" in out, out[-3000:]
        elif show == PREEMPTED:
            assert calls == ["show job -o 4242", "requeue 4242"] and "came with Slurm's preemption" in out, out[-3000:]
        else:
            assert calls == ["show job -o 4242"] and "stopped on SIGTERM without requeueing" in out, out[-3000:]
    finally:
        proc.kill()
        proc.wait()
    hpc = sorted(run_dir.glob("hpc_ckpt_*.ckpt"))
    assert [p.name for p in hpc] == ["hpc_ckpt_1.ckpt"]
    step = torch.load(hpc[0], weights_only=True)["global_step"]
    assert step >= 2 and not (run_dir / "checkpoints" / "last.ckpt").exists()
    # The requeued job: same command and run.dir; resume=auto finds the hpc checkpoint.
    rerun = run_train(run_dir, digits_shards, *common, f"trainer.max_steps={step + 1}")
    assert f"Restoring states from the checkpoint path at {hpc[0]}" in rerun.stdout + rerun.stderr
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == step + 1
    assert not hpc[0].exists(), "a later last.ckpt makes the preemption checkpoint redundant"


@pytest.mark.parametrize("grace_check", [True, False])
def test_grace_check_refuses_a_slurm_run_whose_save_outlasts_kill_wait(tmp_path, digits_shards, grace_check):
    """KillWait 0 s: a step plus a save cannot fit, so the run stops at its second step with an error naming the
    KillWait it needs (and leaves no probe behind); trainer.grace_check=false trains on without asking Slurm."""
    run_dir = tmp_path / "run"
    env = {**fake_scontrol(tmp_path, kill_wait=0), **slurm_task_env("4244")}
    proc = run_train(run_dir, digits_shards, "data.batch_size=16", "trainer.max_steps=4",
                     f"trainer.grace_check={str(grace_check).lower()}", env=env, wait=False)
    try:
        out = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
        proc.wait()
    if grace_check:
        assert proc.returncode != 0 and re.search(r"needs KillWait >= \d+ s .* KillWait is 0 s", out), out[-3000:]
        assert scontrol_calls(tmp_path, config=True) == ["show config"]
        assert not (run_dir / "grace_probe.ckpt").exists() and not (run_dir / "checkpoints" / "last.ckpt").exists()
    else:
        assert proc.returncode == 0 and "trainer.grace_check: " not in out, out[-3000:]
        assert scontrol_calls(tmp_path, config=True) == []

        from framework.training.checkpointing import checkpoint_step

        assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == 4


# Run in its own process: building a Trainer as rank 3 sets Lightning's process-wide rank (rank_zero_only.rank), after
# which a test worker's later in-process runs would log nothing.
ONE_GPU_TASK = """
import sys
from pathlib import Path

import torch
import lightning.fabric.accelerators.cuda as fabric_cuda
import lightning.pytorch.accelerators.cuda as pytorch_cuda

torch.cuda.device_count = lambda: 1
torch.cuda.is_available = lambda: True
fabric_cuda.num_cuda_devices = pytorch_cuda.num_cuda_devices = lambda: 1

from framework import config as config_lib
from framework.train import build_trainer
from tests.helpers import compose_cfg

config_lib.register()
try:
    trainer = build_trainer(config_lib.to_object(compose_cfg(sys.argv[2:])), Path(sys.argv[1]), [])
except Exception as e:
    print(f"refused: {e}")
else:
    print(f"device={trainer.strategy.root_device} ranks={trainer.global_rank},{trainer.local_rank},{trainer.world_size}")
"""


def test_a_task_bound_to_one_gpu_takes_the_gpu_it_sees(tmp_path, digits_shards):
    """`--gpus-per-task=1` sites: task 3 of a node's 4 sees one GPU, cuda:0. The trainer framework.train builds (as
    launch/train.sbatch runs it: trainer.devices=<tasks per node>) puts that task on cuda:0 as rank 3 of 4, where
    Lightning alone would refuse 4 devices with one visible. CUDA is faked: the trainer is built, not run."""
    overrides = train_args(tmp_path / "run", digits_shards, tmp_path / "cache", "strategy=ddp", "trainer.devices=4",
                           "trainer.accelerator=auto", "trainer.precision=32-true")
    env = {**os.environ, **slurm_task_env("4245", rank=3, ntasks=4), "TMPDIR": str(tmp_path)}
    proc = zygote.run([sys.executable, "-c", ONE_GPU_TASK, str(tmp_path / "run"), *overrides], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "device=cuda:0 ranks=3,3,4" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def srun_ranks(run_dir: Path, data: Path, *overrides: str, env: dict[str, str], ntasks: int = 2,
               name: str = "train") -> list[subprocess.Popen]:
    """Start `ntasks` ranks the way srun does: one process per task, each with its Slurm variables."""
    port = {"MASTER_PORT": str(free_port())}
    return [run_train(run_dir, data, *overrides, env={**env, **port, **slurm_task_env("4243", r, ntasks, name)},
                      wait=False) for r in range(ntasks)]


def finish(procs: list[subprocess.Popen], timeout: int = 300) -> str:
    """Wait for every rank; all must exit 0. Returns their output."""
    out = ""
    try:
        for p in procs:
            text = p.communicate(timeout=timeout)[0]
            out += text
            assert p.returncode == 0, text[-3000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return out


def test_preemption_signal_mid_run_saves_one_step_on_every_rank_and_the_requeued_run_matches(runs, tmp_path, digits_shards):
    """fsdp, 2 ranks under Slurm's variables: SIGUSR1 reaches both ranks while they hold after step 3
    (last.ckpt is at step 2). They agree, save hpc_ckpt_1.ckpt at step 3 together, rank 0 requeues
    once, both exit 0; the same command again (the requeued job) continues like the uninterrupted run."""
    run_dir = tmp_path / "run"
    args = [*fsdp(), f"trainer.max_steps={STEPS}"]
    env = fake_scontrol(tmp_path)
    procs = srun_ranks(run_dir, digits_shards, *args, env={**env, "PROBE_PAUSE_AT": "3"})
    deadline = time.time() + 240
    while not all((run_dir / f"paused_rank{r}").exists() for r in (0, 1)):
        assert time.time() < deadline and all(p.poll() is None for p in procs), finish(procs, 10)
        time.sleep(0.2)
    for p in procs:
        p.send_signal(signal.SIGUSR1)
    (run_dir / "go").touch()
    finish(procs)
    assert scontrol_calls(tmp_path, config=True) == ["show config", "requeue 4243"], "KillWait read once, by rank 0"

    from framework.training.checkpointing import checkpoint_step

    hpc = run_dir / "hpc_ckpt_1.ckpt"
    assert sorted(p.name for p in run_dir.glob("hpc_ckpt_*")) == [hpc.name]
    assert (hpc / "meta.pt").is_file() and checkpoint_step(hpc) == 3, "one sharded save, at the step both ranks reached"
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == 2
    assert sorted(losses(run_dir)) == [0, 1, 2]

    # Requeued into an allocation named `interactive` (an salloc shell's name, which Lightning alone would not take
    # for a Slurm job): still one 2-rank job.
    out = finish(srun_ranks(run_dir, digits_shards, *args, env=env, name="interactive"))
    assert f"Restoring states from the checkpoint path at {hpc}" in out
    with open(run_dir / "metrics.csv", newline="") as f:
        logged = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert logged == list(range(STEPS)), "every step logged exactly once: none lost, none repeated"
    full, got = losses(runs["sgo"]), losses(run_dir)
    assert [got[s] for s in range(STEPS)] == [full[s] for s in range(STEPS)]  # bit-identical
    wf, wg = weights(runs["sgo"] / "checkpoints" / "last.ckpt"), weights(run_dir / "checkpoints" / "last.ckpt")
    for k in wf:
        torch.testing.assert_close(wg[k], wf[k], rtol=0, atol=0)
    for r in (0, 1):  # the resumed step read the uninterrupted run's batch
        assert probe(run_dir, r)["keys"] == {"3": probe(runs["sgo"], r)["keys"]["3"]}
    assert not hpc.exists(), "last.ckpt at step 4 makes the step-3 preemption checkpoint redundant"


# --------------------------------------------------------------------------------------------
# Sharded folders outside training: sampling and export
# --------------------------------------------------------------------------------------------


def test_sharded_folder_exports_and_samples(runs, tmp_path):
    from safetensors.torch import load_file

    from framework.export import ExportCommand, export
    from framework.inference.pipeline import Pipeline

    folder = runs["split"] / "checkpoints" / "last.ckpt"
    out = export(ExportCommand(ckpt=str(folder), out=str(tmp_path / "m.safetensors")))
    exported = load_file(str(out))
    for k, v in weights(folder).items():
        torch.testing.assert_close(exported[k[len("net."):]], v, rtol=0, atol=0)
    pipe = Pipeline.from_checkpoint(folder)
    assert pipe.generate(["a handwritten 3"], SamplingPlan(steps=1)).shape == (1, 1, 8, 8)


def test_growth_from_a_sharded_checkpoint_on_two_fsdp_ranks_equals_one_process(runs, tmp_path, digits_shards):
    """plugins=[growth] from split's sharded step-2 folder: each fsdp rank keeps only its rows of the grown
    model, and the run follows the one-process growth of the same source with the same global batch."""
    source = runs["split"] / "checkpoints" / "step0000002.ckpt"
    grow = ["plugins=[growth]", f"plugins.growth.ckpt={source}", "plugins.growth.init=block_expand",
            "model.num_layers=8", "trainer.max_steps=2"]
    run_train(tmp_path / "one", digits_shards, *grow, "data.batch_size=16")
    run_train(tmp_path / "two", digits_shards, *grow, *fsdp())
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    torch.testing.assert_close(torch.tensor([two[0], two[1]]), torch.tensor([one[0], one[1]]), **TOL)
    wo = weights(tmp_path / "one" / "checkpoints" / "last.ckpt")
    assert any(k.startswith("net.transformer_blocks.7.") for k in wo)
    same_updates(tmp_path / "two", tmp_path / "one")


# --------------------------------------------------------------------------------------------
# Gradient accumulation and non-finite steps under fsdp
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory, digits_shards) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fsdp_more")
    out = {name: root / name for name in ("acc_ref", "acc", "poison")}
    run_train(out["acc_ref"], digits_shards, "data.batch_size=8", "trainer.accumulate_grad_batches=2",
              f"trainer.max_steps={STEPS}")
    # data.global_batch_size=16 on 2 ranks of at most 5: 2 micro-batches of 4 per rank and step (split_global_batch)
    run_train(out["acc"], digits_shards, *fsdp(batch=5), "data.global_batch_size=16", f"trainer.max_steps={STEPS}")
    # Rank 1's third micro-batch holds a NaN; rank 0's is clean.
    run_train(out["poison"], digits_shards, *fsdp(), "trainer.skip_nonfinite=true", f"trainer.max_steps={STEPS}",
              "trainer.checkpoint_every_n_steps=1", env={"PROBE_POISON": "1:2"})
    return out


def test_fsdp_gradient_accumulation_follows_one_process_and_syncs_once_per_step(fsdp_runs):
    """2 ranks given data.global_batch_size=16 and at most 5 samples per micro-batch accumulate 2 micro-batches of
    4 each per step: the losses and updates of one process's 2 x 8, one reduce-scatter per step, and on each logged
    step (every step here) one arrival barrier (per-rank figures), at the micro-batch that takes the step."""
    ref, got = losses(fsdp_runs["acc_ref"]), losses(fsdp_runs["acc"])
    assert sorted(got) == list(range(STEPS))
    torch.testing.assert_close(torch.tensor([got[s] for s in range(STEPS)]),
                               torch.tensor([ref[s] for s in range(STEPS)]), **TOL)
    same_updates(fsdp_runs["acc"], fsdp_runs["acc_ref"])
    for rank in (0, 1):
        rs = probe(fsdp_runs["acc"], rank)["reduce_scatters"]
        assert len(rs) == 2 * STEPS
        assert rs[0::2] == [0] * STEPS, f"rank {rank} reduce-scattered on an accumulating micro-batch: {rs}"
        assert all(n > 0 for n in rs[1::2]), rs
        assert probe(fsdp_runs["acc"], rank)["arrivals"] == list(range(1, 2 * STEPS, 2))


def test_a_nonfinite_loss_on_one_rank_skips_the_step_on_every_rank(fsdp_runs):
    run = fsdp_runs["poison"]
    for rank in (0, 1):
        assert probe(run, rank)["skipped"] == [False, False, True, False], rank
    meta = torch.load(run / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=True)
    assert meta["global_step"] == STEPS
    # The skipped step (the third) changed no weight; every weight is finite at the end.
    ckpts = run / "checkpoints"
    before, after = weights(ckpts / "step0000002.ckpt"), weights(ckpts / "step0000003.ckpt")
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=0, atol=0)
    assert all(torch.isfinite(v).all() for v in weights(run / "checkpoints" / "last.ckpt").values())
    logged = losses(run)
    assert sorted(logged) == list(range(STEPS))
    assert [math.isfinite(logged[s]) for s in range(STEPS)] == [True, True, False, True]


def test_fsdp_bf16_mixed_computes_with_bf16_parameters_and_keeps_fp32_masters(runs, digits_shards):
    """trainer.precision=bf16-mixed on 2 fsdp ranks: the MixedPrecisionPolicy reaches fully_shard, so the layers
    compute with bf16 copies of the parameters (gathered in bf16: half the traffic) while the shards that the
    optimizer updates stay fp32."""
    # In the module's short folder: the run's TMPDIR holds the data-loader worker's sockets, whose paths must fit
    # AF_UNIX's 107 characters (under this test's own, long tmp_path they sometimes did not and the loader hung).
    run_dir = runs.root / "bf16"
    run_train(run_dir, digits_shards, *fsdp(), "trainer.precision=bf16-mixed", "trainer.max_steps=2")
    for rank in (0, 1):
        p = probe(run_dir, rank)
        assert p["forward_dtypes"] == ["torch.bfloat16"], p["forward_dtypes"]
        assert p["master_dtypes"] == ["torch.float32"], p["master_dtypes"]


@pytest.mark.parametrize("precision,mixed,dtype", [
    ("32-true", True, None), (None, True, None), ("bf16-mixed", True, torch.bfloat16),
    ("16-mixed", True, torch.float16), ("bf16-mixed", False, None), ("bf16-true", True, None),
])
def test_fsdp_parameter_dtype_follows_trainer_precision(precision, mixed, dtype):
    from framework.distributed.config import StrategyConfig
    from framework.distributed.strategy import build_strategy

    # The accelerator plays no part: a 32-true run on a GPU computes in fp32 like one device would.
    strategy = build_strategy(StrategyConfig(name="fsdp", mixed_precision=mixed), precision)
    assert strategy.param_dtype == dtype
