"""Preemption, requeue and a lost node on a real SLURM (a private 4-node cluster: tests/slurm_cluster.py), through
``launch/slurm/midtrain.sbatch`` as shipped, with only command-line options and environment (2 CPU nodes, one gloo
rank each, data parallel; the tiny preset from the HF weights its 9B config starts from).

One job meets the four ways a run is stopped on a cluster, one per attempt:
1. its time limit (``--signal=B:USR1@90``; the administrator cuts the limit to 1-2 minutes ahead once the job
   trains: a fixed ``--time=2`` warned a loaded machine's ranks before they had installed their handlers): SLURM warns
   the batch shell, which has the ranks save and requeues the job; the administrator then lifts the limit, so that the
   rest finishes however loaded this machine is;
2. a user's ``scancel --signal=USR1 --batch``: the same path;
3. an administrator's ``scontrol requeue``: SIGTERM to every process of the job, SIGKILL after KillWait; the ranks save
   on SIGTERM while the batch shell waits for them;
4. a lost node: its slurmd, its step daemons and its ranks stop answering at once, as a machine that loses power; the
   ranks left wait in a collective up to ``distributed_timeout_minutes`` and SLURM declares the node failed after
   SlurmdTimeout, whichever comes first ends the job, and SLURM requeues it on two other nodes, where it resumes from
   the newest checkpoint (``latest`` still verifies).
After each stop the next attempt starts at the iteration saved (no step beyond the last checkpoint is lost), and the
whole run's curve equals an uninterrupted run's, step for step, to the bit.
"""

import json
import re
import time

import pytest

from megatron_mimesis.checkpoint.integrity import check_checkpoint
from megatron_mimesis.checkpoint.reader import checkpoint_dir, read_latest
from megatron_mimesis.pipeline.cluster import seconds
from tests.launch.stages import stage_config
from tests.slurm_cluster import TIMEOUTS, ended, job_env, sbatch, wait_job
from tests.training.conftest import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.slurm]
# enough steps that an idle machine's job still trains at its fourth stop: the first comes within 30 s of the cut
# (SLURM checks time limits every 30 s), at 3-4 steps/s
STEPS = 160
COMPARED = ("loss", "grad_norm", "loss_tokens", "lr")
# how long a lost node takes to end the job: the controller's SlurmdTimeout, then KillWait for what is left, and room
LOST_NODE_S = TIMEOUTS["SlurmdTimeout"] + TIMEOUTS["KillWait"] + 120


def _config(tmp_path, tiny_dataset, tiny_hf_checkpoint, imported) -> dict:
    config, start = stage_config("midtrain", tmp_path, tiny_dataset, tiny_hf_checkpoint, imported, train_iters=STEPS,
                                 save_interval=10, lr_warmup_iters=2, distributed_timeout_minutes=1)
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config))
    return {"CONFIG": str(path), **start}


def _curve(log_dir) -> dict[int, dict]:
    records = read_metrics(log_dir)
    iterations = [r["iteration"] for r in records]
    assert iterations == sorted(set(iterations)), iterations  # every step once, as the run that continued logged it
    return {r["iteration"]: {k: r.get(k) for k in COMPARED} for r in records}


def _progress(log_dir) -> int:
    try:
        return max(r["iteration"] for r in read_metrics(log_dir))
    except (OSError, ValueError):
        return 0


def _saved_at(out, stop: int, timeout: float = 120) -> int:
    """The iteration the ``stop``-th stop saved: rank 0's line, then its checkpoint's (the ranks of a requeued job
    save within its KillWait, after SLURM has counted the restart)."""
    deadline = time.monotonic() + timeout
    while True:
        text = out.read_text()
        said = re.findall(r"^exit signal received at iteration (\d+): saving and exiting for requeue", text, re.M)
        if len(said) >= stop and re.search(rf"^saved checkpoint iteration {said[stop - 1]} in ", text, re.M):
            return int(said[stop - 1])
        assert time.monotonic() < deadline, f"no save of stop {stop} after {timeout} s:\n{text[-3000:]}"
        time.sleep(1)


def test_a_time_limit_a_scancel_signal_an_admin_requeue_and_a_lost_node_each_resume_where_the_run_stopped(
        slurm_cluster, tmp_path, tiny_dataset, tiny_hf_checkpoint, imported):
    # the uninterrupted run, on the cluster's other two nodes meanwhile
    (tmp_path / "whole").mkdir()
    whole = sbatch(slurm_cluster, ["--nodes=2", "--gpus-per-node=0", f"--output={tmp_path}/whole/slurm-%j.out",
                                   "launch/slurm/midtrain.sbatch"],
                   job_env(slurm_cluster, **_config(tmp_path / "whole", tiny_dataset, tiny_hf_checkpoint, imported)))
    env = job_env(slurm_cluster, **_config(tmp_path, tiny_dataset, tiny_hf_checkpoint, imported))
    job = sbatch(slurm_cluster, ["--nodes=2", "--gpus-per-node=0", f"--output={tmp_path}/slurm-%j.out",
                                 "--time=30", "--signal=B:USR1@90", "launch/slurm/midtrain.sbatch"], env)
    out, log_dir = tmp_path / f"slurm-{job}.out", tmp_path / "log"
    restarted = lambda n: lambda info: int(info.get("Restarts", 0)) >= n  # noqa: E731
    trains_past = lambda n: lambda _: _progress(log_dir) >= n  # noqa: E731

    # 1. the time limit, cut to 1-2 minutes ahead once the job trains: SLURM warns at its first check within 120 s of
    # the limit (90 s of lead and one check's period), so at once; the launcher has the ranks save, then requeues
    wait_job(slurm_cluster, job, trains_past(3), "the first attempt's steps", timeout=300, log=out)
    ran_min = int(seconds(slurm_cluster.job(job)["RunTime"]) // 60)
    slurm_cluster.command("scontrol", "update", f"JobId={job}", f"TimeLimit={ran_min + 2}")
    wait_job(slurm_cluster, job, restarted(1), "requeue at the time limit", timeout=300, log=out)
    slurm_cluster.command("scontrol", "update", f"JobId={job}", "TimeLimit=30")  # the administrator lifts the limit
    saved = [_saved_at(out, 1)]
    # 2. the user: scancel --signal=USR1 --batch, once the next attempt trains
    wait_job(slurm_cluster, job, trains_past(saved[-1] + 3), "the second attempt's steps", timeout=300, log=out)
    slurm_cluster.command("scancel", "--signal=USR1", "--batch", job)
    wait_job(slurm_cluster, job, restarted(2), "requeue after scancel --signal=USR1", timeout=300, log=out)
    saved.append(_saved_at(out, 2))
    # 3. the administrator: scontrol requeue (SIGTERM to every process of the job)
    wait_job(slurm_cluster, job, trains_past(saved[-1] + 3), "the third attempt's steps", timeout=300, log=out)
    slurm_cluster.command("scontrol", "requeue", job)
    wait_job(slurm_cluster, job, restarted(3), "requeue by the administrator", timeout=300, log=out)
    saved.append(_saved_at(out, 3))
    # 4. a node of the job lost (not the batch shell's): the job ends within its timeouts and is requeued, on two
    # other nodes once the uninterrupted run has ended
    info = wait_job(slurm_cluster, whole, ended, "the uninterrupted run's end", timeout=900,
                    log=tmp_path / "whole" / f"slurm-{whole}.out")
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), info
    uninterrupted = _curve(tmp_path / "whole" / "log")
    wait_job(slurm_cluster, job, trains_past(saved[-1] + 12), "the fourth attempt's steps", timeout=300, log=out)
    lost = slurm_cluster.command("scontrol", "show", "hostnames", slurm_cluster.job(job)["NodeList"]).split()[1]
    slurm_cluster.lose_node(lost)
    lost_at = time.monotonic()
    try:
        wait_job(slurm_cluster, job, restarted(4), "requeue after the node failure", timeout=LOST_NODE_S, log=out)
        ended_after = time.monotonic() - lost_at
        newest = read_latest(tmp_path / "ckpt")
        check_checkpoint(checkpoint_dir(tmp_path / "ckpt", newest))  # `latest` names a complete checkpoint
        saved.append(newest)
        info = wait_job(slurm_cluster, job, ended, "end", timeout=900, log=out)
    finally:
        slurm_cluster.revive_node(lost)

    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "4"), info
    assert lost not in slurm_cluster.command("scontrol", "show", "hostnames", info["NodeList"]).split(), info
    text = out.read_text()
    resumed = [int(n) for n in re.findall(rf"^resuming from {tmp_path / 'ckpt'} \(iteration (\d+)\)", text, re.M)]
    # the lost node's attempt resumes from a periodic checkpoint written after the third stop's
    assert resumed == saved and 0 < saved[0] < saved[1] < saved[2] < saved[3] < STEPS, (saved, resumed)
    assert text.count("preempted (SIGUSR1): stopped at iteration") == 2, text[-3000:]  # the launcher's own stops
    assert read_latest(tmp_path / "ckpt") == STEPS
    curve = _curve(log_dir)
    assert curve == uninterrupted
    print(f"job {job}: time limit, scancel --signal=USR1, scontrol requeue, lost node {lost} "
          f"(requeued {ended_after:.0f} s after): saved and resumed at {saved}, 4 restarts; final loss "
          f"{curve[STEPS]['loss']} (uninterrupted {uninterrupted[STEPS]['loss']})")
