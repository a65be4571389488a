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


def _ended_with_one_error(run, failed_at: float, status: int, reasons: tuple[str, ...]) -> str:
    """The whole job ended within ENDS_WITHIN_S of the failure, non-zero, with one error line from the ranks naming
    the failed save and its reason, which the launcher repeats as its last line, below torchrun's report of the
    failure (the reason appears in those two lines only); returns the ranks' line."""
    ended_after = time.monotonic() - failed_at
    out = run.output()
    assert status != 0, out[-4000:]
    assert ended_after < ENDS_WITHIN_S
    assert not run.processes(), run.processes()  # ranks, loader workers and checkpoint writers all ended
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-4000:]
    assert errors[0].startswith(f"error: save of iteration {run.latest() + 1} to {run.save} failed: "), errors
    assert any(reason in errors[0] for reason in reasons), errors
    assert out.strip().splitlines()[-1] == f"failed (exit {status}): {errors[0].removeprefix('error: ')}"
    assert sum(any(reason in line for reason in reasons) for line in out.splitlines()) == 2, out[-4000:]
    return errors[0]


def test_a_save_that_fails_mid_run_ends_the_whole_job(tiny_dataset, tmp_path):
    run = LocalRun(tmp_path, tiny_dataset, train_iters=1000, save_interval=1)
    try:
        run.start()
        run.wait_until(lambda: (run.latest() or 0) >= 1, what="the first checkpoint")
        with unwritable(run.save):
            failed_at = time.monotonic()
            status = run.wait(timeout=ENDS_WITHIN_S)
        _ended_with_one_error(run, failed_at, status, ("Operation not permitted", "Permission denied"))
    finally:
        run.kill_leftovers()


def test_a_disk_that_fills_at_a_later_save_is_named_in_the_last_line(tiny_dataset, tmp_path):
    """The second checkpoint's shards meet ENOSPC in the forked writer: the job's last line names "No space left on
    device" and the save directory, and ``latest`` stays on the first checkpoint."""
    run = LocalRun(tmp_path, tiny_dataset, train_iters=1000, save_interval=1)
    run.env["TRAIN_MODULE"] = "tests.launch.full_disk_at_save"
    try:
        run.start()
        run.wait_until(lambda: (run.latest() or 0) >= 1, what="the first checkpoint")
        failed_at = time.monotonic()
        status = run.wait(timeout=ENDS_WITHIN_S)
        _ended_with_one_error(run, failed_at, status, ("No space left on device",))
        assert run.latest() == 1
    finally:
        run.kill_leftovers()
