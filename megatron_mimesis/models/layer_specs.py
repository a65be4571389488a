"""Per-layer module specs of the Qwen3.5 hybrid stack, for Transformer Engine and for the local backend.

Each decoder layer is a megatron ``TransformerLayer``: a mixer (Gated DeltaNet, or gated full attention
every 4th layer) followed by the SwiGLU MLP, which keeps layers one-to-one with HF's decoder layers. With
TE this is megatron-core's own experimental-attention-variant block spec. megatron-core has no local
version of it (its builder asks TE for the attention spec), so the local one is assembled here from the
same megatron modules, through a backend provider whose norm+linear, norm and core attention come from
:mod:`local_layers`. Both backends therefore fuse the input norms into the following linear and produce
identical parameter names.
"""

import importlib.util
from typing import Literal

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_gated_delta_net_module_spec,
    get_linear_attention_pattern,
)
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from megatron_mimesis.compat import cuda_is_usable
from megatron_mimesis.models.local_layers import NormColumnParallelLinear, PackedDotProductAttention, RMSNorm

Backend = Literal["te", "local"]


def select_backend() -> Backend:
    """Transformer Engine when it is importable and a GPU is present; megatron-core's local modules otherwise."""
    if cuda_is_usable() and importlib.util.find_spec("transformer_engine") is not None:
        return "te"
    return "local"


class LocalBackend(LocalSpecProvider):
    """megatron-core's local modules, with the fused norm+linear, zero-centred norm and packed attention added."""

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self):
        return NormColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        if not rms_norm:
            raise ValueError("the local Qwen3.5 backend implements RMSNorm only")
        return RMSNorm

    def core_attention(self):
        return PackedDotProductAttention


def _local_attention_spec(backend: LocalBackend) -> ModuleSpec:
    norm = backend.layer_norm(rms_norm=True, for_qk=True)
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=backend.column_parallel_layer_norm_linear(),
            core_attention=backend.core_attention(),
            linear_proj=RowParallelLinear,
            q_layernorm=norm,
            k_layernorm=norm,
        ),
    )


def _local_block_spec(config, vp_stage=None, pp_rank=None) -> TransformerBlockSubmodules:
    backend = LocalBackend()
    mixers = {
        1: get_gated_delta_net_module_spec(config, backend=backend),
        0: _local_attention_spec(backend),
    }
    mlp = get_mlp_module_spec_for_backend(backend=backend)
    pattern = get_linear_attention_pattern(config)  # 1 = Gated DeltaNet, 0 = full attention
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    layer_specs = [
        ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=IdentityOp,
                self_attention=mixers[pattern[i]],
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=IdentityOp,
                mlp=mlp,
                mlp_bda=get_bias_dropout_add,
            ),
        )
        for i in range(offset, offset + count)
    ]
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=RMSNorm)


def block_spec(config, backend: Backend, vp_stage=None, pp_rank=None) -> TransformerBlockSubmodules:
    """The decoder block spec of this pipeline stage (and virtual stage)."""
    if backend == "te":
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        return get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage,
                                                                              pp_rank=pp_rank)
    if backend == "local":
        return _local_block_spec(config, vp_stage=vp_stage, pp_rank=pp_rank)
    raise ValueError(f"unknown backend {backend!r}; expected 'te' or 'local'")
