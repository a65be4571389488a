"""Qwen3.5 text-model presets: the one place where Qwen3.5 sizes live.

Sources. ``9b`` is transformers' default ``Qwen3_5TextConfig`` (transformers/models/qwen3_5/
configuration_qwen3_5.py, "Qwen3.5-9B style configuration"); ``4b`` is the text_config of the released
Qwen/Qwen3.5-4B checkpoint (hidden 2560, ffn 9216, tied embeddings; the rest as 9B). Both released
checkpoints are ``Qwen3_5ForConditionalGeneration`` with a vision tower, one MTP layer and
``max_position_embeddings`` 262144, rope theta 1e7 on 64 of 256 head dims (partial rotary 0.25, mrope
sections [11, 11, 10], which for text-only positions is ordinary RoPE).

Everything else derives from these records: the megatron ``TransformerConfig`` and the HF config (``family.py``)
and the parameter mapping (``mapping.py``).
"""

from dataclasses import dataclass
from typing import ClassVar

from megatron_mimesis.models.family import Preset

FULL_ATTENTION_INTERVAL = 4  # layer i is gated full attention when (i + 1) % 4 == 0, else Gated DeltaNet
# The Gated DeltaNet recurrent state's dtype, the released configs' ``mamba_ssm_dtype``: the trainer's chunked kernel
# carries it in fp32, and vLLM sizes and updates its decode state cache in this dtype (``mamba_ssm_cache_dtype``
# follows it). Without it vLLM keeps the state in the model dtype, bf16, and rounds it at every decoded token.
DELTANET_STATE_DTYPE = "float32"


@dataclass(frozen=True, kw_only=True)
class Qwen35Preset(Preset):
    family_name: ClassVar[str] = "qwen3_5"

    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rotary_base: float = 10_000_000.0
    rotary_percent: float = 0.25
    max_position_embeddings: int = 262_144
    mtp_num_layers: int = 1

    def layer_types(self) -> list[str]:
        """Per-layer mixer, in HF's vocabulary ('linear_attention' = Gated DeltaNet)."""
        return [
            "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
            for i in range(self.num_layers)
        ]


_QWEN35_COMMON = dict(
    vocab_size=248_320,
    num_layers=32,
    num_attention_heads=16,
    num_query_groups=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)

PRESETS: dict[str, Qwen35Preset] = {
    "9b": Qwen35Preset(name="9b", hidden_size=4096, ffn_hidden_size=12288, tie_word_embeddings=False, **_QWEN35_COMMON),
    "4b": Qwen35Preset(name="4b", hidden_size=2560, ffn_hidden_size=9216, tie_word_embeddings=True, **_QWEN35_COMMON),
    # Tests, the CPU demos and vLLM on CPU: the hybrid pattern kept (3 DeltaNet + 1 attention), every head count
    # divisible by TP=2, GQA (4 q / 2 kv heads) and DeltaNet key/value head grouping (2 k / 4 v heads) kept.
    # Head dims 64: the smallest vLLM's CPU kernels take (its Gated DeltaNet refuses linear head dims 16 and 32).
    "tiny": Qwen35Preset(
        name="tiny",
        vocab_size=512,
        hidden_size=64,
        ffn_hidden_size=128,
        num_layers=4,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=4096,
        mtp_num_layers=0,
    ),
}
