import math

import pytest

from megatron_mimesis.rl.engines.openai import EndpointError, OpenAICompletionsEngine
from megatron_mimesis.rl.types import SamplingParams
from tests.rl.fakes import IM_END, FakeOpenAIServer, char_tokenizer, ids, logprob_of

STOPS = SamplingParams(max_new_tokens=32, temperature=0.0, stop_token_ids=(IM_END,), seed=5)


def answer(prompt) -> str:
    return f"got {len(prompt)}<|im_end|>"


def encode_with_specials(text: str) -> list[int]:
    return char_tokenizer().encode(text, add_special_tokens=False)


def engine_for(server, **options) -> OpenAICompletionsEngine:
    return OpenAICompletionsEngine(server.base_url, "agent", char_tokenizer(), max_retries=1, **options)


def test_token_id_prompts_come_back_as_exact_ids():
    with FakeOpenAIServer(complete=answer, encode=encode_with_specials) as server:
        generations = engine_for(server).generate([ids("hi"), ids("hey")], STOPS)
    assert [g.token_ids for g in generations] == [ids("got 2") + [IM_END], ids("got 3") + [IM_END]]
    assert generations[0].text == "got 2<|im_end|>"
    assert generations[0].logprobs == [logprob_of(k) for k in range(6)]
    assert {g.finish_reason for g in generations} == {"stop"}
    bodies = sorted(server.requests, key=lambda b: len(b["prompt"]))
    assert [b["prompt"] for b in bodies] == [ids("hi"), ids("hey")]
    for body in bodies:
        assert body["stop_token_ids"] == [IM_END] and body["ignore_eos"] and body["logprobs"] == 0
        assert body["return_token_ids"] and body["max_tokens"] == 32 and body["temperature"] == 0.0


def test_seeds_reproduce_per_call_and_differ_per_request():
    with FakeOpenAIServer(complete=answer, encode=encode_with_specials) as server:
        engine = engine_for(server, concurrency=1)
        engine.generate([ids("a")] * 2, STOPS)
        engine.generate([ids("a")] * 2, STOPS)
        engine.generate([ids("a")] * 2, SamplingParams(seed=6))
    seeds = [b["seed"] for b in server.requests]
    assert seeds[0] != seeds[1] and seeds[:2] == seeds[2:4] and not set(seeds[4:]) & set(seeds[:2])


def test_ids_from_logprob_tokens_or_from_the_text():
    with FakeOpenAIServer(complete=answer, encode=encode_with_specials) as server:
        server.id_fields = {"return_tokens_as_token_ids"}
        from_logprobs = engine_for(server).generate([ids("hi")], STOPS)[0]
        server.id_fields = set()
        from_text = engine_for(server).generate([ids("hi")], STOPS)[0]
    assert from_logprobs.token_ids == from_text.token_ids == ids("got 2") + [IM_END]
    assert from_text.logprobs == [logprob_of(k) for k in range(6)]


def test_text_only_server_adds_the_stop_reason_id():
    def vllm_like(text):
        return encode_with_specials(text) + [IM_END]  # the stop token is sampled but left out of the text

    with FakeOpenAIServer(complete=lambda prompt: "plain", encode=vllm_like) as server:
        server.id_fields = set()
        generation = engine_for(server).generate([ids("hi")], STOPS)[0]
    assert generation.token_ids == ids("plain") + [IM_END] and generation.finish_reason == "stop"


def test_server_without_logprobs_gives_nan_logprobs():
    with FakeOpenAIServer(complete=lambda prompt: "plain") as server:
        generation = engine_for(server).generate([ids("hi")], STOPS)[0]
    assert generation.token_ids == ids("plain") and all(math.isnan(v) for v in generation.logprobs)


def test_retries_then_a_clear_error_naming_the_endpoint():
    with FakeOpenAIServer(complete=answer, encode=encode_with_specials) as server:
        server.failures = [503]
        assert engine_for(server).generate([ids("hi")], STOPS)[0].finish_reason == "stop"
        server.broken = True
        with pytest.raises(EndpointError, match=f"{server.base_url}.*'agent'.*failed"):
            engine_for(server).generate([ids("hi")], STOPS)
        returned = engine_for(server, errors="return").generate([ids("hi"), ids("yo")], STOPS)
    assert all(g.finish_reason.startswith("error: completion request to http") and g.token_ids == [] for g in returned)
