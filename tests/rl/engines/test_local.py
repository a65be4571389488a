"""The local rollout engine against transformers, and at TP=2 (SP) / PP=2 against one process."""

import pytest
import torch

from megatron_mimesis.models.config import ParallelConfig
from megatron_mimesis.rl.engines.local import LocalEngine
from megatron_mimesis.rl.types import SamplingParams
from tests.models.harness import build_megatron_from_hf, hf_reference, init_single_process_megatron
from tests.multiproc import run_distributed

PROMPTS = [[5, 17, 99, 3], [42], [7, 7, 8, 200, 31, 64, 2]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


class _Decoder:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def _engine(hf_state, parallel=None):
    model, _, _ = build_megatron_from_hf(hf_state, parallel or ParallelConfig())
    return LocalEngine(model, _Decoder(), torch.device("cpu"))


def test_greedy_tokens_and_logprobs_match_transformers():
    hf = hf_reference(seed=5)
    init_single_process_megatron()
    generations = _engine(hf.state_dict()).generate(PROMPTS, GREEDY)
    for prompt, gen in zip(PROMPTS, generations, strict=True):
        assert len(gen.token_ids) == 6 and gen.finish_reason == "length"
        full = torch.tensor([prompt + gen.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
        steps = range(len(prompt) - 1, full.shape[1] - 1)
        assert [int(logp[t].argmax()) for t in steps] == gen.token_ids  # greedy = argmax of the reference
        expected = [logp[t, tok].item() for t, tok in zip(steps, gen.token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(gen.logprobs, expected, strict=True)) <= 1e-4


def test_stop_tokens_end_a_sequence_and_sampling_is_seeded():
    hf = hf_reference(seed=5)
    init_single_process_megatron()
    engine = _engine(hf.state_dict())
    first = engine.generate(PROMPTS, GREEDY)
    stop = first[0].token_ids[2]
    stopped = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(stop,)))
    assert stopped[0].token_ids == first[0].token_ids[:3] and stopped[0].finish_reason == "stop"
    sampled = SamplingParams(max_new_tokens=5, temperature=1.0, top_p=0.9, seed=11)
    assert [g.token_ids for g in engine.generate(PROMPTS, sampled)] == \
        [g.token_ids for g in engine.generate(PROMPTS, sampled)]


def _generate_in_layout(rank, world_size, tp, pp, sp, hf_state):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_mimesis.compat import enable_cpu_compat

    enable_cpu_compat()
    parallel_state.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(0)
    engine = _engine(hf_state, ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                              sequence_parallel=sp))
    out = engine.generate(PROMPTS, GREEDY)
    parallel_state.destroy_model_parallel()
    return [(g.token_ids, g.logprobs) for g in out]


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "sp"), [(2, 1, True), (1, 2, False)], ids=["tp2-sp", "pp2"])
def test_parallel_layouts_generate_what_one_process_generates(tp, pp, sp):
    hf_state = hf_reference(seed=5).state_dict()
    (single,) = run_distributed(_generate_in_layout, 1, 1, 1, False, hf_state)
    for rank_out in run_distributed(_generate_in_layout, 2, tp, pp, sp, hf_state):
        for (tokens, logps), (ref_tokens, ref_logps) in zip(rank_out, single, strict=True):
            assert tokens == ref_tokens
            assert max(abs(a - b) for a, b in zip(logps, ref_logps, strict=True)) <= 1e-5
