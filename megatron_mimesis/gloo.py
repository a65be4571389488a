"""Run a function on N local processes joined in a gloo process group, and collect what each returns.

For work that needs megatron's parallel state but no launcher: the HF checkpoint import (a world of one),
and the multi-process tests. Processes are spawned (not forked), so each builds its own process groups
and megatron-core global state, exactly as under torchrun, and each dies with the process that started it
(:mod:`megatron_mimesis.lifetime`): a killed test run or conversion leaves no rank waiting in a collective.
The body of a rank (:func:`run_rank`) is shared with the tests' launcher, which forks its ranks instead.
"""

import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_mimesis.lifetime import die_with_parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun gives a rank of a one-node world, which ``env://`` initialisation reads."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}


def run_rank(rank, world_size, parent_pid, port, fn, args, result_dir):
    """One rank: tied to its parent, in the gloo world, ``fn``'s return value (or its traceback) saved for the
    caller as ``result_dir/{rank}.pt``."""
    die_with_parent(parent_pid)
    os.environ.update(rank_environment(rank, world_size, port))
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


def load_results(result_dir: str, world_size: int) -> list:
    results = [torch.load(os.path.join(result_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]
    return [r["value"] for r in results]


def run_gloo_processes(fn, world_size: int, *args):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the list of return values.

    ``fn`` must be a module-level function (it is pickled into the spawned processes). A failing rank raises
    RuntimeError carrying that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as result_dir:
        try:
            mp.spawn(run_rank, args=(world_size, os.getpid(), free_port(), fn, args, result_dir), nprocs=world_size,
                     join=True)
        except mp.ProcessRaisedException as exc:
            raise RuntimeError(f"a rank failed:\n{exc}") from None
        return load_results(result_dir, world_size)
