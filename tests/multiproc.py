"""The tests' launcher: gloo worlds whose ranks are forks of one server per test process, and the processes of one
run, found by an environment marker the test set (never by a process name other runs share).

A spawned rank, like a torchrun rank, pays ~5 s of CPU to import torch and megatron-core before it does anything,
which is most of a small world's run, and the suite runs a hundred such worlds on two cores. The server imports them
once; each world's ranks are forked from it and start from its state, which has no process group and no megatron
globals, so a fork is as fresh as a spawned rank. Two kinds of world:

- :func:`run_distributed`: ``fn(rank, world_size, *args)`` in a ready gloo world (the library's
  :func:`~megatron_mimesis.gloo.run_rank`), returning what each rank returns;
- :func:`run_main`: an entry point's ``main(argv)`` on each rank with torchrun's environment variables, which
  initialises its own process group as under torchrun, returning the exit status and the ranks' output, for the
  tests whose subject is what the run computes. Tests of the launch itself (torchrun, its signals, the launcher
  scripts) start torchrun (``tests.training.conftest.run_trainer``).

The server is a spawned child tied to its test process, and each fork is tied to the server, so a test process that
is killed takes the server and any world in flight with it. A world gets the caller's environment and working
directory as they are when it starts. A rank that fails ends its world, as torchrun ends a job: the others, which may
be waiting for it in a collective, are killed. A fork ends with ``os._exit``, so no C++ destructor runs: worlds that
run vLLM are spawned or run under torchrun instead, since vLLM's CPU backend unlinks its shared memory (one name in
every world) only at a normal exit. The server is CPU-only: megatron-core's import calls
``torch.cuda.is_available()``, after which a forked child cannot use CUDA.
"""

import concurrent.futures
import gc
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from megatron_mimesis.gloo import free_port, load_results, rank_environment, run_rank
from megatron_mimesis.lifetime import die_with_parent

__all__ = ["processes_with_env", "run_distributed", "run_main"]

RANK_IMPORTS = ("torch.distributed", "megatron.core.models.gpt", "megatron_mimesis.training.train", "transformers")
_server: concurrent.futures.ProcessPoolExecutor | None = None


def _pool() -> concurrent.futures.ProcessPoolExecutor:
    global _server
    if _server is None:
        _server = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_serve,
            initargs=(os.getpid(), multiprocessing.get_start_method(), RANK_IMPORTS))
    return _server


def run_distributed(fn, world_size: int, *args) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks: their return values, in rank order. A failing
    rank raises RuntimeError with the traceback of the rank that failed first."""
    return _pool().submit(_function_world, fn, world_size, args, dict(os.environ), os.getcwd()).result()


def run_main(nproc: int, module: str, argv: list[str], *, check: bool = True, timeout: int = 300,
             env: dict | None = None) -> subprocess.CompletedProcess:
    """``module.main(argv)`` on ``nproc`` ranks, as ``torchrun --nproc-per-node=nproc -m module argv`` runs it: the
    status of the rank that failed first (0 when none did), and every rank's stdout and stderr, rank 0's first."""
    environ = {**os.environ, **(env or {})}
    status, outputs = _pool().submit(_entry_point_world, module, list(argv), nproc, environ, os.getcwd(),
                                     timeout).result()
    proc = subprocess.CompletedProcess([module, *argv], status, "".join(o for o, _ in outputs),
                                       "".join(e for _, e in outputs))
    if check and status != 0:
        raise AssertionError(f"{module} failed ({status}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def _serve(caller_pid: int, start_method: str, imports: tuple[str, ...]) -> None:
    die_with_parent(caller_pid)
    # a spawned process defaults to spawning its own children; a rank's (DataLoader workers, checkpoint writers)
    # start as they do under torchrun, by the caller's default (fork on Linux), not re-importing everything each
    multiprocessing.set_start_method(start_method, force=True)
    torch.set_num_threads(1)  # what every fork starts with, as torchrun's OMP_NUM_THREADS=1 gives a rank
    from megatron_mimesis.compat import prepare_cpu_process

    prepare_cpu_process()  # as the entry points do, before megatron-core is imported
    for name in imports:
        importlib.import_module(name)


def _function_world(fn, world_size: int, args: tuple, environ: dict, cwd: str) -> list:
    with tempfile.TemporaryDirectory() as result_dir:
        port = free_port()
        failures = _world(world_size, environ, cwd, None,
                          lambda rank: run_rank(rank, world_size, os.getppid(), port, fn, args, result_dir))
        if failures:
            raise RuntimeError(f"a rank failed:\n{_first_failure(result_dir, world_size, failures)}")
        return load_results(result_dir, world_size)


def _entry_point_world(module: str, argv: list[str], world_size: int, environ: dict, cwd: str,
                       timeout: int) -> tuple[int, list[tuple[str, str]]]:
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()

        def rank_main(rank: int) -> int:
            die_with_parent(os.getppid())
            for fd, stream in ((1, "out"), (2, "err")):
                target = os.open(os.path.join(out_dir, f"{rank}.{stream}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(target, fd)
                os.close(target)
            os.environ.update(rank_environment(rank, world_size, port))
            return importlib.import_module(module).main(argv)

        failures = _world(world_size, environ, cwd, timeout, rank_main)
        outputs = [tuple(Path(out_dir, f"{rank}.{stream}").read_text(errors="replace") for stream in ("out", "err"))
                   for rank in range(world_size)]
        return (_exit_status(failures[0][1]) if failures else 0), outputs


def _world(world_size: int, environ: dict, cwd: str, timeout: int | None, body) -> list[tuple[int, int]]:
    """Fork ``world_size`` ranks running ``body(rank)`` (its return value is the exit status) and reap them: (rank,
    wait status) of each that failed on its own, in the order they were reaped. At the first failure, or when
    ``timeout`` seconds have passed, the others are killed."""
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            _forked_rank(rank, environ, cwd, body)
        ranks[pid] = rank
    deadline = None if timeout is None else time.monotonic() + timeout
    failures, alive = [], dict(ranks)
    while alive:
        pid, status = os.waitpid(-1, os.WNOHANG if deadline else 0)
        if pid == 0:
            if time.monotonic() > deadline:
                _kill(alive)
                failures.append((next(iter(alive.values())), 124 << 8))  # as timeout(1) reports it
                deadline = None
            time.sleep(0.05)
            continue
        rank = alive.pop(pid, None)
        if rank is None or status == 0 or (failures and os.WIFSIGNALED(status)
                                           and os.WTERMSIG(status) == signal.SIGKILL):
            continue
        failures.append((rank, status))
        if len(failures) == 1:
            _kill(alive)
    return failures


def _forked_rank(rank: int, environ: dict, cwd: str, body) -> None:
    """The life of one fork: never returns into the server's code, and ends with ``os._exit``. The atexit handlers
    and finalizers it inherited are the server's (its temporary directories among them), so none run; what a normal
    exit does for the rank's own helpers is done here: the run's DataLoader iterators collected (they shut their
    workers down), other child processes terminated if daemonic and joined."""
    status = 1
    try:
        # first, on this thread alone: torch's intra-op pool, made in the server, is replaced at its first use after
        # a fork, and that replacement races when two threads make the first use (autograd's worker thread did:
        # "pool INTERNAL ASSERT FAILED ... Invalid thread pool!", abort)
        torch.set_num_threads(1)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        status = body(rank) or 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        gc.collect()
        for child in multiprocessing.active_children():
            if child.daemon:
                child.terminate()
            child.join()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _kill(alive: dict[int, int]) -> None:
    for pid in alive:
        os.kill(pid, signal.SIGKILL)


def _exit_status(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _first_failure(result_dir: str, world_size: int, failures: list[tuple[int, int]]) -> str:
    """The error of the rank that failed first: a peer of a failed rank fails too ("Connection closed by peer"),
    and may be reaped first (the first one then killed, its record written), so the order is that of the error
    records' writes."""
    records = []
    for rank in range(world_size):
        path = os.path.join(result_dir, f"{rank}.pt")
        if os.path.exists(path) and not (record := torch.load(path, weights_only=False))["ok"]:
            records.append((os.stat(path).st_mtime_ns, record["error"]))
    if records:
        return min(records)[1]
    rank, status = failures[0]
    return f"rank {rank} ended with status {_exit_status(status)}"


def processes_with_env(name: str, value: str) -> dict[int, dict]:
    """Live processes whose environment has ``name=value``: pid -> {ppid, cmdline, rss_mb}."""
    wanted = f"{name}={value}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if wanted not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited while being looked at
        if status.get("State", "").split()[:1] == ["Z"]:
            continue  # a zombie has exited; only its parent's wait is missing
        rss_kb = int(status.get("VmRSS", "0 kB").split()[0])
        found[int(entry)] = {"ppid": int(status["PPid"]), "cmdline": cmdline, "rss_mb": rss_kb / 1024}
    return found


def kill_all(pids) -> None:
    """SIGKILL each of ``pids`` that is still alive (a failed test must not leak 1 GB ranks or a server)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
