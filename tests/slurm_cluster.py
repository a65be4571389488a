"""The real SLURM the cluster tests submit to: a private cluster of 4 nodes x 2 CPUs on this machine
(``tools/local_slurm.py``), one per test process, stopped with every process it started when the session ends.

Tests that need it are marked ``slurm``; where Debian's ``slurm-wlm`` is missing they skip with the reason, except in
CI (``CI`` set, as ``.ci/run`` does), where a missing SLURM fails them.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from megatron_mimesis.tools.local_slurm import LocalSlurm, missing

REPO = Path(__file__).resolve().parents[1]
# the controller notices a lost node after this long; a killed job's processes get this long after SIGTERM
TIMEOUTS = {"SlurmdTimeout": 30, "KillWait": 30}


def start_cluster(directory: Path) -> LocalSlurm:
    reason = missing()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"SLURM tests cannot run: {reason}; .ci/run installs slurm-wlm")
        pytest.skip(f"needs a local SLURM: {reason}")
    return LocalSlurm(directory, nodes=4, cpus=2, timeouts=TIMEOUTS).start()


def cancel_every_job(cluster: LocalSlurm, timeout: float = 120) -> None:
    """Cancel the cluster's jobs and wait until they are gone (a running job's processes get KillWait)."""
    def queued() -> list[str]:
        return cluster.command("squeue", "--noheader", "--format=%i", timeout=30).split()

    jobs = queued()
    if jobs:
        cluster.command("scancel", *jobs, check=False, timeout=30)
    deadline = time.monotonic() + timeout
    while jobs and time.monotonic() < deadline:
        time.sleep(2)
        jobs = queued()
    if jobs:
        raise AssertionError(f"jobs {jobs} still queued {timeout} s after scancel")


def job_env(cluster: LocalSlurm, **extra: str) -> dict[str, str]:
    """What a user's shell has when they submit: the cluster, this interpreter for the launchers, one thread per
    rank (the cluster's 4 nodes share this machine's cores)."""
    env = {k: v for k, v in cluster.env.items() if not k.startswith(("SLURM_", "CONFIG", "DATA_PATH", "NPROC",
                                                                   "SAVE", "PRETRAINED_HF"))}
    return {**env, "SLURM_CONF": str(cluster.conf), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", **extra}


def sbatch(cluster: LocalSlurm, args: list[str], env: dict[str, str]) -> str:
    """``sbatch --parsable ARGS`` from the repository root (the sbatch files cd to the submit directory)."""
    result = subprocess.run(["sbatch", "--parsable", *map(str, args)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def wait_job(cluster: LocalSlurm, job: str, until, what: str, timeout: float = 600, log: Path | None = None) -> dict:
    """Poll ``scontrol show job`` until ``until(info)``; fails with the job's fields and its log's tail."""
    deadline = time.monotonic() + timeout
    while True:
        info = cluster.job(job)
        if until(info):
            return info
        if time.monotonic() > deadline:
            tail = log.read_text()[-4000:] if log and log.is_file() else ""
            raise AssertionError(f"job {job}: no {what} after {timeout} s: {info}\n{tail}")
        time.sleep(1)


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def ended(info: dict) -> bool:
    return info.get("JobState") in ENDED
