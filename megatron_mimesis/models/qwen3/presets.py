"""Qwen3 dense presets: the one place where Qwen3 sizes live.

Sources: the released ``config.json`` of Qwen/Qwen3-0.6B, -1.7B, -4B, -8B and -14B (``Qwen3ForCausalLM``): head_dim
128, SwiGLU, RMSNorm eps 1e-6 with a plain weight, per-head q/k RMSNorm, no biases, RoPE theta 1e6 on every head
dim, vocab 151,936, max positions 40,960; the 0.6B, 1.7B and 4B tie their embeddings, the 8B and 14B do not.
Qwen3-8B has 8.19B parameters (6.95B without embeddings).
"""

from dataclasses import dataclass
from typing import ClassVar

from megatron_mimesis.models.family import Preset


@dataclass(frozen=True, kw_only=True)
class Qwen3Preset(Preset):
    family_name: ClassVar[str] = "qwen3"

    head_dim: int = 128
    rotary_base: float = 1_000_000.0
    rotary_percent: float = 1.0
    max_position_embeddings: int = 40_960


_RELEASED = dict(vocab_size=151_936, num_query_groups=8)

PRESETS: dict[str, Qwen3Preset] = {
    "qwen3-0.6b": Qwen3Preset(name="qwen3-0.6b", hidden_size=1024, ffn_hidden_size=3072, num_layers=28,
                              num_attention_heads=16, tie_word_embeddings=True, **_RELEASED),
    "qwen3-1.7b": Qwen3Preset(name="qwen3-1.7b", hidden_size=2048, ffn_hidden_size=6144, num_layers=28,
                              num_attention_heads=16, tie_word_embeddings=True, **_RELEASED),
    "qwen3-4b": Qwen3Preset(name="qwen3-4b", hidden_size=2560, ffn_hidden_size=9728, num_layers=36,
                            num_attention_heads=32, tie_word_embeddings=True, **_RELEASED),
    "qwen3-8b": Qwen3Preset(name="qwen3-8b", hidden_size=4096, ffn_hidden_size=12288, num_layers=36,
                            num_attention_heads=32, **_RELEASED),
    "qwen3-14b": Qwen3Preset(name="qwen3-14b", hidden_size=5120, ffn_hidden_size=17408, num_layers=40,
                             num_attention_heads=40, **_RELEASED),
    # Tests, the CPU runs and vLLM on CPU: the tiny Qwen3.5's widths (head dim 64, the smallest vLLM's CPU attention
    # takes; GQA with 4 q / 2 kv heads, divisible by TP=2), untied as the 8B is.
    "qwen3-tiny": Qwen3Preset(name="qwen3-tiny", vocab_size=512, hidden_size=64, ffn_hidden_size=128, num_layers=4,
                              num_attention_heads=4, num_query_groups=2, head_dim=64, max_position_embeddings=4096),
}
