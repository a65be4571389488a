"""What of the vLLM engine real vLLM on this CPU cannot show, against a fake ``vllm`` module that records every
call: the sleep/wake/sync call order on a platform with sleep mode (vLLM's CPU backend has none, so there the
engine never sleeps; ``test_vllm_colocated.py`` runs everything else on real vLLM). Also the checks that need no
vLLM at all: the refused settings, the message when vLLM is missing, and the vocabulary rows."""

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_mimesis.models.presets import PRESETS
from megatron_mimesis.rl.engines.vllm import VLLMEngine, check_vllm_config, hf_shaped
from megatron_mimesis.rl.simulator.config import SimulatorRLConfig
from megatron_mimesis.training.config import ConfigError
from tests.rl.fakes import char_tokenizer

TINY = PRESETS["tiny"]  # vocab 512, hidden 64


class FakeLLM:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.hf_config = json.loads((Path(kwargs["model"]) / "config.json").read_text())
        self.calls = []
        FakeLLM.built.append(self)

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, [name for name, _ in kwargs["weights_iterator"]]))
        return [None]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


@pytest.fixture
def fake_gpu_vllm(monkeypatch):
    """A vLLM whose platform has sleep mode, as CUDA's does."""
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_sleep_mode_available=lambda: True, device_name="cuda")
    FakeLLM.built = []
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return module


def rl_config(**changes):
    return SimulatorRLConfig(**{"model": "tiny", "tensor_model_parallel_size": 2, "bf16": True, "engine": "vllm",
                                **changes})


def test_sleep_wake_and_sync_order_where_the_platform_sleeps(fake_gpu_vllm, capsys):
    engine = VLLMEngine(TINY, char_tokenizer(), 2, {"seed": 7})
    assert engine.llm.kwargs["enable_sleep_mode"] is True
    assert capsys.readouterr().out.startswith("vLLM engine: sleep mode on (cuda)")
    llm = engine.llm

    def sync():
        engine.load_weights(iter([("model.norm.weight", torch.zeros(64))]), TINY, 512)

    sync()  # awake (the first sync, from from_config): reload, then forget prefixes computed with old weights
    assert llm.calls == [("reload_weights", ["model.norm.weight"]), ("reset_prefix_cache",)]
    llm.calls.clear()
    engine.wake()  # nothing asleep: nothing to do
    engine.sleep()
    sync()  # after the update: only the weights wake for the sync
    engine.wake()  # then the KV cache, before the rollouts
    engine.wake()
    assert llm.calls == [("sleep", 1), ("wake_up", ["weights"]), ("reload_weights", ["model.norm.weight"]),
                         ("wake_up", ["kv_cache"])]
    llm.calls.clear()
    engine.sleep()
    engine.wake()  # a step that synced nothing wakes everything at once
    assert llm.calls == [("sleep", 1), ("wake_up", ["kv_cache", "weights"])]


@pytest.mark.parametrize("changes, reason", [
    ({"pipeline_model_parallel_size": 2}, "pipeline_model_parallel_size 1"),
    ({"context_parallel_size": 2}, "context_parallel_size 1"),
    ({"bf16": False}, "needs bf16"),
    ({"overlap_param_gather": True}, "overlap_param_gather: false"),
    ({"engine_options": {"tensor_parallel_size": 8, "load_format": "auto"}},
     r"\['load_format', 'tensor_parallel_size'\] are set by the vLLM engine"),
    ({"engine_options": {"distributed_timeout_seconds": 60}},
     r"\['distributed_timeout_seconds'\] are set by the vLLM engine .* by distributed_timeout_minutes"),
])
def test_unsupported_settings_are_refused_before_vllm_starts(fake_gpu_vllm, changes, reason):
    config = rl_config(**changes)
    with pytest.raises(ConfigError, match=reason):
        check_vllm_config(config)
    with pytest.raises(ConfigError, match=reason):
        VLLMEngine.from_config(config, None, char_tokenizer())
    assert FakeLLM.built == []


def test_vllms_process_groups_wait_as_long_as_the_trainers(fake_gpu_vllm, monkeypatch):
    from megatron_mimesis.rl.engines import weight_sync

    monkeypatch.setattr(weight_sync, "sync_weights", lambda *args: None)
    trainer = SimpleNamespace(model=None, provider=SimpleNamespace(padded_vocab_size=512))
    VLLMEngine.from_config(rl_config(distributed_timeout_minutes=60), trainer, char_tokenizer())
    (llm,) = FakeLLM.built
    assert llm.kwargs["distributed_timeout_seconds"] == llm.kwargs["cpu_distributed_timeout_seconds"] == 3600


def test_supported_settings_pass():
    check_vllm_config(rl_config(sequence_parallel=True, engine_options={"gpu_memory_utilization": 0.4}))


def test_missing_vllm_names_the_gpu_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"^engine=vllm needs vLLM, which the \[gpu\] extra installs"):
        VLLMEngine(TINY, char_tokenizer(), 1, {})


def test_vocab_rows_other_than_vocab_or_padded_vocab_are_refused():
    with pytest.raises(ValueError, match=r"lm_head.weight: 600 rows, expected vocab 512 or padded 640"):
        list(hf_shaped(iter([("lm_head.weight", torch.zeros(600, 64))]), 512, 640))
