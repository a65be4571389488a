"""The vLLM rollout engine against a fake ``vllm`` module that records every call: what the engine asks of vLLM
(construction, sampling parameters, sleep/wake, weight loading) and what it makes of vLLM's answers. Real vLLM
needs a GPU; what only a GPU can show (generation, log-prob parity after a sync) is the GPU check's job."""

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_mimesis.models.presets import PRESETS
from megatron_mimesis.rl.config import SimulatorRLConfig
from megatron_mimesis.rl.types import SamplingParams
from megatron_mimesis.rl.vllm_engine import VLLMEngine, check_vllm_config
from megatron_mimesis.training.config import ConfigError
from tests.rl.fakes import IM_END, char_tokenizer, ids

TINY = PRESETS["tiny"]  # vocab 512, hidden 64


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class FakeModel:
    """Stands in for the vLLM model inside the worker: records each tensor it loads and how far the source
    stream had been read at that moment."""

    def __init__(self, parameter_names, produced):
        self.parameter_names = parameter_names
        self.produced = produced  # a one-element list the test's stream bumps per tensor
        self.loaded = []

    def named_parameters(self):
        return [(name, None) for name in self.parameter_names]

    def load_weights(self, weights):
        names = set()
        for name, tensor in weights:
            self.loaded.append((name, tuple(tensor.shape), self.produced[0]))
            names.add(name)
        return names


class FakeLLM:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.hf_config = json.loads((Path(kwargs["model"]) / "config.json").read_text())
        self.calls = []
        self.responder = None  # (prompt ids, params) -> a RequestOutput-like namespace
        self.model = FakeModel([], [0])
        FakeLLM.built.append(self)

    def generate(self, prompts, params, use_tqdm):
        self.calls.append(("generate", use_tqdm))
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.requests = list(zip(prompts, params, strict=True))
        return [self.responder(p["prompt_token_ids"], sp) for p, sp in self.requests]

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def apply_model(self, fn):
        self.calls.append(("apply_model",))
        return [fn(self.model)]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = FakeSamplingParams
    module.TokensPrompt = dict
    FakeLLM.built = []
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


@pytest.fixture
def engine(fake_vllm):
    return VLLMEngine(TINY, char_tokenizer(), 2, {"seed": 7, "gpu_memory_utilization": 0.4})


def logprob(value):
    return SimpleNamespace(logprob=value)


def rl_config(**changes):
    return SimulatorRLConfig(**{"model": "tiny", "tensor_model_parallel_size": 2, "bf16": True, "engine": "vllm",
                                **changes})


# ---------------------------------------------------------------------------------------------- construction
def test_the_llm_is_colocated_sleepable_and_starts_from_dummy_weights(engine):
    kwargs = dict(engine.llm.kwargs)
    model_dir = Path(kwargs.pop("model"))
    assert kwargs == {
        "skip_tokenizer_init": True, "tensor_parallel_size": 2, "distributed_executor_backend": "external_launcher",
        "enable_sleep_mode": True, "load_format": "dummy", "dtype": "bfloat16", "logprobs_mode": "raw_logprobs",
        "seed": 7, "gpu_memory_utilization": 0.4,
    }
    assert model_dir.is_dir()  # kept for the engine's lifetime
    config = engine.llm.hf_config
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["model_type"] == "qwen3_5_text"
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (512, 64, 4)
    assert config["dtype"] == "bfloat16"


def test_from_config_syncs_the_trainer_weights_before_any_rollout(fake_vllm, monkeypatch):
    synced = []
    monkeypatch.setattr("megatron_mimesis.rl.weight_sync.sync_weights", lambda *args: synced.append(args))
    trainer = SimpleNamespace(model=["chunk0"], provider=SimpleNamespace(padded_vocab_size=640))
    config = rl_config(engine_options={"max_model_len": 4096})
    engine = VLLMEngine.from_config(config, trainer, char_tokenizer())
    assert engine.llm.kwargs["tensor_parallel_size"] == 2
    assert (engine.llm.kwargs["seed"], engine.llm.kwargs["max_model_len"]) == (config.seed, 4096)
    assert synced == [(engine, ["chunk0"], config.preset, 640)]
    engine = VLLMEngine.from_config(rl_config(engine_options={"seed": 5}), trainer, char_tokenizer())
    assert engine.llm.kwargs["seed"] == 5


@pytest.mark.parametrize("changes, reason", [
    ({"pipeline_model_parallel_size": 2}, "pipeline_model_parallel_size 1"),
    ({"context_parallel_size": 2}, "context_parallel_size 1"),
    ({"bf16": False}, "needs bf16"),
    ({"overlap_param_gather": True}, "overlap_param_gather: false"),
    ({"engine_options": {"tensor_parallel_size": 8, "load_format": "auto"}},
     r"\['load_format', 'tensor_parallel_size'\] are set by the vLLM engine"),
])
def test_unsupported_settings_are_refused_before_vllm_starts(fake_vllm, changes, reason):
    config = rl_config(**changes)
    with pytest.raises(ConfigError, match=reason):
        check_vllm_config(config)
    with pytest.raises(ConfigError, match=reason):
        VLLMEngine.from_config(config, None, char_tokenizer())
    assert FakeLLM.built == []


def test_supported_settings_pass():
    check_vllm_config(rl_config(sequence_parallel=True, engine_options={"gpu_memory_utilization": 0.4}))


def test_missing_vllm_names_the_gpu_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"^engine=vllm needs vLLM, which the \[gpu\] extra installs"):
        VLLMEngine(TINY, char_tokenizer(), 1, {})


# ---------------------------------------------------------------------------------------------- sampling
def completion(token_ids, finish_reason, sampled_logprobs):
    # each step also offers a likelier alternative token first, which must not be taken for the sampled one
    steps = [{t + 1: logprob(-0.01), t: logprob(lp)} for t, lp in zip(token_ids, sampled_logprobs, strict=True)]
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tuple(token_ids), logprobs=steps,
                                                    finish_reason=finish_reason)])


def test_sampling_params_translate_with_one_seed_per_request(engine):
    engine.llm.responder = lambda prompt, params: completion([5], "length", [-0.5])
    sampling = SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.9, stop_token_ids=(IM_END, 0), seed=11)
    prompts = [[1, 2, 3], [1, 2, 3], [4]]
    engine.generate(prompts, sampling)
    assert engine.llm.calls == [("generate", False)]
    assert [p for p, _ in engine.llm.requests] == [{"prompt_token_ids": p} for p in prompts]
    kwargs = [params.kwargs for _, params in engine.llm.requests]
    seeds = [k.pop("seed") for k in kwargs]
    assert kwargs == [{"n": 1, "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "stop_token_ids": [IM_END, 0],
                       "ignore_eos": True, "logprobs": 0, "detokenize": False}] * 3
    assert len(set(seeds)) == 3 and all(0 <= s < 2**63 for s in seeds)  # identical prompts sample independently

    def seeds_of(sampling, on=engine):
        on.generate(prompts, sampling)
        return [params.kwargs["seed"] for _, params in on.llm.requests]

    assert seeds_of(sampling) == seeds  # the call reproduces
    assert not set(seeds_of(SamplingParams(seed=12))) & set(seeds)
    unseeded = [seeds_of(SamplingParams()), seeds_of(SamplingParams())]
    assert len(set(unseeded[0] + unseeded[1])) == 6  # unseeded calls differ from each other...
    again = VLLMEngine(TINY, char_tokenizer(), 2, {"seed": 7})
    again.llm.responder = engine.llm.responder
    # ...but every rank of an instance derives the same ones, so the ranks sample alike
    assert [seeds_of(SamplingParams(), again), seeds_of(SamplingParams(), again)] == unseeded


def test_outputs_become_generations(engine):
    answers = {
        (1,): completion(ids("hi") + [IM_END], "stop", [-0.25, -0.5, -0.125]),
        (2,): completion(ids("abc"), "length", [-1.0, -2.0, -3.0]),
    }
    engine.llm.responder = lambda prompt, params: answers[tuple(prompt)]
    stopped, capped = engine.generate([[1], [2]], SamplingParams(stop_token_ids=(IM_END,), seed=0))
    assert stopped.token_ids == ids("hi") + [IM_END] and stopped.finish_reason == "stop"
    assert stopped.text == "hi<|im_end|>"  # special tokens kept, as the local engine decodes
    assert stopped.logprobs == [-0.25, -0.5, -0.125]
    assert (capped.token_ids, capped.text, capped.finish_reason) == (ids("abc"), "abc", "length")
    assert capped.logprobs == [-1.0, -2.0, -3.0]
    engine.llm.responder = lambda prompt, params: completion([5], "abort", [-1.0])
    with pytest.raises(RuntimeError, match="finish_reason 'abort'"):
        engine.generate([[1]], SamplingParams(seed=0))


def test_score_reads_the_response_tokens_prompt_logprobs(engine):
    def responder(prompt, params):
        # prompt log-probs: none for the first token, then -position/10 for the token at each position
        return SimpleNamespace(prompt_logprobs=[None] + [{t: logprob(-i / 10), t + 1: logprob(-99.0)}
                                                         for i, t in enumerate(prompt[1:], start=1)])

    engine.llm.responder = responder
    assert engine.score([[1, 2], [3]], [[7, 8, 9], [4]]) == [[-0.2, -0.3, -0.4], [-0.1]]
    assert [p["prompt_token_ids"] for p, _ in engine.llm.requests] == [[1, 2, 7, 8, 9], [3, 4]]
    assert engine.llm.requests[0][1].kwargs == {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0,
                                                "detokenize": False}


# ---------------------------------------------------------------------------------------------- memory and sync
def stream(tensors, produced):
    for name, tensor in tensors:
        produced[0] += 1
        yield name, tensor


def test_sleep_wake_and_sync_order(engine):
    llm = engine.llm
    llm.model = FakeModel(["model.norm.weight"], [0])

    def sync():
        engine.load_weights(iter([("model.norm.weight", torch.zeros(64))]), TINY, 512)

    sync()  # awake (the first sync, from from_config): load, then forget prefixes computed with old weights
    assert llm.calls == [("apply_model",), ("reset_prefix_cache",)]
    llm.calls.clear()
    engine.wake()  # nothing asleep: nothing to do
    engine.sleep()
    sync()  # after the update: only the weights wake for the sync
    engine.wake()  # then the KV cache, before the rollouts
    engine.wake()
    assert llm.calls == [("sleep", 1), ("wake_up", ["weights"]), ("apply_model",), ("wake_up", ["kv_cache"])]
    llm.calls.clear()
    engine.sleep()
    engine.wake()  # a step that synced nothing wakes everything at once
    assert llm.calls == [("sleep", 1), ("wake_up", ["kv_cache", "weights"])]


def test_load_weights_strips_vocab_padding_and_streams_one_tensor_at_a_time(engine):
    produced = [0]
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    engine.llm.model = FakeModel(names, produced)
    tensors = [("model.embed_tokens.weight", torch.zeros(640, 64)),  # megatron-padded rows
               ("model.norm.weight", torch.zeros(64)),
               ("lm_head.weight", torch.zeros(512, 64))]  # already HF-shaped
    engine.load_weights(stream(tensors, produced), TINY, 640)
    assert engine.llm.model.loaded == [("model.embed_tokens.weight", (512, 64), 1), ("model.norm.weight", (64,), 2),
                                       ("lm_head.weight", (512, 64), 3)]


def test_load_weights_refuses_wrong_vocab_rows_and_uncovered_parameters(engine):
    engine.llm.model = FakeModel(["lm_head.weight"], [0])
    with pytest.raises(ValueError, match=r"lm_head.weight: 600 rows, expected vocab 512 or padded 640"):
        engine.load_weights(iter([("lm_head.weight", torch.zeros(600, 64))]), TINY, 640)
    engine.llm.model = FakeModel(["lm_head.weight", "model.norm.weight"], [0])
    with pytest.raises(RuntimeError, match=r"left 1 vLLM parameters unloaded, e.g. \['model.norm.weight'\]"):
        engine.load_weights(iter([("lm_head.weight", torch.zeros(512, 64))]), TINY, 640)
