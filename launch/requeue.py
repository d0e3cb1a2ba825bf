"""Requeue a Slurm job whose training failed, leaving out the node that failed: launch/train.sbatch runs it.

    python3 launch/requeue.py JOBID SRUN_STDERR_FILE

Standard library only, because the batch shell runs it outside the job's container. srun's first error line names
the task that failed first (srun then ends the others, which it reports as "Terminated"):

    srun: error: node17: task 5: Killed                   a signal: the node is blamed
    srun: error: Node failure on node17                    the node is blamed
    srun: error: node17: task 5: Exited with exit code 1  the program's error (an exception, the hang watchdog): no one

Slurm changes a job's ExcNodeList only while it is pending, and a requeued job is pending (and completing) from
`scontrol requeue` on, while this shell still runs and so before it can start again: so the requeue comes first,
then the update. The requeue sends SIGTERM to every process of the job, this one and its scontrol calls included,
which is why SIGTERM is ignored here (children inherit that) and each call is retried. A node is left out only if
the job's partitions keep enough usable nodes for it; otherwise it is requeued as it is, saying so.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

TASK = re.compile(r"^srun: error: (?P<node>[^\s:]+): tasks? [\d,\-]+: (?P<why>.+?)\s*$", re.M)
NODE_FAILURE = re.compile(r"^srun: error: Node failure on (?P<node>[^\s:]+)", re.M)
# Exits that are the program's doing, not the node's: an exit code (an exception, the hang watchdog's 86), srun
# ending the other tasks, and the kernel's OOM killer (the job asked for too much memory, on any node).
NOT_THE_NODE = ("Exited with exit code", "Terminated", "Out Of Memory")
# sinfo's short node states that take no new job (a trailing "*" is a node that does not respond).
UNUSABLE = ("down", "drain", "drng", "fail", "maint", "futr", "inval", "unk", "npc", "pow_dn", "powered_down")


def failed_node(srun_err: str) -> tuple[str | None, str]:
    """(the node to blame or None, the first failure as srun reported it)."""
    first = min((m for m in (TASK.search(srun_err), NODE_FAILURE.search(srun_err)) if m),
                key=lambda m: m.start(), default=None)
    if first is None:
        return None, "no task failure reported by srun"
    line = first.group(0).strip()
    if "why" in first.groupdict() and first.group("why").startswith(NOT_THE_NODE):
        return None, line
    return first.group("node"), line


def scontrol(*args: str, tries: int = 5) -> str:
    """One scontrol call, retried: the requeue's SIGTERM (or a busy slurmctld) can end a call."""
    for attempt in range(tries):
        done = subprocess.run(["scontrol", *args], capture_output=True, text=True)
        if done.returncode == 0:
            return done.stdout
        if attempt == tries - 1:
            raise RuntimeError(f"scontrol {' '.join(args)}: {done.stderr.strip() or done.returncode}")
        time.sleep(0.5)
    return ""


def hostnames(hostlist: str) -> set[str]:
    if hostlist in ("", "(null)"):
        return set()
    return set(scontrol("show", "hostnames", hostlist).split())


def usable_nodes(partitions: str) -> set[str]:
    """The nodes of the job's partitions that take jobs now."""
    out = subprocess.run(["sinfo", "-h", "-N", "-p", partitions, "-o", "%N %t"], capture_output=True, text=True,
                         check=True).stdout
    nodes = set()
    for line in out.splitlines():
        name, state = line.split()
        if not state.endswith("*") and not state.rstrip("~#!%$@^-").startswith(UNUSABLE):
            nodes.add(name)
    return nodes


def exclusion(blamed: str | None, excluded: set[str], usable: set[str], needed: int) -> tuple[set[str] | None, str]:
    """The job's new ExcNodeList (None: leave it), and why."""
    if blamed is None:
        return None, "no node is left out"
    if blamed in excluded:
        return None, f"{blamed} is left out already"
    left = usable - excluded - {blamed}
    if len(left) < needed:
        return None, (f"not leaving out {blamed}: the job's partitions would keep {len(left)} usable nodes for the "
                      f"{needed} it needs")
    return excluded | {blamed}, f"leaving out {blamed} ({len(left)} usable nodes remain for the {needed} it needs)"


def plan(job_id: str, srun_err_path: str) -> tuple[set[str] | None, str]:
    """The new ExcNodeList (None: leave it) and what to print, read while the job still runs."""
    record = dict(re.findall(r"(\w+)=(\S*)", scontrol("show", "job", "-o", job_id)))
    with open(srun_err_path, errors="replace") as f:
        blamed, first = failed_node(f.read())
    needed = int(record["NumNodes"].split("-")[0])
    new, why = exclusion(blamed, hostnames(record.get("ExcNodeList", "")), usable_nodes(record["Partition"]), needed)
    return new, f"srun's first failure: {first}; {why}"


def main(job_id: str, srun_err_path: str) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        new, why = plan(job_id, srun_err_path)
    except (OSError, RuntimeError, subprocess.SubprocessError, KeyError, ValueError) as e:
        new, why = None, f"no node left out: {e}"  # the requeue matters more than the exclusion
    scontrol("requeue", job_id)
    if new is not None:
        try:
            scontrol("update", f"JobId={job_id}", f"ExcNodeList={','.join(sorted(new))}")
        except RuntimeError as e:
            why += f"; but the update failed: {e}"
    print(f"latentforge: requeued job {job_id}; {why}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
