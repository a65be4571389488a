"""Asynchronous RL on CPU, both stages, through the entry points: the rollout worker taking turns with the trainer
(max_staleness 0) reproduces the synchronous loop to the bit; ahead of it (1, 2) its rows lag by at most the bound,
the stale ones corrected against the trainer's recomputed log-probs; a requeue mid-run resumes the task sampler
exactly, every step trained once."""

import json

import pytest
import torch

from megatron_mimesis.checkpoint.reader import DistCheckpointReader
from megatron_mimesis.rl.agent.config import AgentRLConfig
from megatron_mimesis.training.config import ConfigError
from tests.rl.test_preemption import STAGES, _args
from tests.training.conftest import read_metrics, run_trainer, run_under_torchrun


def _run(stage, tiny_dataset, tiny_hf_checkpoint, tmp_path, log, *extra, nproc=1, check=True):
    module, _ = STAGES[stage]
    return run_trainer(nproc, *_args(stage, tiny_dataset, tiny_hf_checkpoint, tmp_path, log, *extra), module=module,
                       check=check, timeout=600)


def _checkpoint(path) -> dict[str, torch.Tensor]:
    reader = DistCheckpointReader(path)
    return {name: reader.tensor(name) for name in reader.stored_tensors()}


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
def test_a_worker_that_takes_turns_with_the_trainer_is_the_synchronous_loop_to_the_bit(
        stage, tiny_dataset, tiny_hf_checkpoint, tmp_path):
    _, compared = STAGES[stage]
    runs = {"sync": [], "worker": ["--max-staleness", "0"]}
    for name, extra in runs.items():
        _run(stage, tiny_dataset, tiny_hf_checkpoint, tmp_path, name, "--save", str(tmp_path / name / "ckpt"),
             "--save-interval", "3", *extra)
    sync, worker = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "worker")
    assert len(sync) == len(worker) == 3
    for s, w in zip(sync, worker, strict=True):
        assert {k: s[k] for k in (*compared, "rows_trained")} == {k: w[k] for k in (*compared, "rows_trained")}
        assert w["staleness/0"] == w["rows"] and w["staleness_mean"] == 0
        # the two sides took turns: each waited for the other
        assert 0 < w["trainer_idle_frac"] < 1 and 0 < w["rollout_idle_frac"] < 1
        assert "engine_kl" not in w  # every row at the trainer's version: its own log-probs, no correction
    expected, got = _checkpoint(tmp_path / "sync" / "ckpt"), _checkpoint(tmp_path / "worker" / "ckpt")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
def test_a_worker_ahead_of_the_trainer_samples_within_its_bound_and_corrects_the_stale_rows(
        stage, tiny_dataset, tiny_hf_checkpoint, tmp_path):
    """Two-token turns: the rollouts outrun the update, so the worker runs up to its bound and waits there."""
    for bound, loss in ((1, "decoupled"), (2, "decoupled"), (2, "behaviour")):
        name = f"ahead{bound}-{loss}"
        _run(stage, tiny_dataset, tiny_hf_checkpoint, tmp_path, name, "--train-iters", "5", "--max-new-tokens", "2",
             "--max-staleness", str(bound), "--off-policy-loss", loss)
        records = read_metrics(tmp_path / name)
        assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5]
        for r in records:
            lags = {int(k.split("/")[1]): n for k, n in r.items() if k.startswith("staleness/")}
            assert sorted(lags) == list(range(bound + 1)) and sum(lags.values()) == r["rows"] > 0
            # decoupled PPO: the stale rows' old log-probs are the trainer's, the sampler's weigh them
            stale = r["staleness_mean"] > 0
            assert ("engine_kl" in r) == (stale and loss == "decoupled"), r
            assert 0 <= r["trainer_idle_frac"] < 1 and 0 <= r["rollout_idle_frac"] <= 1
        assert records[0]["staleness_mean"] == 0  # the first step's rollouts had nothing to wait for
        assert max(r[f"staleness/{bound}"] for r in records) > 0  # the worker reached its bound...
        assert max(r["rollout_idle_frac"] for r in records[1:-1]) > 0.05  # ...and waited there for the trainer
        assert records[1]["engine_kl" if loss == "decoupled" else "staleness_mean"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
def test_a_signal_mid_run_resumes_the_sampler_exactly_with_every_step_trained_once(
        stage, tiny_dataset, tiny_hf_checkpoint, tmp_path):
    """The signal reaches the run as the trainer starts iteration 2's update, while the worker plays iteration 3 a
    version ahead: iteration 2 is dropped, iteration 1 saved and the rollouts in flight abandoned. The requeued run
    plays iteration 2 again from the sampler's saved position, at version 1: the synchronous loop's iteration 2 to
    the bit (its version-1 weights are the same, every row of iteration 1 having been fresh), which it could not be
    with a task lost, drawn twice or out of order."""
    module, compared = STAGES[stage]
    _run(stage, tiny_dataset, tiny_hf_checkpoint, tmp_path, "sync")
    sync = {r["iteration"]: r for r in read_metrics(tmp_path / "sync")}
    worker = ["--max-staleness", "1", "--save", str(tmp_path / "ckpt"), "--save-interval", "10"]
    preempted = run_under_torchrun(1, "signal", stage,
                                   *_args(stage, tiny_dataset, tiny_hf_checkpoint, tmp_path, "run", *worker),
                                   module="tests.rl.worker_faults", check=False, timeout=600)
    out = preempted.stdout + preempted.stderr
    assert "exit signal received during iteration 2 (after its old log-probs): stopping at iteration 1" in out, \
        out[-4000:]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "1"
    assert json.loads((tmp_path / "run" / "exit.json").read_text()) == {
        "stopped": "signal", "signal": "SIGTERM", "iteration": 1, "saved": True}
    _run(stage, tiny_dataset, tiny_hf_checkpoint, tmp_path, "run", *worker)
    records = read_metrics(tmp_path / "run")
    assert [r["iteration"] for r in records] == [1, 2, 3]  # each step logged once: none trained twice
    resumed = {r["iteration"]: r for r in records}
    assert resumed[2]["staleness/0"] == resumed[2]["rows"]  # played again at the restored version
    assert {k: resumed[2][k] for k in compared} == {k: sync[2][k] for k in compared}
    assert sum(resumed[3][f"staleness/{lag}"] for lag in (0, 1)) == resumed[3]["rows"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("stage", list(STAGES))
def test_an_error_in_the_worker_ends_the_run_naming_it(stage, tiny_dataset, tiny_hf_checkpoint, tmp_path):
    from tests.rl.worker_faults import MESSAGE

    failed = run_under_torchrun(1, "fail", stage, *_args(stage, tiny_dataset, tiny_hf_checkpoint, tmp_path, "run",
                                                         "--max-staleness", "1"),
                                module="tests.rl.worker_faults", check=False, timeout=300)
    out = failed.stdout + failed.stderr
    assert failed.returncode != 0
    assert (f"error: RolloutWorkerError: the rollout worker failed in iteration 2: RuntimeError: {MESSAGE}"
            in out), out[-4000:]
    assert f"RuntimeError: {MESSAGE}" in (tmp_path / "run" / "error-rank0.txt").read_text()
    assert [r["iteration"] for r in read_metrics(tmp_path / "run")] == [1]  # the step before it trained


@pytest.mark.slow
def test_kill_9_of_a_rank_mid_run_ends_the_run(tiny_dataset, tiny_hf_checkpoint, tmp_path):
    """The worker is a thread of the rank: a hard kill ends it with the rank, and torchrun ends the run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.multiproc import kill_all, processes_with_env
    from tests.training.conftest import REPO

    module, _ = STAGES["agent"]
    marker = f"async-kill-{os.getpid()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", module,
           "--no-progress", *_args("agent", tiny_dataset, tiny_hf_checkpoint, tmp_path, "run", "--train-iters", "1000",
                                   "--max-staleness", "2")]
    run = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "ASYNC_KILL_TEST": marker},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        metrics = tmp_path / "run" / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline and run.poll() is None, "no second step within 120 s"
            time.sleep(0.2)
        (rank,) = [pid for pid, info in processes_with_env("ASYNC_KILL_TEST", marker).items() if pid != run.pid]
        os.kill(rank, signal.SIGKILL)
        assert run.wait(timeout=30) != 0
        time.sleep(1)
        assert not processes_with_env("ASYNC_KILL_TEST", marker)
    finally:
        kill_all([run.pid, *processes_with_env("ASYNC_KILL_TEST", marker)])


@pytest.mark.parametrize(("changes", "message"), [
    (dict(max_staleness=-1), "max_staleness must be at least 0"),
    (dict(max_staleness=1, engine="vllm"), "max_staleness: the rollout worker needs an engine of its own beside the "
                                           "trainer: engine=local .* or engine=served"),
    (dict(engine="served", engine_options={"base_url": "http://h:1/v1", "model": "m", "port": 1}),
     r"engine_options of engine=served: missing \['weights_dir'\]; unknown \['port'\] \(it takes base_url: "),
    (dict(max_staleness=1, tensor_model_parallel_size=2), r"at tensor and pipeline parallel size 1, not 2 x 1 "
                                                          r"\(engine=served takes any layout\)"),
    (dict(off_policy_loss="ppo"), "off_policy_loss must be one of"),
    (dict(max_staleness=1, engine="served", tensor_model_parallel_size=2, coach="policy",
          engine_options={"base_url": "http://h:1/v1", "model": "m", "weights_dir": "/w"}),
     "coach=policy with max_staleness at model-parallel size > 1: it samples the notes from the rollout engine"),
])
def test_async_options_are_validated_before_anything_starts(changes, message):
    config = AgentRLConfig(model="tiny", env="toy", user_model="scripted", coach="none").replace(**changes)
    with pytest.raises(ConfigError, match=message):
        config.validate_without_files(2)
