"""Preset + parallel layout -> megatron-core ``TransformerConfig`` for Qwen3.5.

The architectural switches (zero-centred norms, q/k norm, sigmoid attention output gate, GQA, SwiGLU,
Gated DeltaNet every layer but each 4th) are fixed here once; sizes come from the preset.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from megatron_mimesis.models.presets import FULL_ATTENTION_INTERVAL, Qwen35Preset


@dataclass
class ParallelConfig:
    """The Megatron parallel layout (flag names as in Megatron-LM)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False


def validate_layout(preset: Qwen35Preset, parallel: ParallelConfig) -> None:
    """Reject a layout the model cannot be split into, with a one-line reason, before any process group starts."""
    tp, pp, cp = (
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.context_parallel_size,
    )
    checks = [
        (preset.num_attention_heads % tp == 0, f"TP={tp} must divide num_attention_heads={preset.num_attention_heads}"),
        (
            preset.num_query_groups % tp == 0 or tp % preset.num_query_groups == 0,
            f"TP={tp} must divide (or be a multiple of) num_query_groups={preset.num_query_groups}",
        ),
        (
            preset.linear_num_key_heads % (tp * cp) == 0,
            f"TP*CP={tp * cp} must divide DeltaNet key heads={preset.linear_num_key_heads}",
        ),
        (
            preset.linear_num_value_heads % (tp * cp) == 0,
            f"TP*CP={tp * cp} must divide DeltaNet value heads={preset.linear_num_value_heads}",
        ),
        (preset.ffn_hidden_size % tp == 0, f"TP={tp} must divide ffn_hidden_size={preset.ffn_hidden_size}"),
        (preset.num_layers % pp == 0, f"PP={pp} must divide num_layers={preset.num_layers}"),
        (not parallel.sequence_parallel or tp > 1, "sequence_parallel needs TP > 1"),
    ]
    if parallel.virtual_pipeline_model_parallel_size:
        vpp = parallel.virtual_pipeline_model_parallel_size
        checks.append((preset.num_layers % (pp * vpp) == 0, f"PP*VPP={pp * vpp} must divide num_layers"))
    for ok, reason in checks:
        if not ok:
            raise ValueError(f"invalid parallel layout for preset {preset.name!r}: {reason}")


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 64) -> int:
    """Megatron pads the vocabulary so that every TP shard has the same, aligned size."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def mark_real_vocab(output_layer, vocab_size: int) -> None:
    """Record the model's real vocabulary on its (padded, vocab-sharded) output layer, which only knows its rows:
    every log-softmax over that layer's logits reads it back with :func:`real_vocab` to leave the padding out."""
    output_layer.real_vocab_size = vocab_size


def real_vocab(output_layer) -> int:
    """The real vocabulary recorded by :func:`mark_real_vocab` (the model provider does it for every model)."""
    return output_layer.real_vocab_size


def transformer_config(
    preset: Qwen35Preset,
    parallel: ParallelConfig | None = None,
    *,
    params_dtype: torch.dtype = torch.float32,
    **overrides,
) -> TransformerConfig:
    """Build the megatron-core config; ``overrides`` set any other TransformerConfig field (recompute, ...)."""
    parallel = parallel or ParallelConfig()
    validate_layout(preset, parallel)
    on_gpu = torch.cuda.is_available()
    fields = dict(
        num_layers=preset.num_layers,
        hidden_size=preset.hidden_size,
        ffn_hidden_size=preset.ffn_hidden_size,
        num_attention_heads=preset.num_attention_heads,
        num_query_groups=preset.num_query_groups,
        kv_channels=preset.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=preset.rms_norm_eps,
        layernorm_zero_centered_gamma=True,
        qk_layernorm=True,
        attention_output_gate=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=FULL_ATTENTION_INTERVAL,
        linear_conv_kernel_dim=preset.linear_conv_kernel_dim,
        linear_key_head_dim=preset.linear_key_head_dim,
        linear_value_head_dim=preset.linear_value_head_dim,
        linear_num_key_heads=preset.linear_num_key_heads,
        linear_num_value_heads=preset.linear_num_value_heads,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        # Fusions that need CUDA extensions are off; Transformer Engine brings its own fused paths.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not on_gpu,
        batch_p2p_sync=on_gpu,
        # gloo matches batched isend/irecv between the same two ranks out of order: with PP=2 and virtual
        # pipelining, activations and gradients share that channel and were swapped (measured). Ordered,
        # unbatched p2p is exact.
        batch_p2p_comm=on_gpu,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)
