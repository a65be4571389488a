"""An error mid-run through the launcher's torchrun line: the whole job ends promptly, non-zero, the error named
once (issue 20: a save that failed after the data loaders started left every rank blocked in its exit, joining
loader workers that ignore SIGTERM, and torchrun waiting for them)."""

import contextlib
import os
import shutil
import subprocess
import time

import pytest

from tests.launch.local_run import LocalRun

pytestmark = pytest.mark.slow

ENDS_WITHIN_S = 30


@contextlib.contextmanager
def unwritable(directory):
    """``directory`` refuses new entries (as root, whom permissions do not stop: immutable), for the block."""
    as_root = os.geteuid() == 0
    if as_root and shutil.which("chattr") is None:
        pytest.skip("running as root without chattr: no way to make a directory unwritable")
    command = ["chattr", "+i", str(directory)] if as_root else ["chmod", "a-w", str(directory)]
    subprocess.run(command, check=True)
    try:
        probe = directory / "probe"
        with contextlib.suppress(OSError):
            probe.mkdir()
        if probe.exists():
            pytest.skip(f"{' '.join(command)} did not make {directory} unwritable here")
        yield
    finally:
        subprocess.run(["chattr", "-i", str(directory)] if as_root else ["chmod", "u+w", str(directory)], check=True)


def test_a_save_that_fails_mid_run_ends_the_whole_job(tiny_dataset, tmp_path):
    run = LocalRun(tmp_path, tiny_dataset, train_iters=1000, save_interval=1)
    try:
        run.start()
        run.wait_until(lambda: (run.latest() or 0) >= 1, what="the first checkpoint")
        with unwritable(run.save):
            failed_at = time.monotonic()
            status = run.wait(timeout=ENDS_WITHIN_S)
            ended_after = time.monotonic() - failed_at
        out = run.output()
        assert status != 0, out[-4000:]
        assert ended_after < ENDS_WITHIN_S
        assert not run.processes(), run.processes()  # ranks, loader workers and checkpoint writers all ended
        errors = [line for line in out.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, out[-4000:]
        assert errors[0].startswith(f"error: save of iteration {run.latest() + 1} to {run.save} failed: "), errors
        assert "Operation not permitted" in errors[0] or "Permission denied" in errors[0], errors
        assert sum("Operation not permitted" in line or "Permission denied" in line for line in out.splitlines()) == 1
    finally:
        run.kill_leftovers()
