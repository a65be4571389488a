"""Which modules each family's layer specs pick, per backend and pipeline stage."""

import importlib.util

import pytest
import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.transformer.attention import SelfAttention

from megatron_mimesis.compat import cuda_is_usable
from megatron_mimesis.models.config import ParallelConfig, transformer_config, validate_layout
from megatron_mimesis.models.local_layers import NormColumnParallelLinear, PackedDotProductAttention, RMSNorm
from megatron_mimesis.models.presets import get_preset
from tests.models.harness import init_single_process_megatron

HAVE_TE_GPU = cuda_is_usable() and importlib.util.find_spec("transformer_engine") is not None


def _block_spec(preset, backend, **config):
    return preset.family.block_spec(transformer_config(preset, **config), backend)


def test_local_spec_hybrid_pattern_and_fused_norms():
    init_single_process_megatron()
    spec = _block_spec(get_preset("tiny"), "local")
    mixers = [s.submodules.self_attention for s in spec.layer_specs]
    assert [m.module for m in mixers] == [GatedDeltaNet, GatedDeltaNet, GatedDeltaNet, SelfAttention]
    assert mixers[0].submodules.in_proj is NormColumnParallelLinear
    assert mixers[0].submodules.out_norm is RMSNorm
    assert mixers[3].submodules.linear_qkv is NormColumnParallelLinear
    assert mixers[3].submodules.core_attention is PackedDotProductAttention
    assert spec.layer_norm is RMSNorm


@pytest.mark.skipif(not HAVE_TE_GPU, reason="Transformer Engine and a GPU are needed for the TE spec")
def test_te_spec_uses_transformer_engine_modules():
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear

    init_single_process_megatron()
    spec = _block_spec(get_preset("tiny"), "te", params_dtype=torch.bfloat16)
    mixers = [s.submodules.self_attention for s in spec.layer_specs]
    assert [m.module for m in mixers] == [GatedDeltaNet, GatedDeltaNet, GatedDeltaNet, SelfAttention]
    assert mixers[0].submodules.in_proj is TELayerNormColumnParallelLinear
    qwen3 = _block_spec(get_preset("qwen3-tiny"), "te", params_dtype=torch.bfloat16)
    assert all(s.submodules.self_attention.submodules.linear_qkv is TELayerNormColumnParallelLinear
               for s in qwen3.layer_specs)


def test_qwen3_local_spec_is_uniform_attention_with_qk_norms():
    init_single_process_megatron()
    spec = _block_spec(get_preset("qwen3-tiny"), "local")
    mixers = [s.submodules.self_attention for s in spec.layer_specs]
    assert [m.module for m in mixers] == [SelfAttention] * 4
    assert mixers[0].submodules.linear_qkv is NormColumnParallelLinear
    assert mixers[0].submodules.q_layernorm is RMSNorm and mixers[0].submodules.k_layernorm is RMSNorm
    config = transformer_config(get_preset("qwen3-tiny"))
    assert not config.layernorm_zero_centered_gamma and not config.attention_output_gate and config.qk_layernorm


def test_zero_centred_rms_norm_matches_formula():
    init_single_process_megatron()
    config = transformer_config(get_preset("tiny"))
    norm = RMSNorm(config, 8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    x = torch.randn(3, 8)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + torch.linspace(-0.5, 0.5, 8))
    assert torch.allclose(norm(x), expected, atol=1e-6)


@pytest.mark.parametrize(("parallel", "reason"), [
    (ParallelConfig(tensor_model_parallel_size=3), "num_attention_heads"),
    (ParallelConfig(pipeline_model_parallel_size=3), "num_layers"),
    (ParallelConfig(sequence_parallel=True), "sequence_parallel needs TP > 1"),
])
def test_invalid_layouts_are_rejected_with_a_reason(parallel, reason):
    with pytest.raises(ValueError, match=reason):
        validate_layout(get_preset("tiny"), parallel)


def test_paper_layouts_are_valid_for_9b():
    validate_layout(get_preset("9b"), ParallelConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=2,
                                                     sequence_parallel=True))
