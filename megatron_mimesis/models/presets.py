"""Qwen3.5 text-model presets: the one place where model sizes live.

Sources. ``9b`` is transformers' default ``Qwen3_5TextConfig`` (transformers/models/qwen3_5/
configuration_qwen3_5.py, "Qwen3.5-9B style configuration"); ``4b`` is the text_config of the released
Qwen/Qwen3.5-4B checkpoint (hidden 2560, ffn 9216, tied embeddings; the rest as 9B). Both released
checkpoints are ``Qwen3_5ForConditionalGeneration`` with a vision tower, one MTP layer and
``max_position_embeddings`` 262144, rope theta 1e7 on 64 of 256 head dims (partial rotary 0.25, mrope
sections [11, 11, 10], which for text-only positions is ordinary RoPE).

Everything else derives from these records: the megatron ``TransformerConfig`` (``config.py``), the HF
config (:meth:`Qwen35Preset.to_hf_config`) and the parameter mapping (``mapping.py``).
"""

import dataclasses
from dataclasses import dataclass

FULL_ATTENTION_INTERVAL = 4  # layer i is gated full attention when (i + 1) % 4 == 0, else Gated DeltaNet
# The Gated DeltaNet recurrent state's dtype, the released configs' ``mamba_ssm_dtype``: the trainer's chunked kernel
# carries it in fp32, and vLLM sizes and updates its decode state cache in this dtype (``mamba_ssm_cache_dtype``
# follows it). Without it vLLM keeps the state in the model dtype, bf16, and rounds it at every decoded token.
DELTANET_STATE_DTYPE = "float32"


@dataclass(frozen=True)
class Qwen35Preset:
    name: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rotary_base: float = 10_000_000.0
    rotary_percent: float = 0.25
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262_144
    mtp_num_layers: int = 1

    def layer_types(self) -> list[str]:
        """Per-layer mixer, in HF's vocabulary ('linear_attention' = Gated DeltaNet)."""
        return [
            "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
            for i in range(self.num_layers)
        ]

    def replace(self, **changes) -> "Qwen35Preset":
        return dataclasses.replace(self, **changes)

    def to_hf_config(self, **extra):
        """The equivalent transformers ``Qwen3_5TextConfig`` (text-only, as our training sees the model), with the
        DeltaNet state dtype the released configs carry; ``extra`` adds or overrides fields."""
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.ffn_hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_query_groups,
            head_dim=self.head_dim,
            linear_num_key_heads=self.linear_num_key_heads,
            linear_num_value_heads=self.linear_num_value_heads,
            linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            layer_types=self.layer_types(),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": self.rotary_base,
                "partial_rotary_factor": self.rotary_percent,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
            **{"mamba_ssm_dtype": DELTANET_STATE_DTYPE, **extra},
        )

    @classmethod
    def from_hf_config(cls, hf_config, name: str = "hf") -> "Qwen35Preset":
        """Read a transformers Qwen3.5 config (the composite one or its text_config)."""
        text = getattr(hf_config, "text_config", None) or hf_config
        rope = text.rope_parameters or {}
        preset = cls(
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
            raise ValueError(
                f"unsupported layer pattern in HF config: {text.layer_types}; expected full attention every "
                f"{FULL_ATTENTION_INTERVAL}th layer"
            )
        return preset


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


def get_preset(name: str) -> Qwen35Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None
