"""No process outlives its run: a training run through the launcher's torchrun line, hard-killed after it has
saved (the OOM killer, a scheduler's kill -9), leaves none of its helpers behind (checkpoint writers,
DataLoader workers)."""

import os
import signal
import time

import pytest

from megatron_mimesis.training import data
from megatron_mimesis.training.config import ConfigError
from tests.launch.local_run import LocalRun

GRACE_S = 5


def test_loader_workers_without_shared_memory_are_refused_up_front(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "SHM_DIR", str(tmp_path / "no-shm"))
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'no-shm'}: not writable .* set num_workers: 0$"):
        data.check_worker_shared_memory(1)
    data.check_worker_shared_memory(0)  # no workers, nothing to hand over


@pytest.mark.slow
@pytest.mark.parametrize("ranks_too", [True, False], ids=["torchrun-and-ranks", "torchrun-alone"])
def test_kill_9_of_torchrun_leaves_no_process(tiny_dataset, tmp_path, ranks_too):
    """With the ranks killed too, nothing of the run remains; with torchrun alone killed, its ranks (each in a
    session of its own) and their helpers end with it."""
    run = LocalRun(tmp_path, tiny_dataset, train_iters=1000, save_interval=1)
    try:
        run.start()
        run.wait_until(lambda: (run.latest() or 0) >= 1, what="the first checkpoint")
        torchrun, ranks = run.torchrun(), run.ranks()
        helpers = {p: info for p, info in run.processes().items() if info["ppid"] in ranks}
        assert len(ranks) == 2 and len(helpers) >= 2, run.processes()  # one DataLoader worker per rank at least
        for pid in (torchrun, *ranks) if ranks_too else (torchrun,):
            os.kill(pid, signal.SIGKILL)
        run_pids = {torchrun, *ranks, *helpers}

        def alive():
            return {p: info for p, info in run.processes().items() if ranks_too or p in run_pids}

        deadline = time.monotonic() + GRACE_S
        while alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(), f"alive {GRACE_S} s after kill -9: {alive()}"
    finally:
        run.kill_leftovers()
