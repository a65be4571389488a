"""The one HF <-> megatron parameter table of Qwen3.5 (``Qwen3_5ForCausalLM`` names), used both ways.

Beyond what ``models/mapping.py`` says of every family:

- Gated attention: HF ``q_proj`` holds per head ``[q_h; gate_h]`` (:class:`GroupedQKV` with ``output_gate``).
- Gated DeltaNet: HF ``in_proj_qkv`` (q, k, v sections), ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` -> megatron
  ``in_proj`` whose rank-r slice is ``[q_r, k_r, v_r, z_r, b_r, a_r]``; ``conv1d`` likewise per rank
  ``[q_r; k_r; v_r]``; ``A_log`` / ``dt_bias`` are split on dim 0.
- Norms: decoder norms are zero-centred on both sides (``y = norm(x) * (1 + w)``); the DeltaNet output norm is plain
  in HF and zero-centred in megatron, so ``w_megatron = w_hf - 1``. That shift is exact, and so the round trip
  bit-exact, for weights in [0.5, 2] (Sterbenz), which covers trained norm gains; outside that range it is within
  one ulp.
- The multi-token-prediction head (``mtp.*``, the released checkpoints' one layer), under Megatron-Bridge's names:
  ``fc`` (applied to ``[norm_e(embedding); norm_h(hidden)]`` on both sides) is megatron's column-parallel
  ``eh_proj``; ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden`` and ``norm`` are ``enorm``, ``hnorm`` and
  ``final_layernorm`` (zero-centred on both sides); ``mtp.layers.0`` is a gated-attention decoder layer, megatron's
  ``mtp_model_layer``. HF keeps one ``fc`` and one set of norms for all its MTP layers and megatron one per layer, so
  only one MTP layer has a mapping.
"""

from megatron_mimesis.models.mapping import (
    ParamMapping,
    PerRankConcat,
    Replicated,
    Split,
    attention,
    decoder_layer,
    embedding_and_head,
    swiglu_mlp,
)
from megatron_mimesis.models.qwen3_5.presets import Qwen35Preset


def _gated_deltanet(p: Qwen35Preset, layer: int) -> list[ParamMapping]:
    a, m = f"model.layers.{layer}.linear_attn.", f"decoder.layers.{layer}.self_attention."
    key_dim = p.linear_num_key_heads * p.linear_key_head_dim
    value_dim = p.linear_num_value_heads * p.linear_value_head_dim
    nv = p.linear_num_value_heads
    qkv, conv = a + "in_proj_qkv.weight", a + "conv1d.weight"
    return [
        Replicated(m + "in_proj.layer_norm_weight", f"model.layers.{layer}.input_layernorm.weight"),
        PerRankConcat(m + "in_proj.weight", (
            (qkv, 0, key_dim), (qkv, key_dim, key_dim), (qkv, 2 * key_dim, value_dim),
            (a + "in_proj_z.weight", 0, value_dim),
            (a + "in_proj_b.weight", 0, nv),
            (a + "in_proj_a.weight", 0, nv),
        )),
        PerRankConcat(m + "conv1d.weight", ((conv, 0, key_dim), (conv, key_dim, key_dim),
                                            (conv, 2 * key_dim, value_dim))),
        Split(m + "A_log", a + "A_log", dim=0),
        Split(m + "dt_bias", a + "dt_bias", dim=0),
        Replicated(m + "out_norm.weight", a + "norm.weight", offset=-1.0),
        Split(m + "out_proj.weight", a + "out_proj.weight", dim=1),
    ]


def _mtp_head(p: Qwen35Preset) -> list[ParamMapping]:
    if p.mtp_num_layers > 1:
        raise ValueError(f"mtp_num_layers={p.mtp_num_layers}: HF's Qwen3.5 MTP head shares one fc and its norms "
                         "between its layers, megatron's MTP layers each have their own; only 1 layer maps")
    hf, mc = "mtp.", "mtp.layers.0."
    layer_hf, layer_mc = hf + "layers.0.", mc + "mtp_model_layer."
    return [
        Replicated(mc + "enorm.weight", hf + "pre_fc_norm_embedding.weight"),
        Replicated(mc + "hnorm.weight", hf + "pre_fc_norm_hidden.weight"),
        Split(mc + "eh_proj.weight", hf + "fc.weight", dim=0),
        *attention(p, layer_hf, layer_mc, output_gate=True),
        *swiglu_mlp(p, layer_hf, layer_mc),
        Replicated(mc + "final_layernorm.weight", hf + "norm.weight"),
    ]


def qwen35_mapping(preset: Qwen35Preset, padded_vocab: int) -> list[ParamMapping]:
    """The full table for one model: embeddings, every decoder layer, final norm, the LM head if untied, and the MTP
    head if the model has one."""
    table = embedding_and_head(preset, padded_vocab)
    for i, kind in enumerate(preset.layer_types()):
        table += swiglu_mlp(preset, *decoder_layer(i))
        table += (attention(preset, *decoder_layer(i), output_gate=True) if kind == "full_attention"
                  else _gated_deltanet(preset, i))
    if preset.mtp_num_layers:
        table += _mtp_head(preset)
    return table
