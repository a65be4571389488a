"""Qwen3 dense: grouped-query attention with per-head q/k RMSNorm, SwiGLU, plain RMSNorm gains, RoPE on the whole head.

Megatron-Bridge (v0.6) and slime build it as a ``GPTModel`` with ``qk_layernorm``, an untied output layer where
the checkpoint has one and ``kv_channels`` 128 (slime's flags: ``--qk-layernorm --untie-embeddings-and-output-weights
--kv-channels 128 --rotary-base 1000000``); so does this family, with megatron-core's own TE layer spec on a GPU and
the local layers elsewhere, which give the same parameter names.
"""

from megatron_mimesis.models.family import ChatFormat, ModelFamily, attention_params, causal_attention_flops, mlp_params
from megatron_mimesis.models.qwen3.mapping import qwen3_mapping
from megatron_mimesis.models.qwen3.presets import PRESETS, Qwen3Preset

ATTENTION = "attention"


class Qwen3Family(ModelFamily):
    name = "qwen3"
    title = "Qwen3"
    hf_model_types = ("qwen3",)
    hf_architecture = "Qwen3ForCausalLM"
    tiny_preset = "qwen3-tiny"
    presets = PRESETS
    layer_kinds = {ATTENTION: "attention layer"}
    gpu_kernels = "Transformer Engine"
    measured_eagerly = ""
    # Qwen3's template: tool calls as one JSON object per <tool_call> (vLLM's hermes parser), <tool_response> blocks
    # in a user turn, the model opens <think> itself; earlier thoughts are stripped except in the current tool chain
    chat = ChatFormat(tool_call_parser="hermes", opens_think_in_prompt=False, own_template=True,
                      reasoning_parser="qwen3")

    # ------------------------------------------------------------------ HF
    def hf_config(self, preset: Qwen3Preset, **extra):
        from transformers import Qwen3Config

        p = preset
        fields = dict(
            vocab_size=p.vocab_size,
            hidden_size=p.hidden_size,
            intermediate_size=p.ffn_hidden_size,
            num_hidden_layers=p.num_layers,
            num_attention_heads=p.num_attention_heads,
            num_key_value_heads=p.num_query_groups,
            head_dim=p.head_dim,
            hidden_act="silu",
            rms_norm_eps=p.rms_norm_eps,
            tie_word_embeddings=p.tie_word_embeddings,
            max_position_embeddings=p.max_position_embeddings,
            attention_bias=False,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": p.rotary_base},
        )
        return Qwen3Config(**{**fields, **extra})

    def preset_from_hf_config(self, hf_config, name: str = "hf") -> Qwen3Preset:
        """A transformers Qwen3 config; a layout this family does not build is refused naming its field."""
        c = hf_config
        rope = getattr(c, "rope_parameters", None) or {}
        unsupported = [
            ("hidden_act", getattr(c, "hidden_act", "silu") != "silu", "only silu (SwiGLU)"),
            ("attention_bias", bool(getattr(c, "attention_bias", False)), "biases are not supported"),
            ("use_sliding_window", bool(getattr(c, "use_sliding_window", False)), "sliding-window attention is not "
                                                                                  "supported"),
            ("rope_parameters.rope_type", rope.get("rope_type", "default") != "default",
             f"{rope.get('rope_type')!r} RoPE scaling is not supported"),
            ("layer_types", any(t != "full_attention" for t in getattr(c, "layer_types", None) or []),
             "every layer must be full attention"),
        ]
        for field, bad, why in unsupported:
            if bad:
                raise ValueError(f"{field}: {why} ({self.title} config {getattr(c, field.split('.')[0], None)!r})")
        return Qwen3Preset(
            name=name,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            ffn_hidden_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_query_groups=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            rotary_base=float(rope.get("rope_theta", 1_000_000.0)),
            rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=bool(c.tie_word_embeddings),
            max_position_embeddings=c.max_position_embeddings,
        )

    # ------------------------------------------------------------------ megatron
    def transformer_fields(self, preset: Qwen3Preset) -> dict:
        return dict(layernorm_zero_centered_gamma=False, qk_layernorm=True)

    def block_spec(self, config, backend: str, vp_stage=None, pp_rank=None):
        from megatron_mimesis.models.layer_specs import (
            LocalBackend,
            local_attention_spec,
            local_block_spec,
            local_layer_spec,
        )

        if backend == "te":
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

            return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage,
                                              pp_rank=pp_rank)
        local = LocalBackend()
        layer = local_layer_spec(local_attention_spec(local), local)
        return local_block_spec(config, lambda i: layer, vp_stage=vp_stage, pp_rank=pp_rank)

    def mapping(self, preset: Qwen3Preset, padded_vocab: int) -> list:
        return qwen3_mapping(preset, padded_vocab)

    # ------------------------------------------------------------------ planning
    def layer_kind_of(self, preset: Qwen3Preset) -> list[str]:
        return [ATTENTION] * preset.num_layers

    def matmul_params(self, preset: Qwen3Preset) -> int:
        """Every layer's q / k / v / o and SwiGLU MLP, and the LM head (counted even when tied)."""
        return (preset.num_layers * (attention_params(preset, output_gate=False) + mlp_params(preset))
                + preset.hidden_size * preset.vocab_size)

    def sequence_flops_per_token(self, preset: Qwen3Preset, seq_length: int) -> float:
        return preset.num_layers * causal_attention_flops(preset, seq_length)
