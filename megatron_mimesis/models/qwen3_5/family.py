"""Qwen3.5: the hybrid Gated DeltaNet + gated attention stack (layer i is full attention when (i + 1) % 4 == 0).

The architectural switches (zero-centred norms, q/k norm, sigmoid attention output gate, GQA, SwiGLU, Gated DeltaNet
every layer but each 4th) are fixed here once; sizes come from the preset (``presets.py``). With Transformer Engine
the block is megatron-core's own experimental-attention-variant spec; megatron-core has no local version of it (its
builder asks TE for the attention spec), so the local one is assembled from the same megatron modules.
"""

from megatron_mimesis.models.family import (
    FLOPS_PER_MAC,
    ChatFormat,
    ModelFamily,
    attention_params,
    causal_attention_flops,
    mlp_params,
)
from megatron_mimesis.models.qwen3_5.mapping import qwen35_mapping
from megatron_mimesis.models.qwen3_5.presets import (
    DELTANET_STATE_DTYPE,
    FULL_ATTENTION_INTERVAL,
    PRESETS,
    Qwen35Preset,
)

DELTANET_CHUNK_SIZE = 64  # flash-linear-attention's chunk length for chunk_gated_delta_rule
DELTANET, ATTENTION = "deltanet", "attention"
_KIND_OF = {"linear_attention": DELTANET, "full_attention": ATTENTION}


class Qwen35Family(ModelFamily):
    name = "qwen3_5"
    title = "Qwen3.5"
    hf_model_types = ("qwen3_5", "qwen3_5_text")
    hf_architecture = "Qwen3_5ForCausalLM"
    tiny_preset = "tiny"
    presets = PRESETS
    layer_kinds = {DELTANET: "Gated DeltaNet layer", ATTENTION: "gated attention layer"}
    gpu_kernels = "Transformer Engine and fla"
    measured_eagerly = "megatron's torch.compile'd GDN and output-gate helpers"
    # Qwen3.5's template writes tool calls in Qwen3-Coder's XML and opens <think> in the generation prompt; agent
    # contexts are rendered piece by piece in the ChatML layout the training data has (``rl/chat.py``)
    chat = ChatFormat(tool_call_parser="qwen3_coder", opens_think_in_prompt=True, own_template=False,
                      reasoning_parser="qwen3")

    # ------------------------------------------------------------------ HF
    def hf_config(self, preset: Qwen35Preset, **extra):
        """transformers' ``Qwen3_5TextConfig`` (text-only, as our training sees the model), with the DeltaNet state
        dtype the released configs carry."""
        from transformers import Qwen3_5TextConfig

        p = preset
        fields = dict(
            vocab_size=p.vocab_size,
            hidden_size=p.hidden_size,
            intermediate_size=p.ffn_hidden_size,
            num_hidden_layers=p.num_layers,
            num_attention_heads=p.num_attention_heads,
            num_key_value_heads=p.num_query_groups,
            head_dim=p.head_dim,
            linear_num_key_heads=p.linear_num_key_heads,
            linear_num_value_heads=p.linear_num_value_heads,
            linear_key_head_dim=p.linear_key_head_dim,
            linear_value_head_dim=p.linear_value_head_dim,
            linear_conv_kernel_dim=p.linear_conv_kernel_dim,
            rms_norm_eps=p.rms_norm_eps,
            tie_word_embeddings=p.tie_word_embeddings,
            max_position_embeddings=p.max_position_embeddings,
            layer_types=p.layer_types(),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": p.rotary_base,
                "partial_rotary_factor": p.rotary_percent,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
            mamba_ssm_dtype=DELTANET_STATE_DTYPE,
            mtp_num_hidden_layers=p.mtp_num_layers,  # not a field of transformers' config: vLLM's MTP drafter reads it
        )
        return Qwen3_5TextConfig(**{**fields, **extra})

    def preset_from_hf_config(self, hf_config, name: str = "hf") -> Qwen35Preset:
        """A transformers Qwen3.5 config (the composite one or its text_config)."""
        text = getattr(hf_config, "text_config", None) or hf_config
        rope = text.rope_parameters or {}
        preset = Qwen35Preset(
            name=name,
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            ffn_hidden_size=text.intermediate_size,
            num_layers=text.num_hidden_layers,
            num_attention_heads=text.num_attention_heads,
            num_query_groups=text.num_key_value_heads,
            head_dim=text.head_dim,
            linear_num_key_heads=text.linear_num_key_heads,
            linear_num_value_heads=text.linear_num_value_heads,
            linear_key_head_dim=text.linear_key_head_dim,
            linear_value_head_dim=text.linear_value_head_dim,
            linear_conv_kernel_dim=text.linear_conv_kernel_dim,
            rotary_base=float(rope.get("rope_theta", 10_000_000.0)),
            rotary_percent=float(rope.get("partial_rotary_factor", 0.25)),
            rms_norm_eps=text.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", text.tie_word_embeddings)),
            max_position_embeddings=text.max_position_embeddings,
            mtp_num_layers=int(getattr(text, "mtp_num_hidden_layers", 0) or 0),
        )
        if list(text.layer_types) != preset.layer_types():
            raise ValueError(f"layer_types: unsupported layer pattern {text.layer_types}; expected full attention "
                             f"every {FULL_ATTENTION_INTERVAL}th layer")
        return preset

    def engine_hf_config(self, preset: Qwen35Preset, recurrent_state_dtype: str | None):
        return self.hf_config(preset, architectures=[self.hf_architecture], dtype="bfloat16",
                              mamba_ssm_dtype=recurrent_state_dtype or DELTANET_STATE_DTYPE)

    # ------------------------------------------------------------------ megatron
    def layout_problems(self, preset: Qwen35Preset, tp: int, cp: int) -> list[tuple[bool, str]]:
        return [
            (preset.linear_num_key_heads % (tp * cp) == 0,
             f"TP*CP={tp * cp} must divide DeltaNet key heads={preset.linear_num_key_heads}"),
            (preset.linear_num_value_heads % (tp * cp) == 0,
             f"TP*CP={tp * cp} must divide DeltaNet value heads={preset.linear_num_value_heads}"),
        ]

    def transformer_fields(self, preset: Qwen35Preset) -> dict:
        return dict(
            layernorm_zero_centered_gamma=True,
            qk_layernorm=True,
            attention_output_gate=True,
            experimental_attention_variant="gated_delta_net",
            linear_attention_freq=FULL_ATTENTION_INTERVAL,
            linear_conv_kernel_dim=preset.linear_conv_kernel_dim,
            linear_key_head_dim=preset.linear_key_head_dim,
            linear_value_head_dim=preset.linear_value_head_dim,
            linear_num_key_heads=preset.linear_num_key_heads,
            linear_num_value_heads=preset.linear_num_value_heads,
        )

    def block_spec(self, config, backend: str, vp_stage=None, pp_rank=None):
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_gated_delta_net_module_spec,
            get_linear_attention_pattern,
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        from megatron_mimesis.models.layer_specs import (
            LocalBackend,
            local_attention_spec,
            local_block_spec,
            local_layer_spec,
        )

        if backend == "te":
            return get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage,
                                                                                  pp_rank=pp_rank)
        local = LocalBackend()
        layers = {1: local_layer_spec(get_gated_delta_net_module_spec(config, backend=local), local),
                  0: local_layer_spec(local_attention_spec(local), local)}
        pattern = get_linear_attention_pattern(config)  # 1 = Gated DeltaNet, 0 = full attention
        return local_block_spec(config, lambda i: layers[pattern[i]], vp_stage=vp_stage, pp_rank=pp_rank)

    def mapping(self, preset: Qwen35Preset, padded_vocab: int) -> list:
        return qwen35_mapping(preset, padded_vocab)

    # ------------------------------------------------------------------ planning
    def layer_kind_of(self, preset: Qwen35Preset) -> list[str]:
        return [_KIND_OF[t] for t in preset.layer_types()]

    def matmul_params(self, preset: Qwen35Preset) -> int:
        """Per layer kind (see ``training/flops.py`` for the whole count): full attention q+gate / k / v / o;
        DeltaNet in_proj_qkv / z / b / a, out_proj and the depthwise causal conv (2 x its weight elements per
        token); the SwiGLU MLP; and the LM head (counted even when tied; the lookup is free)."""
        kinds = self.layer_kind_of(preset)
        return (kinds.count(ATTENTION) * attention_params(preset, output_gate=True)
                + kinds.count(DELTANET) * _deltanet_params(preset)
                + preset.num_layers * mlp_params(preset)
                + preset.hidden_size * preset.vocab_size)

    def sequence_flops_per_token(self, preset: Qwen35Preset, seq_length: int) -> float:
        kinds = self.layer_kind_of(preset)
        return (kinds.count(ATTENTION) * causal_attention_flops(preset, seq_length)
                + kinds.count(DELTANET) * deltanet_recurrence_flops(preset))

    def mtp_forward_flops_per_token(self, preset: Qwen35Preset, seq_length: int) -> float:
        """Each MTP layer: ``fc`` over [embedding; hidden] (2h -> h), a gated full-attention decoder layer, and the
        LM head again (9B: 1.26e9 parameters that multiply every token, 16% of the model's)."""
        h = preset.hidden_size
        params = 2 * h * h + attention_params(preset, output_gate=True) + mlp_params(preset) + h * preset.vocab_size
        return preset.mtp_num_layers * (FLOPS_PER_MAC * params + causal_attention_flops(preset, seq_length))

    def engine_cache_sizes(self, preset: Qwen35Preset) -> dict:
        """The gated attention layers' KV per token; per sequence, every DeltaNet layer's recurrent state (value heads
        x key dim x value dim) and its causal conv's last ``kernel - 1`` inputs over q, k and v, in bf16."""
        p, kinds = preset, self.layer_kind_of(preset)
        recurrent = kinds.count(DELTANET) * p.linear_num_value_heads * p.linear_key_head_dim * p.linear_value_head_dim
        conv_channels = 2 * p.linear_num_key_heads * p.linear_key_head_dim + p.linear_num_value_heads * \
            p.linear_value_head_dim
        return {"kv_bf16_bytes_per_token": 2 * kinds.count(ATTENTION) * p.num_query_groups * p.head_dim * 2,
                "recurrent_fp32_bytes": 4 * recurrent, "recurrent_bf16_bytes": 2 * recurrent,
                "conv_bf16_bytes": 2 * kinds.count(DELTANET) * conv_channels * (p.linear_conv_kernel_dim - 1)}


def _deltanet_params(p: Qwen35Preset) -> int:
    key_dim = p.linear_num_key_heads * p.linear_key_head_dim
    value_dim = p.linear_num_value_heads * p.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    in_proj = p.hidden_size * (conv_dim + value_dim + 2 * p.linear_num_value_heads)
    return in_proj + value_dim * p.hidden_size + conv_dim * p.linear_conv_kernel_dim


def deltanet_recurrence_flops(p: Qwen35Preset, chunk_size: int = DELTANET_CHUNK_SIZE) -> float:
    """Forward FLOPs per token of the chunked gated delta rule (flash-linear-attention's ``chunk_gated_delta_rule``)
    in one DeltaNet layer, per value head and token; queries and keys are repeated to the Hv value heads before the
    kernel, as megatron-core does, so every term runs per value head with dk x dv state:

    * intra-chunk: K K^T (2*C*dk), W = T (beta K) (2*C*dk), Q K^T (2*C*dk), U = T (beta V) (2*C*dv), (Q K^T) V_new
      (2*C*dv), the triangular solve for T (~C^2)  -> 2*C*(3*dk + 2*dv) + C^2
    * inter-chunk: V_new = U - W S, O += Q S, S += K^T V_new, each 2*dk*dv  -> 6*dk*dv

    (state decay and gating are element-wise and dropped). For the 9B model this is ~1% of the forward."""
    dk, dv, c = p.linear_key_head_dim, p.linear_value_head_dim, chunk_size
    per_head = 2 * c * (3 * dk + 2 * dv) + c * c + 6 * dk * dv
    return p.linear_num_value_heads * per_head
