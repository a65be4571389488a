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

pytestmark = pytest.mark.slow


def _run(stage, tiny_dataset, tiny_hf_checkpoint, tmp_path, log, *extra, nproc=1, check=True):
    module, _ = STAGES[stage]
    return run_trainer(nproc, *_args(stage, tiny_dataset, tiny_hf_checkpoint, tmp_path, log, *extra), module=module,
                       check=check, timeout=600)


def _checkpoint(path) -> dict[str, torch.Tensor]:
    reader = DistCheckpointReader(path)
    return {name: reader.tensor(name) for name in reader.stored_tensors()}


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
