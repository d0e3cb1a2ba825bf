"""tests/zygote.py against the interpreter it stands in for: a forked command ends as `python -c` would.

Each command runs twice, forked from the zygote and as a fresh interpreter (LATENTFORGE_TEST_FORK=0's
path, subprocess.run), and the two must agree on the exit status and on what happened at exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import zygote

AT_EXIT = """
import atexit, sys, threading, time
from pathlib import Path
out = Path(sys.argv[1])
def late():  # a non-daemon thread still working when the main code returns
    time.sleep(0.5)
    (out / "thread").write_text("done")
threading.Thread(target=late).start()
atexit.register(lambda: (out / "atexit").write_text(str((out / "thread").exists())))
"""


def both(code: str, tmp_path: Path, timeout: float = 60) -> dict[str, zygote.Result]:
    """The command `python -c CODE OUT` forked and fresh, each with its own OUT folder."""
    results = {}
    for way in ("forked", "fresh"):
        out = tmp_path / way
        out.mkdir()
        cmd = [sys.executable, "-c", code, str(out)]
        env = {**os.environ, "LATENTFORGE_TEST_FORK": "1" if way == "forked" else "0"}
        if way == "forked":
            results[way] = zygote.run_module("-c", code, str(out), env=env, timeout=timeout)
        else:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            results[way] = zygote.Result(proc.returncode, proc.stdout, proc.stderr)
    return results


def test_a_forked_command_waits_for_its_threads_then_runs_atexit(tmp_path):
    results = both(AT_EXIT, tmp_path)
    for way, r in results.items():
        assert r.returncode == 0, (way, r.stderr)
        thread, at_exit = tmp_path / way / "thread", tmp_path / way / "atexit"
        assert thread.exists() and thread.read_text() == "done", f"{way}: the process left before its thread ended"
        assert at_exit.exists() and at_exit.read_text() == "True", f"{way}: atexit did not run, or ran before the thread ended"


@pytest.mark.parametrize("code,status,message", [
    ("raise SystemExit(3)", 3, None),
    ("raise SystemExit('bad config')", 1, "bad config"),
    ("raise ValueError('broken')", 1, "ValueError: broken"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9, None),
    ("import atexit; atexit.register(lambda: 1 / 0)", 0, "ZeroDivisionError"),  # printed, status kept
])
def test_exit_status_and_messages_are_the_interpreters(tmp_path, code, status, message):
    results = both(code, tmp_path)
    for way, r in results.items():
        assert r.returncode == status, (way, r.returncode, r.stderr)
        if message:
            assert message in r.stderr, (way, r.stderr)


def test_a_command_that_hangs_at_exit_times_out_instead_of_passing(tmp_path):
    hang = "import threading, time; threading.Thread(target=time.sleep, args=(3600,)).start()"
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run_module("-c", hang, env=dict(os.environ), timeout=5)


def test_forked_nodes_share_a_dev_shm_within_a_node_and_not_across(tmp_path):
    """2 simulated nodes x 2 ranks, forked: a node's ranks see each other's files in /dev/shm and not the other
    node's, and the machine's own /dev/shm sees none (Streaming names its shared memory per host)."""
    import json
    import uuid

    tag = f"lf_zygote_{uuid.uuid4().hex[:8]}"
    results = zygote.forked_nodes("tests.workers.shm_probe", [[str(tmp_path), tag]] * 2, dict(os.environ), tmp_path,
                                  timeout=60, devices=2)
    assert [r.returncode for r in results] == [0] * 4, [r.stderr for r in results]
    seen = [json.loads((tmp_path / f"seen{rank}.json").read_text()) for rank in range(4)]
    assert seen == [[0, 1], [0, 1], [2, 3], [2, 3]], seen
    assert not list(Path("/dev/shm").glob(f"{tag}_*"))
