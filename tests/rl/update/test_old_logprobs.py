"""Old log-probs when another engine sampled: the trainer's own, recomputed before the update, with the engine's kept
beside them for the rollout correction."""

import pytest
import torch

from megatron_mimesis.models.config import ParallelConfig
from megatron_mimesis.rl.types import TrainingRow
from tests.models.harness import build_megatron_from_hf, hf_reference, init_single_process_megatron

CONTEXT, RESPONSE = [5, 17, 99, 3], [8, 8, 120]


def test_trainer_log_probs_replace_the_engines_which_are_kept_beside_them():
    from megatron_mimesis.rl.update.scoring import recompute_old_logprobs

    hf = hf_reference(seed=3)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([CONTEXT + RESPONSE])).logits[0].float(), dim=-1)
    trainer = [logp[len(CONTEXT) - 1 + k, t].item() for k, t in enumerate(RESPONSE)]
    engine = [trainer[0] + 0.1, trainer[1] - 0.2, trainer[2]]  # an engine with slightly different numerics
    row = TrainingRow(0, 0, CONTEXT, RESPONSE, engine, reward=1.0, domain="d")
    init_single_process_megatron()
    model, _, _ = build_megatron_from_hf(hf.state_dict(), ParallelConfig())
    (fixed,) = recompute_old_logprobs([model], [row], 64, torch.device("cpu"))
    assert fixed.response_logprobs == pytest.approx(trainer, abs=1e-4)
    assert fixed.engine_logprobs == engine
    assert (fixed.context_ids, fixed.response_ids, fixed.reward) == (CONTEXT, RESPONSE, 1.0)
