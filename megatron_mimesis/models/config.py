"""Preset + parallel layout -> megatron-core ``TransformerConfig``.

What every family shares (RMSNorm, SwiGLU, GQA, no biases or dropout, the parallel layout, the dtype and the fusions
this process can run) is set here; the preset's family adds its architectural switches
(:meth:`~megatron_mimesis.models.family.ModelFamily.transformer_fields`).
"""

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from megatron_mimesis.compat import cuda_is_usable
from megatron_mimesis.models.family import Preset


@dataclass
class ParallelConfig:
    """The Megatron parallel layout (flag names as in Megatron-LM)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False


def validate_layout(preset: Preset, parallel: ParallelConfig) -> None:
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
        *preset.family.layout_problems(preset, tp, cp),
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


def fusion_flags(*, cuda: bool, te: bool, apex: bool) -> dict[str, bool]:
    """megatron-core's fusion switches for this model, given what the run has: a CUDA device, Transformer Engine, and
    apex's CUDA extensions. Megatron-LM turns all of them on by default on a GPU; each is on here exactly where the
    code it selects can run, so the CPU path (no CUDA) has them all off. What each selects:

    * ``bias_activation_fusion``: the MLP's SwiGLU runs as megatron's ``SwiGLUFunction``
      (``fusions/fused_bias_swiglu.py``, a ``jit_fuser``-compiled autograd.Function) that keeps only its input, the
      fc1 output (3F values per token with the fc2 input, F = ffn_hidden_size), instead of ``glu()`` in
      ``transformer/mlp.py``, whose autograd keeps 5F (the fc1 output, silu(x), x_linear + 0.0 and the product).
      Needs torch.compile on CUDA only.
    * ``bias_dropout_fusion``: the residual adds run as the ``jit_fuser``'d ``bias_dropout_add_fused_train``
      (``fusions/fused_bias_dropout.py``) instead of the unfused Python version.
    * ``apply_rope_fusion``: rotary embeddings through TE's ``fused_apply_rotary_pos_emb`` (``_thd`` for packed
      rows, ``models/common/embeddings/rope_utils.py``), which keeps only the shared frequencies, not a cos/sin per
      layer. Needs TE.
    * ``gradient_accumulation_fusion``: TE's linears accumulate weight gradients straight into DDP's fp32
      ``main_grad`` (``fuse_wgrad_accumulation``); megatron's own ColumnParallelLinear (the output layer) refuses the
      flag without apex's ``fused_weight_gradient_mlp_cuda``, so it needs apex. A model that is trained without
      megatron's DDP has no ``main_grad`` and must be built with it off.
    * ``masked_softmax_fusion``: megatron's ``FusedScaleMaskSoftmax`` CUDA kernels (apex's
      ``scaled_upper_triang_masked_softmax_cuda``) in its local ``DotProductAttention``; TE's attention ignores it.
    * ``persist_layer_norm`` stays off: it selects apex's persistent LayerNorm kernel in megatron's
      ``FusedLayerNorm``, which an RMSNorm model never runs (and megatron's torch-norm wrapper refuses the flag).
    """
    return {
        "bias_activation_fusion": cuda,
        "bias_dropout_fusion": cuda,
        "apply_rope_fusion": cuda and te,
        "gradient_accumulation_fusion": cuda and apex,
        "masked_softmax_fusion": cuda and apex,
        "persist_layer_norm": False,
    }


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def apex_fused_kernels_importable() -> bool:
    """apex's CUDA extensions that megatron's wgrad-accumulation and masked-softmax fusions import."""
    return _importable("fused_weight_gradient_mlp_cuda") and _importable("scaled_upper_triang_masked_softmax_cuda")


def installed_fusions() -> dict[str, bool]:
    """:func:`fusion_flags` for this process: what is importable here, on the device it has."""
    return fusion_flags(cuda=cuda_is_usable(), te=_importable("transformer_engine"),
                        apex=apex_fused_kernels_importable())


def transformer_config(
    preset: Preset,
    parallel: ParallelConfig | None = None,
    *,
    params_dtype: torch.dtype = torch.float32,
    **overrides,
) -> TransformerConfig:
    """Build the megatron-core config, with the fusions this process can run (:func:`installed_fusions`);
    ``overrides`` set any other TransformerConfig field (recompute, a fusion, ...)."""
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
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **preset.family.transformer_fields(preset),
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        **installed_fusions(),
        use_cpu_initialization=not on_gpu,
        batch_p2p_sync=on_gpu,
        # gloo matches batched isend/irecv between the same two ranks out of order: with PP=2 and virtual
        # pipelining, activations and gradients share that channel and were swapped (measured). Ordered,
        # unbatched p2p is exact.
        batch_p2p_comm=on_gpu,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)
