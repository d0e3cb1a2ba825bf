"""launch/train.sbatch's failure requeue and its exclusion of the failed node (launch/requeue.py), run by bash against
stub srun / scontrol / sinfo: srun reports a failure as Slurm's does, scontrol records what it is asked and answers
as slurmctld would, and sends SIGTERM to the whole job when asked to requeue it, as Slurm does. The real cluster's
drill (tests/test_slurm.py) kills a rank on .ci/slurm.sh's one node, which can never be left out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCONTROL = f"""#!{sys.executable}
import os, re, signal, sys
args = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(" ".join(args) + "\\n")
if args[:2] == ["show", "job"]:
    print(os.environ["STUB_JOB"])
elif args[:2] == ["show", "hostnames"]:
    for prefix, ranges in re.findall(r"([^,\\[]+)(?:\\[([^\\]]*)\\])?", args[2]):
        for r in ranges.split(",") if ranges else [""]:
            lo, _, hi = r.partition("-")
            print(*([prefix + str(i) for i in range(int(lo), int(hi or lo) + 1)] if r else [prefix]), sep="\\n")
elif args[0] == "requeue":
    os.killpg(0, signal.SIGTERM)  # Slurm signals every process of a requeued job
elif args[0] == "update" and os.environ.get("STUB_UPDATE_FAILS") and not os.path.exists(os.environ["STUB_LOG"] + ".x"):
    open(os.environ["STUB_LOG"] + ".x", "w").close()
    sys.exit("slurm_update error: Socket timed out on send/recv operation")
"""


def run_sbatch(tmp_path: Path, srun_err: str, job: str = "", sinfo: str = "", restarts: int = 0,
               update_fails: bool = False) -> tuple[list[str], str]:
    """bash launch/train.sbatch as the first attempt of job 7 on 2 nodes (restart `restarts`), with srun failing as
    `srun_err` says; returns scontrol's calls and the job's stderr."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, text in {"scontrol": SCONTROL, "srun": '#!/bin/sh\nprintf "%s\\n" "$STUB_SRUN_ERR" >&2\nexit 137\n',
                       "sinfo": '#!/bin/sh\necho "$@" >> "$STUB_LOG.sinfo"\nprintf "%s\\n" "$STUB_SINFO"\n'}.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    (stubs / "python3").unlink(missing_ok=True)
    (stubs / "python3").symlink_to(sys.executable)  # the site set-up's python
    log = tmp_path / "scontrol.log"
    log.unlink(missing_ok=True)
    Path(f"{log}.sinfo").unlink(missing_ok=True)
    sinfo = sinfo or "\n".join(f"n{i} idle" for i in range(1, 5))
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "TMPDIR": str(tmp_path), "STUB_LOG": str(log),
           "STUB_SRUN_ERR": srun_err, "STUB_SINFO": sinfo,
           "STUB_JOB": job or "JobId=7 JobName=latentforge Partition=gpu NumNodes=2 ExcNodeList=(null)",
           "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "8",
           "SLURM_RESTART_COUNT": str(restarts), "SLURM_SUBMIT_DIR": str(ROOT)}
    env.pop("LATENTFORGE_SETUP", None)
    env.pop("LATENTFORGE_EXEC", None)
    if update_fails:
        env["STUB_UPDATE_FAILS"] = "1"
    done = subprocess.run(["bash", str(ROOT / "launch" / "train.sbatch"), "experiment=x"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, start_new_session=True)
    assert done.returncode == 137, done.stderr  # srun's status is the job's
    assert not list(tmp_path.glob("latentforge-srun-*")), "the copy of srun's stderr is removed"
    calls = log.read_text().splitlines() if log.exists() else []
    return calls, done.stderr


KILLED = "srun: error: n3: task 17: Killed\nsrun: error: n1: tasks 0-15: Terminated"


def test_a_task_killed_by_a_signal_requeues_the_job_without_its_node(tmp_path):
    calls, err = run_sbatch(tmp_path, KILLED)
    assert calls == ["show job -o 7", "requeue 7", "update JobId=7 ExcNodeList=n3"]
    assert "leaving out n3 (3 usable nodes remain for the 2 it needs)" in err
    # the usable nodes are counted in the job's own partition, not over the whole cluster
    assert (tmp_path / "scontrol.log.sinfo").read_text().split() == ["-h", "-N", "-p", "gpu", "-o", "%N", "%t"]


def test_a_lost_node_is_left_out_beside_the_nodes_left_out_before(tmp_path):
    calls, err = run_sbatch(tmp_path, "srun: error: Node failure on n2\nsrun: error: n2: tasks 8-15: Killed",
                            job="JobId=7 Partition=gpu NumNodes=2 ExcNodeList=n4")
    assert calls == ["show job -o 7", "show hostnames n4", "requeue 7", "update JobId=7 ExcNodeList=n2,n4"]
    assert "first failure: srun: error: Node failure on n2" in err


@pytest.mark.parametrize("case", ["excluded", "drained"])
def test_a_node_is_not_left_out_when_too_few_would_remain_for_the_job(tmp_path, case):
    """Nodes left out before, or drained / down / not responding, leave one usable node besides n3: not enough for
    the job's 2, so n3 stays in and the job is requeued as it is (it would never be scheduled otherwise)."""
    if case == "excluded":
        calls, err = run_sbatch(tmp_path, KILLED, job="JobId=7 Partition=gpu NumNodes=2 ExcNodeList=n[1-2]")
        assert calls == ["show job -o 7", "show hostnames n[1-2]", "requeue 7"]
    else:
        calls, err = run_sbatch(tmp_path, KILLED, sinfo="n1 idle\nn2 drain\nn3 alloc\nn4 idle*\nn5 down")
        assert calls == ["show job -o 7", "requeue 7"]
    assert "not leaving out n3: the job's partitions would keep 1 usable nodes for the 2 it needs" in err


@pytest.mark.parametrize("failure", ["Exited with exit code 86", "Out Of Memory"])
def test_a_program_error_requeues_the_job_without_leaving_out_a_node(tmp_path, failure):
    """An exception (the watchdog's exit code) or the program's own out-of-memory kill is the job's, not the node's."""
    calls, err = run_sbatch(tmp_path, f"srun: error: n3: task 17: {failure}\n" + KILLED)
    assert calls == ["show job -o 7", "requeue 7"]
    assert f"first failure: srun: error: n3: task 17: {failure}; no node is left out" in err


def test_an_update_slurmctld_drops_is_sent_again(tmp_path):
    calls, _ = run_sbatch(tmp_path, KILLED, update_fails=True)
    assert calls == ["show job -o 7", "requeue 7"] + ["update JobId=7 ExcNodeList=n3"] * 2


def test_a_job_out_of_restarts_is_not_requeued(tmp_path):
    """LATENTFORGE_MAX_RESTARTS=3 (the default): the third restart is still made, a fourth is not."""
    calls, err = run_sbatch(tmp_path, KILLED, restarts=2)
    assert calls[:2] == ["show job -o 7", "requeue 7"] and "restart 3 of 3 (LATENTFORGE_MAX_RESTARTS)" in err
    calls, err = run_sbatch(tmp_path, KILLED, restarts=3)
    assert calls == []
    assert "not requeued: the job has restarted 3 times (LATENTFORGE_MAX_RESTARTS=3)" in err
