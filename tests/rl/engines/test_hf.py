import pytest
import torch
from transformers import AutoTokenizer

from megatron_mimesis.rl.engines.hf import HFEngine
from megatron_mimesis.rl.types import SamplingParams

PROMPTS = [[1, 20, 30, 40, 50], [1, 7, 300, 9]]


@pytest.fixture(scope="module")
def engine(tiny_hf_checkpoint, tiny_dataset):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dataset / "tokenizer")
    return HFEngine.from_pretrained(tiny_hf_checkpoint, tokenizer=tokenizer, device="cpu")


def reference_logprobs(model, prompt, tokens):
    """Untempered log-softmax of a full forward over prompt + tokens, at each sampled position."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)


def test_greedy_matches_a_direct_forward(engine):
    generations = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0))
    for prompt, generation in zip(PROMPTS, generations, strict=True):
        assert generation.finish_reason == "length" and len(generation.token_ids) == 6
        reference = reference_logprobs(engine.model, prompt, generation.token_ids)
        assert generation.token_ids == reference.argmax(dim=-1).tolist()
        picked = reference.gather(1, torch.tensor(generation.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(generation.logprobs), picked, atol=1e-4)
        assert generation.text == engine.tokenizer.decode(generation.token_ids, skip_special_tokens=False)


def test_stops_at_a_stop_token_and_keeps_it(engine):
    greedy = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=6, temperature=0.0))[0].token_ids
    stop = greedy[2]
    stopped = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(stop,)))
    assert stopped[0].token_ids == greedy[:greedy.index(stop) + 1]
    assert stopped[0].finish_reason == "stop"


def test_seeded_sampling_reproduces_and_draws_independently(engine):
    sampling = SamplingParams(max_new_tokens=8, temperature=1.5, seed=3)
    first = engine.generate([PROMPTS[0]] * 2, sampling)
    again = engine.generate([PROMPTS[0]] * 2, sampling)
    other = engine.generate([PROMPTS[0]] * 2, SamplingParams(max_new_tokens=8, temperature=1.5, seed=4))
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert first[0].token_ids != first[1].token_ids
    assert other[0].token_ids != first[0].token_ids
    # log-probs are the untempered distribution's, whatever the temperature
    reference = reference_logprobs(engine.model, PROMPTS[0], first[0].token_ids)
    picked = reference.gather(1, torch.tensor(first[0].token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(first[0].logprobs), picked, atol=1e-4)


def test_a_tiny_top_p_is_greedy(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=0.0))
    nucleus = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=1.0, top_p=1e-6, seed=1))
    assert [g.token_ids for g in nucleus] == [g.token_ids for g in greedy]
