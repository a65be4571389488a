"""The one HF <-> megatron parameter table of Qwen3 (``Qwen3ForCausalLM`` names), used both ways.

Every entry is one the families share (``models/mapping.py``): grouped-query attention without an output gate, the
per-head q/k RMSNorms, the SwiGLU MLP, the embeddings and the untied head. Norm gains are plain weights on both
sides (``y = norm(x) * w``), so every entry only moves bits.
"""

from megatron_mimesis.models.mapping import ParamMapping, attention, decoder_layer, embedding_and_head, swiglu_mlp
from megatron_mimesis.models.qwen3.presets import Qwen3Preset


def qwen3_mapping(preset: Qwen3Preset, padded_vocab: int) -> list[ParamMapping]:
    """The full table for one model: embeddings, every decoder layer, final norm, and the LM head if untied."""
    table = embedding_and_head(preset, padded_vocab)
    for i in range(preset.num_layers):
        table += swiglu_mlp(preset, *decoder_layer(i)) + attention(preset, *decoder_layer(i), output_gate=False)
    return table
