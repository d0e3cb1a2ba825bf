"""A parent process that has imported the training stack once and forks the tests' training processes.

Importing Lightning (and through it torchmetrics, transformers, torchvision), diffusers and Hydra costs a
process 10-16 s of CPU on a 2-core machine, far more than the few steps a test trains; the suite starts
dozens of such processes. `python -m tests.zygote SOCKET` imports them once, then for each request on the
Unix socket forks a child that runs `python -m MODULE ARGS...` (runpy, as `-m` does) in the requested
directory with the requested environment and its output in a log file, and reports the exit status.

The parent stays single-threaded (it never holds a lock a child could inherit) and runs nothing heavy
itself: no tensors, no thread pools. A child ends as the interpreter would end it (`finish`): it waits for
its non-daemon threads and runs its atexit handlers, so a command that hangs or fails at exit does so here
too (tests/test_zygote.py compares the two ways). Children are real processes with their own pid and process group, so
a test can kill one; several ranks of a job are several requests (tests/test_distributed.py::run_train).
The commands users run (the matrix, Slurm, torchrun tests) still start fresh interpreters.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------------

NODE_NAMESPACE = "LATENTFORGE_TEST_NODE_NAMESPACE"  # in a request's env: the child is a simulated node of its own
# A simulated node of several ranks: its first rank makes the namespace and writes its pid to the file NODE_READY
# names; the node's other ranks (NODE_JOIN: that file) enter the same namespace.
NODE_READY, NODE_JOIN = "LATENTFORGE_TEST_NODE_READY", "LATENTFORGE_TEST_NODE_JOIN"


def _private_shm() -> None:
    """Give this process a mount namespace of its own with a fresh /dev/shm, as `unshare --mount` and a tmpfs
    mount do (root): Streaming names its shared memory per host, so simulated nodes must not share one."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private = 0x00020000, 0x4000, 0x40000
    for ok, what in ((lambda: libc.unshare(clone_newns), "unshare(CLONE_NEWNS)"),
                     (lambda: libc.mount(b"none", b"/", None, ms_rec | ms_private, None), "mount --make-rprivate /"),
                     (lambda: libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, None), "mount tmpfs /dev/shm")):
        if ok() != 0:
            raise OSError(ctypes.get_errno(), f"a simulated node's namespace: {what} failed (needs root)")


def _join_shm(ready: str, timeout: float = 60) -> None:
    """Enter the mount namespace (and so the /dev/shm) of the node's first rank, once it has made it: the ranks of
    one simulated node share their host's shared memory, as on a real host."""
    import ctypes

    deadline = time.monotonic() + timeout
    while not os.path.exists(ready):  # the first rank writes it whole (os.replace)
        if time.monotonic() > deadline:
            raise TimeoutError(f"a simulated node's first rank never made its namespace ({ready})")
        time.sleep(0.01)
    pid = int(Path(ready).read_text())
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x00020000) != 0:  # CLONE_NEWNS
            raise OSError(ctypes.get_errno(), f"setns into rank pid {pid}'s mount namespace failed (needs root)")
    finally:
        os.close(fd)


def _child(request: dict) -> None:
    """In the forked child: become `python -m MODULE ARGS` and exit with its status."""
    import runpy
    import tempfile
    import traceback

    os.setpgid(0, 0)  # its own process group: a test's timeout kills it and whatever it started
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.pop(NODE_NAMESPACE, None):
        _private_shm()
        ready = os.environ.pop(NODE_READY, None)
        if ready:  # the node's other ranks join this namespace
            with open(f"{ready}.tmp", "w") as f:
                f.write(f"{os.getpid()}\n")
            os.replace(f"{ready}.tmp", ready)
    elif os.environ.get(NODE_JOIN):
        _join_shm(os.environ.pop(NODE_JOIN))
    tempfile.tempdir = None  # TMPDIR is per test: forget the parent's
    out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["log"] + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.argv = [request["module"] or "-c", *request["args"]]
    code = 0
    try:
        if request["module"]:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:  # python -c CODE
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:  # as the interpreter does: an int is the status, anything else is printed, status 1
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported in the log like an uncaught exception
        traceback.print_exc()
        code = 1
    code = finish(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not sys.exit: the parent's sockets and state are not this process's to tear down


def finish(code: int) -> int:
    """What the interpreter does before a process ends (Py_FinalizeEx): wait for every non-daemon thread, then
    run the atexit handlers. A command that hangs or fails at exit does so here too, as a fresh `python -m`
    would. Returns the exit status (an atexit handler's error is printed and leaves it, as Python does)."""
    import atexit
    import threading
    import traceback

    try:
        threading._shutdown()  # joins the non-daemon threads, as the interpreter does at exit
    except BaseException:  # noqa: BLE001 - e.g. KeyboardInterrupt while waiting: reported, status 1
        traceback.print_exc()
        code = code or 1
    atexit._run_exitfuncs()
    return code


def serve(path: str) -> None:
    import framework.train  # noqa: F401  the imports every training process needs
    import tests.workers.dist_train  # noqa: F401

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection that asked for it
    while True:
        ready, _, _ = select.select([server], [], [], 0.05)
        if ready:
            conn, _ = server.accept()
            request = json.loads(conn.makefile().readline())
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                _child(request)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:  # the test gave up on it
                    pass
                conn.close()


# --------------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------------

class Forked:
    """The part of subprocess.Popen the tests use, for a forked child: poll, wait, communicate, signals, and
    `stdout` (its output so far; stderr is in the same file's `.err` companion, appended by communicate)."""

    def __init__(self, sock: socket.socket, pid: int, log: Path) -> None:
        self.sock, self.pid, self.log, self.returncode = sock, pid, Path(log), None

    @property
    def stdout(self):  # noqa: ANN201 - a fresh reader of the output so far
        import io

        return io.StringIO(self._output())

    def _output(self) -> str:
        err = Path(f"{self.log}.err")
        return self.log.read_text() + (err.read_text() if err.exists() else "")

    def poll(self) -> int | None:
        if self.returncode is None:
            poller = select.poll()
            poller.register(self.sock, select.POLLIN)
            if poller.poll(0):
                self.returncode = int(_readline(self.sock) or -1)
                self.sock.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """(stdout and stderr together, stderr)."""
        self.wait(timeout)
        err = Path(f"{self.log}.err")
        return self._output(), err.read_text() if err.exists() else ""

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.killpg(self.pid, 9)
            except ProcessLookupError:
                pass

    terminate = kill


def _readline(s: socket.socket) -> str:
    """One line, read unbuffered (so select() on the socket still tells whether the next line is there)."""
    out = b""
    while not out.endswith(b"\n"):
        byte = s.recv(1)
        if not byte:
            break
        out += byte
    return out.decode().strip()


@dataclass
class Result:
    """What subprocess.run(capture_output=True, text=True) would return."""

    returncode: int
    stdout: str
    stderr: str = ""


class Zygote:
    """Start the server (imports take a while; the first request waits for them) and fork from it."""

    def __init__(self, folder: Path) -> None:
        self.path = str(folder / "zygote.sock")
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.log = folder / "zygote.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote", self.path], cwd=ROOT, env=env,
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT)

    def _connect(self, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the zygote exited ({self.proc.returncode}): {self.log.read_text()[-3000:]}")
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(self.path)
                return s
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def start(self, module: str, args: list[str], env: dict[str, str], log: Path,
              code: str | None = None) -> tuple[socket.socket, int]:
        s = self._connect(timeout=300)
        request = {"module": module, "args": list(args), "env": env, "cwd": str(ROOT), "log": str(log), "code": code}
        s.sendall((json.dumps(request) + "\n").encode())
        return s, int(_readline(s))

    def run(self, jobs: list[tuple], timeout: float) -> list[Result]:
        """Start every job (module, args, env, log[, code]) at once (the ranks of one run), wait for all; a
        timeout kills them all."""
        started = [self.start(*job) for job in jobs]
        deadline = time.monotonic() + timeout
        codes: list[int | None] = [None] * len(started)
        while any(c is None for c in codes):
            left = deadline - time.monotonic()
            if left <= 0:
                for (_, pid), c in zip(started, codes):
                    if c is None:
                        try:
                            os.killpg(pid, 9)
                        except ProcessLookupError:
                            pass
                raise subprocess.TimeoutExpired([j[0] for j in jobs], timeout)
            # poll, not select: the test process may hold more than FD_SETSIZE (1024) descriptors
            poller = select.poll()
            for (s, _), c in zip(started, codes):
                if c is None:
                    poller.register(s, select.POLLIN)
            ready = {fd for fd, _ in poller.poll(left * 1000)}
            for i, (s, _) in enumerate(started):
                if s.fileno() in ready and codes[i] is None:
                    codes[i] = int(_readline(s) or -1)
        for s, _ in started:
            s.close()
        return [Result(c, Path(job[3]).read_text(), Path(f"{job[3]}.err").read_text()) for c, job in zip(codes, jobs)]

    def popen(self, module: str, args: list[str], env: dict[str, str], log: Path, code: str | None = None) -> "Forked":
        """Start one process and return at once, with a subprocess.Popen-like handle."""
        s, pid = self.start(module, args, env, log, code)
        return Forked(s, pid, log)

    def close(self) -> None:
        import shutil

        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(Path(self.path).parent, ignore_errors=True)


def run_module(module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600,
               log: Path | None = None) -> Result:
    """`subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True)`, forked."""
    import tempfile

    log = log or Path(tempfile.mkdtemp(prefix="run", dir=(env or os.environ).get("TMPDIR"))) / "out.log"
    env = dict(env if env is not None else os.environ)
    if module == "-c":  # run_module("-c", CODE, *args): python -c CODE
        return shared().run([("", list(args[1:]), env, log, args[0])], timeout)[0]
    return shared().run([(module, list(args), env, log)], timeout)[0]


def run(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 600, **_: object) -> Result:
    """Drop-in for `subprocess.run([sys.executable, "-m", MODULE, ...], cwd=ROOT, capture_output=True, text=True)`:
    forked from the zygote unless LATENTFORGE_TEST_FORK=0 (then that very call)."""
    if not enabled() or cmd[0] != sys.executable or cmd[1] not in ("-m", "-c"):
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if cmd[1] == "-c":  # python -c CODE ARGS
        return run_module("-c", *cmd[2:], env=env, timeout=timeout)
    return run_module(cmd[2], *cmd[3:], env=env, timeout=timeout)


def popen(cmd: list[str], *, env: dict[str, str] | None = None, **_: object) -> "Forked | subprocess.Popen":
    """Drop-in for `subprocess.Popen([sys.executable, "-m" | "-c", ...], cwd=ROOT, env=env)`, forked."""
    import tempfile

    if not enabled() or cmd[0] != sys.executable or cmd[1] not in ("-m", "-c"):
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    env = dict(env if env is not None else os.environ)
    log = Path(tempfile.mkdtemp(prefix="run", dir=env.get("TMPDIR"))) / "out.log"
    module, code = (cmd[2], None) if cmd[1] == "-m" else ("", cmd[2])
    return shared().popen(module, cmd[3:], env, log, code)


def torchrun(nproc: int, module: str, *args: str, env: dict[str, str], timeout: float = 600) -> Result:
    """`torchrun --standalone --nproc_per_node=N -m MODULE ARGS`, forked: every rank at once with torchrun's
    variables. Returns rank 0's output, with the other ranks' after it. LATENTFORGE_TEST_FORK=0: the real torchrun."""
    import tempfile

    if not enabled():
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module,
               *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return Result(proc.returncode, proc.stdout, proc.stderr)
    folder = Path(tempfile.mkdtemp(prefix="ranks", dir=env.get("TMPDIR")))
    port = str(free_port())
    jobs = [(module, list(args), {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(nproc),
                                  "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(nproc),
                                  "GROUP_RANK": "0", "ROLE_RANK": str(r), "TORCHELASTIC_RUN_ID": "test"},
             folder / f"rank{r}.log") for r in range(nproc)]
    results = shared().run(jobs, timeout)
    return Result(job_code([r.returncode for r in results]), "".join(r.stdout for r in results),
                  "".join(r.stderr for r in results))


def job_code(codes: list[int]) -> int:
    """A multi-rank job's exit status: the first rank's that is not 0 (a signal's negative code included), else 0.
    (The largest code would hide a rank killed by a signal, -9, beside ranks that exited 0.)"""
    return next((c for c in codes if c != 0), 0)


def lightning_ranks(module: str, args: list[str], devices: int, env: dict[str, str], folder: Path,
                    timeout: float = 600) -> list[Result]:
    """A Lightning training command on `devices` CPU ranks, forked: all ranks at once with the variables a
    launcher sets (Lightning then starts no processes itself), as srun or torchrun would start them.
    LATENTFORGE_TEST_FORK=0: `python -m MODULE ARGS`, Lightning's launcher starting the other ranks."""
    if not enabled():
        proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        return [Result(proc.returncode, proc.stdout, proc.stderr)]
    ranks = [{}]
    if devices > 1:
        port = str(free_port())
        ranks = [dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=str(devices), NODE_RANK="0",
                      LOCAL_RANK=str(r), RANK=str(r)) for r in range(devices)]
    return shared().run([(module, list(args), {**env, **rank_env}, folder / f"rank{r}.log")
                         for r, rank_env in enumerate(ranks)], timeout)


def forked_nodes(module: str, args_per_node: list[list[str]], env: dict[str, str], folder: Path,
                 timeout: float = 600, devices: int = 1) -> list[Result]:
    """A Lightning training command as a job of `devices` ranks per node, every rank forked from the zygote, each
    node's ranks in a mount namespace of their own with a fresh /dev/shm (as separate hosts have), meeting at one
    MASTER_ADDR / MASTER_PORT: node_launches' job without an interpreter start per rank, so that 16 or more nodes fit
    a test. The results in global rank order."""
    port, n = str(free_port()), len(args_per_node)
    jobs = []
    for node, args in enumerate(args_per_node):
        ready = folder / f"node{node}.ns"
        ready.unlink(missing_ok=True)
        for local in range(devices):
            rank = node * devices + local
            shm = {NODE_NAMESPACE: "1", NODE_READY: str(ready)} if local == 0 else {NODE_JOIN: str(ready)}
            jobs.append((module, list(args), {**env, **shm, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                              "WORLD_SIZE": str(n * devices), "NODE_RANK": str(node), "RANK": str(rank),
                                              "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(devices)},
                         folder / (f"node{node}.log" if devices == 1 else f"node{node}_rank{local}.log")))
    return shared().run(jobs, timeout)


def node_launches(module: str, args_per_node: list[list[str]], env: dict[str, str], folder: Path,
                  timeout: float = 600) -> list[Result]:
    """A Lightning training command as a multi-node job on this machine: one `python -m MODULE` per node (NODE_RANK
    n, `args_per_node[n]`), meeting at one MASTER_ADDR / MASTER_PORT as two hosts' launches would; Lightning's
    launcher starts each node's other ranks. Every node after the first runs in its own mount namespace with a
    fresh /dev/shm: Streaming names its shared memory per host, so two nodes on one host would take the same names.
    Always fresh interpreters (forked ranks could not share a node's namespace)."""
    import shutil

    if shutil.which("unshare") is None:
        raise RuntimeError("node_launches needs util-linux's unshare (a mount namespace per simulated node)")
    port = str(free_port())
    procs, logs = [], []
    for n, args in enumerate(args_per_node):
        cmd = [sys.executable, "-m", module, *args]
        if n > 0:
            cmd = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh", *cmd]
        log = open(folder / f"node{n}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True,  # the node's ranks are killed with it on a timeout
                                      env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(n)}))
    deadline = time.monotonic() + timeout
    results = []
    for proc, log in zip(procs, logs):
        try:
            code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            import signal

            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            code = proc.wait()
        log.seek(0)
        results.append(Result(code, log.read(), ""))
        log.close()
    return results


def enabled() -> bool:
    """LATENTFORGE_TEST_FORK=0 starts every test process as a fresh interpreter instead."""
    return os.environ.get("LATENTFORGE_TEST_FORK", "1") != "0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SHARED: Zygote | None = None


def shared() -> Zygote:
    """The test session's zygote, started on first use (in a short /tmp folder: Unix socket paths are short)."""
    global _SHARED
    if _SHARED is None:
        import atexit
        import tempfile

        _SHARED = Zygote(Path(tempfile.mkdtemp(prefix="zyg", dir="/tmp")))
        atexit.register(_SHARED.close)
    return _SHARED


if __name__ == "__main__":
    serve(sys.argv[1])
