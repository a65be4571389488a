"""MIMESIS recipe for Qwen3.5 on megatron-core."""

__version__ = "0.1.0"
