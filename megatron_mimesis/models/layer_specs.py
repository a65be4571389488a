"""Per-layer module specs for Transformer Engine and for the local backend, shared by the families.

Each decoder layer is a megatron ``TransformerLayer``: a mixer (attention, or a family's linear-attention variant)
followed by the SwiGLU MLP, which keeps layers one-to-one with HF's decoder layers. With TE a family uses
megatron-core's own specs. megatron-core's local specs differ from TE's in parameter names (a separate
``input_layernorm``, no fused norm + linear) and its local attention rejects packed rows, so the local layers are
assembled here from the same megatron modules, through a backend provider whose norm+linear, norm and core attention
come from :mod:`local_layers`. Both backends therefore fuse the input norms into the following linear and produce
identical parameter names.
"""

import importlib.util
from typing import Literal

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
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
        """RMSNorm, whatever ``rms_norm`` says: every family normalizes with it (``models/config.py``), and megatron's
        MTP layer asks for its norms without saying which (TE's provider reads the config's choice instead)."""
        return RMSNorm

    def core_attention(self):
        return PackedDotProductAttention


def local_attention_spec(backend: LocalBackend) -> ModuleSpec:
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


def local_layer_spec(mixer: ModuleSpec, backend: LocalBackend) -> ModuleSpec:
    """One decoder layer of the local backend: ``mixer`` (attention or a linear-attention variant, its input norm fused
    into its first linear) then the SwiGLU MLP (its norm fused into fc1), as TE's specs lay them out."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp,
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp,
            mlp=get_mlp_module_spec_for_backend(backend=backend),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def local_block_spec(config, layer_spec_of, vp_stage=None, pp_rank=None) -> TransformerBlockSubmodules:
    """The local backend's block of this pipeline stage: ``layer_spec_of(global layer index)`` for each of its
    layers, then the final norm."""
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer_spec_of(i) for i in range(offset, offset + count)],
                                      layer_norm=RMSNorm)

