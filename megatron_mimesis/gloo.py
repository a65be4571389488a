"""Run a function on N local processes joined in a gloo process group, and collect what each returns.

For work that needs megatron's parallel state but no launcher: the HF checkpoint import (a world of one),
and the multi-process tests. Each rank builds its own process groups and megatron-core global state, exactly as
under torchrun, and dies with the process that started it (:mod:`megatron_mimesis.lifetime`): a killed test run
or conversion leaves no rank waiting in a collective.

:func:`run_gloo_processes` spawns every rank from scratch. :class:`GlooForkServer` forks them instead from one
process that imported torch and megatron-core once: importing them costs a spawned rank ~6 s of CPU, which is
most of a small world's run, and the test suite runs dozens of such worlds on two cores. A fork starts from the
server's state, which has no process group and no megatron globals, so it is as fresh as a spawned rank. The
server is CPU-only: megatron-core's import calls ``torch.cuda.is_available()``, after which a forked child
cannot use CUDA.
"""

import concurrent.futures
import importlib
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_mimesis.lifetime import die_with_parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, parent_pid, port, fn, args, result_dir):
    die_with_parent(parent_pid)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        out = fn(rank, world_size, *args)
        torch.save({"ok": True, "value": out}, os.path.join(result_dir, f"{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while a peer is still in a collective (seen to abort a rank)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(result_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def _results(result_dir: str, world_size: int) -> list:
    results = [torch.load(os.path.join(result_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]
    return [r["value"] for r in results]


def run_gloo_processes(fn, world_size: int, *args):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the list of return values.

    ``fn`` must be a module-level function (it is pickled into the spawned processes). A failing rank raises
    RuntimeError carrying that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as result_dir:
        try:
            mp.spawn(_worker, args=(world_size, os.getpid(), _free_port(), fn, args, result_dir), nprocs=world_size, join=True)
        except mp.ProcessRaisedException as exc:
            raise RuntimeError(f"a rank failed:\n{exc}") from None
        return _results(result_dir, world_size)


class GlooForkServer:
    """Runs gloo worlds whose ranks are forks of one server process that imported ``preload`` once.

    The server is a spawned child tied to its caller, and each fork is tied to the server, so a caller that is
    killed takes the server and any world in flight with it. Each world gets the caller's environment and working
    directory as they are when it starts, as a spawned rank would. A rank that fails ends its world: the others,
    which may be waiting for it in a collective, are killed, and the failing rank's traceback is raised here.
    """

    def __init__(self, preload: tuple[str, ...]):
        self._pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_serve,
            initargs=(os.getpid(), tuple(preload)))

    def run(self, fn, world_size: int, *args) -> list:
        """``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks: their return values, in rank order."""
        return self._pool.submit(_fork_world, fn, world_size, args, dict(os.environ), os.getcwd()).result()

    def close(self) -> None:
        self._pool.shutdown()


def _serve(caller_pid: int, preload: tuple[str, ...]) -> None:
    die_with_parent(caller_pid)
    torch.set_num_threads(1)  # no OpenMP pool exists in the server when it forks (a fork cannot inherit one)
    for name in preload:
        importlib.import_module(name)


def _fork_world(fn, world_size: int, args: tuple, environ: dict, cwd: str) -> list:
    server, port = os.getpid(), _free_port()
    with tempfile.TemporaryDirectory() as result_dir:
        ranks = {}
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:
                _run_forked_rank(rank, world_size, server, port, fn, args, result_dir, environ, cwd)
            ranks[pid] = rank
        failures = _wait_for_world(ranks)
        if failures:
            raise RuntimeError(f"a rank failed:\n{_first_failure(result_dir, failures)}")
        return _results(result_dir, world_size)


def _run_forked_rank(rank, world_size, server, port, fn, args, result_dir, environ, cwd) -> None:
    """The body of one fork: never returns into the server's code (``os._exit``, no inherited cleanup)."""
    code = 1
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        _worker(rank, world_size, server, port, fn, args, result_dir)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait_for_world(ranks: dict[int, int]) -> list[tuple[int, int]]:
    """Reap every rank; at the first that fails, kill the rest. Returns (rank, wait status) of those that failed
    on their own, in the order they were reaped."""
    failures, alive = [], dict(ranks)
    while alive:
        pid, status = os.wait()
        rank = alive.pop(pid, None)
        if rank is None or status == 0 or (failures and os.WIFSIGNALED(status)
                                           and os.WTERMSIG(status) == signal.SIGKILL):
            continue
        failures.append((rank, status))
        if len(failures) == 1:
            for other in alive:
                os.kill(other, signal.SIGKILL)
    return failures


def _first_failure(result_dir: str, failures: list[tuple[int, int]]) -> str:
    """The error of the rank that failed first: a peer of a failed rank fails too ("Connection closed by peer"),
    and may be reaped first, so the order is that of the error records' writes."""
    records = [(os.stat(path).st_mtime_ns, path) for rank, _ in failures
               if os.path.exists(path := os.path.join(result_dir, f"{rank}.pt"))]
    if records:
        return torch.load(min(records)[1], weights_only=False)["error"]
    rank, status = failures[0]
    if os.WIFSIGNALED(status):
        return f"rank {rank} was killed by signal {os.WTERMSIG(status)} ({signal.Signals(os.WTERMSIG(status)).name})"
    return f"rank {rank} exited with status {os.WEXITSTATUS(status)}"
