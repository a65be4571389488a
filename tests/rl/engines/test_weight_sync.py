"""Weight sync: an engine with its own model copy samples with the trainer's log-probs once synced."""

import pytest
import torch

from megatron_mimesis.models.config import ParallelConfig
from megatron_mimesis.rl.engines.local import LocalEngine
from megatron_mimesis.rl.engines.weight_sync import sync_weights
from megatron_mimesis.rl.types import SamplingParams
from tests.models.harness import PRESET, build_megatron_from_hf, hf_reference
from tests.multiproc import run_distributed

PROMPTS = [[5, 17, 99, 3], [42, 8]]
GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0)


class _Decoder:
    def decode(self, ids, skip_special_tokens=False):
        return ""


def _sync_in_layout(rank, world_size, tp, trained_state, stale_state):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_mimesis.compat import enable_cpu_compat

    enable_cpu_compat()
    parallel_state.initialize_model_parallel(tp, 1)
    model_parallel_cuda_manual_seed(0)
    parallel = ParallelConfig(tensor_model_parallel_size=tp)
    trainer_model, _, provider = build_megatron_from_hf(trained_state, parallel)
    engine_model, _, _ = build_megatron_from_hf(stale_state, parallel)
    cpu = torch.device("cpu")
    reference = LocalEngine(trainer_model, _Decoder(), cpu).generate(PROMPTS, GREEDY)
    engine = LocalEngine(engine_model, _Decoder(), cpu)
    before = engine.generate(PROMPTS, GREEDY)
    sync_weights(engine, [trainer_model], PRESET, provider.padded_vocab_size)
    after = engine.generate(PROMPTS, GREEDY)
    parallel_state.destroy_model_parallel()
    return [[(g.token_ids, g.logprobs) for g in gens] for gens in (reference, before, after)]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_synced_engine_reproduces_the_trainer_log_probs(tp):
    trained, stale = hf_reference(seed=11).state_dict(), hf_reference(seed=12).state_dict()
    for reference, before, after in run_distributed(_sync_in_layout, tp, tp, trained, stale):
        assert before != reference  # the engine's own weights differ before the sync
        for (tokens, logps), (ref_tokens, ref_logps) in zip(after, reference, strict=True):
            assert tokens == ref_tokens
            assert max(abs(a - b) for a, b in zip(logps, ref_logps, strict=True)) <= 1e-6
