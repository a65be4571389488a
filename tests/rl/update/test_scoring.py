"""Teacher scoring (log-probs of given tokens, no grad, fused kernel on the last stage) against transformers,
in one process and at TP=2 with SP / PP=2."""

import pytest
import torch

from megatron_mimesis.models.config import ParallelConfig
from tests.models.harness import build_megatron_from_hf, hf_reference, init_single_process_megatron
from tests.multiproc import run_distributed

ROWS = [([5, 17, 99, 3], [8, 8, 120]), ([42], [7, 300, 2, 2, 9]), ([7, 7, 8, 200, 31, 64, 2], [11])]


def _reference(hf) -> list[list[float]]:
    out = []
    for context, response in ROWS:
        full = torch.tensor([context + response])
        with torch.no_grad():
            logp = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
        out.append([logp[len(context) - 1 + k, token].item() for k, token in enumerate(response)])
    return out


def _score(hf_state, parallel, max_tokens):
    from megatron_mimesis.rl.update.scoring import score_rows

    model, _, _ = build_megatron_from_hf(hf_state, parallel)
    return score_rows([model], ROWS, max_tokens, torch.device("cpu"))


def test_scores_equal_transformers_log_probs_in_any_packing():
    hf = hf_reference(seed=3)
    expected = _reference(hf)
    init_single_process_megatron()
    for max_tokens in (8, 64):  # one row per micro-batch, or all rows packed into one
        scores = _score(hf.state_dict(), ParallelConfig(), max_tokens)
        for got, want in zip(scores, expected, strict=True):
            assert len(got) == len(want)
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4


def _score_in_layout(rank, world_size, tp, pp, sp, hf_state):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_mimesis.compat import enable_cpu_compat

    enable_cpu_compat()
    parallel_state.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(0)
    out = _score(hf_state, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                          sequence_parallel=sp), 16)
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "sp"), [(2, 1, True), (1, 2, False)], ids=["tp2-sp", "pp2"])
def test_parallel_layouts_score_like_transformers_on_every_rank(tp, pp, sp):
    hf = hf_reference(seed=3)
    expected = _reference(hf)
    for scores in run_distributed(_score_in_layout, 2, tp, pp, sp, hf.state_dict()):
        for got, want in zip(scores, expected, strict=True):
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4
