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
