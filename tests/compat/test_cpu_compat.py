"""The CPU adaptation: CUDA device arguments land on the CPU and megatron's RNG tracker really seeds and forks."""

import pytest
import torch

from megatron_mimesis.compat import compute_device, enable_cpu_compat
from megatron_mimesis.models.layer_specs import select_backend
from tests.models.harness import init_single_process_megatron


def test_enable_is_idempotent_and_maps_cuda_to_cpu():
    assert enable_cpu_compat() is True
    assert enable_cpu_compat() is True
    assert compute_device() == torch.device("cpu")
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(1).cuda().device.type == "cpu"
    assert torch.ones(1).to("cuda:0").device.type == "cpu"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"


def test_cuda_manual_seed_really_seeds():
    enable_cpu_compat()
    torch.cuda.manual_seed(5)
    a = torch.rand(4)
    expected = torch.rand(4, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, expected)


def test_tracker_fork_uses_the_tensor_parallel_seed_and_restores_the_default_stream():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    init_single_process_megatron()
    model_parallel_cuda_manual_seed(123)
    default_stream = torch.Generator().manual_seed(123)  # data-parallel seed
    tp_stream = torch.Generator().manual_seed(123 + 2718)  # megatron: seed + 2718 + tp_rank
    before = torch.rand(3)
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(3)
    after = torch.rand(3)
    assert torch.equal(inside, torch.rand(3, generator=tp_stream))
    assert torch.equal(torch.cat([before, after]), torch.rand(6, generator=default_stream))


def test_backend_selection(monkeypatch):
    assert select_backend() == "local"  # this machine: no GPU
    import megatron_mimesis.models.layer_specs as specs

    monkeypatch.setattr(specs.importlib.util, "find_spec", lambda name: object())
    assert specs.select_backend() == "local"  # TE importable but no GPU
    monkeypatch.setattr(specs, "cuda_is_usable", lambda: True)
    assert specs.select_backend() == "te"


def test_asking_for_transformer_engine_without_it_names_the_extra():
    """megatron-core itself would stop later, at a NameError on TESpecProvider (seen on an H200 without TE)."""
    from megatron_mimesis.models.config import ParallelConfig, transformer_config
    from megatron_mimesis.models.presets import get_preset
    from megatron_mimesis.models.provider import ModelProvider

    init_single_process_megatron()
    preset = get_preset("tiny")
    with pytest.raises(ImportError, match=r"backend='te' needs Transformer Engine.*pip install -e '\.\[gpu\]'"):
        ModelProvider(preset, transformer_config(preset, ParallelConfig()), backend="te")()
