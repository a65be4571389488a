import pytest

from megatron_mimesis.models.family import attention_params, causal_attention_flops, parameter_count
from megatron_mimesis.models.presets import PRESETS
from megatron_mimesis.models.qwen3_5.family import _deltanet_params, deltanet_recurrence_flops
from megatron_mimesis.training import flops

TINY = PRESETS["tiny"]  # h 64, ffn 128, 4 q / 2 kv heads of 64, DeltaNet 2 k / 4 v heads of 64, vocab 512
QWEN3_TINY = PRESETS["qwen3-tiny"]  # h 64, ffn 128, 4 layers of 4 q / 2 kv heads of 64, vocab 512


def test_tiny_full_attention_layer_by_hand():
    # q+gate 64*(2*4*64) + k,v 64*(2*2*64) + o (4*64)*64
    assert attention_params(TINY, output_gate=True) == 32768 + 16384 + 16384
    # causal QK^T + AV at S=256: 2 * 256 * 4 heads * 64
    assert causal_attention_flops(TINY, 256) == 131072


def test_tiny_deltanet_layer_by_hand():
    # conv_dim = 2*128 + 256 = 512; in_proj 64*(512 + 256 + 2*4), out_proj 256*64, conv 512*4
    assert _deltanet_params(TINY) == 49664 + 16384 + 2048
    # per value head: 2*64*(3*64 + 2*64) + 64^2 + 6*64*64 = 69632; 4 value heads
    assert deltanet_recurrence_flops(TINY) == 4 * 69632


def test_qwen3_tiny_by_hand():
    # per layer: q 64*256 + k,v 64*(2*2*64) + o 256*64 = 49152, MLP 3*64*128 = 24576; 4 layers; head 64*512
    matmul = 4 * (49152 + 24576) + 64 * 512
    assert QWEN3_TINY.family.matmul_params(QWEN3_TINY) == matmul
    # causal attention at S=256 on every layer: 4 x 2 * 256 * 4 heads * 64
    assert flops.model_flops_per_token(QWEN3_TINY, 256) == 2 * matmul + 4 * 131072
    assert parameter_count(QWEN3_TINY) == matmul + 64 * 512  # untied: the input embedding too


def test_qwen3_8b_parameters_as_released():
    # Qwen3-8B: 8.19B parameters, 6.95B without the (untied) input and output embeddings; norms are left out
    preset = PRESETS["qwen3-8b"]
    total = parameter_count(preset)
    assert 8.18e9 < total < 8.20e9
    assert 6.94e9 < total - 2 * preset.vocab_size * preset.hidden_size < 6.96e9


def test_tiny_total_is_sum_of_layers():
    per_layer_mlp = 3 * 64 * 128
    matmul = 1 * 65536 + 3 * 68096 + 4 * per_layer_mlp + 64 * 512
    expected = 2 * matmul + 1 * 131072 + 3 * 4 * 69632
    assert flops.model_flops_per_token(TINY, 256) == expected
    assert flops.train_flops_per_token(TINY, 256) == 3 * expected


def test_9b_close_to_issue_estimate():
    # The issue quotes ~5.8e10 (6*N incl. the embedding table); ours leaves the lookup out: 5.29e10.
    value = flops.train_flops_per_token(PRESETS["9b"], 24576)
    assert 5.2e10 < value < 5.4e10
    assert abs(value - 5.8e10) / 5.8e10 < 0.10


def test_a_trained_9b_mtp_head_by_hand():
    # fc 4096 x 8192; gated attention: q+gate 4096*(2*16*256), k,v 4096*(2*4*256), o 4096*4096; MLP 3*4096*12288;
    # the LM head again 4096 x 248320; causal attention at S=24576: 2 * 24576 * 16 heads * 256
    params = 4096 * 8192 + 4096 * 8192 + 4096 * 2048 + 4096 * 4096 + 3 * 4096 * 12288 + 4096 * 248320
    preset = PRESETS["9b"]
    extra = flops.train_flops_per_token(preset, 24576, trained_mtp=True) - flops.train_flops_per_token(preset, 24576)
    assert extra == 3 * (2 * params + 2 * 24576 * 16 * 256)
    assert flops.train_flops_per_token(TINY, 256, trained_mtp=True) == flops.train_flops_per_token(TINY, 256)  # no head


def test_mfu_arithmetic():
    per_token = flops.train_flops_per_token(PRESETS["9b"], 24576)
    assert flops.mfu(1000.0, PRESETS["9b"], 24576, 312e12) == pytest.approx(1000.0 * per_token / 312e12)
    # the paper's 717 tokens/s/GPU on A100 is ~12% MFU
    assert flops.mfu(717.0, PRESETS["9b"], 24576, flops.device_peak_flops("NVIDIA A100-SXM4-80GB")) == pytest.approx(
        0.12, abs=0.005
    )


def test_device_peak_flops_lookup():
    assert flops.device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert flops.device_peak_flops("cpu") == 1e12
    assert flops.device_peak_flops("NVIDIA H800") is None


def test_an_unknown_gpu_gives_mfu_na_in_one_line_not_an_exception():
    said = []
    assert flops.peak_for_mfu("NVIDIA B200", said.append) is None
    assert said == ["MFU n/a: no peak bf16 FLOP/s known for 'NVIDIA B200' (known: A100, H100, H200, cpu)"]
    assert flops.peak_for_mfu("NVIDIA A100-SXM4-80GB", said.append) == 312e12
    assert flops.peak_for_mfu(None, said.append) is None  # the CPU: no MFU, nothing to say
    assert len(said) == 1


def test_packed_documents_attend_within_themselves():
    """Two documents of 3 and 5 tokens in a row of 8: attention costs each token its own document's length on
    average, sum L^2 / sum L = 34 / 8 tokens, not the row's 8."""
    import torch

    from megatron_mimesis.training.loss import document_stats

    squares, total = document_stats(torch.tensor([0, 3, 8], dtype=torch.int32)).tolist()
    assert (squares, total) == (34.0, 8.0)
    row = flops.model_flops_per_token(TINY, 8)
    packed = flops.model_flops_per_token(TINY, squares / total)
    # the tiny preset's one attention layer, 2 * S * 4 heads * 64 per token: 512 per attended token
    assert row - packed == pytest.approx(512 * (8 - 34 / 8))
