"""The tests' launcher (``tests/multiproc.py``): its ranks are real gloo ranks with the caller's environment, an
entry point runs on them as under torchrun, a rank that fails mid-run ends its world with its error (the peer
waiting for it in a collective is killed), a world past its time is killed, and a test process that is hard-killed
or signalled takes the server and every rank with it."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.multiproc import processes_with_env, run_distributed, run_main
from tests.training.conftest import REPO

MARKER = "MIMESIS_TEST_GLOO_WORLD"
GRACE_S = 5


def _sum_of_ranks_and_marker(rank, world_size):
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return value.item(), os.environ.get(MARKER), dist.get_world_size(), os.getcwd()


def _rank_one_fails_while_rank_zero_waits(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one gives up")
    dist.all_reduce(torch.ones(1))  # rank 1 never joins: only killing this rank ends the world


def _ranks_wait_forever(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        time.sleep(3600)
    dist.barrier()


def main(argv):
    """An entry point as torchrun starts one: its own process group from the environment; ``argv`` says how it
    ends: ``sum`` prints the all-reduced ranks, ``fail`` exits 3 on rank 1 while rank 0 waits for it, ``hang``
    waits forever."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} (local {os.environ['LOCAL_RANK']})", file=sys.stderr)
    if argv == ["fail"] and rank == 1:
        return 3
    if argv == ["hang"]:
        time.sleep(3600)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    print(f"sum {value.item()}")
    dist.destroy_process_group()
    return 0


def test_ranks_reduce_with_the_callers_environment_and_working_directory(monkeypatch, tmp_path):
    monkeypatch.setenv(MARKER, "set-after-the-server-started")
    monkeypatch.chdir(tmp_path)
    assert run_distributed(_sum_of_ranks_and_marker, 3) == [(6.0, "set-after-the-server-started", 3,
                                                              str(tmp_path))] * 3


def test_a_rank_that_fails_mid_run_ends_its_world_and_the_server_runs_the_next():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)a rank failed:.*ValueError: rank one gives up"):
        run_distributed(_rank_one_fails_while_rank_zero_waits, 2)
    assert time.monotonic() - started < 60  # rank 0 was killed, not waited for
    assert [r[0] for r in run_distributed(_sum_of_ranks_and_marker, 2)] == [3.0, 3.0]


def test_an_entry_point_runs_as_under_torchrun_and_its_failure_or_timeout_is_its_status():
    done = run_main(3, "tests.test_multiproc", ["sum"])
    assert done.stdout == "sum 6.0\n" * 3
    assert done.stderr == "".join(f"rank {r} of 3 (local {r})\n" for r in range(3))
    failed = run_main(2, "tests.test_multiproc", ["fail"], check=False)
    assert failed.returncode == 3 and failed.stdout == ""  # rank 0, waiting in its all-reduce, was killed
    started = time.monotonic()
    hung = run_main(2, "tests.test_multiproc", ["hang"], check=False, timeout=3)
    assert hung.returncode == 124 and time.monotonic() - started < 30
    with pytest.raises(AssertionError, match=r"tests.test_multiproc failed \(3\)"):
        run_main(2, "tests.test_multiproc", ["fail"])


CALLER = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from tests.multiproc import run_distributed
from tests.test_multiproc import _ranks_wait_forever
run_distributed(_ranks_wait_forever, 2)
"""


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_a_caller_that_dies_takes_the_server_and_its_ranks(how):
    marker = uuid.uuid4().hex
    caller = subprocess.Popen([sys.executable, "-c", CALLER], cwd=REPO, env={**os.environ, MARKER: marker})
    try:
        deadline = time.monotonic() + 120
        while len(helpers := {p for p in processes_with_env(MARKER, marker) if p != caller.pid}) < 3:
            assert caller.poll() is None and time.monotonic() < deadline, helpers  # the server and two ranks
            time.sleep(0.5)
        time.sleep(2)  # the ranks are in their barrier
        caller.send_signal(how)
        caller.wait(timeout=30)
        deadline = time.monotonic() + GRACE_S
        while (left := processes_with_env(MARKER, marker)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left
    finally:
        caller.kill()
        for pid in processes_with_env(MARKER, marker):
            os.kill(pid, signal.SIGKILL)
