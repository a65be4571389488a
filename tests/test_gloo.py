"""The fork server that runs the tests' gloo worlds: ranks are real gloo ranks with the caller's environment, a
rank that fails mid-run ends its world with its traceback (the peer waiting for it in a collective is killed),
and a caller that is hard-killed or signalled takes the server and every rank with it."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.multiproc import processes_with_env, run_distributed
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


CALLER = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from megatron_mimesis.gloo import GlooForkServer
from tests.test_gloo import _ranks_wait_forever
GlooForkServer(("torch.distributed",)).run(_ranks_wait_forever, 2)
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

