"""Saves through the launcher's torchrun line (2 data-parallel ranks, each writing its share in a forked writer):
a kill -9 of the job while both writers are in the middle of a checkpoint leaves ``latest`` on the previous one, and
retention keeps exactly ``keep_last_n`` checkpoints, deleting none of them for a save that never completed."""

import os
import signal
import time

import pytest

from megatron_mimesis.checkpoint.integrity import verify_files
from megatron_mimesis.checkpoint.reader import newest_complete, published_iterations
from tests.launch.local_run import LocalRun

pytestmark = pytest.mark.slow

STALL_ITERATION = 4


def test_kill_9_mid_parallel_save_leaves_latest_on_the_previous_and_retention_keeps_n(tiny_dataset, tmp_path):
    run = LocalRun(tmp_path, tiny_dataset, train_iters=1000, save_interval=1, keep_last_n=2)
    run.env.update(TRAIN_MODULE="tests.launch.stall_at_save", STALL_ITERATION=str(STALL_ITERATION))
    writing = [tmp_path / f"writing-{rank}" for rank in (0, 1)]
    try:
        run.start()
        run.wait_until(lambda: all(marker.exists() for marker in writing), what="both ranks writing the checkpoint")
        torchrun, ranks = run.torchrun(), run.ranks()
        assert len(ranks) == 2
        for pid in (torchrun, *ranks):  # the scheduler's kill of a job
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while run.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not run.processes(), run.processes()  # the writers died with their ranks
        previous = STALL_ITERATION - 1
        assert run.latest() == previous
        assert newest_complete(run.save) == (run.save / f"iter_{previous:07d}", [])
        assert published_iterations(run.save) == [previous - 1, previous]  # 1 deleted once 3 verified; 2 kept
        assert all(verify_files(run.save / f"iter_{i:07d}") is None for i in (previous - 1, previous))
        assert (run.save / f"iter_{STALL_ITERATION:07d}.tmp").is_dir()  # what the writers had begun

        run.env.pop("TRAIN_MODULE")
        run.start("--exit-interval", str(STALL_ITERATION + 1))  # resumes from 3, saves 4 and 5
        assert run.wait() == 0, run.output()[-4000:]
        assert f"resuming from {run.save} (iteration {previous})" in run.output()
        assert published_iterations(run.save) == [STALL_ITERATION, STALL_ITERATION + 1] and run.latest() == 5
        assert not list(run.save.glob("*.tmp"))
    finally:
        run.kill_leftovers()
