"""Real Slurm: launch/train.sbatch (1 and 2 tasks) and a hydra/launcher=slurm sweep, warned, preempted and
cancelled the way Slurm does it, continued, and compared with an uninterrupted run.

Needs a cluster: `bash .ci/slurm.sh install && bash .ci/slurm.sh start` makes a one-node one on
loopback (CI does this); without one the file is skipped (under CI=true it fails instead). Every
job trains the debug model on the 8x8 digits for STEPS steps on CPU. Slurm's warning is sent by
hand, as its timer would: `scancel --signal=USR1 --batch` for the sbatch script
(--signal=B:USR1@90) and USR2 to the job steps for submitit (--signal=USR2@90); a preemption is real (a job of
.ci/slurm.sh's higher-tier partition that needs the CPUs); a cancel is a plain `scancel`. The job saves
run.dir/hpc_ckpt_1.ckpt, then requeues itself (warning, preemption) and Slurm starts it again, or ends CANCELLED
(cancel) and is submitted again; the rerun continues from the saved step: every step is logged once and the
losses are the uninterrupted run's. The rerun lands on the same node, where the killed job's shared memory and
files would be, and nothing of them may be left once it has finished.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from framework.train import train
from tests.helpers import compose_cfg, losses

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40  # long enough that the warning lands mid-run, short enough for a few seconds of training
# fsdp over 2 ranks sums gradients in another order than one process: float32 round-off only.
TOL = dict(rtol=1e-4, atol=1e-5)


def _no_cluster() -> str | None:
    if shutil.which("sbatch") is None:
        return "no Slurm here: sbatch is not on PATH (bash .ci/slurm.sh install && bash .ci/slurm.sh start)"
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10).stdout.split()
    except subprocess.TimeoutExpired:
        states = []
    if not any(s.rstrip("*~#") in ("idle", "mixed", "allocated") for s in states):
        return f"the Slurm cluster does not answer or has no usable node (sinfo: {states}); bash .ci/slurm.sh start"
    return None


_REASON = _no_cluster()
if _REASON and os.environ.get("CI") == "true":
    raise RuntimeError(f"CI must run the Slurm tests: {_REASON}")
pytestmark = [pytest.mark.skipif(_REASON is not None, reason=_REASON or ""), pytest.mark.slow]


def tiny(run_dir: Path | str, data: Path, cache: str, paced: bool = False) -> list[str]:
    """tests/test_distributed.py::run_train's tiny CPU training (without its probe), STEPS steps.

    paced: a 10-step sample grid after every step. The losses are the same (grids draw from their own seeds), but the
    40 steps take seconds rather than about one, so a test that warns the job once it has logged a step warns it
    mid-run on a fast idle machine too (unpaced, the job could finish between two polls of the test). Measured on 2 cores
    beside another test process: the warned one-task job saved at step 2 of 40. (50-step grids gave
    more margin than that needs and cost about a minute of the suite: the requeued run draws them too.)"""
    grids = ["sample.every_n_steps=1", "sample.steps=10"] if paced else ["sample.every_n_steps=0", "sample.steps=1"]
    return [
        f"run.dir={run_dir}", f"data.path={data}", f"data.local={cache}", "model=pixart_debug",
        "model.in_channels=1", "model.sample_size=8", "model.text_dim=384", "trainer.accelerator=cpu",
        "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "eval.at_end=false",
        *grids, "sample.per_prompt=1", "sample.prompts=[a handwritten 3]",
        "data.batch_size=16", f"trainer.max_steps={STEPS}", "trainer.checkpoint_every_n_steps=10", "resume=auto",
        # A stall (once: a requeued job at its first batch) ends the task with every thread's stack in
        # run.dir/hangs/ after a minute, rather than holding the test until it times out saying nothing.
        "trainer.hang_timeout_s=60",
    ]


def hangs(run_dir: Path) -> str:
    """What the hang watchdog wrote, for a failing assertion's message."""
    return "".join(p.read_text()[-4000:] for p in sorted((run_dir / "hangs").glob("*.txt")))


def activate() -> str:
    """The set-up line that activates this virtual environment ("" outside one)."""
    script = Path(sys.executable).parent / "activate"
    return f". {script}" if script.is_file() else ""


def job_env(tmp: Path) -> dict[str, str]:
    """What the jobs inherit (sbatch exports the environment): their own TMPDIR, loopback gloo, and the site set-up
    and wrapper of launch/*.sbatch. The set-up activates the venv and then does what conda's and module's shell
    functions do (read an unset variable, return non-zero), which the scripts' strict mode must survive. The
    wrapper stands in for `apptainer exec IMAGE`: it marks that task SLURM_PROCID ran inside it, then runs python."""
    wrapper = tmp / "wrap.sh"
    wrapper.write_text(f'#!/bin/sh\ntouch "{tmp}/wrapped.$SLURM_PROCID"\nexec "$@"\n')
    wrapper.chmod(0o755)
    site = ': "$LATENTFORGE_TEST_UNSET_SITE_VARIABLE"; false'
    return {**os.environ, "TMPDIR": str(tmp), "GLOO_SOCKET_IFNAME": "lo",
            "LATENTFORGE_SETUP": f"{activate()}; {site}" if activate() else site, "LATENTFORGE_EXEC": str(wrapper)}


def ran_wrapped(tmp: Path, ntasks: int) -> bool:
    return sorted(p.name for p in tmp.glob("wrapped.*")) == [f"wrapped.{r}" for r in range(ntasks)]


def job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for(what: str, ok, timeout: float = 400, every: float = 0.2):
    deadline = time.time() + timeout
    while not (value := ok()):
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
    return value


def logged_steps(run_dir: Path) -> list[int]:
    if not (run_dir / "metrics.csv").exists():
        return []
    with open(run_dir / "metrics.csv", newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]


def when_training(job_id: str, run_dir: Path, act) -> None:
    """act() once the job has trained a step (and while it still has steps to go): a signal, a preempting job."""
    polls = iter(range(10**9))

    def trained_or_ended() -> bool:  # the file every 0.05 s; scontrol (slower) every second
        if logged_steps(run_dir):
            return True
        return next(polls) % 20 == 0 and job(job_id).get("JobState", "PENDING") not in ("PENDING", "RUNNING")

    wait_for(f"job {job_id} to train", trained_or_ended, every=0.05)
    assert job(job_id)["JobState"] == "RUNNING" and len(logged_steps(run_dir)) < STEPS, "finished before the signal"
    act()


def wait_done(job_id: str) -> dict[str, str]:
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
    return wait_for(f"job {job_id} to finish", lambda: (j := job(job_id)).get("JobState") in ended and j, every=1)


def check_resumed_cleanly(run_dir: Path, out: str, cache: Path) -> int:
    """The preempted run saved hpc_ckpt_1.ckpt at step S and the rerun started there; returns S."""
    saved = re.findall(r"Slurm signal: saving step (\d+) to (\S+),", out)
    assert len(saved) == 1 and saved[0][1] == str(run_dir / "hpc_ckpt_1.ckpt"), out[-3000:]
    step = int(saved[0][0])
    assert 0 < step < STEPS
    # A signal at a periodic checkpoint's step (every 10) saves that step twice: ModelCheckpoint, which Lightning runs
    # after the other callbacks, writes last.ckpt last, and the rerun resumes from it, the same step.
    resumed = [run_dir / "hpc_ckpt_1.ckpt"] + ([run_dir / "checkpoints" / "last.ckpt"] if step % 10 == 0 else [])
    assert any(f"Restoring states from the checkpoint path at {p}" in out for p in resumed), out[-3000:]
    assert logged_steps(run_dir) == list(range(STEPS)), "every step logged exactly once: none lost, none repeated"
    # Nothing left over: the preemption checkpoint went once last.ckpt was later, no half-written
    # file stays, and no Streaming shared memory still names this job's cache folder.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "last.ckpt", "step0000020.ckpt", "step0000030.ckpt", "step0000040.ckpt"]
    assert not list(run_dir.glob("hpc_ckpt_*")) and not list(run_dir.rglob("*.tmp"))
    shm = [p.name for p in Path("/dev/shm").glob("*_locals") if str(cache).encode() in _read(p)]
    assert not shm, f"stale Streaming shared memory for {cache}: {shm}"
    return step


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # another test's segment went away meanwhile
        return b""


@pytest.fixture(scope="module")
def reference(tmp_path_factory, digits_shards) -> dict[int, float]:
    """The same training, uninterrupted, in one process without Slurm."""
    run_dir = tmp_path_factory.mktemp("slurm_reference") / "run"
    train(compose_cfg(tiny(run_dir, digits_shards, str(run_dir / "cache"))))
    return losses(run_dir)


# --------------------------------------------------------------------------------------------
# sbatch launch/train.sbatch
# --------------------------------------------------------------------------------------------


def sbatch_train(tmp_path: Path, run_dir: Path, data: Path, cache: Path, ntasks: int) -> str:
    """The README's command, sized for this CPU node (no --gpus-per-node, one CPU per task); the job id."""
    strategy = ["strategy=fsdp", "data.batch_size=8", "data.num_workers=1"] if ntasks == 2 else []
    cmd = ["sbatch", "--parsable", f"--ntasks-per-node={ntasks}", "--cpus-per-task=1", f"--output={tmp_path}/slurm-%j.out",
           "launch/train.sbatch", *tiny(run_dir, data, str(cache), paced=True), *strategy]
    return subprocess.run(cmd, cwd=ROOT, env=job_env(tmp_path), capture_output=True, text=True, check=True).stdout.strip()


def preempt(job_id: str, tmp_path: Path) -> str:
    """A job of the higher-tier partition that needs both of the node's CPUs: Slurm preempts the running job
    (.ci/slurm.sh: preempt/partition_prio, PreemptMode=REQUEUE). Returns its id."""
    cmd = ["sbatch", "--parsable", "--partition=urgent", "--cpus-per-task=2", f"--output={tmp_path}/urgent-%j.out",
           "--wrap", "sleep 1"]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


# How each signal reaches the job (.ci/slurm.sh's cluster), and what the job must do: the time-limit warning
# (--signal=B:USR1@90, sent by hand as its timer would) saves and requeues; a real preemption saves, is requeued and
# continues; `scancel` saves and ends the job CANCELLED, and submitting the same command again continues it.
SIGNALS = {"usr1": 2, "preempt": 1, "scancel": 1}  # case: tasks


@pytest.mark.parametrize("case", list(SIGNALS))
def test_sbatch_job_saves_on_each_signal_and_resumes_exactly(tmp_path, digits_shards, reference, case):
    run_dir, cache, ntasks = tmp_path / "run", tmp_path / "cache", SIGNALS[case]
    job_id, jobs = sbatch_train(tmp_path, run_dir, digits_shards, cache, ntasks), []
    jobs.append(job_id)
    try:
        if case == "usr1":
            when_training(job_id, run_dir, lambda: subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True))
        elif case == "preempt":
            when_training(job_id, run_dir, lambda: jobs.append(preempt(job_id, tmp_path)))
        else:
            when_training(job_id, run_dir, lambda: subprocess.run(["scancel", job_id], check=True))
        info = wait_done(job_id)
        out = (tmp_path / f"slurm-{job_id}.out").read_text()
        if case == "scancel":
            assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), out[-3000:]
            assert "stopped on SIGTERM without requeueing" in out and "requeued Slurm job" not in out, out[-3000:]
            assert (run_dir / "hpc_ckpt_1.ckpt").exists()
            # Later, the same command: resume=auto continues from the saved step.
            again = sbatch_train(tmp_path, run_dir, digits_shards, cache, ntasks)
            jobs.append(again)
            info = wait_done(again)
            out += (tmp_path / f"slurm-{again}.out").read_text()
            assert info["JobState"] == "COMPLETED", out[-3000:]
        else:
            assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out[-3000:] + hangs(run_dir)
            assert f"requeued Slurm job {job_id}" in out, out[-3000:]
        if case == "preempt":
            assert "came with Slurm's preemption" in out, out[-3000:]
            assert job(jobs[1])["JobState"] == "COMPLETED"  # the preempting job ran
    finally:
        for j in jobs:
            subprocess.run(["scancel", j], capture_output=True)
    check_resumed_cleanly(run_dir, out, cache)
    assert ran_wrapped(tmp_path, ntasks), "every task ran inside LATENTFORGE_EXEC"
    got = losses(run_dir)
    if ntasks == 1:
        assert got == reference  # bit-identical
    else:
        torch.testing.assert_close(torch.tensor([got[s] for s in range(STEPS)]),
                                   torch.tensor([reference[s] for s in range(STEPS)]), **TOL)


def training_task(run_dir: Path) -> int:
    """The pid of the job's training process (the task srun started: python -m framework.train run.dir=RUN_DIR)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (Path(argv[0].decode()).name.startswith("python") and argv[1:3] == [b"-m", b"framework.train"]
                and f"run.dir={run_dir}".encode() in argv):
            return int(proc.name)
    raise AssertionError(f"no training process of {run_dir}")


def test_sbatch_job_whose_rank_is_killed_is_requeued_and_continues_exactly(tmp_path, digits_shards, reference):
    """The drill of a lost rank: SIGKILL to the training task mid-run (no signal to the job, nothing saved). srun ends
    the step as failed, launch/train.sbatch requeues the job (restart 1 of LATENTFORGE_MAX_RESTARTS), and the rerun
    continues from the last periodic checkpoint: the steps after it are trained again, and every step's last logged
    loss is the uninterrupted run's. Prints the time from the SIGKILL to a step trained again. Leaving out the node
    (launch/requeue.py) is refused here, the cluster's only one; tests/test_requeue.py has the exclusions."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    job_id = sbatch_train(tmp_path, run_dir, digits_shards, cache, 1)
    killed = []
    try:
        def kill() -> None:
            wait_for("a step past the first checkpoint", lambda: len(logged_steps(run_dir)) > 11, every=0.05)
            os.kill(training_task(run_dir), 9)
            killed.append((time.time(), len(logged_steps(run_dir))))

        when_training(job_id, run_dir, kill)
        # Trained again: a step logged a second time (the rerun starts at the checkpoint of step 10).
        wait_for("the rerun to train", lambda: len(set(s := logged_steps(run_dir))) < len(s), every=0.1)
        again_s = time.time() - killed[0][0]
        info = wait_done(job_id)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    out = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out[-3000:]
    assert f"requeueing job {job_id}, restart 1 of 3" in out, out[-3000:]
    # launch/requeue.py read srun's report of the killed task; the cluster's one node cannot be left out.
    assert (f"requeued job {job_id}; srun's first failure: srun: error: localhost: task 0: Killed; not leaving out "
            "localhost: the job's partitions would keep 0 usable nodes for the 1 it needs") in out, out[-3000:]
    assert f"Restoring states from the checkpoint path at {run_dir / 'checkpoints' / 'last.ckpt'}" in out, out[-3000:]
    assert losses(run_dir) == reference  # every step's last logged loss, bit-identical
    assert sorted(set(logged_steps(run_dir))) == list(range(STEPS))
    shm = [p.name for p in Path("/dev/shm").glob("*_locals") if str(cache).encode() in _read(p)]
    assert not shm, f"stale Streaming shared memory for {cache}: {shm}"
    print(f"drill: SIGKILL at step {killed[0][1]} of {STEPS}; training again {again_s:.1f} s later")


# --------------------------------------------------------------------------------------------
# sbatch launch/precompute.sbatch
# --------------------------------------------------------------------------------------------


def test_precompute_sbatch_preempted_on_two_tasks_is_requeued_and_writes_the_one_process_dataset(tmp_path,
                                                                                                tiny_text_encoder_dir):
    """launch/precompute.sbatch as its usage line says, sized for this CPU node: 2 tasks deal a folder's 3 parts
    (ranks from srun's environment alone), rank 0 merges. A higher-tier job preempts it once both tasks have started:
    the script requeues it, and the requeued job's rows are the one-process run's, in its order."""
    from data_prep.precompute import precompute
    from tests.helpers import folder_config, make_image_folder, read_rows

    src = make_image_folder(tmp_path / "imgs", n=9)
    want = precompute({**folder_config(src, tmp_path / "one", tiny_text_encoder_dir), "records_per_part": 4},
                      rank=0, world_size=1)
    out = tmp_path / "two"
    cmd = ["sbatch", "--parsable", "--ntasks-per-node=2", "--cpus-per-task=1", f"--output={tmp_path}/slurm-%j.out",
           "launch/precompute.sbatch", "source=folder", f"source.path={src}", "vae=pixel",
           f"text_encoder={tiny_text_encoder_dir}", "resolution=8", "records_per_part=4", f"out={out}",
           f"hydra.run.dir={tmp_path / 'hydra'}"]
    job_id = subprocess.run(cmd, cwd=ROOT, env=job_env(tmp_path), capture_output=True, text=True, check=True).stdout.strip()
    jobs = [job_id]
    try:
        # Both tasks are in python (the wrapper ran), which takes seconds to import and encode: preempt them there.
        wait_for("both tasks to start", lambda: ran_wrapped(tmp_path, 2), every=0.05)
        assert not (out / "dataset.json").exists(), "finished before the preemption"
        jobs.append(preempt(job_id, tmp_path))
        info = wait_done(job_id)
    finally:
        for j in jobs:
            subprocess.run(["scancel", j], capture_output=True)
    log = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:]
    assert f"precompute: job {job_id} is being preempted; requeueing it" in log, log[-3000:]
    assert "rank 0 of 2: " in log and "rank 1 of 2: " in log, log[-3000:]
    got = json.loads((out / "dataset.json").read_text())
    assert got["world_size"] == 2 and got["num_samples"] == json.loads((want / "dataset.json").read_text())["num_samples"]
    rows = lambda d: [(r["key"], r["caption"], r["latents"].tobytes()) for r in read_rows(d)]
    assert rows(out) == rows(want)


# --------------------------------------------------------------------------------------------
# python -m framework.train -m hydra/launcher=slurm
# --------------------------------------------------------------------------------------------


def test_submitit_sweep_job_saves_on_the_warning_and_submitit_requeues_it(tmp_path, digits_shards, reference):
    """Two jobs that train identically (data.num_workers=0,1); job 1 is warned mid-run."""
    root = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "framework.train", "-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0",
           "hydra.launcher.tasks_per_node=1", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=30",
           *tiny(root, digits_shards, "${hydra:runtime.output_dir}/cache", paced=True), "data.num_workers=0,1"]
    if activate():
        cmd.append(f"hydra.launcher.setup=[{activate()!r}]")
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=job_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        folder = wait_for("the array job", lambda: sorted((root / ".submitit").glob("*_1")), timeout=120)[0]
        job_id = folder.name
        when_training(job_id, root / "1", lambda: subprocess.run(["scancel", "--signal=USR2", job_id], check=True))
        out, _ = launcher.communicate(timeout=600)
        assert launcher.returncode == 0, out[-3000:]
    finally:
        launcher.kill()
        subprocess.run(["scancel", job_id.split("_")[0]], capture_output=True)
    info = job(job_id)
    log = "".join(p.read_text() for p in sorted(folder.glob("*_log.*")))
    assert info["Restarts"] == "1" and "Requeued job" in log, log[-3000:]
    check_resumed_cleanly(root / "1", log, root / "1" / "cache")
    assert losses(root / "1") == reference and losses(root / "0") == reference  # bit-identical


def test_submitit_job_of_two_tasks_logs_to_the_run_dir_from_global_rank_zero_only(tmp_path, digits_shards):
    """hydra/launcher=slurm with 2 tasks: each task runs the same pickled Hydra job, yet only global rank 0 writes
    train.log (and .hydra/) into the run directory; rank 1's lines go to its own task log, which submitit keeps."""
    root = tmp_path / "sweep"
    args = [a for a in tiny(root, digits_shards, "${hydra:runtime.output_dir}/cache") if not a.startswith("trainer.max_steps")]
    cmd = [sys.executable, "-m", "framework.train", "-m", "hydra/launcher=slurm", "hydra.launcher.gpus_per_node=0",
           "hydra.launcher.tasks_per_node=2", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=30",
           *args, "trainer.max_steps=2", "strategy=ddp", "data.batch_size=8"]
    if activate():
        cmd.append(f"hydra.launcher.setup=[{activate()!r}]")
    launcher = subprocess.run(cmd, cwd=ROOT, env=job_env(tmp_path), capture_output=True, text=True, timeout=600)
    folders = sorted(p for p in (root / ".submitit").glob("*") if p.is_dir() and not p.is_symlink())  # the job's own
    tasks = {t: "".join(p.read_text() for p in folders[0].glob(f"*_{t}_log.*")) for t in (0, 1)} if folders else {}
    assert launcher.returncode == 0, launcher.stdout[-2000:] + launcher.stderr[-2000:] + str(tasks)[-3000:]
    run_dir = root / "0"
    train_log = (run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""
    # Each task's root logger says so once at its end, in the run's log format: rank 0's line alone is in train.log,
    # rank 1's in its own task log.
    done = "][submitit][INFO] - Job completed successfully"
    assert train_log.count(done) == 1, train_log[-3000:]
    assert done in tasks[1], tasks[1][-3000:]
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "checkpoints" / "last.ckpt").exists()
