"""Rollout correction of a step's rows: weights per row from the two log-probs each token carries, what a rejected
token does to the update's arrays, the warning, and the options' validation."""

import math

import pytest
import torch

from megatron_mimesis.rl.simulator.config import SimulatorRLConfig
from megatron_mimesis.rl.types import TrainingRow
from megatron_mimesis.rl.update.rollout_correction import correction_warning, rollout_weights
from megatron_mimesis.rl.update.rows import StepRows
from megatron_mimesis.training.config import ConfigError


def _row(trainer, engine, rollout_id=0):
    return TrainingRow(0, rollout_id, [1, 2], list(range(3, 3 + len(trainer))), trainer, reward=1.0, domain="d",
                       engine_logprobs=engine)


def test_rows_sampled_by_the_training_model_get_no_weights_and_no_metrics():
    assert rollout_weights(StepRows.of_rows([_row([-1.0, -2.0], None)]), "tis", "token", 2.0) == (None, {})


def test_weights_come_back_per_token_with_the_metrics_of_all_tokens():
    rows = StepRows.of_rows([_row([-1.0, -1.0], [-1.0, -1.0 - math.log(3.0)]),
                             _row([-2.0], [-2.0 + math.log(4.0)], rollout_id=1)])
    weights, metrics = rollout_weights(rows, "mis", "token", 2.0)
    assert weights.tolist() == [1.0, 0.0, 0.0]  # ratios 1, 3 and 1/4: two leave [1/2, 2]
    assert metrics["is_masked_frac"] == pytest.approx(2 / 3)
    assert metrics["engine_logprob_abs_diff_max"] == pytest.approx(math.log(4.0))
    assert all(isinstance(v, float) for v in metrics.values())
    weights, metrics = rollout_weights(rows, "off", "token", 2.0)
    assert weights is None and metrics["is_ratio_max"] == pytest.approx(3.0)  # statistics without a correction


def test_a_rejected_token_leaves_the_loss_mask_and_keeps_its_place():
    rows = StepRows.of_rows([_row([-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0])])
    weighted = rows.with_response("rollout_weights", torch.tensor([1.5, 0.0, 1.0], dtype=torch.float64))
    batch = {k: v[0].tolist() for k, v in weighted.microbatch([0], torch.tensor([0.5]), 1, "cpu").items()
             if isinstance(v, torch.Tensor) and v.dim() == 2}
    assert batch["loss_mask"] == [0, 1, 0, 1, 0] and batch["rollout_weights"] == [0, 1.5, 0.0, 1.0, 0]
    assert batch["old_logprobs"] == [0, -1.0, -2.0, -3.0, 0] and batch["advantages"] == [0, 0.5, 0.5, 0.5, 0]
    assert rows.microbatch([0], torch.tensor([0.5]), 1, "cpu")["rollout_weights"][0].tolist() == [0, 1, 1, 1, 0]


def test_a_warning_line_when_the_correction_acts_on_too_many_tokens():
    record = {"is_masked_frac": 0.2, "is_truncated_frac": 0.005, "engine_kl": 0.3, "engine_logprob_abs_diff_max": 2.5}
    line = correction_warning(record, "mis", 2.0, 0.01)
    assert line.startswith("rollout correction: 20.0% of sampled tokens masked (trainer/engine ratio outside "
                           "[0.5, 2])") and "\n" not in line
    assert correction_warning(record, "tis", 2.0, 0.01) is None  # 0.5% truncated: numerics
    assert correction_warning(record, "mis", 2.0, 0.25) is None
    assert correction_warning({}, "tis", 2.0, 0.01) is None  # the local engine: nothing measured
    assert line.endswith(": check the weight sync and engine_deltanet_state_dtype")
    stale = correction_warning({**record, "staleness_mean": 1.5}, "mis", 2.0, 0.01)
    assert stale.endswith(": rows were sampled 1.5 policy versions behind on average: lower max_staleness or the "
                          "learning rate")


@pytest.mark.parametrize(("changes", "message"), [
    (dict(rollout_correction="clip"), "rollout_correction must be one of"),
    (dict(rollout_correction_level="geometric"), "rollout_correction_level must be one of"),
    (dict(rollout_correction_cap=1.0), "rollout_correction_cap must be greater than 1"),
    (dict(rollout_correction_warn_frac=1.5), "rollout_correction_warn_frac must be in"),
    (dict(engine_deltanet_state_dtype="float16"), "engine_deltanet_state_dtype must be one of"),
    (dict(engine="vllm", bf16=True, engine_options={"mamba_ssm_cache_dtype": "bfloat16"}),
     "set by the vLLM engine itself .*engine_deltanet_state_dtype"),
])
def test_correction_and_state_dtype_options_are_validated_before_anything_starts(tmp_path, changes, message):
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=message):
        SimulatorRLConfig(tokenizer=str(tmp_path), **changes).validate(1)
