"""Preemption through torchrun, the way SLURM delivers it: SIGTERM or SIGUSR1 to the torchrun that
``launch/midtrain.sh`` starts, with the default config (one DataLoader worker per rank, the checkpoint written by a
forked writer). torchrun passes the signal to each rank's whole process group, DataLoader worker and writer
included; the rank must save at the end of its step and exit, the launcher exit 0 saying so, and the requeued
launcher resume from that step."""

import os
import signal

import pytest

from megatron_mimesis.checkpoint.integrity import verify_files
from tests.launch.local_run import LocalRun

pytestmark = pytest.mark.slow


def test_sigterm_then_sigusr1_to_torchrun_save_and_the_launcher_resumes(tiny_dataset, tmp_path):
    run = LocalRun(tmp_path, tiny_dataset, train_iters=1000)
    try:
        saved = 0
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            before = saved
            run.start()
            run.wait_until(lambda b=before: max(run.iterations(), default=0) > b, what="a training step")
            assert len(run.ranks()) == 2
            os.kill(run.torchrun(), sig)
            status = run.wait(timeout=300)
            out = run.output()
            assert "killed by signal" not in out and "ChildFailedError" not in out, out[-4000:]
            saved = run.latest()
            assert saved is not None and saved > before, out[-4000:]
            assert f"exit signal received at iteration {saved}: saving and exiting for requeue" in out
            # torchrun exits 1 on any signal; the launcher, told by the trainer that it saved, exits 0 and says so
            assert status == 0 and out.splitlines()[-1] == (f"preempted ({sig.name}): stopped at iteration {saved} "
                                                            f"with its checkpoint saved; exit 0 for the requeue")
            assert run.iterations()[-1] == saved  # the step it stopped at is the step it saved
            assert verify_files(run.save / f"iter_{saved:07d}") is None
            if before:
                assert f"resuming from {run.save} (iteration {before})" in out
            assert not run.processes()
        run.start("--exit-interval", str(saved + 1))  # the same schedule (a resume keeps it), one step further
        assert run.wait() == 0, run.output()[-4000:]
        assert f"resuming from {run.save} (iteration {saved})" in run.output()
        assert run.iterations()[-1] == saved + 1 and run.latest() == saved + 1
    finally:
        run.kill_leftovers()
