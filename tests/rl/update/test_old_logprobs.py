"""Old log-probs when another engine sampled: the trainer's own, recomputed before the update, with the
engine/trainer mismatch measured against the hand-computed values."""

import math

import pytest
import torch

from megatron_mimesis.models.config import ParallelConfig
from megatron_mimesis.rl.types import TrainingRow
from tests.models.harness import build_megatron_from_hf, hf_reference, init_single_process_megatron

CONTEXT, RESPONSE = [5, 17, 99, 3], [8, 8, 120]


def test_trainer_log_probs_replace_the_engines_and_the_mismatch_is_reported():
    from megatron_mimesis.rl.update.scoring import recompute_old_logprobs

    hf = hf_reference(seed=3)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([CONTEXT + RESPONSE])).logits[0].float(), dim=-1)
    trainer = [logp[len(CONTEXT) - 1 + k, t].item() for k, t in enumerate(RESPONSE)]
    engine = [trainer[0] + 0.1, trainer[1] - 0.2, trainer[2]]  # an engine with slightly different numerics
    row = TrainingRow(0, 0, CONTEXT, RESPONSE, engine, reward=1.0, domain="d")
    init_single_process_megatron()
    model, _, _ = build_megatron_from_hf(hf.state_dict(), ParallelConfig())
    (fixed,), stats = recompute_old_logprobs([model], [row], 64, torch.device("cpu"))
    assert fixed.response_logprobs == pytest.approx(trainer, abs=1e-4)
    assert (fixed.context_ids, fixed.response_ids, fixed.reward) == (CONTEXT, RESPONSE, 1.0)
    diffs = [-0.1, 0.2, 0.0]  # trainer - engine
    assert stats["engine_logprob_abs_diff"] == pytest.approx(0.1, abs=1e-4)
    assert stats["engine_kl"] == pytest.approx(sum(math.exp(d) - d - 1 for d in diffs) / 3, abs=1e-4)
